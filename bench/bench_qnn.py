"""qnn-htp on every model sdnpu knows: the tiny presets converted whole (``sdnpu convert --target qnn-htp``) and
every zoo member (``tests/zoo.py``) compiled (``sdnpu compile --target qnn-htp``, the member's example inputs
for the fidelity run), each on Qualcomm's compiler and, where it is x86-64, its HTP emulator. One row a graph:
sdnpu's count by its table, QNN's own count, whether QNN took it whole with CPU fallback disabled, and the
emulated fp16 outputs against the fp32 graph on onnxruntime's CPU (min cosine, max abs, any NaN or Inf), the
fp16 headroom list's length and unguarded values.

    python bench/bench_qnn.py [--presets tiny-sdxl,...] [--zoo all|none|NAME,...] [--out DIR] [--json FILE]

The emulator's times are this CPU's, not the NPU's: they are not printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PRESETS = ("tiny-sdxl", "tiny-sd15", "tiny-sdxl-turbo", "tiny-sd3", "tiny-flux", "tiny-controlnet-sdxl")


def _row(name: str, report: dict[str, Any]) -> dict[str, Any]:
    s, q = report["summary"], report.get("qnn") or {}
    t = q.get("trace") or {}
    fid = report.get("fidelity") or {}
    finite = all(o.get("max_abs", 0.0) != float("inf") for o in fid.get("outputs", {}).values())  # inf: NaN or Inf
    room = report.get("fp16_headroom") or []
    return {"graph": name, "table": f"{s['offloaded_nodes']}/{s['total_nodes']}",
            "qnn": f"{t.get('supported_nodes', 0)}/{t.get('total_onnx_nodes', 0)}", "whole": bool(q.get("whole")),
            "partitions": t.get("qnn_subgraphs", 0), "min_cosine": fid.get("min_cosine"), "max_abs": fid.get("max_abs"),
            "finite": finite, "near_fp16_max": len(room), "unguarded": sum(1 for e in room if not e.get("guard")),
            "refused": [f"{r['op_type']}: {r['reason'][:80]}" for r in t.get("refused", [])][:3]}


def presets(names: list[str], out: Path) -> list[dict[str, Any]]:
    from sdnpu.convert import ConvertOptions, convert

    rows = []
    for preset in names:
        try:
            result = convert(preset, "all", out=out / preset, options=ConvertOptions(target="qnn-htp"))
        except Exception as e:
            rows.append({"graph": preset, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"})
            continue
        for c in result.components:
            report = json.loads((out / preset / c.component / "qnn" / "report.json").read_text())
            rows.append(_row(f"{preset}/{c.component}", report))
    return rows


def _example_inputs(path: Path, feeds: dict[str, Any]) -> None:
    """The member's example inputs as an ONNX backend test's ``test_data_set_0`` beside its graph (the compile's
    fidelity run takes them: a timestep the model is called with, not a seeded draw of any size)."""
    import onnx
    from onnx import numpy_helper

    names = [i.name for i in onnx.load(str(path), load_external_data=False).graph.input]
    folder = path.parent / "test_data_set_0"
    folder.mkdir(exist_ok=True)
    for i, name in enumerate(names):
        (folder / f"input_{i}.pb").write_bytes(numpy_helper.from_array(feeds[name], name).SerializeToString())


def zoo(names: list[str], out: Path) -> list[dict[str, Any]]:
    from sdnpu.convert.compile import compile_file
    from sdnpu.passes.pipeline import CompileOptions
    from tests import zoo as z

    rows = []
    for name in names:
        for exporter in z.MEMBERS[name].exporters:
            label = f"zoo {name} ({exporter})"
            try:
                path, feeds, reference = z.export(name, exporter, out / "zoo" / name / exporter)
                if not z.agrees_with_pytorch(path, feeds, reference):
                    rows.append({"graph": label, "error": "the export is not its module (onnxruntime vs PyTorch)"})
                    continue
                _example_inputs(path, feeds)  # the fidelity run reads the member's own inputs, not generic ones
                report = compile_file(path, path.parent / "qnn", CompileOptions.named("qnn-htp"))
                rows.append(_row(label, report))
            except Exception as e:
                rows.append({"graph": label, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"})
                traceback.print_exc()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default=",".join(PRESETS))
    p.add_argument("--zoo", default="all")
    p.add_argument("--out", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None, help="also write the table as markdown to this file")
    args = p.parse_args(argv)
    from tests import zoo as z

    members = [] if args.zoo == "none" else sorted(z.MEMBERS) if args.zoo == "all" else args.zoo.split(",")
    with tempfile.TemporaryDirectory(prefix="bench-qnn-") as tmp:
        out = Path(args.out or tmp)
        rows = presets([x for x in args.presets.split(",") if x], out) + zoo(members, out)
    print(f"{'graph':<44}{'table':>11}{'QNN':>11}{'whole':>7}{'parts':>6}{'min cosine':>12}{'max abs':>10}"
          f"{'near 65504':>11}")
    for r in rows:
        if "error" in r:
            print(f"{r['graph']:<44}  {r['error'][:120]}")
            continue
        cos = f"{r['min_cosine']:.6f}" if r["min_cosine"] is not None else "-"
        mab = f"{r['max_abs']:.3g}" if r["max_abs"] is not None else "-"
        print(f"{r['graph']:<44}{r['table']:>11}{r['qnn']:>11}{'yes' if r['whole'] else 'NO':>7}{r['partitions']:>6}"
              f"{cos:>12}{mab:>10}{r['near_fp16_max']:>6} ({r['unguarded']} unguarded)"
              + ("" if r["finite"] else "  NOT FINITE"))
        for why in r["refused"]:
            print(f"{'':<6}refused: {why}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows))
    return 0


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as the table bench/results.md holds."""
    out = ["| graph | sdnpu's table | QNN takes | taken whole | QNN partitions | min cosine | max abs | near 65504 "
           "(unguarded) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['graph']} | {r['error'][:100]} | | | | | | |")
            continue
        cos = f"{r['min_cosine']:.6f}" if r["min_cosine"] is not None else "-"
        mab = f"{r['max_abs']:.3g}" if r["max_abs"] is not None else "-"
        out.append(f"| {r['graph']} | {r['table']} | {r['qnn']} | {'yes' if r['whole'] else 'no'} | {r['partitions']} "
                   f"| {cos}{'' if r['finite'] else ' (not finite)'} | {mab} | {r['near_fp16_max']} "
                   f"({r['unguarded']}) |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
