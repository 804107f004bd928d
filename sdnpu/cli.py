"""The ``sdnpu`` command line. The library only logs; this module prints and sets up logging.

The stages import torch, diffusers and onnxruntime only where they use them, so that the CLI starts without
them."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sdnpu import __version__
from sdnpu.components import COMPONENTS, LORA_COMPONENTS
from sdnpu.convert import ConvertOptions, convert
from sdnpu.convert.compile import compile_file
from sdnpu.convert.export import DEFAULT_OPSET, EXPORTERS
from sdnpu.errors import SdnpuError, storage_error
from sdnpu.formats.overlay import applied_names
from sdnpu.imagesize import Size
from sdnpu.lora import LoraSpec, overlay
from sdnpu.ops.target import DEFAULT_TARGET, target_names
from sdnpu.passes.pipeline import CompileOptions
from sdnpu.reports import show
from sdnpu.reports.plot import plot
from sdnpu.reports.report import bf16_sensitive, render_text
from sdnpu.runtime import GenerateOptions, Pipeline, RuntimeOptions, save_png, verify
from sdnpu.runtime.controlnet import ControlSpec
from sdnpu.runtime.pack import PACKED_DIR, amd_packer, pack
from sdnpu.runtime.session import is_qnn_folder

log = logging.getLogger("sdnpu")


def _human_bytes(n: float) -> str:
    """Decimal units, as the progress lines and the benchmarks print them."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} GB"


def _cmd_convert(args: argparse.Namespace) -> int:
    options = ConvertOptions(res=args.res, exporter=args.exporter, opset=args.opset, check=not args.no_check,
                             compile=not args.no_compile, outputs=args.outputs, target=args.target,
                             precision=args.precision or "", htp_arch=args.htp_arch, context_gb=args.context_gb,
                             htp_optimization=args.htp_optimization,
                             loras=tuple(args.lora or ()),
                             add=args.add,
                             blockwise=args.blockwise, dispatch_only=args.dispatch_only, batch=args.batch)
    if args.pack and options.compile_options.target.kind != "dispatch":
        raise SdnpuError(f"--pack writes AMD's loading format; --target {args.target} has its own (QNN's context "
                         "binaries are written by the convert itself)", hint="drop --pack")
    if args.pack:
        amd_packer()  # a prerequisite: checked before any work
    result = convert(args.source, components=args.model, out=args.out, options=options)
    sizes = ", ".join(str(s) for s in result.sizes)
    batches = (f", denoiser at batch {', '.join(map(str, result.batches))}"
               if any(c.batch is not None for c in result.components) or not result.components else "")
    print(f"\n{result.source.name} -> {result.out} ({sizes} px{batches}{', added' if args.add else ''})")
    if args.add and not result.components:
        print("nothing to add: every size given is converted already")
        return 0
    print(f"{'component':<16}{'size':>10}{'batch':>6}{'nodes':>7}{'params':>15}{'export s':>9}{'peak mem':>10}  "
          f"{'max abs / rel error':<20}{'offload':>8}{'CPU':>5}")
    for c in result.components:
        err = (f"{c.check['max_abs_error']:.2e} / {c.check['max_rel_error']:.2e}" if c.check else "not checked")
        rate = f"{100 * c.report['offload_rate']:.2f}%" if c.report else "-"
        cpu = str(c.report["cpu_nodes"]) if c.report else "-"
        vendor = (f"  QNN takes {c.report['vendor_taken']}/{c.report['vendor_nodes']}"
                  f"{', whole' if c.report['vendor_whole'] else ''}" if c.report and "vendor_nodes" in c.report else "")
        print(f"{c.component:<16}{c.size:>10}{c.batch or '':>6}{c.nodes:>7}{c.parameters:>15,}"
              f"{c.seconds.get('export', 0):>9.1f}{_human_bytes(c.peak_rss_bytes):>10}  {err:<20}{rate:>8}{cpu:>5}"
              f"{vendor}")
    print("peak mem: the process's peak resident memory up to that component (a worker's, where larger)")
    if options.loras:
        print(f"LoRA fused before export (diffusers' fuse_lora): {', '.join(str(s) for s in options.loras)}")
    if result.pipeline_files:
        print(f"pipeline files: {', '.join(result.pipeline_files)}")
    if args.pack:
        print()
        _print_packed(pack(result.out), None)
    return 0


