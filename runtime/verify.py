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
from pathlib import Path
from typing import Any

import numpy as np

from sdnpu.errors import SdnpuError
from sdnpu.fileio import atomic_write_json
from sdnpu.progress import release_memory, step
from sdnpu.reports import report as reports
from sdnpu.reports.fidelity import RANGE_RUNS, fidelity, pessimistic_model, range_inputs, worst
from sdnpu.reports.show import COMPONENT_ORDER
from sdnpu.runtime.pipeline import GenerateOptions, Pipeline
from sdnpu.runtime.session import RuntimeOptions, open_component, open_component_path

log = logging.getLogger(__name__)


def _component(folder: Path, name: str, runs: tuple[tuple[int, float], ...]) -> dict[str, Any]:
    """The optimistic and pessimistic fidelity of one component, each the worst over ``runs``."""
    import tempfile

    source = folder / name / "model.onnx"
    feeds = [range_inputs(source, seed, t) for seed, t in runs]
    with step(log, f"[{name}] fp32 graph, {len(runs)} inputs"):
        session = open_component(folder, name, reference=True, options=RuntimeOptions(optimize=True))
        references = [session.run(f) for f in feeds]
        del session
    release_memory()
    with step(log, f"[{name}] dispatch model (rounding once per op: optimistic)"):
        session = open_component(folder, name, options=RuntimeOptions(optimize=False))
        optimistic = worst([fidelity(r, session.run(f)) for r, f in zip(references, feeds, strict=True)])
        del session
    release_memory()
    with tempfile.TemporaryDirectory(prefix="sdnpu-pessimistic-") as tmp:
        with step(log, f"[{name}] dispatch model with every body intermediate in bf16 (pessimistic)"):
            path = pessimistic_model(folder / name / "dd" / "replaced.onnx", Path(tmp))
            session = open_component_path(path, name)
            pessimistic = worst([fidelity(r, session.run(f)) for r, f in zip(references, feeds, strict=True)])
            del session
    release_memory()
    described = ", ".join(f"seed {seed}" + (f" at timestep {t:g}" if "timestep" in feeds[0] else "")
                          for seed, t in runs)
    return {"optimistic": {**optimistic, "inputs": f"worst of {described} (sdnpu verify)"},
            "pessimistic": {**pessimistic, "inputs": f"worst of {described}; every body intermediate in bf16"}}


def verify(folder: str | Path, steps: int = 3, seed: int = 0, prompt: str = "a photo of a cat",
           runs: tuple[tuple[int, float], ...] = RANGE_RUNS) -> dict[str, Any]:
    folder = Path(folder)
    present = [c for c in COMPONENT_ORDER if (folder / c / "dd" / "report.json").is_file()
               and (folder / c / "model.onnx").is_file()]
    if not present:
        raise SdnpuError(f"no converted component with a dispatch model under {folder}",
                         hint="make convert MODEL=all (OUT=...) first")
    results: dict[str, Any] = {"components": {}, "pipeline": None}
    for name in present:
        results["components"][name] = _component(folder, name, runs)
    if (folder / "model_index.json").is_file() and {"unet", "vae_decoder", "text_encoder"} <= set(present):
        opts = GenerateOptions(prompt, steps=steps, seed=seed)
        with step(log, f"pipeline, {steps} steps, dispatch models"):
            ours = Pipeline(folder)(opts)
        with step(log, f"pipeline, {steps} steps, fp32 graphs"):
            ref = Pipeline(folder, reference=True)(opts)
        mse = float(np.mean((ours.astype(np.float64) - ref) ** 2))
        results["pipeline"] = {"prompt": prompt, "steps": steps, "seed": seed,
                               "psnr_db": float(10 * np.log10(255**2 / mse)) if mse else float("inf")}
    for name, fid in results["components"].items():
        dd = folder / name / "dd"
        report = json.loads((dd / "report.json").read_text())
        report["fidelity"] = {**fid["optimistic"], "pipeline": results["pipeline"]}
        report["fidelity_pessimistic"] = fid["pessimistic"]
        reports.write(dd, report)
    atomic_write_json(folder / "verify.json", results)
    return results
