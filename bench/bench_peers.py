"""sdnpu against its peers, on the same exported graphs: compile (sdnpu's passes vs onnxruntime's transformers
optimizer) and inference on onnxruntime CPU (dispatch model vs fp32 graph vs ORT-optimized graph).

    python bench/bench_peers.py                                   # tiny-sdxl, every component
    python bench/bench_peers.py --full                  # + sdxl-base's VAE decoder and UNet at 512x512

Every measurement runs in its own process (peak memory from os.wait4; a watchdog stops a process whose
resident memory passes --mem-limit GB and records that). Inference: a session per variant, one warm-up run,
then --runs timed runs, the median kept; the variants take turns for --rounds rounds and each ratio is taken
within a round (this machine is noisy), then the median ratio over rounds is reported.

Variants:
  fp32         model.onnx, onnxruntime's default optimizations (what a plain ORT user runs)
  dispatch     dd/replaced.onnx as `sdnpu generate` runs it: optimizations off (the reference bodies cast
               bf16 weights to fp32 at each call; with optimizations on, ORT folds those casts into a second,
               fp32 copy of the weights)
  dispatch+opt dd/replaced.onnx with ORT's default optimizations (faster, twice the weight memory)
  ort-opt      onnxruntime.transformers.optimizer.optimize_model(model_type=unet|vae|clip, use_gpu=False), with
               the fusions whose ops have only CUDA kernels turned off (else the graph does not load on a CPU)
sdnpu compiles with --outputs all here, so that every variant computes the same outputs.
Results go to bench/results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out" / "models"
PEERS = ROOT / "bench" / "out" / "peers"
COMPONENTS = ("text_encoder", "text_encoder_2", "vae_encoder", "vae_decoder", "unet")
ORT_TYPES = {"unet": "unet", "vae_encoder": "vae", "vae_decoder": "vae", "text_encoder": "clip",
             "text_encoder_2": "clip"}
VARIANTS = ("fp32", "dispatch", "dispatch+opt", "ort-opt")
# FusionOptions whose ops (NhwcConv, GroupNorm, SkipGroupNorm, BiasSplitGelu, BiasAdd, packed QKV/KV
# attention) onnxruntime implements for CUDA only; left on, the optimized graph does not load on the CPU.
CUDA_ONLY_FUSIONS = ("enable_nhwc_conv", "enable_group_norm", "enable_skip_group_norm", "enable_bias_splitgelu",
                     "enable_bias_add", "enable_packed_qkv", "enable_packed_kv")


# ---- children: each runs in its own process -----------------------------------------------------------

def child_sdnpu(model: Path, out: Path) -> dict:
    from sdnpu.convert.compile import compile_file

    start = time.perf_counter()
    # every output, as the fp32 graph and ORT's optimizer have them: the same work on all sides
    report = compile_file(model, out, verify=False, outputs="all")
    wall = time.perf_counter() - start
    s = report["summary"]
    return {"wall_s": wall, "passes_s": sum(p["seconds"] for p in report["passes"]),
            "nodes_after": s["total_nodes"], "fused": s["offloaded_nodes"], "left": s["cpu_nodes"],
            "by_type": report["offloaded_by_type"]}


def child_ort(model: Path, out: Path, component: str) -> dict:
    import logging

    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    logging.getLogger("onnxruntime").setLevel(logging.ERROR)
    logging.getLogger("onnx_model").setLevel(logging.ERROR)
    options = FusionOptions(ORT_TYPES[component])
    for cuda_only in CUDA_ONLY_FUSIONS:  # their contrib ops have no CPU kernel: the graph would not run
        setattr(options, cuda_only, False)
    start = time.perf_counter()
    opt = optimize_model(str(model), model_type=ORT_TYPES[component], use_gpu=False, optimization_options=options)
    passes = time.perf_counter() - start
    out.mkdir(parents=True, exist_ok=True)
    big = sum(t.ByteSize() for t in opt.model.graph.initializer) > 2**31 - 2**26
    opt.save_model_to_file(str(out / "model.onnx"), use_external_data_format=big)
    wall = time.perf_counter() - start
    stats = {k: v for k, v in opt.get_fused_operator_statistics().items() if v}
    nodes = opt.model.graph.node
    standard = {"", "ai.onnx"}
    contrib = {}
    for n in nodes:
        if n.domain not in standard:
            contrib[n.op_type] = contrib.get(n.op_type, 0) + 1
    return {"wall_s": wall, "passes_s": passes, "nodes_after": len(nodes), "fused": sum(contrib.values()),
            "left": len(nodes) - sum(contrib.values()), "by_type": dict(sorted(contrib.items(), key=lambda kv: -kv[1])),
            "stats": stats}


def child_infer(model: Path, optimize: bool, runs: int) -> dict:
    import onnxruntime as ort

    from sdnpu.reports.fidelity import generic_inputs

    source = model.parent.parent / "model.onnx" if model.parent.name == "dd" else model
    if not source.is_file():  # the ORT-optimized copy lives elsewhere: its inputs are the graph's own
        source = model
    feeds = generic_inputs(source, seed=0)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                     else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    opts.log_severity_level = 3
    start = time.perf_counter()
    try:
        sess = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - a peer's graph that does not run on the CPU is a result
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    load = time.perf_counter() - start
    names = {i.name for i in sess.get_inputs()}
    feeds = {k: v for k, v in feeds.items() if k in names}
    sess.run(None, feeds)  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - start)
    return {"load_s": load, "median_s": statistics.median(times), "runs": times}


# ---- the parent: spawn, watch memory, tabulate ---------------------------------------------------------

def spawn(args: list[str], mem_limit_gb: float) -> tuple[dict, float]:
    """Run this script as a child; its JSON result and peak RSS in GB. A child past the memory limit is
    killed and reported as such."""
    import shutil
    import tempfile

    cmd = [sys.executable, __file__, "--child", *args]
    # the child's temporary files (ORT's optimizer writes a full copy of the model there) go in a folder
    # removed afterwards, also when the watchdog kills it
    scratch = Path(tempfile.mkdtemp(prefix="sdnpu-peers-", dir=PEERS.parent))
    env = {**os.environ, "TMPDIR": str(scratch)}
    with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out_f, stderr=err_f, text=True, env=env)
        killed = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            try:
                rss_kb = next(int(line.split()[1]) for line in
                              Path(f"/proc/{proc.pid}/status").read_text().splitlines() if line.startswith("VmRSS:"))
            except (OSError, StopIteration, ValueError):
                rss_kb = 0
            if rss_kb * 1024 > mem_limit_gb * 1e9:
                proc.kill()
                killed = True
            time.sleep(0.2)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out_f.seek(0)
        err_f.seek(0)
        out, err = out_f.read(), err_f.read()
    shutil.rmtree(scratch, ignore_errors=True)
    peak = usage.ru_maxrss * 1024 / 1e9
    if killed:
        return {"error": f"stopped at the {mem_limit_gb:g} GB memory limit"}, peak
    if proc.returncode != 0:
        return {"error": (err.strip().splitlines() or ["failed"])[-1][:200]}, peak
    return json.loads(out.strip().splitlines()[-1]), peak


def ensure_exported(source: str, res: int | None, component: str, folder: Path) -> Path:
    model = folder / component / "model.onnx"
    if not model.exists():
        cmd = [sys.executable, "-m", "sdnpu", "-q", "convert", "--source", source, "--model", component,
               "--out", str(folder), "--no-compile"] + (["--res", str(res)] if res else [])
        subprocess.run(cmd, cwd=ROOT, check=True)
    return model


def compile_rows(source: str, folder: Path, components: list[str], mem_limit: float) -> list[dict]:
    rows = []
    for comp in components:
        model = folder / comp / "model.onnx"
        weights = sum(f.stat().st_size for f in model.parent.glob("model.onnx*")) / 1e9
        ours, ours_peak = spawn(["sdnpu", str(model), str(folder / comp / "dd")], mem_limit)
        theirs, theirs_peak = spawn(["ort", str(model), str(PEERS / folder.name / comp), comp], mem_limit)
        rows.append({"component": comp, "weights_gb": weights, "sdnpu": {**ours, "peak_gb": ours_peak},
                     "ort": {**theirs, "peak_gb": theirs_peak}})
        print(f"compile {source} {comp}: {json.dumps(rows[-1])}", flush=True)
    return rows


def _types(by_type: dict[str, int], n: int = 4) -> str:
    items = list(by_type.items())
    text = ", ".join(f"{k} {v}" for k, v in items[:n])
    return text + (f", +{len(items) - n} types" if len(items) > n else "")


def compile_table(rows: list[dict]) -> str:
    head = ("| component | tool | passes s | wall s | peak RSS GB | peak / fp32 weights | nodes after | fused ops "
            "| other nodes | fused ops by type |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        for tool, label in (("sdnpu", "sdnpu"), ("ort", "ORT transformers optimizer")):
            d = r[tool]
            ratio = f"{d['peak_gb'] / r['weights_gb']:.2f}" if r["weights_gb"] else "-"
            if "error" in d:
                lines.append(f"| {r['component']} | {label} | - | - | {d['peak_gb']:.2f} | {ratio} | - | - | - | "
                             f"{d['error']} |")
                continue
            lines.append(f"| {r['component']} | {label} | {d['passes_s']:.1f} | {d['wall_s']:.1f} | {d['peak_gb']:.2f} "
                         f"| {ratio} | {d['nodes_after']} | {d['fused']} | {d['left']} | {_types(d['by_type'])} |")
    return "\n".join(lines)


def infer_rows(source: str, folder: Path, components: list[str], runs: int, rounds: int,
               mem_limit: float) -> list[dict]:
    rows = []
    for comp in components:
        dispatch = folder / comp / "dd" / "replaced.onnx"
        paths = {"fp32": (folder / comp / "model.onnx", True), "dispatch": (dispatch, False),
                 "dispatch+opt": (dispatch, True),
                 "ort-opt": (PEERS / folder.name / comp / "model.onnx", True)}
        per_round: list[dict[str, dict]] = []
        for _ in range(rounds):
            got = {}
            for name, (path, optimize) in paths.items():
                if not path.is_file():
                    got[name] = {"error": "not produced (see the compile table)"}
                    continue
                result, peak = spawn(["infer", str(path), "1" if optimize else "0", str(runs)], mem_limit)
                got[name] = {**result, "peak_gb": peak}
            per_round.append(got)
        row: dict = {"component": comp}
        for name in VARIANTS:
            ok = [r[name] for r in per_round if "error" not in r[name]]
            if not ok:
                row[name] = {"error": per_round[-1][name]["error"]}
                continue
            row[name] = {"median_s": statistics.median(r["median_s"] for r in ok),
                         "peak_gb": max(r["peak_gb"] for r in ok)}
            if name != "fp32":
                ratios = [r[name]["median_s"] / r["fp32"]["median_s"] for r in per_round
                          if "error" not in r[name] and "error" not in r["fp32"]]
                row[name]["ratio"] = statistics.median(ratios) if ratios else None
        rows.append(row)
        print(f"infer {source} {comp}: {json.dumps(row)}", flush=True)
    return rows


def infer_table(rows: list[dict]) -> str:
    head = "| component | " + " | ".join(f"{v} (x fp32) | {v} peak GB" for v in VARIANTS) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = []
        for name in VARIANTS:
            d = r[name]
            if "error" in d:
                cells += [d["error"], "-"]
                continue
            ratio = f" ({d['ratio']:.2f}x)" if d.get("ratio") is not None else ""
            t = d["median_s"]
            cells += [(f"{t:.2f} s" if t >= 1 else f"{1000 * t:.3g} ms") + ratio, f"{d['peak_gb']:.2f}"]
        lines.append(f"| {r['component']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, rest = sys.argv[2], sys.argv[3:]
        if kind == "sdnpu":
            result = child_sdnpu(Path(rest[0]), Path(rest[1]))
        elif kind == "ort":
            result = child_ort(Path(rest[0]), Path(rest[1]), rest[2])
        else:
            result = child_infer(Path(rest[0]), rest[1] == "1", int(rest[2]))
        print(json.dumps(result))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="also sdxl-base's VAE decoder and UNet at 512x512")
    parser.add_argument("--no-tiny", action="store_true", help="skip tiny-sdxl (with --full)")
    parser.add_argument("--components", default=",".join(COMPONENTS), help="tiny-sdxl components")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per session (median kept)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of all variants (median ratio kept)")
    parser.add_argument("--mem-limit", type=float, default=20.0, help="GB of RSS at which a child is stopped")
    parser.add_argument("--only", choices=("compile", "infer"), default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_export import write_section  # type: ignore[import-not-found]

    jobs = [] if args.no_tiny else [("tiny-sdxl", None, OUT / "tiny-sdxl", args.components.split(","), args.runs,
                                      args.rounds)]
    if args.full:
        jobs.append(("sdxl-base", 512, OUT / "sdxl-base-512", ["vae_decoder", "unet"], 2, 2))
    for source, res, folder, comps, runs, rounds in jobs:
        label = f"{source}" + (f" at {res}x{res}" if res else "")
        for comp in comps:
            ensure_exported(source, res, comp, folder)
        if args.only != "infer":
            rows = compile_rows(source, folder, comps, args.mem_limit)
            write_section(f"Compile vs ORT transformers optimizer: {label}", compile_table(rows))
        if args.only != "compile":
            rows = infer_rows(source, folder, comps, runs, rounds, args.mem_limit)
            write_section(f"Inference on onnxruntime CPU: {label}", infer_table(rows))


if __name__ == "__main__":
    main()
