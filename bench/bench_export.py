"""Export benchmark: wall time and peak memory of `sdnpu convert` per component, each in its own process.

    make bench            # tiny-sdxl, all five components
    make bench FULL=1     # also sdxl-base (the full SDXL base 1.0 architecture): about half an hour

Peak memory is the child process's own maximum resident set (os.wait4), so components do not blur into
each other; the phase split (weights, PyTorch run, export, onnxruntime check) comes from each
component's export.json. Results go to bench/results.md (a section per source) and bench/out/*.json.
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
COMPONENTS = ("text_encoder", "text_encoder_2", "vae_encoder", "vae_decoder", "unet")


def run_component(source: str, component: str, out: Path, exporter: str, compile: bool) -> dict:
    cmd = [sys.executable, "-m", "sdnpu", "-q", "convert", "--source", source, "--model", component,
           "--out", str(out), "--exporter", exporter] + ([] if compile else ["--no-compile"])
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    stderr = proc.stderr.read() if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{component} failed:\n{stderr}")
    info = json.loads((out / component / "export.json").read_text())
    return {
        "source": source,
        "component": component,
        "exporter": exporter,
        "wall_s": round(wall, 1),
        "peak_rss_gb": round(usage.ru_maxrss * 1024 / 1e9, 2),
        "phases_s": info["seconds"],
        "nodes": info["nodes"],
        "parameters": info["parameters"],
        "max_abs_error": info["check"]["max_abs_error"],
        "max_rel_error": info["check"]["max_rel_error"],
        "weights_gb": round(sum(f.stat().st_size for f in (out / component).glob("model.onnx*")) / 1e9, 2),
    }


def table(rows: list[dict]) -> str:
    compiled = any("compile" in r["phases_s"] for r in rows)
    head = ("| component | exporter | params | nodes | load s | torch run s | export s | ORT check s | "
            + ("compile s | " if compiled else "") + "wall s | peak RSS GB | ONNX GB | max abs err | max rel err |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        p = r["phases_s"]
        lines.append(
            f"| {r['component']} | {r['exporter']} | {r['parameters']:,} | {r['nodes']} | {p.get('load', 0):.1f} | "
            f"{p.get('torch_run', 0):.1f} | {p.get('export', 0):.1f} | {p.get('onnx_run', 0):.1f} | "
            + (f"{p.get('compile', 0):.1f} | " if compiled else "")
            + f"{r['wall_s']:.1f} | {r['peak_rss_gb']:.2f} | {r['weights_gb']:.2f} | {r['max_abs_error']:.2e} | "
            f"{r['max_rel_error']:.2e} |")
    return "\n".join(lines)


def write_section(title: str, body: str) -> None:
    """Replace (or add) the section ``## title`` of bench/results.md, naming the command line that measured it."""
    import shlex

    command = shlex.join(["python", *sys.argv])
    results = ROOT / "bench" / "results.md"
    text = results.read_text() if results.exists() else "# sdnpu benchmarks\n"
    marker = f"## {title}"
    section = (f"{marker}\n\n`{command}` on {time.strftime('%Y-%m-%d')}, one process per component, "
               f"{os.cpu_count()} cores.\n\n{body}\n")
    parts = text.split("\n## ")
    kept = [parts[0]] + [p for p in parts[1:] if not ("## " + p).startswith(marker + "\n")]
    results.write_text("\n## ".join(kept).rstrip() + "\n\n" + section)


def write_results(source: str, rows: list[dict], compiled: bool = False) -> None:
    out_dir = ROOT / "bench" / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    what = "export-compile" if compiled else "export"
    (out_dir / f"{what}-{source}.json").write_text(json.dumps(rows, indent=2) + "\n")
    title = f"Export + compile: {source}" if compiled else f"Export: {source}"
    write_section(title, table(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="also benchmark the full-size sdxl-base")
    parser.add_argument("--components", default=",".join(COMPONENTS))
    parser.add_argument("--exporter", default="dynamo")
    parser.add_argument("--sources", default=None, help="comma-separated (default: tiny-sdxl[,sdxl-base])")
    parser.add_argument("--compile", action="store_true", help="time export + compile (default: export only)")
    args = parser.parse_args()
    sources = args.sources.split(",") if args.sources else ["tiny-sdxl"] + (["sdxl-base"] if args.full else [])
    for source in sources:
        rows = []
        with tempfile.TemporaryDirectory(prefix=f"sdnpu-bench-{source}-") as tmp:
            for comp in args.components.split(","):
                row = run_component(source, comp, Path(tmp), args.exporter, args.compile)
                rows.append(row)
                print(f"{source} {comp}: {row['wall_s']} s, peak {row['peak_rss_gb']} GB", flush=True)
                write_results(source, rows, args.compile)  # after each component: a long run keeps what it measured
        print(table(rows))


if __name__ == "__main__":
    main()
