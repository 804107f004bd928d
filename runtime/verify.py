"""``sdnpu verify``: every dispatch model against its fp32 graph, and the whole pipeline both ways with one
seed (image PSNR). The results go into each component's report and into ``verify.json`` beside the folder's
model_index.json.

Fidelity is a range. The dispatch model's reference bodies compute in fp32 and round once, at each op's
output: the *optimistic* number (``fidelity``). A kernel with bf16 internals rounds more often; the
*pessimistic* number (``fidelity_pessimistic``) comes from the same model with every intermediate of every
body rounded to bf16 (``reports.fidelity.pessimistic_model``). Both are the worst over three seeded inputs,
the UNet's or SD3 transformer's at timesteps 999, 500 and 1 (``RANGE_RUNS``)."""

from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from sdnpu.components import COMPONENTS, LORA_COMPONENTS, SIZED
from sdnpu.errors import SdnpuError
from sdnpu.fileio import atomic_write_json
from sdnpu.formats import generation
from sdnpu.formats.overlay import read_manifest
from sdnpu.formats.sizes import SizeFiles, sizes_of
from sdnpu.imagesize import Size
from sdnpu.memory import check_fits, estimate
from sdnpu.progress import step
from sdnpu.reports import report as reports
from sdnpu.reports.fidelity import RANGE_RUNS, fidelity, pessimistic_model, range_inputs, timestep_scale, worst
from sdnpu.runtime.session import QNN_MODEL, RuntimeOptions, component_path, open_component, open_component_path
from sdnpu.runtime.text2image import GenerateOptions, Pipeline
from sdnpu.worker import run_in_worker

log = logging.getLogger(__name__)

ONE_WORKER_BELOW = 1 << 30  # bytes (memory.estimate): a smaller model runs all its inputs in one worker


def _component(folder: Path, name: str, runs: tuple[tuple[int, float], ...], size: Any = None) -> dict[str, Any]:
    """The optimistic and pessimistic fidelity of one component, each the worst over ``runs``. Each run (the
    fp32 graph, the dispatch model, the pessimistic model, on each input) is a worker process of its own: a
    deleted onnxruntime session leaves gigabytes behind in the process (``sdnpu.worker``), and three inputs
    through one session roughly doubled a run's peak (SDXL at 1024 px: the VAE encoder's dispatch model 9.2 GB
    against 4.9 GB, its pessimistic model 11.4 against 6.2; the VAE decoder's pessimistic run was killed by
    the kernel on a 24 GB machine, and peaks at 9.2 GB one input at a time). A model estimated under
    ``ONE_WORKER_BELOW`` runs its inputs in one worker: starting a process costs more than such a run."""
    source = component_path(folder, name, True, size)
    dispatch = component_path(folder, name, False, size)
    peak = max(check_fits(path, f"[{name}] running {path.name}", hint="verify the other components: sdnpu verify "
                          "takes a folder, move this one aside; or convert at a smaller RES").bytes
               for path in (source, dispatch))
    config = folder / name / "config.json"
    scale = timestep_scale(json.loads(config.read_text()) if config.is_file() else None)
    feeds = [range_inputs(source, seed, t, scale) for seed, t in runs]

    def each(model: str, what: str, path: Path | None = None) -> list[dict[str, np.ndarray]]:
        if peak < ONE_WORKER_BELOW:
            return run_in_worker(_run, folder, name, model, feeds, path, size, what=what)  # type: ignore[no-any-return]
        return [run_in_worker(_run, folder, name, model, [f], path, size, what=what)[0] for f in feeds]

    with step(log, f"[{name}] fp32 graph, {len(runs)} inputs"):
        references = each("fp32", f"running {name}'s fp32 graph")
    qnn = dispatch.parent.name == QNN_MODEL.parent.name  # QNN's compiled model: fp16 on the HTP, no bf16 bodies
    what = ("QNN's compiled model (fp16" + (", on the HTP emulator: slow)" if qnn and _emulated() else ")") if qnn
            else "dispatch model (rounding once per op: optimistic)")
    with step(log, f"[{name}] {what}"):
        actual = each("dispatch", f"running {name}'s dispatch model")
        optimistic = worst([fidelity(r, a) for r, a in zip(references, actual, strict=True)])
    described = ", ".join(f"seed {seed}" + (f" at timestep {t:g}" if "timestep" in feeds[0] else "")
                          for seed, t in runs)
    if qnn:
        return {"optimistic": {**optimistic, "inputs": f"worst of {described} (sdnpu verify; QNN's model on the "
                               f"{'HTP emulator' if _emulated() else 'HTP'})"}, "pessimistic": None}
    with step(log, f"[{name}] dispatch model with every body intermediate in bf16 (pessimistic)"), \
            tempfile.TemporaryDirectory(prefix="sdnpu-pessimistic-") as tmp:
        path = run_in_worker(pessimistic_model, dispatch, Path(tmp), what=f"writing {name}'s pessimistic model")
        actual = each("pessimistic", f"running {name}'s dispatch model with bf16 intermediates", path)
        pessimistic = worst([fidelity(r, a) for r, a in zip(references, actual, strict=True)])
    return {"optimistic": {**optimistic, "inputs": f"worst of {described} (sdnpu verify)"},
            "pessimistic": {**pessimistic, "inputs": f"worst of {described}; every body intermediate in bf16"}}


