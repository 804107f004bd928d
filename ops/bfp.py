"""BFP16 (``bfp16ebs8``), the block format AMD's NPU multiplies in: blocks of 8 values along the reduction
axis share one 8-bit exponent, each value keeps an 8-bit signed mantissa.

    block max m = max |x_i|,  e = floor(log2 m),  scale = 2^(e - 6)
    x_i -> clip(round_half_even(x_i / scale), -127, 127) * scale

so the largest value of a block keeps 7 significant bits and smaller ones lose theirs to the shared exponent.
The mantissa is sign + 7-bit magnitude (symmetric, -127..127): with -128 allowed, a block whose largest
value rounds to -2^(e+1) would change its own exponent when rounded again.
Every BFP16 value is exactly representable in bf16, so BFP16-rounded weights are stored as bf16.
The ``_bfp`` dispatch ops round their activation inputs in their reference body (ops below) and carry
BFP16-rounded weights (``round_bfp16`` offline, in the precision pass).
"""

from __future__ import annotations

import numpy as np

BLOCK = 8
MANTISSA_MAX = 127
# op -> (activation inputs rounded in the body along their last axis, weight input index, weight block axis)
BFP_OPS: dict[str, tuple[tuple[int, ...], int | None, int | None]] = {
    "SDConv": ((0,), 1, -1),      # X [B, H, W, C], W [OC, KH, KW, C]: blocks along C
    "SDGemm": ((0,), 1, 0),       # X [.., K], W [K, N]: blocks along K
    "SDMHA": ((0, 1, 2), None, None),   # Q, K, V [B, S, C]: blocks along C
    "SDMHA_VAE": ((0, 1, 2), None, None),
}


def _exponent(m: np.ndarray) -> np.ndarray:
    """floor(log2 m) for m > 0, exact at powers of two (log2 alone can miss by one there)."""
    e = np.floor(np.log2(m))
    r = m / np.exp2(e)
    return e + (r >= 2) - (r < 1)


def round_bfp16(a: np.ndarray, axis: int = -1) -> np.ndarray:
    """``a`` rounded to BFP16 in blocks of 8 along ``axis`` (whose size must be a multiple of 8)."""
    x = np.moveaxis(np.asarray(a, dtype=np.float32), axis, -1)
    if x.shape[-1] % BLOCK:
        raise ValueError(f"axis of size {x.shape[-1]} is not a multiple of the {BLOCK}-value block")
    blocks = x.reshape(-1, BLOCK).astype(np.float64)
    m = np.maximum(np.abs(blocks).max(axis=1, keepdims=True), np.finfo(np.float32).tiny)
    scale = np.exp2(_exponent(m) - 6)
    q = np.clip(np.round(blocks / scale), -MANTISSA_MAX, MANTISSA_MAX) * scale
    return np.moveaxis(q.astype(np.float32).reshape(x.shape), -1, axis)


def body(b: object, x: str) -> str:
    """ONNX nodes (through an opset ``_Body``) rounding fp32 ``x`` to BFP16 along its last axis."""
    from onnx import TensorProto as T

    op = b.op  # type: ignore[attr-defined]
    const = b.const_ints  # type: ignore[attr-defined]

    def f(v: float) -> str:
        return op("Constant", value_float=v)

    blocks = op("Reshape", x, const([-1, BLOCK]))
    m = op("Max", op("ReduceMax", op("Abs", blocks), const([1]), keepdims=1), f(float(np.finfo(np.float32).tiny)))
    e = op("Floor", op("Div", op("Log", m), f(float(np.log(2.0)))))
    r = op("Div", m, op("Pow", f(2.0), e))
    e = op("Add", e, op("Sub", op("Cast", op("GreaterOrEqual", r, f(2.0)), to=T.FLOAT),
                          op("Cast", op("Less", r, f(1.0)), to=T.FLOAT)))
    scale = op("Pow", f(2.0), op("Sub", e, f(6.0)))
    q = op("Clip", op("Round", op("Div", blocks, scale)), f(-float(MANTISSA_MAX)), f(float(MANTISSA_MAX)))
    return op("Reshape", op("Mul", q, scale), op("Shape", x))  # type: ignore[no-any-return]
