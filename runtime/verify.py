"""``sdnpu verify``: every dispatch model against its fp32 graph, and the whole pipeline both ways with one
seed (image PSNR). The results go into each component's report and into ``verify.json`` beside the folder's
model_index.json.

Fidelity is a range. The dispatch model's reference bodies compute in fp32 and round once, at each op's
output: the *optimistic* number (``fidelity``). A kernel with bf16 internals rounds more often; the
*pessimistic* number (``fidelity_pessimistic``) comes from the same model with every intermediate of every
body rounded to bf16 (``reports.fidelity.pessimistic_model``). Both are the worst over three seeded inputs,
the UNet's at timesteps 999, 500 and 1 (``RANGE_RUNS``)."""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from sdnpu.errors import SdnpuError
from sdnpu.fileio import atomic_write_json
from sdnpu.memory import check_fits
from sdnpu.progress import step
from sdnpu.reports import report as reports
from sdnpu.reports.fidelity import RANGE_RUNS, fidelity, pessimistic_model, range_inputs, worst
from sdnpu.reports.show import COMPONENT_ORDER
from sdnpu.lora.adapters import COMPONENTS as LORA_COMPONENTS
from sdnpu.lora.overlay import read_manifest
from sdnpu.runtime.pipeline import GenerateOptions, Pipeline
from sdnpu.runtime.session import RuntimeOptions, open_component, open_component_path
from sdnpu.worker import run_in_worker

log = logging.getLogger(__name__)


def _component(folder: Path, name: str, runs: tuple[tuple[int, float], ...]) -> dict[str, Any]:
    """The optimistic and pessimistic fidelity of one component, each the worst over ``runs``. Each run (the
    fp32 graph, the dispatch model, the pessimistic model, on each input) is a worker process of its own: a
    deleted onnxruntime session leaves gigabytes behind in the process (``sdnpu.worker``), and three inputs
    through one session roughly doubled a run's peak (SDXL at 1024 px: the VAE encoder's dispatch model 9.2 GB
    against 4.9 GB, its pessimistic model 11.4 against 6.2; the VAE decoder's pessimistic run was killed by
    the kernel on a 24 GB machine, and peaks at 9.2 GB one input at a time)."""
    source = folder / name / "model.onnx"
    dispatch = folder / name / "dd" / "replaced.onnx"
    for path in (source, dispatch):
        check_fits(path, f"[{name}] running {path.name}", hint="verify the other components: sdnpu verify takes a "
                   "folder, move this one aside; or convert at a smaller RES")
    feeds = [range_inputs(source, seed, t) for seed, t in runs]

    def each(model: str, what: str, path: Path | None = None) -> list[dict[str, np.ndarray]]:
        return [run_in_worker(_run, folder, name, model, [f], path, what=what)[0] for f in feeds]

    with step(log, f"[{name}] fp32 graph, {len(runs)} inputs"):
        references = each("fp32", f"running {name}'s fp32 graph")
    with step(log, f"[{name}] dispatch model (rounding once per op: optimistic)"):
        actual = each("dispatch", f"running {name}'s dispatch model")
        optimistic = worst([fidelity(r, a) for r, a in zip(references, actual, strict=True)])
    with step(log, f"[{name}] dispatch model with every body intermediate in bf16 (pessimistic)"), \
            tempfile.TemporaryDirectory(prefix="sdnpu-pessimistic-") as tmp:
        path = run_in_worker(pessimistic_model, dispatch, Path(tmp), what=f"writing {name}'s pessimistic model")
        actual = each("pessimistic", f"running {name}'s dispatch model with bf16 intermediates", path)
        pessimistic = worst([fidelity(r, a) for r, a in zip(references, actual, strict=True)])
    described = ", ".join(f"seed {seed}" + (f" at timestep {t:g}" if "timestep" in feeds[0] else "")
                          for seed, t in runs)
    return {"optimistic": {**optimistic, "inputs": f"worst of {described} (sdnpu verify)"},
            "pessimistic": {**pessimistic, "inputs": f"worst of {described}; every body intermediate in bf16"}}


