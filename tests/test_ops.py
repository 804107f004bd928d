"""The reference bodies: every function passes the checker, and computes what its docstring says."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto as T
from onnx import helper

from sdnpu.ops.capability import check_attention, check_conv, check_gemm, check_tensor
from sdnpu.ops.opset import DOMAIN, OPS, functions_for

from .graphs import run


def _call(op: str, inputs: dict[str, np.ndarray], attrs: dict, inits: dict[str, np.ndarray] | None = None,
          dtype: int = T.FLOAT) -> np.ndarray:
    names = list(inputs) + list(inits or {})
    node = helper.make_node(op, names, ["y"], domain=DOMAIN, **attrs)
    cast_in = [helper.make_node("Cast", [n], [f"{n}_c"], to=dtype) for n in inputs]
    if dtype != T.FLOAT:
        node.input[:len(inputs)] = [f"{n}_c" for n in inputs]
    out = helper.make_node("Cast", ["y"], ["out"], to=T.FLOAT)
    g = helper.make_graph(
        (cast_in if dtype != T.FLOAT else []) + [node, out], "g",
        [helper.make_tensor_value_info(n, T.FLOAT, list(a.shape)) for n, a in inputs.items()],
        [helper.make_tensor_value_info("out", T.FLOAT, None)],
        [onnx.numpy_helper.from_array(a, n) for n, a in (inits or {}).items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(DOMAIN, 1)],
                          functions=functions_for({op}))
    return run(m, inputs)[0]


def test_every_function_is_valid():
    for fn in functions_for(set(OPS) | {"CastAvx"}):
        assert fn.domain == DOMAIN and fn.node
        assert {"in_dtypes", "out_dtypes", "input_shape", "output_shape"} <= set(fn.attribute)


@pytest.mark.parametrize("silu", [0, 1])
@pytest.mark.parametrize(("stride", "pads", "group"),
                         [(1, [1, 1, 1, 1], 1), (2, [0, 0, 1, 1], 1), (1, [0, 0, 0, 0], 2)])
def test_sdconv_is_nhwc_conv(silu, stride, pads, group):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 8, 9, 9), dtype=np.float32)
    w = rng.standard_normal((6, 8 // group, 3, 3), dtype=np.float32)
    b = rng.standard_normal(6, dtype=np.float32)
    y = _call("SDConv", {"x": x.transpose(0, 2, 3, 1).copy()},
              {"strides": [stride] * 2, "pads": pads, "dilations": [1, 1], "group": group, "silu": silu},
              {"w": w.transpose(0, 2, 3, 1).copy(), "b": b})
    xt = torch.nn.functional.pad(torch.from_numpy(x), (pads[1], pads[3], pads[0], pads[2]))
    ref = torch.nn.functional.conv2d(xt, torch.from_numpy(w), torch.from_numpy(b), stride=stride, groups=group)
    if silu:
        ref = torch.nn.functional.silu(ref)
    np.testing.assert_allclose(y, ref.numpy().transpose(0, 2, 3, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("silu", [0, 1])
def test_sdgroupnorm_is_nhwc_groupnorm(silu):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 32, 5, 7), dtype=np.float32) * 3 + 1
    g, b = rng.standard_normal(32, dtype=np.float32), rng.standard_normal(32, dtype=np.float32)
    y = _call("SDGroupNorm", {"x": x.transpose(0, 2, 3, 1).copy()}, {"groups": [8], "epsilon": 1e-5, "silu": silu},
              {"g": g, "b": b})
    ref = torch.nn.functional.group_norm(torch.from_numpy(x), 8, torch.from_numpy(g), torch.from_numpy(b), 1e-5)
    if silu:
        ref = torch.nn.functional.silu(ref)
    np.testing.assert_allclose(y, ref.numpy().transpose(0, 2, 3, 1), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("causal", [0, 1])
def test_sdmha_is_sdpa(causal):
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 7, 24), dtype=np.float32)
    k, v = rng.standard_normal((2, 7, 24), dtype=np.float32), rng.standard_normal((2, 7, 24), dtype=np.float32)
    y = _call("SDMHA", {"q": q, "k": k, "v": v}, {"num_heads": [3], "scale": 0.125, "causal": causal})

    def heads(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).view(2, 7, 3, 8).transpose(1, 2)

    ref = torch.nn.functional.scaled_dot_product_attention(heads(q), heads(k), heads(v), scale=0.125,
                                                           is_causal=bool(causal))
    np.testing.assert_allclose(y, ref.transpose(1, 2).reshape(2, 7, 24).numpy(), rtol=1e-5, atol=1e-5)


def test_bf16_inputs_give_bf16_rounded_outputs():
    x = np.linspace(-3, 3, 64, dtype=np.float32).reshape(1, 64)
    y = _call("SDSilu", {"x": x}, {}, dtype=T.BFLOAT16)
    exact = torch.nn.functional.silu(torch.from_numpy(x).bfloat16().float())
    np.testing.assert_array_equal(y, exact.bfloat16().float().numpy())


@pytest.mark.parametrize(
    ("call", "reason"),
    [(lambda: check_conv((8, 8, 9, 9), [1, 1], [1, 1]), "kernel 9x9"),
     (lambda: check_conv((8, 8, 3, 3), [8, 8], [1, 1]), "stride 8"),
     (lambda: check_gemm(20000, 10), "K=20000"),
     (lambda: check_attention((1, 4096, 1024), (1, 4096, 1024), 2), "head dim 512"),
     (lambda: check_attention((1, 32768, 512), (1, 32768, 512), 1), "sequence length 32768"),
     (lambda: check_tensor(5, True), "rank 5"),
     (lambda: check_tensor(2, False), "integer data")],
)
def test_capability_limits_name_the_limit(call, reason):
    assert reason in call()


def test_sdxl_shapes_fit_the_capability_table():
    assert check_conv((1280, 2560, 3, 3), [1, 1], [1, 1]) is None
    assert check_gemm(1280, 10240) is None
    assert check_attention((2, 4096, 640), (2, 77, 2048), 10) is None  # cross attention at 1024 px
    assert check_attention((1, 16384, 512), (1, 16384, 512), 1) is None  # VAE attention at 1024 px


def test_bfp16_rounding_is_a_shared_exponent_block_format():
    from sdnpu.ops.bfp import round_bfp16

    rng = np.random.default_rng(5)
    a = (rng.standard_normal((6, 32)) * np.exp2(rng.integers(-8, 8, size=(6, 1)))).astype(np.float32)
    r = round_bfp16(a)
    blocks, rb = a.reshape(-1, 8), r.reshape(-1, 8)
    for x, y in zip(blocks, rb, strict=True):
        e = np.floor(np.log2(np.abs(x).max()))
        scale = 2.0 ** (e - 6)
        mant = y / scale
        assert np.array_equal(mant, np.round(mant)) and np.abs(mant).max() <= 127  # sign + 7-bit mantissas
        assert np.abs(x - y).max() <= scale  # nearest on the shared grid (the clip at 127 costs up to one step)
    assert np.array_equal(round_bfp16(r), r)  # idempotent
    assert np.array_equal(torch.from_numpy(r).bfloat16().float().numpy(), r)  # exact in bf16
    assert np.array_equal(round_bfp16(np.full((1, 8), 2.0**-3, np.float32)), np.full((1, 8), 2.0**-3))  # power of 2
    with pytest.raises(ValueError, match="not a multiple"):
        round_bfp16(np.ones((2, 12), np.float32))


def test_bfp_gemm_body_rounds_its_activation_like_the_offline_weights():
    from sdnpu.ops.bfp import round_bfp16

    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 5, 16), dtype=np.float32)
    w = round_bfp16(rng.standard_normal((16, 8), dtype=np.float32), axis=0)
    b = rng.standard_normal(8, dtype=np.float32)
    y = _call("SDGemm_bfp", {"x": x}, {}, {"w": w, "b": b})
    np.testing.assert_allclose(y, round_bfp16(x) @ w + b, rtol=1e-5, atol=1e-5)
