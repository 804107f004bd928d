"""Fidelity of a dispatch model against its fp32 graph: the numbers the report shows, and seeded inputs
for graphs whose caller has no better ones. Shared by the compiler (convert) and ``sdnpu verify`` (runtime)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def generic_inputs(path: Path, seed: int = 0, shapes: dict[str, list[int]] | None = None) -> dict[str, np.ndarray]:
    """Seeded inputs from a graph's signature when the caller has no better ones: Gaussian floats, a
    mid-schedule scalar timestep, token ids below 1000 (valid for any CLIP vocabulary)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        t = vi.type.tensor_type
        shape = (shapes or {}).get(vi.name) or [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else 1
                                                for d in t.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
        if np.issubdtype(dtype, np.integer):
            feeds[vi.name] = rng.integers(0, 1000, size=shape).astype(dtype)
        elif not shape:
            feeds[vi.name] = np.array(500.0, dtype=dtype)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def is_image(shape: tuple[int, ...]) -> bool:
    """An RGB image tensor [B, 3, H, W] (the VAE decoder's output, the encoder's input)."""
    return len(shape) == 4 and shape[1] == 3 and shape[2] >= 8 and shape[3] >= 8


def fidelity(reference: dict[str, np.ndarray], actual: dict[str, np.ndarray]) -> dict[str, Any]:
    """Per output: max abs error, max error relative to the reference's largest magnitude, cosine, and
    PSNR for images over their [-1, 1] range (peak-to-peak 2). Non-finite outputs count as infinitely off.
    Compares the outputs ``actual`` has (a dispatch model may keep fewer outputs than its fp32 graph)."""
    outputs = {}
    for name, got in actual.items():
        if name not in reference:
            raise ValueError(f"output {name!r} is not an output of the reference")
        ref = reference[name]
        if got.shape != ref.shape:
            raise ValueError(f"output {name!r} has shape {got.shape}, the reference {ref.shape}")
        a, r = got.astype(np.float64).ravel(), ref.astype(np.float64).ravel()
        scale = float(np.max(np.abs(r))) if r.size else 0.0
        if not np.all(np.isfinite(a)):
            outputs[name] = {"max_abs": float("inf"), "ref_max_abs": scale, "max_rel": float("inf"), "cosine": 0.0}
            continue
        max_abs = float(np.max(np.abs(a - r))) if r.size else 0.0
        denom = float(np.linalg.norm(a) * np.linalg.norm(r))
        outputs[name] = {
            "max_abs": max_abs,
            "ref_max_abs": scale,
            "max_rel": max_abs / scale if scale > 0 else max_abs,
            "cosine": float(a @ r / denom) if denom else (1.0 if max_abs == 0 else 0.0),
        }
        if is_image(ref.shape):
            clipped = np.clip(a, -1, 1) - np.clip(r, -1, 1)
            mse = float(np.mean(clipped**2))
            outputs[name]["psnr_db"] = float(10 * np.log10(4.0 / mse)) if mse > 0 else float("inf")
    return {"reference": "fp32 graph (onnxruntime CPU)", "outputs": outputs,
            "min_cosine": min(o["cosine"] for o in outputs.values()),
            "max_abs": max(o["max_abs"] for o in outputs.values())}