def _cmd_compile(args: argparse.Namespace) -> int:
    shapes = {}
    for item in args.shape or []:
        name, _, dims = item.partition("=")
        try:
            shapes[name] = [int(d) for d in dims.split(",") if d] if dims else []
        except ValueError as e:
            raise SdnpuError(f"cannot read --shape {item!r}", hint="write NAME=D,D,... e.g. sample=2,4,128,128") from e
    options = dataclasses.replace(CompileOptions.named(args.target, args.precision, args.htp_arch, args.context_gb,
                                                       args.htp_optimization), shapes=shapes)
    report = compile_file(Path(args.model), Path(args.out) if args.out else None, options, verify=not args.no_verify,
                          res=args.res, outputs=args.outputs)
    print(render_text(report), end="")
    fid = report.get("fidelity") or {}
    if fid.get("bf16_rounding"):
        print(bf16_sensitive(fid))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    paths = [Path(p) for p in args.paths]
    if args.fail_under is not None:
        show.below([], args.fail_under)  # a value that is not a percent fails before anything is printed
    if args.paths and args.paths[0] == "diff":
        if len(paths) != 3:
            raise SdnpuError("`sdnpu report diff` compares two reports", hint="sdnpu report diff A B")
        print(show.diff(show.find(paths[1]), show.find(paths[2])), end="")
        return 0
    if len(paths) != 1:
        raise SdnpuError("give one path to report on", hint="sdnpu report models/sdxl-base [--json]")
    found = show.find_with_models(paths[0])
    reports = [(name, report) for name, report, _ in found]
    if args.json:
        print(json.dumps(dict(reports) if len(reports) > 1 else reports[0][1], indent=2))
    elif len(reports) == 1:
        print(render_text(reports[0][1]), end="")
    else:
        print(show.summary_lines(reports), end="")
    if args.plot:
        plot(found, Path(args.plot))
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.fail_under is not None:
        failing = show.below(reports, args.fail_under)
        for line in failing:
            print(f"sdnpu: offload below the gate: {line}", file=sys.stderr)
        return 1 if failing else 0
    return 0


def _control_specs(args: argparse.Namespace) -> tuple[Any, ...]:
    """--controlnet DIR (repeated) with one --control-image each; --control-scale/-start/-end once for all, or
    once per ControlNet."""

    nets, images = args.controlnet or [], args.control_image or []
    if len(images) != len(nets):
        raise SdnpuError(f"{len(nets)} --controlnet and {len(images)} --control-image",
                         hint="give one --control-image per --controlnet, in the same order")

    def each(values: list[float] | None, default: float, flag: str) -> list[float]:
        if not values:
            return [default] * len(nets)
        if len(values) == 1:
            return values * len(nets)
        if len(values) != len(nets):
            raise SdnpuError(f"{len(values)} {flag} for {len(nets)} --controlnet",
                             hint=f"give {flag} once (for all) or once per --controlnet")
        return values

    scales = each(args.control_scale, 1.0, "--control-scale")
    starts = each(args.control_start, 0.0, "--control-start")
    ends = each(args.control_end, 1.0, "--control-end")
    return tuple(ControlSpec(n, i, sc, st, en) for n, i, sc, st, en in zip(nets, images, scales, starts, ends,
                                                                          strict=True))


def _qnn_how() -> str:
    # the qnn-htp backend where its target runs (onnxruntime with it): the CLI starts without them (25-45 ms)
    from sdnpu.backends import qnn_htp

    return ("QNN models (--target qnn-htp) on Qualcomm's HTP emulator: this machine is not a Snapdragon, so the "
            "NPU's program ran on the CPU, slowly; its time is not the NPU's" if qnn_htp.is_emulated() else
            "QNN models (--target qnn-htp) on Qualcomm's HTP")


