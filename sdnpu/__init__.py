"""sdnpu: a model-conversion and NPU-offload compiler for Stable Diffusion.

The stages install as one namespace: ``sdnpu.convert`` (export from diffusers), ``sdnpu.passes``
(the offload compiler), ``sdnpu.reports``, ``sdnpu.runtime`` and ``sdnpu.ops``. This top-level
package holds only what every stage shares: the error type, atomic file writes and progress logging.
"""

from __future__ import annotations

__version__ = "0.1.0"

from sdnpu.errors import SdnpuError

__all__ = ["SdnpuError", "__version__"]
