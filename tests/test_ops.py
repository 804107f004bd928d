"""The reference bodies: every function passes the checker, and computes what the op's table entry says, on
the views its attributes name; and bfp16ebs8 as AMD's packer writes it, against an independent bit-level
encoder."""

from __future__ import annotations

import struct

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto as T
from onnx import helper

from sdnpu.ops.bodies import functions_for
from sdnpu.ops.target import get_target

from .graphs import run

TARGET = get_target()


def _call(op: str, inputs: dict[str, np.ndarray], attrs: dict, inits: dict[str, np.ndarray] | None = None,
          dtype: int = T.FLOAT) -> np.ndarray:
    """Run one dispatch op (its reference body) on ``inputs`` (activations, cast to ``dtype`` first) and
    ``inits`` (constants, in the order of the table's remaining inputs)."""
    spec = TARGET.base_spec(op)
    names = list(inputs) + list(inits or {})
    for extra in spec.inputs[len(names):]:  # the dummy buffers
        names.append(f"dummy_{extra.name}")
        inits = {**(inits or {}), f"dummy_{extra.name}": np.zeros(extra.dummy_shape, np.dtype(extra.dtype))}
    full = {"in_dtypes": list(spec.in_dtypes), "out_dtypes": list(spec.out_dtypes), **attrs}
    node = helper.make_node(op, names, ["y"], domain=TARGET.domain, **full)
    cast_in = [helper.make_node("Cast", [n], [f"{n}_c"], to=dtype) for n in inputs]
    if dtype != T.FLOAT:
        node.input[:len(inputs)] = [f"{n}_c" for n in inputs]
    out = helper.make_node("Cast", ["y"], ["out"], to=T.FLOAT)
    g = helper.make_graph(
        (cast_in if dtype != T.FLOAT else []) + [node, out], "g",
        [helper.make_tensor_value_info(n, T.FLOAT, list(a.shape)) for n, a in inputs.items()],
        [helper.make_tensor_value_info("out", T.FLOAT, None)],
        [onnx.numpy_helper.from_array(a, n) for n, a in (inits or {}).items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(TARGET.domain, 1)],
                          functions=functions_for(TARGET, {op}))
    return run(m, inputs)[0]


def test_every_function_is_valid_and_declares_the_table_attributes():
    names = set(TARGET.ops) | set(TARGET.bfp_variants) | {TARGET.boundary.op_type}
    for fn in functions_for(TARGET, names):
        assert fn.domain == TARGET.domain and fn.node
        spec = TARGET.boundary if fn.name == "CastAvx" else TARGET.base_spec(fn.name)
        declared = set(fn.attribute) | {a.name for a in fn.attribute_proto}
        assert {a.name for a in spec.attrs} == declared, fn.name
        assert list(fn.input) == [i.name for i in spec.inputs]


@pytest.mark.parametrize(("stride", "pads", "k"), [(1, [1, 1, 1, 1], 3), (2, [1, 1, 1, 1], 3), (2, [0, 0, 1, 1], 3),
                                                   (1, [0, 0, 0, 0], 1), (2, [0, 0, 0, 0], 2)])
