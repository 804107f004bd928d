"""Numerics of a full-size qnn-htp component, one block per block type: the emulator cannot run a full-size
UNet (SDXL's at 1024 px is 6,761 GMAC; the emulator runs about 0.07 GMAC a second here), but it can run one
block of each kind at the component's full size, on the values the whole graph hands that block.

For a component converted with ``--target qnn-htp`` (its ``qnn/model.onnx``: the fp32 graph in the forms the HTP
takes), the blocks are the module instances the exporter recorded in each node's ``namespace`` metadata
(``ResnetBlock2D``, ``BasicTransformerBlock``, ``Downsample2D``, ...). For each block type the instance with the
fewest MACs is taken (``--classes`` picks the types; by default those named like blocks). The whole graph runs once in fp32 on onnxruntime's CPU
(seeded inputs) with every chosen block's inputs and outputs added as graph outputs; each block is cut out
(``sdnpu.convert.split``: its nodes, in the graph's order), compiled by QNN with CPU fallback disabled, run on
the HTP emulator on the whole graph's fp32 values at its inputs, and its outputs compared with the fp32 run's.

    python bench/bench_qnn_blocks.py COMPONENT_DIR [--classes ResnetBlock2D,...] [--budget-gmac 300] [--json FILE]

The emulator's times are this CPU's, not the NPU's; the MAC counts are sdnpu's report's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# "<scope>: <module class>/..." in the exporter's namespace metadata: each level is "attr: package.Class"
_LEVEL = re.compile(r"([\w.]+): ([\w.]+)")


def instances(model: Any) -> dict[tuple[str, str], list[int]]:
    """(module path, class) -> the positions of the nodes that module's forward wrote."""
    out: dict[tuple[str, str], list[int]] = defaultdict(list)
    for k, node in enumerate(model.graph.node):
        scope = next((p.value for p in node.metadata_props if p.key == "namespace"), "")
        for path, cls in _LEVEL.findall(scope):
            out[(path, cls.rsplit(".", 1)[-1])].append(k)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("component", type=Path, help="a component folder converted with --target qnn-htp")
    ap.add_argument("--classes", default="", help="block types (module classes), comma-separated (default: the "
                    "classes named like blocks: *Block*, *Transformer*, *Attention, *sample*)")
    ap.add_argument("--budget-gmac", type=float, default=300.0, help="skip a type whose smallest instance has more")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import onnx

    from sdnpu.backends import qnn_htp
    from sdnpu.convert import split
    from sdnpu.onnxrun import run_onnx
    from sdnpu.ops.target import get_target
    from sdnpu.reports.fidelity import fidelity, generic_inputs
    from sdnpu.reports.report import _shapes, macs
    from sdnpu.worker import run_in_worker

    source = args.component / "qnn" / "model.onnx"
    model = onnx.load(str(source), load_external_data=False)
    model = onnx.shape_inference.infer_shapes(model)
    target = get_target("qnn-htp")
    shapes = _shapes(model)
    nodes = list(model.graph.node)
    inits = {t.name for t in model.graph.initializer}
    wanted = {c for c in args.classes.split(",") if c}
    blockish = re.compile(r"Block|Transformer|Attention$|sample")
    chosen: dict[str, tuple[int, int, int, str]] = {}  # class -> (macs, start, end, path)
    for (path, cls), where in instances(model).items():
        if path.count(".") == 0 or (cls not in wanted if wanted else not blockish.search(cls)):
            continue  # the wrapper and the component's own module; a type not asked for
        start, end = min(where), max(where) + 1
        if not any(x in inits for k in range(start, end) for x in nodes[k].input):
            continue  # no weights: not a block
        m = sum(macs(nodes[k], shapes, target) or 0 for k in range(start, end))
        if cls not in chosen or m < chosen[cls][0]:
            chosen[cls] = (m, start, end, path)
    blocks = sorted(chosen.items(), key=lambda kv: kv[1][0])
    pieces = {cls: split.piece_of(model, start, end) for cls, (_, start, end, _) in blocks}
    needed = sorted({x for p in pieces.values() for x in [*p.inputs, *p.outputs]})
    print(f"{len(blocks)} block types: " + ", ".join(f"{c} ({m / 1e9:.1f} GMAC, {p})" for c, (m, _, _, p) in blocks),
          flush=True)

    feeds = generic_inputs(source)
    known = {o.name for o in model.graph.output}
    info = {v.name: v for v in [*model.graph.value_info, *model.graph.input]}
    probe = onnx.ModelProto()  # the whole graph with the blocks' values as outputs, beside its data file
    probe.CopyFrom(model)
    probe.graph.output.extend(info[x] for x in needed if x not in known and x not in feeds and x in info)
    probe_path = source.parent / f"probe-{os.getpid()}.onnx"
    probe_path.write_bytes(probe.SerializeToString())
    t0 = time.perf_counter()
    try:
        values = {**feeds, **run_in_worker(run_onnx, probe_path, feeds, True, what="the fp32 run")}
    finally:
        probe_path.unlink(missing_ok=True)
    print(f"fp32 run of the whole graph: {time.perf_counter() - t0:.0f} s", flush=True)
    arch = qnn_htp.parse_arch(None)
    rows = []
    for cls, (m, _, _, path) in blocks:
        if m / 1e9 > args.budget_gmac:
            rows.append({"block": cls, "instance": path, "gmac": round(m / 1e9, 2), "skipped": "over --budget-gmac"})
            continue
        p = pieces[cls]
        piece_path = source.parent / f"block-{os.getpid()}.onnx"
        with tempfile.TemporaryDirectory(prefix="block-ctx-") as out:
            try:
                split.write_piece(model, p, piece_path)
                compiled = run_in_worker(qnn_htp.compile_context, piece_path, Path(out), arch, "ctx",
                                         what=f"compiling {cls}")
            finally:
                piece_path.unlink(missing_ok=True)
            t0 = time.perf_counter()
            from sdnpu.convert.standard import run_compiled

            got = run_in_worker(run_compiled, compiled.context, arch, not compiled.whole,
                                {k: values[k] for k in p.inputs}, what=f"running {cls} on the emulator")
            seconds = time.perf_counter() - t0
        fid = fidelity({k: values[k] for k in p.outputs}, {k: got[k] for k in p.outputs})
        finite = all(np.isfinite(v).all() for v in got.values())
        row = {"block": cls, "instance": path, "nodes": p.end - p.start, "gmac": round(m / 1e9, 2),
               "weights_mb": round(p.weight_bytes / 1e6, 1), "whole": compiled.whole,
               "min_cosine": round(fid["min_cosine"], 6), "max_abs": float(f"{fid['max_abs']:.4g}"),
               "finite": bool(finite), "emulator_s": round(seconds, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print("\n| block | instance | nodes | GMAC | weights MB | taken whole | cosine | max abs | finite | emulator s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['block']} | {r['instance']} | | {r['gmac']} | | | {r['skipped']} | | | |")
        else:
            print(f"| {r['block']} | {r['instance']} | {r['nodes']} | {r['gmac']} | {r['weights_mb']} | "
                  f"{'yes' if r['whole'] else 'no'} | {r['min_cosine']} | {r['max_abs']} | {r['finite']} | "
                  f"{r['emulator_s']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
