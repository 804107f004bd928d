"""The qnn-htp table against Qualcomm's compiler, on ONNX's own conformance node tests.

Each of onnx's node test cases (one node, its inputs) is read as the table reads it (``sdnpu.passes.standard``:
taken, or refused with a reason) and handed to QNN's HTP backend with CPU fallback disabled (taken: the session
builds). Where they disagree, the table says something QNN does not: those are the table's errors, printed with
the case and QNN's message.

    python bench/bench_qnn_table.py [PATTERN] [--json OUT]

Cases whose graph onnxruntime itself cannot load are skipped; so are cases with dynamic shapes (QNN refuses
every dynamic shape, the table is for static graphs).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _verdict(case: object, tmp: Path) -> dict[str, object] | None:
    import onnx
    import onnx_ir as ir
    import onnxruntime as ort

    from sdnpu.backends import qnn_htp
    from sdnpu.passes.pipeline import CompileOptions, compile_model

    path = tmp / "m.onnx"
    m = case.model  # type: ignore[attr-defined]
    if any(d.dim_value <= 0 for vi in m.graph.input for d in vi.type.tensor_type.shape.dim):
        return None
    try:
        onnx.save(m, str(path))
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception:
        return None
    model = ir.load(str(path))
    name = case.name  # type: ignore[attr-defined]
    try:
        compile_model(model, CompileOptions.named("qnn-htp"))
    except Exception as e:
        return {"case": name, "error": f"{type(e).__name__}: {str(e)[:200]}"}
    refused = [n.metadata_props.get("sdnpu.cpu_reason") for n in model.graph if "sdnpu.cpu_reason" in n.metadata_props]
    ir.save(model, str(path))
    try:
        qnn_htp.session(path)
        qnn, message = True, ""
    except Exception as e:
        qnn, message = False, " ".join(str(e).split())[:200]
    return {"case": name, "ops": sorted({n.op_type for n in m.graph.node}), "table": not refused, "qnn": qnn,
            "reason": refused[:1], "qnn_message": message}


def _worker(pattern: str, start: int, log: str) -> None:
    """(A child process.) The cases from ``start`` on, each line of ``log`` written before (its index) and after
    (its row): a case that crashes onnxruntime or QNN ends the process, and the parent goes on after it."""
    from tests.node_tests import cases

    with tempfile.TemporaryDirectory() as tmp, open(log, "a") as out:
        for i, case in enumerate(cases(pattern)):
            if i < start:
                continue
            out.write(json.dumps({"start": i, "case": case.name}) + "\n")
            out.flush()
            row = _verdict(case, Path(tmp))
            out.write(json.dumps({"done": i, "row": row}) + "\n")
            out.flush()


def verdicts(pattern: str = "") -> list[dict[str, object]]:
    import multiprocessing as mp

    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        log = str(Path(tmp) / "log.jsonl")
        start = 0
        while True:
            child = mp.get_context("spawn").Process(target=_worker, args=(pattern, start, log))
            child.start()
            child.join()
            lines = [json.loads(x) for x in Path(log).read_text().splitlines()] if Path(log).is_file() else []
            Path(log).unlink(missing_ok=True)
            last = None
            for x in lines:
                if "done" in x:
                    if x["row"] is not None:
                        rows.append(x["row"])
                    last = None
                else:
                    last = x
            if child.exitcode == 0 or last is None:
                break
            rows.append({"case": last["case"], "error": f"the process died (exit {child.exitcode}) in this case"})
            start = int(last["start"]) + 1
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pattern", nargs="?", default="")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = verdicts(args.pattern)
    tally = Counter((r.get("table"), r.get("qnn")) for r in rows if "error" not in r)
    agree = tally[(True, True)] + tally[(False, False)]
    total = sum(tally.values())
    print(f"{total} cases: table and QNN agree on {agree} ({100 * agree / max(total, 1):.1f}%): both take "
          f"{tally[(True, True)]}, both refuse {tally[(False, False)]}; the table takes and QNN refuses "
          f"{tally[(True, False)]}; the table refuses and QNN takes {tally[(False, True)]}")
    for r in rows:
        if "error" in r:
            print(f"  error  {r['case']}: {r['error']}")
        elif r["table"] != r["qnn"]:
            side = "table takes, QNN refuses" if r["table"] else "table refuses, QNN takes"
            print(f"  {side:<26} {r['case']} ({', '.join(r['ops'])}): {r['reason'] or r['qnn_message']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
