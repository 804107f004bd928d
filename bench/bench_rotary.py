"""The rotary rewrite at a real head count and length: time and peak memory of the canonical steps on a rotary
exported in one of its spellings (``tests/test_canonical_rotary.py``'s module: a projection, its heads, the
rotation by constant tables, the heads moved first), at a size of your choosing.

    python bench/bench_rotary.py wan                   # Wan's spelling (two ScatterNDs), B 1, S 4096, 24 x 128
    python bench/bench_rotary.py cat --seq 1024 --heads 8 --dim 64

Prints the canonical steps' wall time, the rotary and interleave counts (1: rewritten) and the process's peak
resident memory (the export's included).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spelling", choices=["wan", "cat", "computed"])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--dim", type=int, default=128)
    args = ap.parse_args()

    import onnx_ir as ir
    import torch

    import tests.test_canonical_rotary as rope
    from sdnpu.passes.pipeline import canonicalize

    rope.B, rope.S, rope.H, rope.D = 1, args.seq, args.heads, args.dim
    module = rope._ExportedRope(args.spelling).eval()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rope.onnx"
        torch.onnx.export(module, (torch.randn(1, args.seq, args.heads * args.dim), torch.ones(1)), str(path),
                          dynamo=True, input_names=["x", "t"], verbose=False)
        model = ir.load(str(path))  # its weights read from the folder as the steps need them
        start = time.perf_counter()
        counts = canonicalize(model).counts
        took = time.perf_counter() - start
    shown = {k: v for k, v in counts.items() if "rotation" in k or "interleave" in k}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(f"{args.spelling}: x {args.seq * args.heads * args.dim / 1e6:.1f} M elements; canonical steps "
          f"{took:.1f} s; {shown}; peak {peak:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
