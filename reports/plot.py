"""``sdnpu report PATH --plot out.svg|png``: where the CPU islands are, at a glance.

One row per component: its nodes in topological order as a strip, coloured by NPU region (CPU nodes in
red, labelled with their op type), and beside it a bar chart of the dispatch ops by type.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx

from sdnpu.errors import SdnpuError
from sdnpu.formats.keys import REGION_TAG

_NPU_COLORS = ("#2a9d8f", "#457b9d", "#8ab17d", "#6d597a", "#e9c46a")
_CPU_COLOR = "#d62828"


def node_strip(model_path: Path) -> list[tuple[str, int | None]]:
    """(op_type, region or None for CPU) for each node of a dispatch model, in graph order."""
    model = onnx.load(str(model_path), load_external_data=False)
    out = []
    for node in model.graph.node:
        meta = {p.key: p.value for p in node.metadata_props}
        out.append((node.op_type, int(meta[REGION_TAG]) if REGION_TAG in meta else None))
    return out


def plot(reports: list[tuple[str, dict[str, Any], Path]], out: Path) -> None:
    """Draw ``reports`` ((component, report, dispatch model path)) to ``out`` (.svg or .png)."""
    if out.suffix.lower() not in (".svg", ".png"):
        raise SdnpuError(f"cannot draw {out.name}", hint="use a .svg or .png file name")
    import matplotlib  # matplotlib at first use: the CLI starts without it (about 0.5 s)

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: searchable, and testable
    import matplotlib.pyplot as plt  # after use("Agg"): pyplot takes its backend as it loads
    from matplotlib.patches import Patch  # matplotlib, as above

    rows = len(reports)
    fig, axes = plt.subplots(rows, 2, figsize=(14, 2.2 * rows + 0.6), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1]})
    for (name, report, model_path), (ax_strip, ax_bar) in zip(reports, axes, strict=True):
        strip = node_strip(model_path)
        n = len(strip)
        for i, (_op, region) in enumerate(strip):
            color = _CPU_COLOR if region is None else _NPU_COLORS[region % len(_NPU_COLORS)]
            ax_strip.add_patch(plt.Rectangle((i, 0), 1, 1, color=color, linewidth=0))
        cpu = [(i, op) for i, (op, region) in enumerate(strip) if region is None]
        for k, (i, op) in enumerate(cpu[:40]):
            ax_strip.annotate(op, (i + 0.5, 1.0), xytext=(0, 6 + 10 * (k % 3)), textcoords="offset points",
                              ha="center", fontsize=7, color=_CPU_COLOR, rotation=0)
        s = report["summary"]
        ax_strip.set_xlim(0, max(n, 1))
        ax_strip.set_ylim(0, 2.2)
        ax_strip.set_yticks([])
        ax_strip.set_title(f"{name}: {100 * s['offload_rate']:.2f}% offloaded, {s['cpu_nodes']} CPU nodes, "
                           f"{s['npu_regions']} NPU region(s)", fontsize=10, loc="left")
        ax_strip.set_xlabel("nodes in topological order", fontsize=8)
        ops = report["offloaded_by_type"]
        ax_bar.barh(list(ops)[::-1], list(ops.values())[::-1], color=_NPU_COLORS[0])
        ax_bar.tick_params(labelsize=7)
        ax_bar.set_title("dispatch ops by type", fontsize=9)
    fig.legend(handles=[Patch(color=_NPU_COLORS[0], label="NPU region"), Patch(color=_CPU_COLOR, label="CPU")],
               loc="lower right", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