def _cmd_generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm  # tqdm at first use: the CLI starts without it (4 ms)


    optimize = {"auto": None, "on": True, "off": False}[args.optimize]
    runtime = RuntimeOptions.from_env(args.custom_ops, npu_text_encoders=args.npu_text_encoders, optimize=optimize,
                                      threads=args.threads, loras=_lora_specs(args.lora))
    pipe = Pipeline(Path(args.models), reference=args.reference, runtime=runtime)
    height, width = pipe.image_size
    if (args.width or width, args.height or height) != (width, height):  # another of the folder's sizes
        pipe = Pipeline(Path(args.models), reference=args.reference, runtime=runtime,
                        size=Size(args.height or height, args.width or width))
    steps = args.steps if args.steps is not None else pipe.generation.steps  # the folder's (generation.json)
    guidance = args.guidance if args.guidance is not None else pipe.generation.guidance
    opts = GenerateOptions(args.prompt, args.negative_prompt, steps, guidance, args.seed, args.scheduler,
                           args.image, args.strength, _control_specs(args), num_images=args.num_images,
                           mask=args.mask)

    with tqdm(total=steps, desc="denoising", unit="step", disable=args.quiet) as bar:
        def advance(i: int, n: int) -> None:
            if i == 1 and bar.n:  # the next denoiser call
                bar.reset(n)
            bar.total = n
            bar.update(1)

        images = pipe.generate(opts, progress=advance)
    outs = _image_paths(Path(args.out), len(images))
    for image, out in zip(images, outs, strict=True):
        save_png(image, out)
    image = images[0]
    how = "fp32 graphs" if args.reference else (
        f"dispatch models, custom ops {runtime.custom_ops}" if runtime.custom_ops else
        _qnn_how() if is_qnn_folder(Path(args.models)) else
        "dispatch models through their reference bodies on the CPU")
    if runtime.loras:
        how += f"; LoRA {', '.join(str(s) for s in runtime.loras)} applied at session open"
    else:
        names = applied_names(Path(args.models), LORA_COMPONENTS)
        if names:
            how += f"; the folder's LoRA {names}"
    how += f"; text encoders {', '.join(pipe.encoders)}"
    if "text_encoder_3" in pipe.index and "text_encoder_3" not in pipe.encoders:
        how += " (no text_encoder_3 converted: T5's part of the prompt is zeros)"
    if opts.mask is not None:
        how += f"; inpainting {opts.image} where {opts.mask} is white"
    elif opts.image is not None:
        how += f"; image-to-image from {opts.image}"
    for spec in opts.controlnets:
        how += f"; ControlNet {spec.folder} on {spec.image} at {spec.scale:g} ({spec.start:g}-{spec.end:g} of steps)"
    how += f"; {steps} step{'s' if steps > 1 else ''} at guidance {guidance:g}"
    if len(outs) == 1:
        print(f"wrote {outs[0]} ({image.shape[1]}x{image.shape[0]}, {how})")
    else:
        print(f"wrote {len(outs)} images ({image.shape[1]}x{image.shape[0]}, {how}):")
        for k, out in enumerate(outs):
            print(f"  {out}  seed {args.seed + k}")
    return 0


def _image_paths(out: Path, n: int) -> list[Path]:
    """Where ``n`` images go: ``out`` for one, else ``out``'s stem with 1..n (image.png -> image-1.png, ...)."""
    if n == 1:
        return [out]
    return [out.with_name(f"{out.stem}-{k + 1}{out.suffix or '.png'}") for k in range(n)]


def _lora_specs(items: Sequence[str] | None) -> tuple[object, ...]:
    return tuple(LoraSpec.parse(x) for x in items or ())


def _cmd_lora(args: argparse.Namespace) -> int:
    if args.action == "apply":
        if not args.lora:
            raise SdnpuError("no LoRA given", hint="sdnpu lora apply MODELS --lora FILE[:SCALE] [--lora ...]")
        results = overlay.apply(args.models, _lora_specs(args.lora))  # type: ignore[arg-type]
        for r in results:
            print(f"{r.component:<16}{r.modules:>5} modules  {r.tensors:>5} dispatch-model weights  "
                  f"{_human_bytes(r.bytes):>9}  {r.seconds:6.1f} s")
        print("written to <component>/dd/lora/ (the base files are unchanged; `sdnpu lora remove` goes back)")
        return 0
    if args.lora:
        raise SdnpuError(f"`sdnpu lora {args.action}` takes no --lora", hint="sdnpu lora apply MODELS --lora FILE")
    if args.action == "remove":
        removed = overlay.remove(args.models)
        print(f"removed the LoRA overlay of {', '.join(removed)}" if removed else "no LoRA was applied")
        return 0
    for comp, manifest in overlay.status(args.models).items():
        if manifest is None:
            print(f"{comp:<16}base weights")
        else:
            loras = ", ".join(f"{x['name']}:{x['scale']:g} ({x['format']})" for x in manifest["loras"])
            print(f"{comp:<16}{loras}; {len(manifest['tensors'])} weights, {_human_bytes(manifest['bytes'])}")
    return 0


