"""Block by block: a module whose fp32 weights do not fit this machine's memory whole, converted one piece at a
time and stitched (``driver``). ``piece``: what a piece is and where its weights come from; ``t5``, ``flux``
and ``qwenimage``: the modules cut into pieces; ``qnn``: a standard target's pieces, a context each; ``state``: a
run under way, and how a run that stops leaves it for the next."""

from sdnpu.convert.blockwise.driver import CLASSES, convert_blockwise, pieces, supports, whole_module
from sdnpu.convert.blockwise.state import STATE, work_dir

__all__ = ["CLASSES", "STATE", "convert_blockwise", "pieces", "supports", "whole_module", "work_dir"]
