"""A component converted at several sizes: where the conversion time went, the bytes on disk, and the peak
memory of sessions for two sizes opened together, one process each.

    python bench/bench_sizes.py --models models/sdxl-base [--component unet] [--sizes 1024x1024,1152x896]

Time: each size's ``export*.json`` (export, check, compile, writing its graphs over the shared weights).
Disk: the shared data files against what each size adds (graph + own data). Memory: sessions over the
dispatch models (graph optimizations off, as on an NPU), each run once on seeded inputs so that every weight
is read: one size alone; two sizes, each session with its own weights; two sizes sharing them
(``sdnpu.runtime.session.SharedWeights``). Results go to bench/results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import sys
import numpy as np
from sdnpu.imagesize import Size
from sdnpu.runtime.session import RuntimeOptions, SharedWeights, open_component
folder, component, share = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
shared = SharedWeights() if share else None
sessions = [open_component(folder, component, options=RuntimeOptions(optimize=False), size=Size.of(s), shared=shared)
            for s in sys.argv[4:]]
rng = np.random.default_rng(0)
for c in sessions:
    feeds = {}
    for i in c.session.get_inputs():
        dtype = np.int64 if "int64" in i.type else np.float32
        feeds[i.name] = (np.full(i.shape, 7, dtype) if dtype == np.int64 else
                         rng.standard_normal(i.shape).astype(dtype) if i.shape else np.asarray(500.0, dtype))
    c.run(feeds)
"""


def _peak(folder: Path, component: str, share: bool, sizes: list[str]) -> int:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(folder), component, "1" if share else "0", *sizes])
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"running {component} at {', '.join(sizes)} failed")
    return usage.ru_maxrss * 1024


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="models/sdxl-base")
    p.add_argument("--component", default="unet")
    p.add_argument("--sizes", default=None, help="the two sizes to open together (default: the first two)")
    p.add_argument("--no-memory", action="store_true", help="time and disk only")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_export import write_section  # type: ignore[import-not-found]

    from sdnpu.convert.shared import sizes_of

    comp_dir = Path(args.models) / args.component
    files = sizes_of(comp_dir)
    if len(files) < 2:
        raise SystemExit(f"{comp_dir} holds {len(files)} size(s): convert with --res A,B[,...] first")
    lines = ["| size | export s | check s | compile s | share s | graph (fp32 + dd) | own data |",
             "|---|---|---|---|---|---|---|"]
    for f in files:
        sec = json.loads((comp_dir / f.export).read_text())["seconds"]
        graphs = _size(comp_dir / f.model) + _size(comp_dir / f.dispatch)
        own = 0 if f.primary else sum(_size(comp_dir / (g + ".data")) for g in (f.model, f.dispatch))
        check = sec.get("torch_run", 0) + sec.get("onnx_run", 0) + sec.get("onnx_check", 0)
        lines.append(f"| {f.size}{' (primary)' if f.primary else ''} | {sec.get('export', 0):.1f} | {check:.1f} | "
                     f"{sec.get('compile', 0):.1f} | {sec.get('share', 0):.1f} | {graphs / 1e6:.2f} MB | "
                     f"{own / 1e6:.2f} MB |")
    shared = _size(comp_dir / "model.onnx.data") + _size(comp_dir / "dd" / "replaced.onnx.data")
    one = shared + _size(comp_dir / "model.onnx") + _size(comp_dir / "dd" / "replaced.onnx")
    total = shared + sum(_size(comp_dir / f.model) + _size(comp_dir / f.dispatch) for f in files) + sum(
        _size(comp_dir / (g + ".data")) for f in files if not f.primary for g in (f.model, f.dispatch))
    lines += ["", f"Disk: {total / 1e9:.3f} GB for {len(files)} sizes against {one / 1e9:.3f} GB for the primary "
              f"alone ({total / one:.4f}x; shared data {shared / 1e9:.3f} GB)."]
    if not args.no_memory:
        pair = args.sizes.split(",") if args.sizes else [str(f.size) for f in files[:2]]
        alone = _peak(comp_dir.parent, args.component, False, pair[:1])
        apart = _peak(comp_dir.parent, args.component, False, pair)
        together = _peak(comp_dir.parent, args.component, True, pair)
        lines += ["", f"Peak RSS, sessions run once each (graph optimizations off): {pair[0]} alone "
                  f"{alone / 1e9:.2f} GB; {pair[0]} + {pair[1]}, own weights each {apart / 1e9:.2f} GB "
                  f"({apart / alone:.2f}x); sharing them {together / 1e9:.2f} GB ({together / alone:.2f}x)."]
    text = "\n".join(lines)
    print(text)
    write_section(f"Sizes: {args.models} {args.component}", text)


if __name__ == "__main__":
    main()
