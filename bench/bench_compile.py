"""Compile benchmark: time and peak memory of `sdnpu compile` per component, each in its own process.

    python bench/bench_compile.py                   # tiny-sdxl
    python bench/bench_compile.py --sources sdxl-base --components unet,vae_decoder

Exports each component once (into bench/out/models/<source>/, reused by later runs), then compiles it in
a fresh process and records: wall time, the passes' own time (from report.json), peak resident memory
(os.wait4) against the fp32 weight size, and the offload summary. Results go to bench/results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out" / "models"
COMPONENTS = ("text_encoder", "text_encoder_2", "vae_encoder", "vae_decoder", "unet")


def _run(cmd: list[str]) -> tuple[float, int]:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read() if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    return time.perf_counter() - start, usage.ru_maxrss * 1024


def bench(source: str, component: str) -> dict:
    model = OUT / source / component / "model.onnx"
    if not model.exists():
        _run([sys.executable, "-m", "sdnpu", "-q", "convert", "--source", source, "--model", component,
              "--out", str(OUT / source), "--no-compile"])
    weights = sum(f.stat().st_size for f in model.parent.glob("model.onnx*"))
    with tempfile.TemporaryDirectory(prefix="sdnpu-compile-") as tmp:
        wall, peak = _run([sys.executable, "-m", "sdnpu", "-q", "compile", str(model), "--out", tmp, "--no-verify"])
        report = json.loads((Path(tmp) / "report.json").read_text())
    s = report["summary"]
    return {"source": source, "component": component, "wall_s": round(wall, 1),
            "passes_s": round(sum(p["seconds"] for p in report["passes"]), 1),
            "peak_rss_gb": round(peak / 1e9, 2), "weights_gb": round(weights / 1e9, 2),
            "peak_over_weights": round(peak / weights, 2), "offload_rate": s["offload_rate"],
            "dispatch": s["offloaded_nodes"], "cpu": s["cpu_nodes"], "regions": s["npu_regions"]}


def table(rows: list[dict]) -> str:
    head = ("| component | passes s | wall s (load+passes+save+check) | peak RSS GB | fp32 weights GB | peak / weights "
            "| offload | dispatch ops | CPU nodes | regions |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['component']} | {r['passes_s']} | {r['wall_s']} | {r['peak_rss_gb']} | {r['weights_gb']} | "
                     f"{r['peak_over_weights']} | {100 * r['offload_rate']:.2f}% | {r['dispatch']} | {r['cpu']} | "
                     f"{r['regions']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sources", default="tiny-sdxl")
    parser.add_argument("--components", default=",".join(COMPONENTS))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_export import write_section  # type: ignore[import-not-found]

    for source in args.sources.split(","):
        rows = []
        for comp in args.components.split(","):
            rows.append(bench(source, comp))
            print(f"{source} {comp}: {rows[-1]}", flush=True)
            write_section(f"Compile: {source}", table(rows))
        print(table(rows))


if __name__ == "__main__":
    main()
