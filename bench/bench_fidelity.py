"""bf16 fidelity against PyTorch's own bf16 run, per component (the compiler issue's target: our error no
worse than 1.2x PyTorch's, in max abs error and in 1 - cosine).

    python bench/bench_fidelity.py --source sdxl-base --models models/sdxl-base --components vae_decoder

Runs the module in PyTorch fp32 and bf16 on the seeded inputs `sdnpu convert` uses, and the dispatch model
(`dd/replaced.onnx`, onnxruntime CPU through the reference bodies), and compares both with fp32. Results go
to bench/results.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def measure(source: str, models: Path, component: str, res: int | None) -> dict:
    import torch

    from sdnpu.convert import resolve_source
    from sdnpu.convert.compile import fidelity, run_onnx
    from sdnpu.convert.components import build_wrapper, sample_inputs, signature
    from sdnpu.convert.driver import default_resolution

    src = resolve_source(source)
    res = res or default_resolution(src)
    config = src.module_config(component)
    sig = signature(component, config, res)
    feeds = sample_inputs(sig, config, res)
    key = "vae" if component.startswith("vae") else component
    wrapper = build_wrapper(component, src.load_module(key), config)
    with torch.no_grad():
        start = time.perf_counter()
        ref = [o.numpy() for o in wrapper(*[torch.from_numpy(v) for v in feeds.values()])]
        fp32_s = time.perf_counter() - start
        wrapper = wrapper.to(torch.bfloat16)
        start = time.perf_counter()
        bf = [o.float().numpy() for o in wrapper(*[torch.from_numpy(v).to(torch.bfloat16)
                                                   if v.dtype == np.float32 else torch.from_numpy(v)
                                                   for v in feeds.values()])]
        bf16_s = time.perf_counter() - start
    del wrapper
    reference = dict(zip(sig.outputs, ref, strict=True))
    start = time.perf_counter()
    dispatch = run_onnx(models / component / "dd" / "replaced.onnx", feeds)
    ort_s = time.perf_counter() - start
    ours = fidelity(reference, dispatch)
    # the outputs the dispatch model keeps (a text encoder's: what the pipeline reads)
    theirs = fidelity(reference, {k: v for k, v in zip(sig.outputs, bf, strict=True) if k in dispatch})
    return {"component": component, "ours_max_abs": ours["max_abs"], "torch_max_abs": theirs["max_abs"],
            "ours_1mcos": 1 - ours["min_cosine"], "torch_1mcos": 1 - theirs["min_cosine"],
            "seconds": (round(fp32_s, 1), round(bf16_s, 1), round(ort_s, 1))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="tiny-sdxl")
    parser.add_argument("--models", default=None, help="converted folder (default: models/<source>)")
    parser.add_argument("--components", default="text_encoder,text_encoder_2,vae_encoder,vae_decoder,unet")
    parser.add_argument("--res", type=int, default=None)
    args = parser.parse_args()
    models = Path(args.models or ROOT / "models" / args.source)
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_export import write_section  # type: ignore[import-not-found]

    head = ("| component | ours: max abs | PyTorch bf16: max abs | ratio | ours: 1 - cos | PyTorch bf16: 1 - cos "
            "| ratio | seconds (torch fp32, torch bf16, ORT dispatch) |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for comp in args.components.split(","):
        r = measure(args.source, models, comp, args.res)
        rows.append(f"| {comp} | {r['ours_max_abs']:.4g} | {r['torch_max_abs']:.4g} | "
                    f"{r['ours_max_abs'] / r['torch_max_abs']:.2f} | {r['ours_1mcos']:.3g} | {r['torch_1mcos']:.3g} | "
                    f"{r['ours_1mcos'] / r['torch_1mcos']:.2f} | {r['seconds']} |")
        print(rows[-1], flush=True)
        write_section(f"Fidelity: {args.source}", "python bench/bench_fidelity.py", "\n".join(rows))


if __name__ == "__main__":
    main()
