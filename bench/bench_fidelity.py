"""bf16 fidelity against PyTorch's own bf16 run, per component, as a range (the target: our error no worse
than 1.2x PyTorch's, in max abs error and in 1 - cosine).

    python bench/bench_fidelity.py --source sdxl-base --models models/sdxl-base --components vae_decoder
    python bench/bench_fidelity.py --source sdxl-base --components unet --lora style.safetensors:0.8
    python bench/bench_fidelity.py --source controlnet-sdxl --models models/controlnet-sdxl --components controlnet

With --lora, PyTorch's module has the LoRAs fused (diffusers' fuse_lora) before both of its runs, and the
dispatch model carries them as the folder has them: fused at conversion, or applied (`sdnpu lora apply`: the
overlay is used).

Runs the module in PyTorch fp32 and bf16, the dispatch model (`dd/replaced.onnx`: its reference bodies round
once per op, the optimistic number) and the same model with every body intermediate rounded to bf16 (the
pessimistic number, as a kernel with bf16 internals), on three seeded inputs (the UNet's at timesteps 999, 500
and 1), and compares each with fp32. The ratios are of the means over the three inputs. Results go to
bench/results.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_COMPONENTS = "text_encoder,text_encoder_2,vae_encoder,vae_decoder,unet"


def _run(path: Path, comp_dir: Path, component: str, feeds: dict) -> dict:
    """The dispatch model at ``path`` on ``feeds``, with the component's LoRA overlay where it has one."""
    from sdnpu.convert.compile import run_onnx
    from sdnpu.formats.overlay import read_manifest
    from sdnpu.runtime.session import RuntimeOptions, open_component_path

    if read_manifest(comp_dir / "dd") is None:
        return run_onnx(path, feeds)
    return open_component_path(path, component, options=RuntimeOptions(optimize=False), comp_dir=comp_dir).run(feeds)


def measure(source: str, models: Path, component: str, res: int | None, loras: tuple = ()) -> dict:

    import torch

    from sdnpu.convert import resolve_source
    from sdnpu.convert.wrappers import build_wrapper
    from sdnpu.convert.driver import default_resolution
    from sdnpu.signatures import sample_inputs
    from sdnpu.reports.fidelity import RANGE_RUNS, timestep_scale

    src = resolve_source(source)
    res = res or default_resolution(src)
    config = src.module_config(component)
    spec = src.pipeline_config().spec(component)
    sig = spec.signature(res, src.generation().batch if spec.batched else None)
    runs = []
    for seed, t in RANGE_RUNS:
        feeds = sample_inputs(sig, config, res, seed=seed)
        if "timestep" in feeds:  # diffusers' timestep, as the module takes it (Flux: a thousandth)
            feeds["timestep"] = np.full(feeds["timestep"].shape, t * timestep_scale(config), feeds["timestep"].dtype)
        runs.append(feeds)
    from sdnpu.components import module_of

    export = models / component / "export.json"
    if export.is_file() and json.loads(export.read_text()).get("blockwise"):
        refs, bfs, seconds = _blockwise_torch(src, module_of(component), sig, runs, list(sig.outputs))
        return _compare(component, models, runs, refs, bfs, seconds, sig.outputs)
    module = src.load_module(module_of(component))
    if loras:
        from sdnpu import families
        from sdnpu.lora.adapters import fuse_into, read_lora

        unet_config = src.module_config("unet") if "unet" in src.modules else None
        family = families.named(src.pipeline_config().family).name
        files = [read_lora(spec, family, unet_config) for spec in loras]
        fuse_into(module, component, files, family)
    wrapper = build_wrapper(component, module, config)
    del module
    seconds = {}
    with torch.no_grad():
        start = time.perf_counter()
        refs = [dict(zip(sig.outputs, [o.numpy() for o in wrapper(*[torch.from_numpy(v) for v in f.values()])],
                         strict=True)) for f in runs]
        seconds["torch fp32"] = time.perf_counter() - start
        wrapper = wrapper.to(torch.bfloat16)
        start = time.perf_counter()
        bfs = [[o.float().numpy() for o in wrapper(*[torch.from_numpy(v).to(torch.bfloat16)
                                                     if v.dtype == np.float32 else torch.from_numpy(v)
                                                     for v in f.values()])] for f in runs]
        seconds["torch bf16"] = time.perf_counter() - start
    del wrapper
    return _compare(component, models, runs, refs, bfs, seconds, sig.outputs)


