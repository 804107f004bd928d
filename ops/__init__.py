"""The target: each dispatch op's contract and capability limits (``target``, ``amd_xdna2``), its reference body
(``bodies``) and AMD's block format (``bfp``). Only the target: the formats the stages share are
``sdnpu.formats``, running sessions is ``sdnpu.onnxrun``.

The built-in targets' tables (``amd_xdna2``, ``qnn_htp``) register themselves with ``target.register`` as they
load. This package imports them, and Python runs it before any module of it, so ``target.get_target`` knows
them whichever module asks first; they import ``target``, and ``target`` imports neither (no circle)."""

from sdnpu.ops import amd_xdna2, qnn_htp

__all__ = ["amd_xdna2", "qnn_htp"]
