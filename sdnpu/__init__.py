"""sdnpu: a model-conversion and NPU-offload compiler for Stable Diffusion.

The stages install as one namespace: ``sdnpu.convert`` (export from diffusers), ``sdnpu.passes``
(the offload compiler), ``sdnpu.reports``, ``sdnpu.lora``, ``sdnpu.runtime`` and ``sdnpu.ops`` (the target).
This top-level package holds what every stage shares: the component and family tables (``components``,
``families``), the formats
(``formats``), each component's signature and spec (``signatures``, ``specs``, ``imagesize``), running graphs
in onnxruntime (``onnxrun``), the error type, atomic file writes, progress logging, memory and workers; and
the CLI (docs/design.md has the map).
"""

from __future__ import annotations

__version__ = "0.1.0"

from sdnpu.errors import SdnpuError

__all__ = ["SdnpuError", "__version__"]