def _cmd_pack(args: argparse.Namespace) -> int:
    results = pack(args.models, out=args.out)
    _print_packed(results, args.out)
    return 0


def _print_packed(results: dict, out: str | None) -> None:
    for name, counts in results.items():
        if isinstance(counts, str):
            print(f"{name:<16}not packaged: {counts}")
        else:
            print(f"{name:<16}{', '.join(f'{k} {v}' for k, v in counts.items()) or 'nothing to pack'}")
    where = f"{out}/<component>/dd/" if out else f"<component>/dd/{PACKED_DIR}/"
    print(f"written to {where}replaced.onnx (and replaced.WxH.onnx for each other size) with its DD cache "
          f"{where}.cache/: AMD's loading format, for AMD's custom-op library only (no reference bodies)")


def _cmd_serve(args: argparse.Namespace) -> int:
    # fastapi, uvicorn and PIL with it: only `sdnpu serve` loads them (0.2-0.3 s)
    from sdnpu.runtime.server import serve

    if args.queue < 0:
        raise SdnpuError(f"--queue must be at least 0, not {args.queue}")
    folders = [Path(m) for m in args.models]
    for folder in folders:
        if not (folder / "model_index.json").is_file():
            raise SdnpuError(f"{folder} is not a converted pipeline folder (no model_index.json)",
                             hint="give the OUT of `sdnpu convert --model all`")
    runtime = RuntimeOptions.from_env(args.custom_ops, threads=args.threads)
    print(f"serving {', '.join(f.name for f in folders)} on http://{args.host}:{args.port}/v1 (Ctrl+C stops)")
    lora_dir = Path(args.lora_dir) if args.lora_dir else None
    if lora_dir is not None and not lora_dir.is_dir():
        raise SdnpuError(f"--lora-dir {lora_dir} is not a folder", hint="give the folder that holds the LoRA files")
    serve(folders, args.host, args.port, queue=args.queue, reference=args.reference, runtime=runtime,
          lora_dir=lora_dir)
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    size = None
    if args.width or args.height:
        if not (args.width and args.height):
            raise SdnpuError("--width and --height go together in sdnpu verify",
                             hint="give both: the size to verify, one the folder is converted at")
        size = Size(args.height, args.width)
    results = verify(args.models, steps=args.steps, seed=args.seed, size=size)
    print("worst over 3 seeded inputs (the UNet's or transformer's at timesteps 999, 500, 1), against the fp32 graphs:")
    print(f"{'component':<16}{'min cosine':>24}{'max abs':>24}  PSNR (images)")
    print(f"{'':<16}{'optimistic':>12}{'pessimistic':>12}{'optimistic':>12}{'pessimistic':>12}")
    for name, fid in results["components"].items():
        o, p = fid["optimistic"], fid["pessimistic"]
        if p is None:  # QNN's compiled model (qnn-htp): one measure, the HTP's own fp16
            psnr = [f"{a['psnr_db']:.1f} dB" for a in o["outputs"].values() if "psnr_db" in a]
            print(f"{name:<16}{o['min_cosine']:>12.6f}{'(QNN)':>12}{o['max_abs']:>12.3e}{'':>12}  {' '.join(psnr)}")
            continue
        psnr = [f"{a['psnr_db']:.1f} / {b['psnr_db']:.1f} dB" for a, b in zip(o["outputs"].values(),
                                                                          p["outputs"].values(), strict=True)
                if "psnr_db" in a]
        print(f"{name:<16}{o['min_cosine']:>12.6f}{p['min_cosine']:>12.6f}{o['max_abs']:>12.3e}{p['max_abs']:>12.3e}  "
              f"{' '.join(psnr)}")
    pipe = results["pipeline"]
    if pipe:
        print(f"pipeline ({pipe['steps']} steps, seed {pipe['seed']}): image PSNR {pipe['psnr_db']:.1f} dB, "
              "dispatch models against the fp32 graphs")
    where = f"report.{size}.json" if results.get("size") else "report.json"
    tag = "." + str(size) if results.get("size") else ""
    print(f"written into each dd/{where} (qnn/report.json) and {args.models}/verify{tag}.json")
    return 0


