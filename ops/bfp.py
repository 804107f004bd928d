"""BFP16 (``bfp16ebs8``), the block format AMD's NPU multiplies in, as AMD's packer writes it
(DynamicDispatch src/ops/sd/sd_helper.hpp:122-155, ``compress_bf16``): blocks of 8 values along the
reduction axis share one 8-bit exponent, each value keeps an 8-bit signed mantissa.

    E  = the largest fp32 biased exponent field in the block   ((bits & 0x7F800000) >> 23)
    m  = trunc(x * 2^(133 - E))          truncated toward zero (a C++ float -> int8 conversion)
    x' = m * 2^(E - 133)

so the largest value of a block keeps 7 significant bits (|m| < 128 always: no saturation) and smaller ones
lose theirs to the shared exponent; truncation makes every value's magnitude round down. Every BFP16 value is
exactly representable in bf16, so BFP16-rounded weights are stored as bf16. 9 bytes hold 8 values.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

BLOCK = 8
EXP_OFFSET = 133  # 127 (the fp32 bias) + 6: the block's largest value gets a mantissa in [64, 128)


def shared_exponents(blocks: np.ndarray) -> np.ndarray:
    """The biased fp32 exponent field of each block's largest value ([n, 8] float32 -> [n, 1] int)."""
    bits = np.ascontiguousarray(blocks, dtype=np.float32).view(np.uint32)
    return (((bits & 0x7F800000) >> 23).max(axis=1, keepdims=True)).astype(np.int64)


def round_bfp16(a: np.ndarray, axis: int = -1) -> np.ndarray:
    """``a`` as AMD's packer leaves it: blocks of 8 along ``axis`` (whose size must be a multiple of 8)."""
    x = np.moveaxis(np.asarray(a, dtype=np.float32), axis, -1)
    if x.shape[-1] % BLOCK:
        raise ValueError(f"axis of size {x.shape[-1]} is not a multiple of the {BLOCK}-value block")
    blocks = np.ascontiguousarray(x).reshape(-1, BLOCK)
    scale = np.exp2((shared_exponents(blocks) - EXP_OFFSET).astype(np.float64))
    q = np.trunc(blocks.astype(np.float64) / scale) * scale
    return np.moveaxis(q.astype(np.float32).reshape(x.shape), -1, axis)


def body(b: object, x: str) -> str:
    """ONNX nodes (through ``sdnpu.ops.bodies.Body``) rounding fp32 ``x`` to BFP16 along its last axis. The
    shared exponent is floor(log2 of the block's largest magnitude), exact at powers of two; an all-zero block
    stays zero."""
    op = b.op  # type: ignore[attr-defined]
    ints = b.ints  # type: ignore[attr-defined]

    def f(v: float) -> str:
        return op("Constant", value_float=v)  # type: ignore[no-any-return]

    blocks = op("Reshape", x, ints([-1, BLOCK]))
    m = op("Max", op("ReduceMax", op("Abs", blocks), ints([1]), keepdims=1), f(float(np.finfo(np.float32).tiny)))
    e = op("Floor", op("Div", op("Log", m), f(float(np.log(2.0)))))
    r = op("Div", m, op("Pow", f(2.0), e))
    e = op("Add", e, op("Sub", op("Cast", op("GreaterOrEqual", r, f(2.0)), to=TensorProto.FLOAT),
                          op("Cast", op("Less", r, f(1.0)), to=TensorProto.FLOAT)))
    scale = op("Pow", f(2.0), op("Sub", e, f(6.0)))
    scaled = op("Div", blocks, scale)
    q = op("Mul", op("Sign", scaled), op("Floor", op("Abs", scaled)))  # trunc
    return op("Reshape", op("Mul", q, scale), op("Shape", x))  # type: ignore[no-any-return]
