"""Opening a dispatch model with a LoRA: time and peak memory of the session, each way, one process each.

    python bench/bench_lora_open.py --models models/sdxl-base --lora LORA.safetensors [--component unet]

Three sessions over ``<component>/dd/replaced.onnx`` (graph optimizations off, as on an NPU): without a LoRA;
with the LoRA applied (``sdnpu lora apply``: the overlay read in place); with it given at session open
(``sdnpu generate --lora``: computed in memory, onnxruntime's external-initializer API). The folder must have
no LoRA applied; the one this applies is removed again. Results go to bench/results.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import sys, time
from pathlib import Path
from sdnpu.lora import LoraSpec
from sdnpu.runtime.session import RuntimeOptions, open_component
folder, component, lora = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
loras = (LoraSpec.parse(lora),) if lora else ()
start = time.perf_counter()
c = open_component(folder, component, options=RuntimeOptions(optimize=False, loras=loras))
print(time.perf_counter() - start, len(c.replaced or {}))
"""


def _open(folder: Path, component: str, lora: str) -> tuple[float, int, int]:
    """(seconds to open, peak RSS bytes of the process, tensors replaced through the API)."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(folder), component, lora], stdout=subprocess.PIPE,
                            text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    out = proc.stdout.read().split() if proc.stdout else []
    if os.waitstatus_to_exitcode(status) or len(out) != 2:
        raise SystemExit(f"opening {component} failed")
    return float(out[0]), usage.ru_maxrss * 1024, int(out[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="models/sdxl-base")
    p.add_argument("--lora", required=True, metavar="FILE[:SCALE]")
    p.add_argument("--component", default="unet")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_export import write_section  # type: ignore[import-not-found]

    folder = Path(args.models)
    sdnpu = str(Path(sys.executable).with_name("sdnpu"))
    if (folder / args.component / "dd" / "lora").is_dir():
        raise SystemExit(f"{folder} has a LoRA applied: sdnpu lora remove {folder} first")
    rows = [("no LoRA", *_open(folder, args.component, ""))]
    subprocess.run([sdnpu, "-q", "lora", "apply", str(folder), "--lora", args.lora], check=True,
                   stdout=subprocess.DEVNULL)
    try:
        rows.append(("applied (overlay read in place)", *_open(folder, args.component, "")))
    finally:
        subprocess.run([sdnpu, "-q", "lora", "remove", str(folder)], check=True, stdout=subprocess.DEVNULL)
    rows.append(("--lora (in memory, external initializers)", *_open(folder, args.component, args.lora)))
    lines = [f"{args.component}/dd/replaced.onnx, graph optimizations off; LoRA {Path(args.lora).name}; each "
             f"session opened in a process of its own (peak RSS from wait4), {time.strftime('%Y-%m-%d')}.", "",
             "| session | open s | peak GB | tensors through the API |", "|---|---|---|---|"]
    lines += [f"| {name} | {s:.1f} | {rss / 1e9:.2f} | {n} |" for name, s, rss, n in rows]
    body = "\n".join(lines)
    print(body)
    write_section(f"LoRA session open: {folder.name} {args.component}", body)


if __name__ == "__main__":
    main()
