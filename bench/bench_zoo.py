"""The zoo's table: every public architecture of ``tests/zoo.py``, exported with each torch exporter that can
export it, compiled with ``sdnpu compile`` in a process of its own.

    python bench/bench_zoo.py                     # every member: the table, into bench/results.md
    python bench/bench_zoo.py --only flux-dev,sana --no-write
    python bench/bench_zoo.py --floors            # also record each member's floor in tests/zoo_floors.json
    python bench/bench_zoo.py --draws 4 --only lumina2,sd15-unet   # the PyTorch bf16 ratios on 4 input draws

Per member and exporter: the offload counted AMD's way (dispatch ops / (dispatch ops + CPU nodes), CastAvx
on the CPU), CPU nodes, NPU regions, CPU islands (at the graph's edges / around ops the registry lacks /
avoidable), the share of multiply-accumulates on the NPU, contract problems
(``tests/contract.py``), the dispatch model against its fp32 graph (min cosine, seeded inputs of the
compile's own check), the error against PyTorch's own bf16 run on the member's example inputs (max abs and
1 - cosine, each as a ratio: the dispatch model's error against PyTorch fp32 over PyTorch bf16's), the same
ratios over the error of the export itself with every weight, input and node output rounded to bf16
(``tests.fuzz_repro.bf16_everywhere``: what rounding each op's result costs this graph, where PyTorch's bf16 keeps
some intermediates in fp32, its fused attention's and norms'), and the compile's wall time and peak memory
(os.wait4). An export torch writes wrong says so instead.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import zoo  # noqa: E402
from tests.contract import problems  # noqa: E402

FLOORS = ROOT / "tests" / "zoo_floors.json"
RESULTS = ROOT / "bench" / "results.md"
SECTION = "## Zoo: public architectures through sdnpu compile"


def _compile(path: Path, out: Path) -> tuple[float, int, str]:
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "sdnpu", "-q", "compile", str(path), "--out", str(out)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read() if proc.stderr else ""
    return time.perf_counter() - start, usage.ru_maxrss * 1024, "" if os.waitstatus_to_exitcode(status) == 0 else err


def _errors(got: list[np.ndarray], want: list[np.ndarray]) -> tuple[float, float]:
    a = np.concatenate([g.astype(np.float64).ravel() for g in got])
    b = np.concatenate([w.astype(np.float64).ravel() for w in want])
    cos = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))) if np.linalg.norm(a) * np.linalg.norm(b) else 1.0
    return float(np.abs(a - b).max()), 1.0 - cos


def _pytorch_bf16(name: str) -> list[np.ndarray] | None:
    import torch

    wrapper, built = zoo.build(name)
    args = [a.to(torch.bfloat16) if a.is_floating_point() else a for a in built.inputs]
    try:
        with torch.no_grad():
            return [o.float().numpy() for o in wrapper.to(torch.bfloat16)(*args)]
    except (RuntimeError, TypeError) as e:  # an op PyTorch's CPU has no bf16 kernel for
        print(f"  {name}: no PyTorch bf16 run ({str(e)[:80]})", flush=True)
        return None


def measure_fast(name: str, exporter: str, tmp: Path) -> dict:
    """The offload and fidelity alone, compiled in this process (what the floors need; no timings)."""
    from sdnpu.convert.compile import compile_file
    from sdnpu.errors import SdnpuError

    row: dict = {"member": name, "exporter": exporter, "architecture": zoo.MEMBERS[name].architecture}
    path, feeds, reference = zoo.export(name, exporter, tmp / "export")
    try:
        report = compile_file(path, tmp / "dd")
    except SdnpuError as e:
        row["refused"] = str(e).splitlines()[0]
        return row
    if not zoo.agrees_with_pytorch(path, feeds, reference):
        row["exporter_bug"] = "onnxruntime's run of the export is not PyTorch's (non-finite or off by > 1e-3)"
        return row
    s = report["summary"]
    row.update(offload=s["offload_rate"], dispatch=s["offloaded_nodes"], cpu=s["cpu_nodes"], regions=s["npu_regions"],
               macs=s["macs_offloaded_share"], min_cosine=report["fidelity"]["min_cosine"],
               contract=len(problems(tmp / "dd" / "replaced.onnx")[1]), compile_s=None, peak_gb=None)
    return row


def measure(name: str, exporter: str, tmp: Path) -> dict:
    from sdnpu.convert.compile import run_onnx

    row: dict = {"member": name, "exporter": exporter, "architecture": zoo.MEMBERS[name].architecture}
    t0 = time.perf_counter()
    try:
        path, feeds, reference = zoo.export(name, exporter, tmp / "export")
    except Exception as e:  # torch's exporter: the member's why_not should say so
        row["refused"] = f"export failed: {type(e).__name__}: {' '.join(str(e).split())[:160]}"
        return row
    row["export_s"] = round(time.perf_counter() - t0, 1)
    agrees = zoo.agrees_with_pytorch(path, feeds, reference)
    wall, peak, err = _compile(path, tmp / "dd")
    if err:
        line = next((ln for ln in err.splitlines() if ln.startswith("sdnpu: error:")), err.strip().splitlines()[-1])
        row["refused"] = line.replace("sdnpu: error: ", "")
        return row
    if not agrees:
        row["exporter_bug"] = "onnxruntime's run of the export is not PyTorch's (non-finite or off by > 1e-3)"
        return row
    report = json.loads((tmp / "dd" / "report.json").read_text())
    s = report["summary"]
    checked, found = problems(tmp / "dd" / "replaced.onnx")
    row.update(offload=s["offload_rate"], dispatch=s["offloaded_nodes"], cpu=s["cpu_nodes"], regions=s["npu_regions"],
               transitions=s["transitions"], islands=s.get("cpu_islands"), macs=s["macs_offloaded_share"],
               contract=len(found),
               min_cosine=report["fidelity"]["min_cosine"], compile_s=round(wall, 1), peak_gb=round(peak / 1e9, 2))
    ours = run_onnx(tmp / "dd" / "replaced.onnx", feeds)
    ours_list = [ours[k] for k in ours]
    bf16 = _pytorch_bf16(name)
    m_ours, c_ours = _errors(ours_list, reference)
    if bf16 is not None:
        m_pt, c_pt = _errors(bf16, reference)
        row["ratio_max_abs"] = m_ours / m_pt if m_pt else None
        row["ratio_cos"] = c_ours / c_pt if c_pt else None
    m_r, c_r = _errors(_rounded_op_by_op(path, feeds), reference)
    row["ratio_rounded_max_abs"] = m_ours / m_r if m_r else None
    row["ratio_rounded_cos"] = c_ours / c_r if c_r else None
    return row


def _rounded_op_by_op(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnx
    import onnxruntime as ort

    from sdnpu.reports.bf16 import rounded_feeds
    from tests.fuzz_repro import bf16_everywhere

    exported = onnx.load(str(path))
    model = bf16_everywhere(exported)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, rounded_feeds(exported, feeds))


def draw_errors(name: str, exporter: str, tmp: Path, draws: int) -> list[tuple[float, float, float, float]]:
    """The dispatch model's and PyTorch bf16's errors against PyTorch fp32 (max abs ours, PyTorch's; 1 - cos
    ours, PyTorch's) on ``draws`` inputs: the member's example inputs, then its float inputs of 8 or more values
    drawn again (seeded normals with the example's mean and deviation; timesteps, sizes, ids and masks kept):
    how much one input's ratio says. Raises ValueError where the export is not the module."""
    import torch

    from sdnpu.convert.compile import compile_file, run_onnx

    path, feeds, reference = zoo.export(name, exporter, tmp / "export")
    if not zoo.agrees_with_pytorch(path, feeds, reference):
        raise ValueError("onnxruntime does not run the export to PyTorch's outputs")
    compile_file(path, tmp / "dd")
    out = []
    for draw in range(draws):
        wrapper, built = zoo.build(name)  # afresh: the bf16 run rounds the module's weights in place
        g = torch.Generator().manual_seed(draw)
        inputs = [a if draw == 0 or not a.is_floating_point() or a.numel() < 8
                  else torch.randn(a.shape, generator=g) * a.std() + a.mean() for a in built.inputs]
        with torch.no_grad():
            ref = [o.numpy().copy() for o in wrapper(*inputs)]
            low = [o.float().numpy() for o in wrapper.to(torch.bfloat16)(
                *[a.to(torch.bfloat16) if a.is_floating_point() else a for a in inputs])]
        got = run_onnx(tmp / "dd" / "replaced.onnx", {k: a.numpy() for k, a in zip(feeds, inputs, strict=True)})
        (m_ours, c_ours), (m_pt, c_pt) = _errors([got[k] for k in got], ref), _errors(low, ref)
        out.append((m_ours, m_pt, c_ours, c_pt))
    return out


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    head = ("| member | exporter | offload | dispatch ops | CPU nodes | NPU regions | CPU islands (edges / lacks / "
            "avoidable) | MACs on NPU | contract | cosine vs fp32 | vs PyTorch bf16 (max abs, 1 - cos) | vs the graph "
            "rounded to bf16 op by op | compile s | peak GB |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "refused" in r or "exporter_bug" in r:
            why = re.sub(r"/\S*/export/", "<export>/", r.get("refused") or r["exporter_bug"])  # no temp paths
            lines.append(f"| {r['member']} | {r['exporter']} | {why[:150]} |" + " |" * 11)
            continue
        ratio = f"{_fmt(r.get('ratio_max_abs'), '.2f')}x, {_fmt(r.get('ratio_cos'), '.2f')}x"
        rounded = f"{_fmt(r.get('ratio_rounded_max_abs'), '.2f')}x, {_fmt(r.get('ratio_rounded_cos'), '.2f')}x"
        i = r.get("islands") or {}
        isl = (f"{i['total']} ({i['at the edges']} / {i['around ops the registry lacks']} / {i['avoidable']})"
               if "total" in i else "-")
        lines.append(f"| {r['member']} | {r['exporter']} | {100 * r['offload']:.2f}% | {r['dispatch']} | {r['cpu']} | "
                     f"{r['regions']} | {isl} | {_fmt(100 * r['macs'] if r['macs'] is not None else None, '.2f')}% | "
                     f"{r['contract']} | {r['min_cosine']:.6f} | {ratio} | {rounded} | {r.get('compile_s') or '-'} | "
                     f"{r.get('peak_gb') or '-'} |")
    for name, m in zoo.MEMBERS.items():
        for exporter, why in m.why_not.items():
            lines.append(f"| {name} | {exporter} | not exported: {why} |" + " |" * 11)
    return "\n".join(lines)


def floors(rows: list[dict]) -> dict:
    out = {}
    for r in rows:
        key = f"{r['member']}/{r['exporter']}"
        if "refused" in r:
            phrase = "is not valid ONNX" if "is not valid ONNX" in r["refused"] else "onnxruntime cannot run"
            out[key] = {"refused": re.escape(phrase)}
        elif "exporter_bug" in r:
            out[key] = {"exporter_bug": r["exporter_bug"]}
        else:
            out[key] = {"offload": r["offload"], "cpu_nodes": r["cpu"], "npu_regions": r["regions"],
                        "macs": r["macs"] or 0.0, "min_cosine": float(np.floor(r["min_cosine"] * 1e4) / 1e4)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated members (default: all)")
    ap.add_argument("--floors", action="store_true", help="write tests/zoo_floors.json from this run")
    ap.add_argument("--no-write", action="store_true", help="print the table, leave bench/results.md")
    ap.add_argument("--fast", action="store_true", help="offload and fidelity only, in this process (implies "
                    "--no-write): what the floors need")
    ap.add_argument("--draws", type=int, default=0, help="only the PyTorch bf16 ratios, on this many input draws "
                    "(the first the example's), printed")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(zoo.MEMBERS)
    if args.draws:
        print("| member | exporter | max abs: ratio per draw | of the means | 1 - cos: ratio per draw | of the means |\n"
              "|---|---|---|---|---|---|")
        for name in names:
            for exporter in zoo.MEMBERS[name].exporters:  # the first whose export compiles and runs
                with tempfile.TemporaryDirectory(prefix="sdnpu-zoo-") as tmp:
                    try:
                        got = draw_errors(name, exporter, Path(tmp), args.draws)
                    except Exception as e:  # noqa: BLE001 - the zoo's table says why, in full
                        print(f"  {name} {exporter}: {type(e).__name__}: {str(e)[:100]}", file=sys.stderr)
                        continue
                break
            else:
                continue
            m = [_ratio(e[0], e[1]) for e in got]
            c = [_ratio(e[2], e[3]) for e in got]
            means = [float(np.mean([e[i] for e in got])) for i in range(4)]
            print(f"| {name} | {exporter} | {', '.join(m)} | {_ratio(means[0], means[1])} | {', '.join(c)} | "
                  f"{_ratio(means[2], means[3])} |", flush=True)
        return
    rows = []
    for name in names:
        for exporter in zoo.MEMBERS[name].exporters:
            with tempfile.TemporaryDirectory(prefix="sdnpu-zoo-") as tmp:
                row = (measure_fast if args.fast else measure)(name, exporter, Path(tmp))
            rows.append(row)
            print(json.dumps(row), flush=True)
    text = table(rows)
    print(text)
    if args.floors:
        old = json.loads(FLOORS.read_text()) if FLOORS.exists() else {}
        FLOORS.write_text(json.dumps({**old, **floors(rows)}, indent=1, sort_keys=True) + "\n")
    if not args.no_write and not args.fast:
        stamp = time.strftime("%Y-%m-%d")
        body = (f"{SECTION}\n\nMeasured {stamp} with `python bench/bench_zoo.py` (one process per compile, 2 cores). "
                "Offload counted AMD's way; the bf16 ratios on each member's example inputs.\n\n{text}\n")
        body = body.replace("{text}", text)
        results = RESULTS.read_text() if RESULTS.exists() else ""
        if SECTION in results:
            before, rest = results.split(SECTION, 1)
            after = rest[rest.find("\n## "):] if "\n## " in rest else ""
            results = before + body + after
        else:
            results = results.rstrip() + "\n\n" + body
        RESULTS.write_text(results)


if __name__ == "__main__":
    main()
