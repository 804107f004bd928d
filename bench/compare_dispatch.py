"""Two dispatch models of one graph, run on the same seeded input: do they give the same outputs? For a change
that should move work without changing any number (e.g. the step prologue, which splits a ControlNet's or
the residual UNet's dispatch model in two).

    python bench/compare_dispatch.py OLD/dd/replaced.onnx NEW/dd/replaced.onnx SRC/model.onnx

Each model runs through ``run_onnx`` (a step prologue first, where it has one) on ``generic_inputs`` of the
fp32 graph SRC (seed 0); prints each run's time and whether the outputs are identical, bit for bit.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np


def main() -> int:
    from sdnpu.convert.compile import run_onnx
    from sdnpu.reports.fidelity import generic_inputs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("source", type=Path, help="the fp32 graph whose inputs both take")
    args = ap.parse_args()
    feeds = generic_inputs(args.source)
    outputs = []
    for name, path in (("old", args.old), ("new", args.new)):
        start = time.perf_counter()
        outputs.append(run_onnx(path, feeds))
        print(f"{name}: {path} in {time.perf_counter() - start:.1f} s", flush=True)
    a, b = outputs
    if a.keys() != b.keys():
        print(f"different outputs: {sorted(a)} vs {sorted(b)}")
        return 1
    differ = {k: float(np.abs(a[k].astype(np.float32) - b[k].astype(np.float32)).max())
              for k in a if not np.array_equal(a[k], b[k])}
    print(f"{len(a)} outputs: " + ("identical, bit for bit" if not differ else f"{len(differ)} differ: {differ}"))
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