def _target_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """--target, --precision and --htp-arch, as convert and compile take them."""
    parser.add_argument("--target", default=DEFAULT_TARGET, choices=target_names(),
                        help=f"the NPU the {what} are compiled for: {DEFAULT_TARGET} (default; AMD's dispatch ops, "
                        "dd/) or qnn-htp (Qualcomm's Hexagon NPU through onnxruntime-qnn: standard ops compiled by "
                        "QNN into an EPContext model, qnn/)")
    parser.add_argument("--precision", choices=("bf16", "bfp16", "fp16"), default=None,
                        help="amd-xdna2: bf16 (default) or bfp16, AMD's numerics (weights as its packer writes them, "
                        "`_bfp` ops); qnn-htp: fp16 (the HTP computes the float32 graph in fp16)")
    parser.add_argument("--htp-arch", default=None, metavar="V",
                        help="qnn-htp: the HTP generation, v69, v73 (default: Snapdragon X Elite / X Plus), v75, v79 "
                        "or v81 (Snapdragon X2 Elite)")
    parser.add_argument("--htp-optimization", default=None, metavar="N", choices=("1", "2", "3"),
                        help="qnn-htp: how hard QNN's compiler optimizes the graph (its finalization mode): 1 "
                        "compiles faster into a less optimized graph (which may need more of the HTP's memory), 2 "
                        "more, 3 the most; default: QNN's own")
    parser.add_argument("--context-gb", type=float, default=None, metavar="GB",
                        help="qnn-htp: the most fp16 weight one QNN context holds (default 2.0: a context lives in "
                        "the HTP's 32-bit address space); a larger graph is cut into several contexts, chained in "
                        "one ctx.onnx")


