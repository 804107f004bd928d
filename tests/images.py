"""Comparing drawn images: the bound the pipeline tests hold (levels apart, and on what share of the values),
and PSNR."""

from __future__ import annotations

import numpy as np


def levels(a: np.ndarray, b: np.ndarray) -> tuple[int, float]:
    """(the largest difference in 8-bit levels, the share of values that differ at all)."""
    diff = np.abs(a.astype(int) - b.astype(int))
    return int(diff.max()), float(np.mean(diff > 0))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(float) - b.astype(float)) ** 2)
    return float("inf") if mse == 0 else float(10 * np.log10(255**2 / mse))


def uint8(images: np.ndarray) -> list[np.ndarray]:
    """diffusers' ``output_type="np"`` images ([N, H, W, 3] in [0, 1]) as sdnpu's, rounded to 8 bits."""
    return [(x * 255).round().astype(np.uint8) for x in images]