def _run(folder: Path, name: str, model: str, feeds: list[dict[str, np.ndarray]], pessimistic: Path | None = None,
         size: Any = None) -> list[dict[str, np.ndarray]]:
    """(In a worker.) ``name``'s fp32 graph (onnxruntime's optimizations on), dispatch model (off: they would
    fold each bf16 weight into an fp32 copy), or the pessimistic dispatch model written at ``pessimistic``
    (once per component, in a worker of its own: the SDXL UNet's is 5 GB of weights), on each of ``feeds``."""
    if model == "fp32":
        session = open_component(folder, name, reference=True, options=RuntimeOptions(optimize=True), size=size)
    elif model == "dispatch":
        session = open_component(folder, name, options=RuntimeOptions(optimize=False), size=size)
    else:
        assert pessimistic is not None  # with the folder's LoRAs, as the dispatch model has them
        session = open_component_path(pessimistic, name, comp_dir=folder / name)
    return [session.run(f) for f in feeds]


def _generate(folder: Path, reference: bool, opts: GenerateOptions, size: Any = None) -> np.ndarray:
    """(In a worker.) One image through the whole pipeline."""
    return Pipeline(folder, reference=reference, size=size)(opts)


def _generate_both(folder: Path, opts: GenerateOptions, size: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """(In a worker.) The image through the dispatch models, then through the fp32 graphs: for small models,
    where starting a process costs more than the run."""
    return _generate(folder, False, opts, size), _generate(folder, True, opts, size)


def _inpainting_unet(folder: Path, denoiser: str) -> bool:
    """Whether the folder's denoiser is an inpainting UNet (latents, mask and masked-picture latents in)."""
    try:
        unet = json.loads((folder / denoiser / "config.json").read_text())
        vae = json.loads((folder / "vae_decoder" / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return int(unet.get("in_channels", 0)) == 2 * int(vae.get("latent_channels", 4)) + 1


def _seeded_picture_and_mask(tmp: Path, seed: int) -> dict[str, Path]:
    """A seeded picture and a mask (a centred square to redraw) for an inpainting pipeline run, as PNGs."""
    from PIL import Image  # PIL at first use: the CLI starts without it (10 ms)

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)).save(tmp / "picture.png")
    mask = np.zeros((256, 256), np.uint8)
    mask[64:192, 64:192] = 255
    Image.fromarray(mask).save(tmp / "mask.png")
    return {"image": tmp / "picture.png", "mask": tmp / "mask.png"}


def _compiled(folder: Path, name: str) -> bool:
    """Whether ``folder/<name>`` has a compiled model with its report: AMD's dispatch model or QNN's."""
    return any((folder / name / d / "report.json").is_file() for d in ("dd", QNN_MODEL.parent.name))


def _emulated() -> bool:
    # the qnn-htp backend where its target runs (onnxruntime with it): the CLI starts without them (25-45 ms)
    from sdnpu.backends import qnn_htp

    return qnn_htp.is_emulated()


def _files(folder: Path, name: str, size: Any) -> SizeFiles:
    """``name``'s files at ``size`` (None, or a component that does not depend on it: the primary's)."""
    if size is not None and name in SIZED:
        match = next((f for f in sizes_of(folder / name) if f.size == size), None)
        if match is not None:
            return match
    return SizeFiles(size or Size(0, 0), True)


def verify(folder: str | Path, steps: int = 3, seed: int = 0, prompt: str = "a photo of a cat",
           runs: tuple[tuple[int, float], ...] = RANGE_RUNS, size: Any = None) -> dict[str, Any]:
    """Verify the dispatch models under ``folder`` (see the module's doc). ``size``: one of the sizes the folder
    is converted at (None: the primary); at another size, the components that depend on it (the UNet, the
    VAEs) are verified at it and the pipeline runs at it; their reports of that size get the results."""
    folder = Path(folder)
    size = Size.of(size) if size is not None else None
    present = [c for c in COMPONENTS if _compiled(folder, c) and (folder / c / "model.onnx").is_file()]
    if not present:
        raise SdnpuError(f"no converted component with a dispatch model under {folder}",
                         hint="make convert MODEL=all (OUT=...) first")
    denoiser = "transformer" if "transformer" in present else "unet"  # SD3's MMDiT, or the UNet
    if size is not None:
        have = [c for c in present if c in SIZED and any(f.size == size for f in sizes_of(folder / c))]
        for name in sorted(present, key=lambda c: (c != denoiser, c != "vae_decoder")):  # the UNet's refusal first
            if name in SIZED and name not in have:
                if name in (denoiser, "vae_decoder") or not have:  # what the pipeline needs: the list, the --add hint
                    component_path(folder, name, False, size)
                log.info("[%s] not converted at %s: not verified", name, size)
        if all(_files(folder, name, size).primary for name in have):
            size = None  # the primary's
        else:
            present = have
    lora = {}
    for name in present:  # an applied LoRA is in both models of the comparison (runtime.session)
        manifest = read_manifest(folder / name / "dd") if name in LORA_COMPONENTS else None
        if manifest is not None:
            lora[name] = [f"{x['name']}:{x['scale']:g}" for x in manifest["loras"]]
            log.info("[%s] with the applied LoRAs %s, in the dispatch model and the fp32 graph", name,
                     ", ".join(lora[name]))
    results: dict[str, Any] = {"components": {}, "pipeline": None, "lora": lora}
    for name in present:
        results["components"][name] = _component(folder, name, runs, size)
    pipeline = {denoiser, "vae_decoder"} <= set(present) and _compiled(folder, "text_encoder")
    if (folder / "model_index.json").is_file() and pipeline:
        # the folder's own guidance (a Turbo folder's 0, on its batch-1 UNet); an inpainting UNet draws over a
        # seeded picture and mask
        opts = GenerateOptions(prompt, steps=steps, seed=seed, guidance=generation.read(folder).guidance)
        with tempfile.TemporaryDirectory(prefix="sdnpu-verify-") as tmp:
            if _inpainting_unet(folder, denoiser):
                opts = dataclasses.replace(opts, **_seeded_picture_and_mask(Path(tmp), seed))
            if estimate(component_path(folder, denoiser, True, size)).bytes < ONE_WORKER_BELOW:
                with step(log, f"pipeline, {steps} steps, dispatch models and fp32 graphs (small: one worker)"):
                    ours, ref = run_in_worker(_generate_both, folder, opts, size, what="running the pipeline")
            else:
                with step(log, f"pipeline, {steps} steps, dispatch models"):
                    ours = run_in_worker(_generate, folder, False, opts, size,
                                         what="running the pipeline (dispatch models)")
                with step(log, f"pipeline, {steps} steps, fp32 graphs"):
                    ref = run_in_worker(_generate, folder, True, opts, size,
                                        what="running the pipeline (fp32 graphs)")
        mse = float(np.mean((ours.astype(np.float64) - ref) ** 2))
        results["pipeline"] = {"prompt": prompt, "steps": steps, "seed": seed, "guidance": opts.guidance,
                               "inpainting": opts.mask is not None,
                               "psnr_db": float(10 * np.log10(255**2 / mse)) if mse else float("inf")}
    if size is not None:
        results["size"] = str(size)
    for name, fid in results["components"].items():
        dd = folder / name / "dd"
        files = _files(folder, name, size)
        if not (folder / name / files.report).is_file() and (folder / name / "qnn" / "report.json").is_file():
            qnn = folder / name / "qnn"  # a QNN folder: its one report
            report = json.loads((qnn / "report.json").read_text())
            report["fidelity"] = {**fid["optimistic"], "pipeline": results["pipeline"]}
            reports.write(qnn, report)
            continue
        report = json.loads((folder / name / files.report).read_text())
        if lora.get(name):  # measured with the applied LoRAs: kept with them (lora remove drops it)
            report["lora"]["fidelity"] = {**fid["optimistic"], "pipeline": results["pipeline"]}
            report["lora"]["fidelity_pessimistic"] = fid["pessimistic"]
        else:
            report["fidelity"] = {**fid["optimistic"], "pipeline": results["pipeline"]}
            report["fidelity_pessimistic"] = fid["pessimistic"]
        reports.write(dd, report, Path(files.report).name, Path(files.text_report).name)
    atomic_write_json(folder / (f"verify.{size}.json" if size is not None else "verify.json"), results)
    return results