def _convert_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`sdnpu convert`: export a pipeline's modules to ONNX, check them, compile them."""
    conv = sub.add_parser("convert", help="export a pipeline's modules to ONNX and check them against PyTorch")
    conv.add_argument("--model", "-m", default="all",
                      help=f"component(s), comma-separated: {', '.join(COMPONENTS)} or all (default)")
    conv.add_argument("--source", "-s", default="sdxl-base",
                      help="a preset (sdxl-base, tiny-sdxl, controlnet-sdxl, ...), a local diffusers folder or a "
                      "single-file checkpoint (.safetensors in the original layout: SDXL, SD 1.x/2.x, SD3, Flux.1) "
                      "(default: sdxl-base)")
    conv.add_argument("--out", "-o", default=None, help="output folder (default: models/<source name>)")
    conv.add_argument("--add", action="store_true",
                      help="add the --res sizes to the conversion already in --out: only their graphs are written, "
                      "over the weights the folder has (same source and settings)")
    conv.add_argument("--res", default=None, metavar="WxH|N[,...]|sdxl-buckets",
                      help="image sizes in pixels, WxH (1152x896: 1152 wide) or one number for a square, comma-"
                      "separated, or sdxl-buckets (SDXL's nine); the UNets, VAEs and ControlNets get a graph per size "
                      "over one copy of the weights (default: the model's own, 1024 for SDXL)")
    conv.add_argument("--batch", default=None, metavar="B[,...]",
                      help="the denoiser's batch (UNet, ControlNet, SD3 transformer), comma-separated for several over "
                      "one copy of the weights: 2 runs classifier-free guidance's two halves in one call, 1 a "
                      "guidance-free model (Turbo, LCM), 2N or N draw N images a call (default: the model's, 1 for a "
                      "guidance-free preset, else 2; with --add, the batches the folder has)")
    conv.add_argument("--exporter", choices=EXPORTERS, default="dynamo", help="torch exporter (default: dynamo)")
    conv.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset (default {DEFAULT_OPSET})")
    conv.add_argument("--no-check", action="store_true", help="skip the onnxruntime-vs-PyTorch check")
    conv.add_argument("--no-compile", action="store_true", help="export only (no dd/ dispatch model)")
    conv.add_argument("--blockwise", action="store_true",
                      help="convert T5 (SD3's text_encoder_3, Flux's text_encoder_2) and Flux.1's and Qwen-Image's "
                      "transformers one block at a time and stitch the graphs, even where they fit whole (done so by "
                      "itself where the fp32 weights exceed half the available memory, as T5-XXL's 19 GB, Flux.1's "
                      "47.6 GB and Qwen-Image's 81.7 GB do here)")
    conv.add_argument("--dispatch-only", action="store_true",
                      help="for a big model on a small disk: the modules converted block by block keep their dispatch "
                      "model only (dd/), each piece's fp32 graph deleted once its dispatch model is checked and no "
                      "fp32 model.onnx stitched: a third of the disk (Qwen-Image's transformer: about 41 GB instead of "
                      "123 GB); generate --reference, lora apply and --add then refuse that component")
    conv.add_argument("--pack", action="store_true",
                      help="then pack the folder's dispatch models in AMD's loading format (sdnpu pack: "
                      "DynamicDispatch nodes, their DD cache, AMD's packed weights; needs AMD's "
                      "ryzenai_dynamic_dispatch packer, checked first)")
    _target_arguments(conv, "models")
    conv.add_argument("--outputs", choices=("pipeline", "all"), default="pipeline",
                      help="outputs the dispatch models keep: what the diffusers pipeline reads (default; the "
                      "text encoders' other hidden states go) or all; model.onnx always keeps all")
    conv.add_argument("--lora", action="append", metavar="FILE[:SCALE]",
                      help="fuse a LoRA (diffusers/PEFT or kohya safetensors) into the UNet and text encoders "
                      "before export, with diffusers' fuse_lora (repeatable: stacked in order). To switch LoRAs "
                      "without converting again, use `sdnpu lora apply`")
    conv.set_defaults(func=_cmd_convert)


def _compile_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`sdnpu compile`: one ONNX graph compiled."""
    comp = sub.add_parser("compile", help="compile an ONNX graph into a dispatch model + offload report")
    comp.add_argument("model", help="an .onnx file (from `sdnpu convert`, optimum-cli, or elsewhere)")
    comp.add_argument("--out", "-o", default=None, help="output folder (default: dd/ beside the model)")
    comp.add_argument("--no-verify", action="store_true", help="skip the fidelity run against the fp32 graph")
    comp.add_argument("--shape", action="append", metavar="NAME=D,D,...",
                      help="static shape for a dynamic input (repeatable); an SD component folder with its "
                      "config.json (as optimum writes it) gets sdnpu's shapes by default")
    comp.add_argument("--res", default=None, metavar="WxH|N", help="image size for those default shapes")
    _target_arguments(comp, "model")
    comp.add_argument("--outputs", default="pipeline", metavar="pipeline|all|NAME,...",
                      help="outputs the dispatch model keeps: what the diffusers pipeline reads (default; needs "
                      "the pipeline's model_index.json above a text_encoder), all, or a list of names")
    comp.set_defaults(func=_cmd_compile)


def _report_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`sdnpu report`: offload reports shown or compared."""
    rep = sub.add_parser("report", help="show offload reports; `sdnpu report diff A B` compares two",
                         description="PATH: an output folder (one line per component), a component folder, a "
                         "report.json or a replaced.onnx. `sdnpu report diff A B` shows what changed.")
    rep.add_argument("paths", nargs="+", metavar="PATH")
    rep.add_argument("--json", action="store_true", help="print the JSON report(s)")
    rep.add_argument("--fail-under", type=float, default=None, metavar="PERCENT",
                     help="exit 1 when a component's offload rate is below PERCENT (e.g. 99.5; a percent, as "
                     "coverage tools read it)")
    rep.add_argument("--plot", default=None, metavar="FILE", help="draw the offload strip to FILE (.svg or .png)")
    rep.set_defaults(func=_cmd_report)


