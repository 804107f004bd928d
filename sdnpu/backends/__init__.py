"""The vendors' backends: each target that has a compile step, packaging, session options or an offload count
of its own has one module here, named by the target's ``backend`` field (``sdnpu.ops.target.Target``), so that
the compile stage and the runtime reach it without the table importing it. ``qnn_htp``: Qualcomm's HTP."""

from __future__ import annotations

import importlib
from types import ModuleType

from sdnpu.ops.target import Target


def backend_of(target: Target) -> ModuleType | None:
    """The target's backend module, or None where it has none (AMD's dispatch model is the result itself)."""
    return importlib.import_module(target.backend) if target.backend else None
