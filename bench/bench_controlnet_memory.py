"""Memory of the denoising stage with a ControlNet: the UNet's and the ControlNet's sessions each with an
activation arena of their own, against one arena shared between them (what ``sdnpu generate`` does), side by
side, each generation in a process of its own.

    python bench/bench_controlnet_memory.py --models models/sdxl-base --controlnet models/controlnet-sdxl \
        --control-image edges.png [--steps 1]

The child's peak private memory (``RssAnon`` in /proc, sampled every 0.2 s: the weights' file mappings are
not in it) and peak RSS (with them), and its wall time.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import dataclasses, sys
from sdnpu.runtime import ControlSpec, GenerateOptions, Pipeline
from sdnpu.runtime.text2image import Pipeline as P

shared = sys.argv[1] == "shared"
stage = P._stage_runtime
P._stage_runtime = lambda self, *a: dataclasses.replace(stage(self, *a), shared_arena=shared)
spec = ControlSpec(sys.argv[3], sys.argv[4], scale=0.8)
Pipeline(sys.argv[2])(GenerateOptions("a house by a lake", steps=int(sys.argv[5]), seed=3, controlnets=(spec,)))
"""


def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def run(arena: str, args: argparse.Namespace) -> dict[str, float]:
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", CHILD, arena, str(args.models), str(args.controlnet),
                              str(args.control_image), str(args.steps)])
    peak = {"RssAnon": 0, "VmRSS": 0}
    while child.poll() is None:
        for k, v in _status(child.pid).items():
            peak[k] = max(peak[k], v)
        time.sleep(0.2)
    return {"rc": child.returncode, "seconds": time.perf_counter() - start,
            "private_gb": peak["RssAnon"] / 1e9, "rss_gb": peak["VmRSS"] / 1e9}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=Path, required=True)
    ap.add_argument("--controlnet", type=Path, required=True)
    ap.add_argument("--control-image", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=1)
    args = ap.parse_args()
    rows = {arena: run(arena, args) for arena in ("own", "shared")}
    print("| activation arenas | exit | wall | peak private memory (RssAnon) | peak RSS (with the weights' mappings) |")
    print("|---|---|---|---|---|")
    for arena, r in rows.items():
        label = "one per session" if arena == "own" else "one shared by the stage"
        print(f"| {label} | {r['rc']} | {r['seconds']:.0f} s | {r['private_gb']:.2f} GB | {r['rss_gb']:.2f} GB |")
    own, shared = rows["own"], rows["shared"]
    if own["rc"] == 0 and shared["rc"] == 0 and own["private_gb"]:
        print(f"\nshared / own: private memory {shared['private_gb'] / own['private_gb']:.2f}x, "
              f"wall {shared['seconds'] / own['seconds']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