def _generate_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`sdnpu generate`: text to image on a converted folder."""
    gen = sub.add_parser("generate", help="text to image on a converted folder, every graph in onnxruntime")
    gen.add_argument("--models", default="models/sdxl-base", help="a converted folder (default: models/sdxl-base)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--negative-prompt", default="")
    gen.add_argument("--width", type=int, default=None, help="image width: one of the sizes the folder is converted "
                     "at (default: its first)")
    gen.add_argument("--height", type=int, default=None, help="image height (as --width)")
    gen.add_argument("--steps", type=int, default=None,
                     help="denoising steps (default: the folder's generation.json, else 30; a Turbo folder's is 1)")
    gen.add_argument("--guidance", type=float, default=None,
                     help="classifier-free guidance scale; at most 1 runs without it, on a batch-1 denoiser (default: "
                     "the folder's generation.json, else 5; a Turbo folder's is 0)")
    gen.add_argument("--seed", type=int, default=0, help="image k of --num-images is drawn from seed + k")
    gen.add_argument("--num-images", "-n", type=int, default=1, metavar="N",
                     help="draw N images of the prompt, in as few denoiser calls as the converted batches allow "
                     "(written as OUT-1.png ... OUT-N.png)")
    gen.add_argument("--scheduler", default=None, help="a diffusers scheduler class (default: the folder's)")
    gen.add_argument("--image", default=None, help="image-to-image: start from this picture")
    gen.add_argument("--strength", type=float, default=None,
                     help="image-to-image and inpainting: share of the schedule to run (default 0.3; inpainting 1.0)")
    gen.add_argument("--mask", default=None,
                     help="inpainting: white where to draw anew over --image, black where to keep it")
    gen.add_argument("--controlnet", action="append", default=None, metavar="DIR",
                     help="a converted ControlNet (OUT of `sdnpu convert --model controlnet`); repeat for several, "
                     "whose residuals are summed. Needs the folder's unet_controlnet")
    gen.add_argument("--control-image", action="append", default=None, metavar="FILE",
                     help="the control image of each --controlnet (edges, depth, ...), resized to the image size")
    gen.add_argument("--control-scale", action="append", type=float, default=None,
                     help="the residuals' scale (default 1.0), once for all or once per --controlnet")
    gen.add_argument("--control-start", action="append", type=float, default=None,
                     help="the share of the steps before the ControlNet acts (default 0)")
    gen.add_argument("--control-end", action="append", type=float, default=None,
                     help="the share of the steps after which it stops (default 1)")
    gen.add_argument("--reference", action="store_true", help="run the fp32 graphs instead of the dispatch models")
    gen.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads")
    gen.add_argument("--optimize", choices=("auto", "on", "off"), default="auto",
                     help="onnxruntime's graph optimizations: faster, but a dispatch model's weights are held "
                     "in fp32 too; auto (default) turns them on where that fits in memory")
    gen.add_argument("--custom-ops", default=None, metavar="LIBRARY",
                     help="AMD's onnx_custom_ops library: registered on the dispatch models' sessions (after the "
                     "dd_cache and onnx_custom_ops_const_key entries) so it claims their com.amd ops; default "
                     "$SDNPU_CUSTOM_OPS; without one, the CPU runs the ops' reference bodies")
    gen.add_argument("--npu-text-encoders", action="store_true",
                     help="register the custom-op library on the text encoders too (AMD runs them on the CPU)")
    gen.add_argument("--lora", action="append", metavar="FILE[:SCALE]",
                     help="apply a LoRA as the sessions open (repeatable: stacked in order), in place of the "
                     "folder's own (`sdnpu lora apply`); no file changes")
    gen.add_argument("--out", default="image.png")
    gen.set_defaults(func=_cmd_generate)


def _lora_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`sdnpu lora`: LoRAs applied to a converted folder or removed."""
    lo = sub.add_parser("lora", help="apply LoRAs to a converted folder without converting again, remove them, "
                        "or show what is applied", description="apply: the LoRAs' changed weights go to "
                        "<component>/dd/lora/ (replacing what was applied before; the base files are never "
                        "written). remove: back to the base, byte for byte. show: what is applied.")
    lo.add_argument("action", choices=("apply", "remove", "show"))
    lo.add_argument("models", nargs="?", default="models/sdxl-base", help="a converted folder (default: "
                    "models/sdxl-base) or one of its components")
    lo.add_argument("--lora", action="append", metavar="FILE[:SCALE]",
                    help="a LoRA (diffusers/PEFT or kohya safetensors) and its scale (default 1); repeatable")
    lo.set_defaults(func=_cmd_lora)


