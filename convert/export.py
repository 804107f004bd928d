"""Export one torch module to ONNX with static shapes, and check the graph against PyTorch.

Exporter: torch's dynamo exporter by default (measured in the README: on the full SDXL UNet it peaks at
10.3 GB where the TorchScript exporter needs 13.6 GB, writes one external-data file instead of one per
tensor, and 5,607 nodes instead of 13,741 with no dynamic-shape arithmetic left). ``exporter="torchscript"``
is kept so that the passes are tested on what both exporters write.

The model is written with weights inline below 2 GB and to one ``model.onnx.data`` above. Per-node
stack traces that the dynamo exporter records are dropped (they hold absolute paths of this machine, so
the same conversion in two checkouts would differ); the ``namespace`` tag (which module a node came
from) is kept.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from sdnpu.errors import SdnpuError
from sdnpu.passes.modelfile import save

log = logging.getLogger(__name__)

EXPORTERS = ("dynamo", "torchscript")
DEFAULT_OPSET = 20
MIN_OPSET = 17
_KEEP_METADATA = frozenset({"namespace"})
# The exported fp32 graph must agree with PyTorch to this fraction of the output's largest magnitude.
# Measured on both exporters: 1e-6 (tiny-sdxl) to 4e-6 (sdxl-base); see the README.
CHECK_RTOL = 1e-3


def _strip_metadata(model: Any) -> None:
    for node in model.graph.all_nodes():
        for key in [k for k in node.metadata_props if k not in _KEEP_METADATA]:
            del node.metadata_props[key]


def save_ir(model: Any, path: Path) -> None:
    """Save with weights inline below 2 GB and in one ``<name>.data`` file above (the compiler's rule)."""
    save(model, path)


@dataclass(frozen=True)
class Exporter:
    """Which of torch's exporters writes the graph, at which opset; validated when made."""

    name: str = "dynamo"
    opset: int = DEFAULT_OPSET

    def __post_init__(self) -> None:
        if self.name not in EXPORTERS:
            raise SdnpuError(f"unknown exporter {self.name!r}", hint=f"choose one of: {', '.join(EXPORTERS)}")
        if self.opset < MIN_OPSET:
            raise SdnpuError(f"opset {self.opset} is too old", hint=f"use opset {MIN_OPSET} or newer")


def export_module(wrapper: Any, args: tuple[Any, ...], input_names: list[str], output_names: list[str],
                  path: Path, exporter: Exporter = Exporter()) -> None:
    """Export ``wrapper(*args)`` to ``path`` (and ``path.data`` past 2 GB). Complex rotary tables (Lumina 2,
    Z-Image, Qwen-Image) are exported in real arithmetic (``sdnpu.convert.realrope``); a module class whose
    forward the exporter cannot trace (HiDream's MoE feed-forward) in its export form
    (``sdnpu.convert.exportforms``)."""
    from sdnpu.convert.exportforms import export_forms  # imports torch: the CLI imports this module without it
    from sdnpu.convert.realrope import real_rotary  # imports torch: the CLI imports this module without it

    with real_rotary(wrapper), export_forms(wrapper, exporter.name):
        _export(wrapper, args, input_names, output_names, path, exporter)


def _export(wrapper: Any, args: tuple[Any, ...], input_names: list[str], output_names: list[str],
            path: Path, exporter: Exporter) -> None:
    import torch  # torch at first use: the CLI starts without it (about 1 s)

    opset = exporter.opset
    if exporter.name == "dynamo":
        # its optimizer folds the graph's own arithmetic: T5's position buckets take Log(0) = -inf in a branch
        # that a Where drops; numpy's warnings about it say nothing about the result
        with np.errstate(all="ignore"):
            program = torch.onnx.export(wrapper, args, dynamo=True, input_names=input_names,
                                        output_names=output_names, opset_version=opset, optimize=True,
                                        verbose=False, report=False)
        model = program.model
        _strip_metadata(model)
        save_ir(model, path)
        return
    # TorchScript writes one file per tensor past 2 GB: export beside, then re-save as one data file.
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".torchscript-") as tmp:
        raw = Path(tmp) / "model.onnx"
        with torch.no_grad():
            torch.onnx.export(wrapper, args, str(raw), dynamo=False, input_names=input_names,
                              output_names=output_names, opset_version=opset, do_constant_folding=True)
        model = ir.load(raw)
        save_ir(model, path)


def torch_outputs(wrapper: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import torch  # torch at first use: the CLI starts without it (about 1 s)

    with torch.no_grad():
        outs = wrapper(*(torch.from_numpy(v) for v in feeds.values()))
    return [o.detach().numpy().copy() for o in outs]
