"""The denoiser's batch: per-image time of `sdnpu generate` on this CPU at batch 1 (guidance-free) against batch 2
(both halves of classifier-free guidance, or two guidance-free images a call), side by side in one run.

    python bench/bench_batch.py --models models/tiny-sdxl-turbo [--repeats 3] [--reference]

The folder's UNet must hold batches 1 and 2 (``sdnpu convert --source tiny-sdxl-turbo --batch 1,2``, or ``--add
--batch 2``). Four ways, each drawn ``--repeats`` times in turn (round robin, so that the machine's noise falls on
all of them alike), the sessions kept open between draws (``keep_sessions``) and a first draw of each not
counted: one image at guidance 0 on batch 1; one image at guidance 5 on batch 2 (what every sdnpu folder did
before batches were a choice, and what AMD's server does above guidance 1); two images at guidance 0 on batch 2
(one call); two images at guidance 0 on batch 1 (two calls). Printed: the median seconds per image of each and
its ratio to the first, with the NPU MACs per call from the reports. Dispatch models run through their
reference bodies on the CPU (no NPU here): the times say what the CPU does, not what an NPU would.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="models/tiny-sdxl-turbo")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--reference", action="store_true", help="the fp32 graphs instead of the dispatch models")
    args = p.parse_args()

    from sdnpu.formats.sizes import sizes_of
    from sdnpu.runtime import GenerateOptions, Pipeline

    folder = Path(args.models)
    files = {f.batch: f for f in sizes_of(folder / "unet")}
    if not {1, 2} <= files.keys():
        raise SystemExit(f"{folder}/unet holds batches {sorted(files)}; convert it with --batch 1,2")
    macs = {b: json.loads((folder / "unet" / f.report).read_text())["summary"]["macs_total"] for b, f in files.items()}
    pipe = Pipeline(folder, reference=args.reference, keep_sessions=True)
    ways = {  # name -> (options, images)
        "1 image, guidance 0, batch 1 (1 call)": (GenerateOptions("a cat", steps=args.steps, guidance=0.0), 1),
        "1 image, guidance 5, batch 2 (1 call)": (GenerateOptions("a cat", steps=args.steps, guidance=5.0), 1),
        "2 images, guidance 0, batch 2 (1 call)": (GenerateOptions("a cat", steps=args.steps, guidance=0.0,
                                                                  num_images=2), 2),
    }
    one_batch = Pipeline(folder, reference=args.reference, keep_sessions=True)
    one_batch.batches = [1]  # the same folder, its batch-2 graph not used: two calls of one
    seconds: dict[str, list[float]] = {name: [] for name in [*ways, "2 images, guidance 0, batch 1 (2 calls)"]}
    for rnd in range(args.repeats + 1):
        for name in seconds:
            opts, n = ways.get(name, (GenerateOptions("a cat", steps=args.steps, guidance=0.0, num_images=2), 2))
            runner = one_batch if "batch 1 (2 calls)" in name else pipe
            t = time.perf_counter()
            runner.generate(opts)
            if rnd:  # the first round opens the sessions
                seconds[name].append((time.perf_counter() - t) / n)
    first = statistics.median(seconds[next(iter(seconds))])
    print(f"{folder} ({'fp32 graphs' if args.reference else 'dispatch models, reference bodies on the CPU'}), "
          f"{args.steps} step(s), median of {args.repeats}; UNet MACs a call: batch 1 {macs[1]:,}, batch 2 {macs[2]:,}")
    print("| way | s per image | ratio |")
    print("|---|---:|---:|")
    for name, values in seconds.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.3f} | {median / first:.2f} |")


if __name__ == "__main__":
    main()
