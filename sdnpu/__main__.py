import sys

from sdnpu.cli import main

sys.exit(main())