def _blockwise_torch(src, key: str, sig, runs: list[dict], outputs: list[str]) -> tuple[list, list, dict]:
    """PyTorch's fp32 and bf16 outputs of a module converted block by block (T5-XXL, Flux.1's transformer: too
    large to load whole here), chained piece by piece as ``sdnpu.convert.blockwise`` builds them: each piece in
    fp32 on the fp32 chain, then in bf16 on the bf16 chain, one piece in memory at a time."""
    import torch

    from sdnpu.convert.blockwise import pieces
    from sdnpu.convert.blockwise.piece import link_values

    def bf16(x):
        return x.to(torch.bfloat16) if x.is_floating_point() else x

    fp32 = [{k: torch.from_numpy(v) for k, v in f.items()} for f in runs]
    low = [{k: bf16(v) for k, v in f.items()} for f in fp32]
    seconds = {"torch fp32": 0.0, "torch bf16": 0.0}
    with torch.no_grad():
        for piece in pieces(src, key, sig):
            module = piece.module

            def step(values, module=module, piece=piece):
                got = module(*(values[n] for n in piece.inputs))
                return link_values(values, piece.outputs, got if isinstance(got, tuple) else (got,))

            start = time.perf_counter()
            fp32 = [step(v) for v in fp32]
            seconds["torch fp32"] += time.perf_counter() - start
            module.to(torch.bfloat16)
            start = time.perf_counter()
            low = [step(v) for v in low]
            seconds["torch bf16"] += time.perf_counter() - start
            del module, piece
    return ([{o: v[o].numpy() for o in outputs} for v in fp32],
            [[v[o].float().numpy() for o in outputs] for v in low], seconds)


def _compare(component: str, models: Path, runs: list[dict], refs: list[dict], bfs: list[list], seconds: dict,
             outputs: list[str]) -> dict:
    import tempfile

    from sdnpu.convert.compile import fidelity
    from sdnpu.reports.fidelity import pessimistic_model

    model = models / component / "dd" / "replaced.onnx"
    start = time.perf_counter()
    optimistic = [fidelity(r, _run(model, models / component, component, f)) for r, f in zip(refs, runs, strict=True)]
    seconds["ours"] = time.perf_counter() - start
    with tempfile.TemporaryDirectory(prefix="sdnpu-pessimistic-") as tmp:
        start = time.perf_counter()
        path = pessimistic_model(model, Path(tmp))
        pessimistic = [fidelity(r, _run(path, models / component, component, f))
                       for r, f in zip(refs, runs, strict=True)]
        seconds["ours, pessimistic"] = time.perf_counter() - start
    # the outputs the dispatch model keeps (a text encoder's: what the pipeline reads)
    torch_bf16 = [fidelity(r, {k: v for k, v in zip(outputs, b, strict=True) if k in o["outputs"]})
                  for r, b, o in zip(refs, bfs, optimistic, strict=True)]

    def mean(results: list[dict], what: str) -> float:
        return float(np.mean([r["max_abs"] if what == "max_abs" else 1 - r["min_cosine"] for r in results]))

    out = {"component": component, "seconds": {k: round(v, 1) for k, v in seconds.items()}}
    for what in ("max_abs", "1mcos"):
        out[f"torch_{what}"] = mean(torch_bf16, what)
        for name, results in (("optimistic", optimistic), ("pessimistic", pessimistic)):
            out[f"{name}_{what}"] = mean(results, what)
            out[f"{name}_{what}_ratio"] = out[f"{name}_{what}"] / out[f"torch_{what}"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="tiny-sdxl")
    parser.add_argument("--models", default=None, help="converted folder (default: models/<source>)")
    parser.add_argument("--components", default=None,
                        help="comma-separated (default: the source's, as `convert --model all` writes them: "
                        f"{DEFAULT_COMPONENTS} for SDXL)")
    parser.add_argument("--res", type=int, default=None)
    parser.add_argument("--lora", action="append", default=[], metavar="FILE[:SCALE]",
                        help="LoRAs fused into PyTorch's module; the folder's models must carry the same")
    args = parser.parse_args()
    from sdnpu.lora import LoraSpec

    loras = tuple(LoraSpec.parse(x) for x in args.lora)
    models = Path(args.models or ROOT / "models" / args.source)
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_export import write_section  # type: ignore[import-not-found]

    head = ("| component | PyTorch bf16: max abs | ours: max abs (ratio) | pessimistic: max abs (ratio) "
            "| PyTorch bf16: 1 - cos | ours: 1 - cos (ratio) | pessimistic: 1 - cos (ratio) | seconds |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    if args.components is None:
        from sdnpu.convert import resolve_source

        comps = [c for c in resolve_source(args.source).components if c != "unet_controlnet"]
    else:
        comps = args.components.split(",")
    for comp in comps:
        r = measure(args.source, models, comp, args.res, loras)
        rows.append(f"| {comp} | {r['torch_max_abs']:.4g} | {r['optimistic_max_abs']:.4g} "
                    f"({r['optimistic_max_abs_ratio']:.2f}) | {r['pessimistic_max_abs']:.4g} "
                    f"({r['pessimistic_max_abs_ratio']:.2f}) | {r['torch_1mcos']:.3g} | {r['optimistic_1mcos']:.3g} "
                    f"({r['optimistic_1mcos_ratio']:.2f}) | {r['pessimistic_1mcos']:.3g} "
                    f"({r['pessimistic_1mcos_ratio']:.2f}) | {r['seconds']} |")
        print(rows[-1], flush=True)
        with_lora = f", LoRA {', '.join(spec.path.name + f':{spec.scale:g}' for spec in loras)}" if loras else ""
        only = "" if args.components in (None, DEFAULT_COMPONENTS) else f", {args.components}"  # its own section
        write_section(f"Fidelity: {args.source}{only}{with_lora} (mean of 3 seeded inputs; the UNet or transformer "
                      "at timesteps 999, 500, 1)", "\n".join(rows))


if __name__ == "__main__":
    main()