def test_sdconv_is_nhwc_conv(stride, pads, k):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 8, 9, 9), dtype=np.float32)
    w = rng.standard_normal((6, 8, k, k), dtype=np.float32)
    b = rng.standard_normal(6, dtype=np.float32)
    xt = torch.nn.functional.pad(torch.from_numpy(x), (pads[1], pads[3], pads[0], pads[2]))
    ref = torch.nn.functional.conv2d(xt, torch.from_numpy(w), torch.from_numpy(b), stride=stride).numpy()
    y = _call("SDConv", {"x": x.transpose(0, 2, 3, 1).copy()},
              {"input_shape": [2, 9, 9, 8], "output_shape": list(ref.transpose(0, 2, 3, 1).shape),
               "weight_shape": [6, k, k, 8], "strides": [stride] * 2, "pads": pads, "dilations": [1, 1],
               "group": 1, "kernel_shape": [k, k]},
              {"w": w.transpose(0, 2, 3, 1).copy(), "b": b})
    np.testing.assert_allclose(y, ref.transpose(0, 2, 3, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("silu", [False, True])
def test_sdgroupnorm_is_nhwc_groupnorm_with_gamma_then_beta(silu):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 32, 5, 7), dtype=np.float32) * 3 + 1
    g, b = rng.standard_normal(32, dtype=np.float32), rng.standard_normal(32, dtype=np.float32)
    attrs = {"input_shape": [2, 5, 7, 32], "output_shape": [2, 5, 7, 32], "wts_shape": [64], "gamma_shape": [32],
             "beta_shape": [32], "epsilon": 1e-5, "groups": 8, "activation": 0, "channels_last": 1}
    if silu:
        attrs["nonlinear"] = "Silu"
    y = _call("SDGroupNorm", {"x": x.transpose(0, 2, 3, 1).copy()}, attrs, {"wts": np.concatenate([g, b])})
    ref = torch.nn.functional.group_norm(torch.from_numpy(x), 8, torch.from_numpy(g), torch.from_numpy(b), 1e-5)
    if silu:
        ref = torch.nn.functional.silu(ref)
    np.testing.assert_allclose(y, ref.numpy().transpose(0, 2, 3, 1), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize(("op", "m", "n", "length"), [("SDFlatMHA", 7, 5, 128), ("SDMHA", 7, 7, 7),
                                                      ("SDMHA_VAE", 9, 9, 9)])
def test_sdmha_is_sdpa_on_its_views_with_a_padded_mask(op, m, n, length):
    rng = np.random.default_rng(2)
    heads = 1 if op == "SDMHA_VAE" else 3
    b = 1 if op == "SDMHA_VAE" else 2
    q = rng.standard_normal((b, m, 24), dtype=np.float32)
    k, v = rng.standard_normal((b, n, 24), dtype=np.float32), rng.standard_normal((b, n, 24), dtype=np.float32)
    mask = np.where(np.arange(length) < n, 0.0, -np.inf).astype(np.float32)
    y = _call(op, {"q": q.reshape(b, m, 4, 6), "k": k, "v": v},  # Q through a view: input_shape names [B, M, K]
              {"input_shape": [b, m, 24, n], "num_heads": heads, "op_version": "v"}, {"mask": mask})

    def split(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).view(b, a.shape[1], heads, 24 // heads).transpose(1, 2)

    ref = torch.nn.functional.scaled_dot_product_attention(split(q), split(k), split(v))
    np.testing.assert_allclose(y, ref.transpose(1, 2).reshape(b, m, 24).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gelu", [False, True])
def test_sdgemm_is_a_linear_layer_on_the_bmk_view(gelu):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 16), dtype=np.float32)  # [B, K], read as [B, 1, K]
    w, b = rng.standard_normal((16, 8), dtype=np.float32), rng.standard_normal(8, dtype=np.float32)
    attrs = {"input_shape": [2, 1, 16], "output_shape": [2, 1, 8], "weight_shape": [16, 8], "bias_enable": 1}
    if gelu:
        attrs["nonlinear"] = "Gelu"
    y = _call("SDGemm", {"x": x}, attrs, {"w": w, "b": b})
    ref = torch.from_numpy(x @ w + b)
    ref = torch.nn.functional.gelu(ref) if gelu else ref
    np.testing.assert_allclose(y, ref.numpy().reshape(2, 1, 8), rtol=1e-5, atol=1e-5)


def test_sdresize_doubles_h_and_w_as_torch_nearest():
    x = np.random.default_rng(4).standard_normal((1, 3, 4, 5), dtype=np.float32)
    y = _call("SDResize", {"x": x.transpose(0, 2, 3, 1).copy()}, {"a_shape": [1, 4, 5, 3], "c_shape": [1, 8, 10, 3]})
    ref = torch.nn.functional.interpolate(torch.from_numpy(x), scale_factor=2, mode="nearest").numpy()
    np.testing.assert_array_equal(y, ref.transpose(0, 2, 3, 1))


def test_binary_ops_read_their_views_and_broadcast():
    rng = np.random.default_rng(5)
    a = rng.standard_normal((2, 12, 4), dtype=np.float32)  # viewed [2, 3, 4, 4]
    b = rng.standard_normal((2, 4), dtype=np.float32)  # viewed [2, 1, 1, 4]
    shapes = {"a_shape": [2, 3, 4, 4], "b_shape": [2, 1, 1, 4], "c_shape": [2, 3, 4, 4]}
    np.testing.assert_allclose(_call("SDAdd", {"a": a, "b": b}, {**shapes, "is_bias_add": 0}),
                               a.reshape(2, 3, 4, 4) + b.reshape(2, 1, 1, 4), rtol=1e-6)
    np.testing.assert_allclose(_call("SDMul", {"a": a, "b": b}, shapes), a.reshape(2, 3, 4, 4) * b.reshape(2, 1, 1, 4),
                               rtol=1e-6)
    c = _call("SDConcat", {"a": a, "b": a}, {"a_shape": [2, 12, 4], "b_shape": [2, 12, 4], "c_shape": [2, 12, 8],
                                           "axis": 2})
    np.testing.assert_array_equal(c, np.concatenate([a, a], axis=2))


def test_bf16_inputs_give_bf16_rounded_outputs():
    x = np.linspace(-3, 3, 64, dtype=np.float32).reshape(1, 64)
    y = _call("SDSilu", {"x": x}, {"input_shape": [1, 64], "output_shape": [1, 64], "weight_shape": [128]},
              dtype=T.BFLOAT16)
    exact = torch.nn.functional.silu(torch.from_numpy(x).bfloat16().float())
    np.testing.assert_array_equal(y, exact.bfloat16().float().numpy())


# --- bfp16ebs8 -------------------------------------------------------------------------------------------

def _encode_block(values: np.ndarray) -> bytes:
    """bfp16ebs8 for 8 fp32 values, written from the format's description (DynamicDispatch
    sd_helper.hpp compress_bf16): byte 0 the largest biased exponent field, bytes 1-8 the values times
    2^(133 - E) truncated toward zero to int8."""
    bits = [struct.unpack("<I", struct.pack("<f", float(v)))[0] for v in values]
    e = max((b >> 23) & 0xFF for b in bits)
    mantissas = []
    for v in values:
        m = float(v) * 2.0 ** (133 - e)
        m = int(m)  # Python's int() truncates toward zero, as a C++ float -> int8 conversion does
        assert -128 < m < 128
        mantissas.append(m)
    return struct.pack("<B8b", e, *mantissas)


def _decode_block(block: bytes) -> list[float]:
    e, *mantissas = struct.unpack("<B8b", block)
    return [m * 2.0 ** (e - 133) for m in mantissas]


def test_bfp16_rounding_matches_a_bit_level_encoder_and_decoder():
    from sdnpu.ops.bfp import round_bfp16

    rng = np.random.default_rng(7)
    a = (rng.standard_normal((64, 32)) * np.exp2(rng.integers(-20, 20, size=(64, 1)))).astype(np.float32)
    a[0, :8] = 0.0  # an all-zero block
    a[1, :8] = [1.0, -1.0, 0.5, 2.0, -2.0, 0.0, 3.0, -0.125]  # powers of two, where log2 can miss by one
    a[2, :8] = np.float32(1.9999999)  # just below a power of two
    r = round_bfp16(a)
    for row_a, row_r in zip(a.reshape(-1, 8), r.reshape(-1, 8), strict=True):
        assert _decode_block(_encode_block(row_a)) == [float(x) for x in row_r]
    assert np.array_equal(torch.from_numpy(r).bfloat16().float().numpy(), r)  # exact in bf16
    assert np.all(np.abs(r) <= np.abs(a))  # truncation: magnitudes never grow
    with pytest.raises(ValueError, match="not a multiple"):
        round_bfp16(np.ones((2, 12), np.float32))


def test_bfp16_body_rounds_like_the_packer_bit_for_bit():
    """The ``_bfp`` ops round their activations in ONNX; that rounding equals the offline one exactly."""
    from sdnpu.ops.bfp import round_bfp16

    rng = np.random.default_rng(8)
    x = (rng.standard_normal((2, 5, 16)) * np.exp2(rng.integers(-10, 10, size=(2, 5, 1)))).astype(np.float32)
    w = np.eye(16, dtype=np.float32)
    y = _call("SDGemm_bfp", {"x": x}, {"input_shape": [2, 5, 16], "output_shape": [2, 5, 16],
                                       "weight_shape": [16, 16], "bias_enable": 1},
              {"w": w, "b": np.zeros(16, np.float32)})
    np.testing.assert_array_equal(y, round_bfp16(x))
    assert not np.array_equal(y, x)  # the rounding is not a no-op on these values
