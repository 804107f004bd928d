"""``sdnpu verify``: every dispatch model against its fp32 graph on seeded inputs, and the whole pipeline
both ways with one seed (image PSNR). The results go into each component's report (``fidelity``) and into
``verify.json`` beside the folder's model_index.json."""

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
from sdnpu.reports.fidelity import fidelity, generic_inputs
from sdnpu.reports.show import COMPONENT_ORDER
from sdnpu.runtime.pipeline import GenerateOptions, Pipeline
from sdnpu.runtime.session import RuntimeOptions, open_component

log = logging.getLogger(__name__)


def _component(folder: Path, name: str, seed: int) -> dict[str, Any]:
    feeds = generic_inputs(folder / name / "model.onnx", seed)
    with step(log, f"[{name}] fp32 graph"):
        reference = open_component(folder, name, reference=True, options=RuntimeOptions(optimize=True)).run(feeds)
    release_memory()
    with step(log, f"[{name}] dispatch model"):
        actual = open_component(folder, name).run(feeds)
    release_memory()
    return {**fidelity(reference, actual), "inputs": f"seeded Gaussian inputs (seed {seed}), sdnpu verify"}


def verify(folder: str | Path, steps: int = 3, seed: int = 0, prompt: str = "a photo of a cat") -> dict[str, Any]:
    folder = Path(folder)
    present = [c for c in COMPONENT_ORDER if (folder / c / "dd" / "report.json").is_file()
               and (folder / c / "model.onnx").is_file()]
    if not present:
        raise SdnpuError(f"no converted component with a dispatch model under {folder}",
                         hint="make convert MODEL=all (OUT=...) first")
    results: dict[str, Any] = {"components": {}, "pipeline": None}
    for name in present:
        results["components"][name] = _component(folder, name, seed)
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
        report["fidelity"] = {**fid, "pipeline": results["pipeline"]}
        reports.write(dd, report)
    atomic_write_json(folder / "verify.json", results)
    return results