def _pack_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`sdnpu pack`: a deployable copy with AMD's packed weights."""
    pk = sub.add_parser("pack", help="a deployable copy of the dispatch models with AMD's packed weights "
                        "(needs AMD's ryzenai_dynamic_dispatch packer)")
    pk.add_argument("models", nargs="?", default="models/sdxl-base", help="a converted folder or one component's")
    pk.add_argument("--out", default=None, metavar="DIR",
                    help="write a whole new folder laid out for AMD's SD server (each component's dd/ the package, "
                         "the rest hard links) instead of <component>/dd/packed/")
    pk.set_defaults(func=_cmd_pack)


def _serve_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`sdnpu serve`: converted folders served over HTTP."""
    srv = sub.add_parser("serve", help="serve converted folders over an OpenAI-style images API "
                         "(/v1/images/generations, /v1/images/edits, /v1/models, /health)")
    srv.add_argument("models", nargs="+", help="converted folders; each is the model named as its directory")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8080)
    srv.add_argument("--queue", type=int, default=8,
                     help="requests that may wait per model behind the running one (more are answered 429)")
    srv.add_argument("--reference", action="store_true", help="run the fp32 graphs instead of the dispatch models")
    srv.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads")
    srv.add_argument("--custom-ops", default=None, metavar="LIBRARY",
                     help="AMD's onnx_custom_ops library, as for generate (default $SDNPU_CUSTOM_OPS)")
    srv.add_argument("--lora-dir", default=None, metavar="DIR",
                     help="LoRA files requests may name (`\"lora\": [\"style.safetensors:0.8\"]`); none without it")
    srv.set_defaults(func=_cmd_serve)


def _verify_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`sdnpu verify`: dispatch models against their fp32 graphs."""
    ver = sub.add_parser("verify", help="dispatch models against their fp32 graphs, component by component "
                         "and over the whole pipeline; results go into the reports")
    ver.add_argument("models", nargs="?", default="models/sdxl-base")
    ver.add_argument("--steps", type=int, default=3, help="denoising steps of the pipeline comparison")
    ver.add_argument("--seed", type=int, default=0)
    ver.add_argument("--width", type=int, default=None, help="verify another of the sizes the folder is converted "
                     "at (with --height): the UNet and the VAEs at it, and the pipeline")
    ver.add_argument("--height", type=int, default=None)
    ver.set_defaults(func=_cmd_verify)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sdnpu", description="Stable Diffusion to NPU dispatch models.")
    parser.add_argument("--version", action="version", version=f"sdnpu {__version__}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_convert_parser, _compile_parser, _report_parser, _generate_parser, _lora_parser, _pack_parser,
                _serve_parser, _verify_parser):
        add(sub)
    return parser


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time of each record: a handler that kept the stream of
    its first call writes to a closed one once that stream is swapped (as pytest's capture does)."""

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


def _log_to_stderr() -> None:
    """Progress and warnings as plain lines on stderr, once per process."""
    root = logging.getLogger()
    if not any(isinstance(h, _StderrHandler) for h in root.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
        if root.level == logging.NOTSET or root.level > logging.WARNING:
            root.setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    _log_to_stderr()
    log.setLevel(logging.WARNING if args.quiet else logging.INFO)
    # Third-party chatter that says nothing to a user of sdnpu (the exporter's optional torchvision ops,
    # deprecation notices inside torch/diffusers); real errors still surface as exceptions.
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    logging.getLogger("diffusers.utils.import_utils").setLevel(logging.ERROR)  # "multiple distributions" of optimum
    logging.getLogger("diffusers.configuration_utils").setLevel(logging.ERROR)  # a scheduler's unused config keys
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    try:
        return int(args.func(args))
    except SdnpuError as e:
        print(f"sdnpu: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        err = storage_error(e)
        if err is None:
            raise
        print(f"sdnpu: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sdnpu: interrupted; previous outputs are unchanged", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
