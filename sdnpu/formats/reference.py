"""A component folder's fp32 reference graph (``model.onnx``), which a block-by-block conversion with
``--dispatch-only`` does not keep: each piece's fp32 graph is deleted once its dispatch model is checked, and
no stitched fp32 graph is written (the folder holds the bf16 dispatch model alone: a third of the disk the fp32
graph and it take). ``export.json`` says so (``KEY``: true), and so does the offload report (``blockwise.dispatch_only``). Its
``parameters.json`` and ``dd/weights.json`` name the constants as the stitched fp32 graph would (``b<i>/<name>``,
each piece's own: no fp32 stitch merged equal constants): a record of where each weight came from, with no graph
to replay them on.

Every reader that needs the fp32 graph (``generate --reference``, ``serve --reference``, ``lora apply``,
``convert --add``) asks ``require`` first and, on such a folder, fails with its one line.
"""

from __future__ import annotations

import json
from pathlib import Path

from sdnpu.errors import SdnpuError

FILE = "model.onnx"  # the fp32 graph, beside export.json
KEY = "dispatch_only"  # export.json: true where the conversion kept no fp32 graph
EXPORT = "export.json"


def dispatch_only(comp_dir: Path) -> bool:
    """Whether ``comp_dir`` was converted with ``--dispatch-only`` (its ``export.json`` says so)."""
    try:
        return bool(json.loads((Path(comp_dir) / EXPORT).read_text()).get(KEY))
    except (OSError, ValueError):
        return False


def require(comp_dir: Path, to: str) -> None:
    """Refuse, in one line, to ``to`` (what the caller would do with it) on a component that has no fp32 graph
    because it was converted with ``--dispatch-only``; a folder whose graph is missing otherwise is the
    caller's own error."""
    comp_dir = Path(comp_dir)
    if not (comp_dir / FILE).is_file() and dispatch_only(comp_dir):
        raise SdnpuError(f"{comp_dir} was converted with --dispatch-only: it has no fp32 graph ({FILE}) to {to}",
                         hint="convert it again without --dispatch-only, on a disk with room for the fp32 graph "
                              "(twice the dispatch model's size)")