def _run(folder: Path, name: str, model: str, feeds: list[dict[str, np.ndarray]], pessimistic: Path | None = None
         ) -> list[dict[str, np.ndarray]]:
    """(In a worker.) ``name``'s fp32 graph (onnxruntime's optimizations on), dispatch model (off: they would
    fold each bf16 weight into an fp32 copy), or the pessimistic dispatch model written at ``pessimistic``
    (once per component, in a worker of its own: the SDXL UNet's is 5 GB of weights), on each of ``feeds``."""
    if model == "fp32":
        session = open_component(folder, name, reference=True, options=RuntimeOptions(optimize=True))
    elif model == "dispatch":
        session = open_component(folder, name, options=RuntimeOptions(optimize=False))
    else:
        assert pessimistic is not None  # with the folder's LoRAs, as the dispatch model has them
        session = open_component_path(pessimistic, name, comp_dir=folder / name)
    return [session.run(f) for f in feeds]


def _generate(folder: Path, reference: bool, opts: GenerateOptions) -> np.ndarray:
    """(In a worker.) One image through the whole pipeline."""
    return Pipeline(folder, reference=reference)(opts)


def verify(folder: str | Path, steps: int = 3, seed: int = 0, prompt: str = "a photo of a cat",
           runs: tuple[tuple[int, float], ...] = RANGE_RUNS) -> dict[str, Any]:
    folder = Path(folder)
    present = [c for c in COMPONENT_ORDER if (folder / c / "dd" / "report.json").is_file()
               and (folder / c / "model.onnx").is_file()]
    if not present:
        raise SdnpuError(f"no converted component with a dispatch model under {folder}",
                         hint="make convert MODEL=all (OUT=...) first")
    lora = {}
    for name in present:  # an applied LoRA is in both models of the comparison (runtime.session)
        manifest = read_manifest(folder / name / "dd") if name in LORA_COMPONENTS else None
        if manifest is not None:
            lora[name] = [f"{x['name']}:{x['scale']:g}" for x in manifest["loras"]]
            log.info("[%s] with the applied LoRAs %s, in the dispatch model and the fp32 graph", name,
                     ", ".join(lora[name]))
    results: dict[str, Any] = {"components": {}, "pipeline": None, "lora": lora}
    for name in present:
        results["components"][name] = _component(folder, name, runs)
    if (folder / "model_index.json").is_file() and {"unet", "vae_decoder", "text_encoder"} <= set(present):
        opts = GenerateOptions(prompt, steps=steps, seed=seed)
        with step(log, f"pipeline, {steps} steps, dispatch models"):
            ours = run_in_worker(_generate, folder, False, opts, what="running the pipeline (dispatch models)")
        with step(log, f"pipeline, {steps} steps, fp32 graphs"):
            ref = run_in_worker(_generate, folder, True, opts, what="running the pipeline (fp32 graphs)")
        mse = float(np.mean((ours.astype(np.float64) - ref) ** 2))
        results["pipeline"] = {"prompt": prompt, "steps": steps, "seed": seed,
                               "psnr_db": float(10 * np.log10(255**2 / mse)) if mse else float("inf")}
    for name, fid in results["components"].items():
        dd = folder / name / "dd"
        report = json.loads((dd / "report.json").read_text())
        if lora.get(name):  # measured with the applied LoRAs: kept with them (lora remove drops it)
            report["lora"]["fidelity"] = {**fid["optimistic"], "pipeline": results["pipeline"]}
            report["lora"]["fidelity_pessimistic"] = fid["pessimistic"]
        else:
            report["fidelity"] = {**fid["optimistic"], "pipeline": results["pipeline"]}
            report["fidelity_pessimistic"] = fid["pessimistic"]
        reports.write(dd, report)
    atomic_write_json(folder / "verify.json", results)
    return results
