"""The fuse pass (``sdnpu.passes.fuse``): each fusion rule on tiny graphs, through the passes up to views: what
must become the target's ops (and compute the same), what must not (and the reason it gives), in the spellings
the exporters write."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import helper

from sdnpu.formats.keys import RULE_TAG
from sdnpu.passes.fuse import fuse
from sdnpu.passes.canonical import constants
from sdnpu.passes.canonical.driver import sweep
from sdnpu.passes.pipeline import CompileOptions, canonicalize, compile_model

from .fuzz_repro import check
from .graphs import feeds_for, model, ops, run, to_ir, to_proto, with_functions
from .lowering import TARGET, assert_same, declined, dispatch_ops, lowered, n, w


# --- graphs as the exporters write them -------------------------------------------------------------------------------

def conv_silu():
    return model([n("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), n("Sigmoid", ["c"], ["s"]),
                  n("Mul", ["c", "s"], ["y"])], {"x": [1, 4, 6, 6]}, {"y": [1, 8, 6, 6]},
                 {"w": w(8, 4, 3, 3), "b": w(8)})


def conv_grouped():
    return model([n("Conv", ["x", "w"], ["y"], group=2)], {"x": [1, 4, 6, 6]}, {"y": [1, 8, 4, 4]},
                 {"w": w(8, 2, 3, 3)})


def group_norm(silu: bool, rank: int = 4, grouping: list[int] | None = None):
    shape = {3: [2, 8, 16], 4: [2, 8, 4, 4], 5: [2, 8, 2, 3, 4]}[rank]  # 5: a video UNet's [B, C, F, H, W]
    bshape = [8] + [1] * (rank - 2)
    nodes = [n("Reshape", ["x", "g_shape"], ["r"]),
             n("InstanceNormalization", ["r", "ones", "zeros"], ["i"], epsilon=1e-5),
             n("Reshape", ["i", "x_shape"], ["r2"]), n("Mul", ["r2", "gamma"], ["m"]), n("Add", ["m", "beta"], ["y0"])]
    if silu:
        nodes += [n("Sigmoid", ["y0"], ["s"]), n("Mul", ["y0", "s"], ["y"])]
    else:
        nodes += [n("Identity", ["y0"], ["y"])]
    groups = (grouping or [0, 4, -1])[1]
    return model(nodes, {"x": shape}, {"y": shape},
                 {"g_shape": np.array(grouping or [0, 4, -1]), "x_shape": np.array(shape),
                  "ones": np.ones(groups, np.float32), "zeros": np.zeros(groups, np.float32),
                  "gamma": w(*bshape) + 1, "beta": w(*bshape)})


def attention(variant: str, s: int = 5, mask: str | None = None, scale: float | None = None,
              scale_first: bool = False):
    """Self-attention over x [2, s, 16] with 4 heads, spelled as dynamo or TorchScript write it."""
    b, c, h, d = 2, 16, 4, 4
    nodes = [n("MatMul", ["x", "wq"], ["q"]), n("MatMul", ["x", "wk"], ["k"]), n("MatMul", ["x", "wv"], ["v"])]
    for t in "qkv":
        nodes += [n("Reshape", [t, "split"], [f"{t}4"]), n("Transpose", [f"{t}4"], [f"{t}h"], perm=[0, 2, 1, 3])]
    inits = {"wq": w(c, c), "wk": w(c, c), "wv": w(c, c), "split": np.array([b, -1, h, d]),
             "merge": np.array([b, -1, c]), "scale": np.array(d ** -0.25, np.float32)}
    if variant == "dynamo":  # kᵀ via [B*H, S, D] reshapes; q and kᵀ each scaled by d^-1/4
        inits.update(flat=np.array([-1, s, d]), back=np.array([b, h, d, s]))
        nodes += [n("Reshape", ["kh", "flat"], ["kf"]), n("Transpose", ["kf"], ["kft"], perm=[0, 2, 1]),
                  n("Reshape", ["kft", "back"], ["kt"]), n("Mul", ["qh", "scale"], ["qs"]),
                  n("Mul", ["kt", "scale"], ["ks"]), n("MatMul", ["qs", "ks"], ["sc"])]
    else:  # one Transpose for kᵀ, the scale applied to the scores
        inits["scale"] = np.array(scale if scale is not None else d ** -0.5, np.float32)
        nodes += [n("Transpose", ["kh"], ["kt"], perm=[0, 1, 3, 2]), n("MatMul", ["qh", "kt"], ["sc0"]),
                  n("Mul", ["scale", "sc0"] if scale_first else ["sc0", "scale"], ["sc"])]
    if mask == "causal":  # CLIP's text encoders
        inits["mask"] = np.triu(np.full((s, s), np.finfo(np.float32).min, np.float32), k=1)[None, None]
        nodes += [n("Add", ["sc", "mask"], ["scm"]), n("Softmax", ["scm"], ["p"], axis=-1)]
    elif mask == "keyrow":  # a padding row over the keys: the last key masked for every query
        inits["mask"] = np.zeros((1, 1, 1, s), np.float32)
        inits["mask"][..., -1] = np.finfo(np.float32).min
        nodes += [n("Add", ["sc", "mask"], ["scm"]), n("Softmax", ["scm"], ["p"], axis=-1)]
    elif mask == "input":  # a per-query mask the graph is given (a decoder's causal and padding mask)
        nodes += [n("Add", ["sc", "mask"], ["scm"]), n("Softmax", ["scm"], ["p"], axis=-1)]
    elif mask == "position":  # T5's: a key row from the graph's input plus its position bias, folded per head
        inits["position"] = w(1, h, s, s)
        nodes += [n("Add", ["position", "mask"], ["bias"]), n("Add", ["sc", "bias"], ["scm"]),
                  n("Softmax", ["scm"], ["p"], axis=-1)]
    elif mask == "softcap":  # Gemma 2's attention logit softcapping: cap * tanh(scores / cap)
        inits["cap"] = np.array(2.0, np.float32)
        nodes += [n("Div", ["sc", "cap"], ["scd"]), n("Tanh", ["scd"], ["sct"]), n("Mul", ["sct", "cap"], ["scc"]),
                  n("Softmax", ["scc"], ["p"], axis=-1)]
    else:
        nodes += [n("Softmax", ["sc"], ["p"], axis=-1)]
    nodes += [n("MatMul", ["p", "vh"], ["o"]), n("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
              n("Reshape", ["ot", "merge"], ["y"])]
    masks = {"input": {"mask": [b, 1, s, s]}, "position": {"mask": [b, 1, 1, s]}}.get(mask or "", {})
    return model(nodes, {"x": [b, s, c], **masks}, {"y": [b, s, c]}, inits)


def linear():
    return model([n("MatMul", ["x", "w"], ["m"]), n("Add", ["m", "b"], ["y0"]),
                  n("Gemm", ["t", "w2", "b2"], ["y1"], transB=1)],
                 {"x": [2, 5, 8], "t": [2, 8]}, {"y0": [2, 5, 6], "y1": [2, 3]},
                 {"w": w(8, 6), "b": w(6), "w2": w(3, 8), "b2": w(3)})


def geglu(spelling: str = "dynamo", width: int = 8):
    """The feed-forward gate: proj(x) split in halves (dynamo: Split; TorchScript: two Slices), h * gelu(g)."""
    half = width // 2
    nodes = [n("MatMul", ["x", "w"], ["m"]), n("Add", ["m", "b"], ["p"])]
    if spelling == "dynamo":
        nodes.append(n("Split", ["p"], ["h", "g"], axis=-1, num_outputs=2))
    else:
        nodes += [n("Slice", ["p", "s0", "s1", "ax"], ["h"]), n("Slice", ["p", "s1", "s2", "ax"], ["g"])]
    nodes += [n("Gelu", ["g"], ["gg"]), n("Mul", ["h", "gg"], ["y"])]
    out = [2, 5, width - half] if spelling == "dynamo" else [2, 5, half]
    return model(nodes, {"x": [2, 5, 6]}, {"y": out},
                 {"w": w(6, width), "b": w(width), "s0": np.array([0]), "s1": np.array([half]),
                  "s2": np.array([width]), "ax": np.array([-1])})


def layer_norm():
    return model([n("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1, epsilon=1e-5)], {"x": [2, 5, 8]},
                 {"y": [2, 5, 8]}, {"g": w(8) + 1, "b": w(8)})


def upsample(factor: int = 2, mode: str = "nearest"):
    return model([n("Resize", ["x", "", "scales"], ["y"], mode=mode, nearest_mode="floor",
                    coordinate_transformation_mode="asymmetric")], {"x": [1, 4, 3, 3]},
                 {"y": [1, 4, 3 * factor, 3 * factor]}, {"scales": np.array([1, 1, factor, factor], np.float32)})


@pytest.mark.parametrize(
    ("build", "expected"),
    [(conv_silu, {"SDConv": 1, "SDSilu": 1}),
     (conv_grouped, {"SDConv": 1}),  # the dense conv with a block-diagonal weight
     (lambda: group_norm(True), {"SDGroupNorm": 1}),
     (lambda: group_norm(False), {"SDGroupNorm": 1}),
     (lambda: group_norm(True, rank=3), {"SDGroupNorm": 1}),
     (lambda: group_norm(True, rank=5), {"SDGroupNorm": 1}),
     # the batch folded into the rows, [1, B*G, -1], and the groups' channels on an axis of their own: the same
     # GroupNorm (4 groups); an earlier version read the first as 8 groups, 0.28 off at an output scale of 2.6
     (lambda: group_norm(False, grouping=[1, 8, -1]), {"SDGroupNorm": 1}),
     (lambda: group_norm(False, grouping=[2, 4, 2, -1]), {"SDGroupNorm": 1}),
     (lambda: attention("dynamo"), {"SDFlatMHA": 1, "SDGemm": 3}),
     (lambda: attention("torchscript"), {"SDFlatMHA": 1, "SDGemm": 3}),
     (lambda: attention("torchscript", scale_first=True), {"SDFlatMHA": 1, "SDGemm": 3}),  # Mul(s, scores)
     (linear, {"SDGemm": 2}),
     (geglu, {"SDGemm": 2, "SDMul": 1}),
     (lambda: geglu("torchscript"), {"SDGemm": 2, "SDMul": 1}),
     (layer_norm, {"SDLayerNorm": 1}),
     (upsample, {"SDResize": 1})],
)
def test_rule_fires_and_keeps_numbers(build, expected):
    m = build()
    irm = lowered(m)
    assert dispatch_ops(irm) == expected
    leftovers = {"Conv", "InstanceNormalization", "Softmax", "Gemm", "LayerNormalization", "Gelu", "Resize", "Sigmoid",
                 "MatMul", "Split", "Slice"}
    assert not leftovers & set(ops(irm)), ops(irm)
    assert_same(m, irm)


def test_groupnorm_takes_the_silu_after_it_and_stores_gamma_then_beta():
    m = group_norm(True)
    irm = lowered(m)
    node = next(x for x in irm.graph if x.op_type == "SDGroupNorm")
    assert node.attributes["nonlinear"].value == "Silu" and node.metadata_props[RULE_TAG] == "GroupNormFusion"
    assert node.attributes["groups"].value == 4 and list(node.attributes["wts_shape"].value) == [16]
    gamma = onnx.numpy_helper.to_array(next(i for i in m.graph.initializer if i.name == "gamma")).reshape(-1)
    np.testing.assert_array_equal(node.inputs[1].const_value.numpy()[:8], gamma)
    assert "nonlinear" not in next(x for x in lowered(group_norm(False)).graph if x.op_type == "SDGroupNorm").attributes


@pytest.mark.parametrize(("m", "n_", "heads", "op"), [(256, 128, 4, "SDMHA"), (256, 77, 4, "SDFlatMHA"),
                                                     (64, 256, 4, "SDFlatMHA"), (16, 16, 1, "SDMHA_VAE")])
def test_mha_variant_and_mask_follow_amd(m, n_, heads, op):
    assert TARGET.mha_variant(m, n_, heads) == op
    assert TARGET.mha_mask_length(2, m, 640, 77) == 128  # the UNet's cross attention: padded to 128
    assert TARGET.mha_mask_length(2, 1024, 640, 1024) == 1024
    assert TARGET.mha_mask_length(1, 16384, 512, 16384) == 16384  # the VAE: M
    assert TARGET.mha_mask_length(2, 4250, 1536, 4250) == 4352  # SD3's MMDiT: N aligned to 256


def test_mha_carries_amd_attributes_and_a_mask_of_the_padded_length():
    irm = lowered(attention("dynamo"))
    node = next(x for x in irm.graph if x.op_type == "SDFlatMHA")
    assert list(node.attributes["input_shape"].value) == [2, 5, 16, 5]
    assert node.attributes["num_heads"].value == 4 and node.attributes["op_version"].value == "v1.1"
    mask = node.inputs[3].const_value.numpy()
    assert mask.shape == (128,) and not mask[:5].any() and np.all(np.isneginf(mask[5:]))


def test_geglu_from_no_linear_layer_is_written_with_registry_ops():
    """Halves of an activation that no linear layer wrote: no weight to split, and SDSlice has no offsets,
    so the split stays on the CPU and the GELU and the product are SDGelu and SDMul."""
    m = model([n("Split", ["x"], ["h", "g"], axis=-1, num_outputs=2), n("Gelu", ["g"], ["gg"]),
               n("Mul", ["h", "gg"], ["y"])], {"x": [2, 5, 8]}, {"y": [2, 5, 4]})
    irm = to_ir(m)
    canonicalize(irm)
    fuse(irm, TARGET)
    assert dispatch_ops(irm) == {}
    irm = lowered(m)
    assert ops(irm)["Split"] == 1  # on the CPU: its inputs are the graph's, its readers not yet NPU ops
    assert_same(m, irm)


def _modulation(bias: bool):
    """``1 + Linear(e)``, a conditional norm's scale (Kandinsky 3's, SD3's and Flux's AdaLayerNorm ``1 +
    scale``): small outputs, then a constant far larger than the layer's bias."""
    nodes = [n("MatMul", ["e", "wl"], ["p"])]
    inits = {"wl": w(64, 48) * 0.1, "one": np.array(1.0, np.float32)}
    if bias:
        nodes.append(n("Add", ["p", "bl"], ["pb"]))
        inits["bl"] = w(48) * 0.1
    nodes.append(n("Add", ["pb" if bias else "p", "one"], ["y"]))
    return model(nodes, {"e": [16, 64]}, {"y": [16, 48]}, inits)


def _bf16(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.mark.parametrize(("bias", "expected"), [(True, {"SDGemm": 1, "SDAdd": 1}), (False, {"SDGemm": 1})])
def test_a_constant_after_a_linear_layer_folds_into_its_bias_only_where_bf16_holds_the_sum(bias, expected):
    """SDGemm's bias is bf16: ``bf16(b + 1)`` keeps the learned bias only to bf16's spacing at 1, a second
    rounding at 1's scale beside the output's, where the module computes ``bf16(bf16(x W + b) + 1)``. So with a
    bias the ``1 +`` stays an Add after the layer (the glue's SDAdd); without one the sum is 1, exact in bf16, and
    folds. The compiled model's error against fp32 is the module's bf16 order's (within 5%; the fold measured
    1.3-1.5x it on this graph)."""
    m = _modulation(bias)
    irm = lowered(m)
    assert dispatch_ops(irm) == expected, ops(irm)
    assert_same(m, irm)
    compiled = to_ir(m)
    compile_model(compiled, CompileOptions())
    feeds = feeds_for(m)
    ours = run(with_functions(compiled, TARGET), feeds)[0].astype(np.float64)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}
    x, wl = feeds["e"].astype(np.float64), inits["wl"].astype(np.float64)
    exact = x @ wl + (inits["bl"] if bias else 0.0) + 1.0
    layer = _bf16(_bf16(x) @ _bf16(wl) + (_bf16(inits["bl"]) if bias else 0.0))  # the layer, rounded once
    module = _bf16(layer + 1.0)  # then its ``+ 1``, rounded
    assert np.linalg.norm(ours - exact) <= 1.05 * np.linalg.norm(module - exact), (
        np.linalg.norm(ours - exact) / np.linalg.norm(module - exact))


# --- near misses: must not fuse, and say why --------------------------------------------------------------------------

def conv_dynamic_weight():
    return model([n("Conv", ["x", "w"], ["y"])], {"x": [1, 4, 6, 6], "w": [8, 4, 3, 3]}, {"y": [1, 8, 4, 4]})


def conv_rectangular():
    return model([n("Conv", ["x", "w"], ["y"])], {"x": [1, 4, 6, 6]}, {"y": [1, 8, 4, 5]}, {"w": w(8, 4, 3, 2)})


def conv_column_strided():
    """A (3, 1) kernel is squared with zero taps only where its unit axis has stride 1."""
    return model([n("Conv", ["x", "w"], ["y"], strides=[1, 2])], {"x": [1, 4, 6, 6]}, {"y": [1, 8, 4, 3]},
                 {"w": w(8, 4, 3, 1)})


def conv_stride_three():
    return model([n("Conv", ["x", "w"], ["y"], strides=[3, 3])], {"x": [1, 4, 9, 9]}, {"y": [1, 8, 3, 3]},
                 {"w": w(8, 4, 2, 2)})


def conv_dilated():
    return model([n("Conv", ["x", "w"], ["y"], dilations=[2, 2])], {"x": [1, 4, 9, 9]}, {"y": [1, 8, 5, 5]},
                 {"w": w(8, 4, 3, 3)})


def group_norm_shared_intermediate():
    m = group_norm(False)
    m.graph.output.append(helper.make_tensor_value_info("i", 1, [2, 4, 32]))  # InstanceNorm output escapes
    return m


def sub_from_a_constant():
    """1 - conv(x) between two convolutions: x - k maps onto SDAdd, k - x would need a negation."""
    return model([n("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), n("Sub", ["one", "c"], ["d"]),
                  n("Conv", ["d", "w2", "b"], ["y"], pads=[1, 1, 1, 1])], {"x": [1, 4, 6, 6]}, {"y": [1, 8, 6, 6]},
                 {"w": w(8, 4, 3, 3), "w2": w(8, 8, 3, 3), "b": w(8), "one": np.ones(1, np.float32)})


def attention_wrong_heads():
    """The output merge transposes the wrong axes: not a head merge."""
    m = attention("dynamo")
    for node in m.graph.node:
        if node.op_type == "Transpose" and list(node.attribute[0].ints) == [0, 2, 1, 3] and node.output[0] == "ot":
            del node.attribute[:]
            node.attribute.append(helper.make_attribute("perm", [0, 1, 2, 3]))
    return m


@pytest.mark.parametrize(
    ("build", "anchor_op", "reason"),
    [(conv_dynamic_weight, "Conv", "the weight is not a constant"),
     (conv_rectangular, "Conv", "kernel 3x2 is not square"),
     (conv_column_strided, "Conv", "kernel 3x1 is not square"),
     (conv_dilated, "Conv", "SDConv has none"),
     (conv_stride_three, "Conv", "stride 3: AMD's conv shapes have strides 1 and 2"),
     (group_norm_shared_intermediate, "InstanceNormalization", "is also used outside the pattern"),
     (attention_wrong_heads, "Softmax", "not merged back"),
     (sub_from_a_constant, "Sub", "Sub with the constant first (k - x)"),
     (lambda: attention("torchscript", mask="causal"), "MultiHeadAttention", "a causal mask varies per query"),
     # a mask the graph computes: the report names what it is computed from
     (lambda: attention("dynamo", mask="input"), "MultiHeadAttention", "computed, not a constant mask (from the "
      "graph input mask), and it varies per query"),
     (lambda: attention("dynamo", mask="position"), "MultiHeadAttention", "varies per query ([2, 4, 5, 5]: a "
      "constant [1, 4, 5, 5] position bias)"),
     (lambda: attention("torchscript", scale=0.3), "MultiHeadAttention", "is not 1/sqrt(4): the kernel has no scale"),
     (lambda: attention("torchscript", mask="softcap"), "Softmax", "the scores are soft-capped"),
     # on the CPU for its scale, its key row spread over the queries for onnxruntime's attention_bias
     (lambda: attention("torchscript", mask="keyrow", scale=0.3), "Expand", "the key mask spread over the queries"),
     (lambda: upsample(mode="linear"), "Resize", "only nearest"),
     (lambda: upsample(factor=3), "Resize", "is not a 2x upsampling")],
)
def test_near_miss_does_not_fuse_and_says_why(build, anchor_op, reason):
    """An attention the target cannot take (a causal mask, another scale) is one onnxruntime MultiHeadAttention
    on the CPU, with the reason; the other families' near misses keep their op."""
    m = build()
    irm = lowered(m)
    assert any(reason in why for why in declined(irm)), declined(irm)
    assert ops(irm)[anchor_op] >= 1
    assert_same(m, irm)


# --- InstanceNormalization as the GroupNorm it is ---------------------------------------------------------------------

def group_norm_learned_instance_scale(grouping: list[int] | None = None):
    """The GroupNorm spelling with a learned scale and bias on the InstanceNormalization (no exporter writes
    one)."""
    m = group_norm(False, grouping=grouping)
    for init in m.graph.initializer:
        if init.name in ("ones", "zeros"):
            init.CopyFrom(onnx.numpy_helper.from_array(w(init.dims[0]) + (init.name == "ones"), init.name))
    return m


@pytest.mark.parametrize("build", [
    group_norm_learned_instance_scale,
    # [2, 8, 4, 4] as [4, 4, -1]: 8 groups of a channel, row r reading the scale's r % 4
    lambda: group_norm_learned_instance_scale([4, 4, -1]),
    lambda: group_norm(False, grouping=[1, 1, -1]),  # one row over the whole batch: no GroupNorm of x
    lambda: group_norm(False, grouping=[2, 16, -1]),  # rows of half a channel
])
def test_the_instance_norm_goes_alone_where_the_affine_form_does_not_hold(build):
    """Where Reshape -> InstanceNormalization -> Reshape -> Mul -> Add is no GroupNorm of x with that affine, the
    InstanceNormalization is still the GroupNorm of its rows (a group a row, its own scale and bias repeated over
    a group's channels): SDGroupNorm, and the Mul and Add are element-wise ops (the glue's, or the CPU's where a
    Reshape of the rows stands between)."""
    m = build()
    irm = lowered(m)
    assert dispatch_ops(irm)["SDGroupNorm"] == 1 and not {"InstanceNormalization", "SDGemm"} & set(ops(irm))
    assert_same(m, irm)


def instance_norm(shape: list[int], scale: np.ndarray, bias: np.ndarray, silu: bool = False):
    nodes = [n("InstanceNormalization", ["x", "s", "b"], ["i" if silu else "y"], epsilon=1e-5)]
    if silu:
        nodes += [n("Sigmoid", ["i"], ["g"]), n("Mul", ["i", "g"], ["y"])]
    return model(nodes, {"x": shape}, {"y": shape}, {"s": scale, "b": bias})


def test_an_instance_norm_is_a_group_norm_of_one_group_a_channel():
    m = instance_norm([2, 8, 3, 5], w(8) + 1, w(8), silu=True)
    irm = lowered(m)
    assert dispatch_ops(irm) == {"SDGroupNorm": 1} and ops(irm)["Transpose"] == 2
    node = next(x for x in irm.graph if x.op_type == "SDGroupNorm")
    assert node.attributes["groups"].value == 8 and node.attributes["nonlinear"].value == "Silu"
    assert list(node.attributes["input_shape"].value) == [2, 3, 5, 8]
    assert_same(m, irm)


def test_an_instance_norm_of_one_channel_moves_nothing():
    """[B, 1, H, W] in NHWC is the same memory: a Reshape, not a Transpose, each side."""
    m = instance_norm([2, 1, 3, 5], np.ones(1, np.float32), np.zeros(1, np.float32))
    irm = lowered(m)
    assert dispatch_ops(irm) == {"SDGroupNorm": 1} and "Transpose" not in ops(irm)
    assert_same(m, irm)


# --- L2 and RMS norms written out -------------------------------------------------------------------------------------

def l2_norm(shape: list[int], axes: list[int], root: str = "ReduceL2", clamp: str = "Clip", eps: float = 1e-12,
            expand: bool = True, after: list[tuple[str, np.ndarray]] = (), numerator: str = "x"):
    """x / clamp(||x||, eps) as F.normalize exports it (ReduceL2, Clip, Expand, Div), and its neighbours: the root
    as Sqrt(ReduceSum(x * x)) or Sqrt(ReduceMean(x * x)) (an RMS norm), eps by Max or added, constants after."""
    inits = {"axes": np.array(axes), "eps": np.array(eps, np.float32), "shape": np.array(shape)}
    if root == "ReduceL2":
        nodes = [n("ReduceL2", ["x", "axes"], ["r"], keepdims=1)]
    else:
        nodes = [n("Mul", ["x", "x"], ["sq"]), n(root, ["sq", "axes"], ["m"], keepdims=1), n("Sqrt", ["m"], ["r"])]
    nodes.append(n(clamp, ["r", "eps"], ["c"]))
    nodes += [n("Expand", ["c", "shape"], ["d"])] if expand else [n("Identity", ["c"], ["d"])]
    nodes.append(n("Div", [numerator, "d"], ["y0"]))
    for i, (op, value) in enumerate(after):
        inits[f"k{i}"] = value
        nodes.append(n(op, [f"y{i}", f"k{i}"], [f"y{i + 1}"]))
    nodes.append(n("Identity", [f"y{len(after)}"], ["y"]))
    inputs = {"x": shape} | ({numerator: shape} if numerator != "x" else {})
    return model(nodes, inputs, {"y": shape}, inits)


@pytest.mark.parametrize(("build", "expected"), [
    (lambda: l2_norm([2, 5, 8], [-1]), {"SDRMSNorm": 1}),
    (lambda: l2_norm([2, 8, 3, 5], [1]), {"SDRMSNorm": 1}),  # over the channels: NHWC's last axis
    (lambda: l2_norm([2, 8, 3, 5], [1], root="ReduceSum", clamp="Max", expand=False), {"SDRMSNorm": 1}),
    (lambda: l2_norm([2, 5, 8], [2], clamp="Add", eps=1e-8), {"SDRMSNorm": 1}),  # eps outside, small
    (lambda: l2_norm([2, 5, 8], [-1], root="ReduceMean", clamp="Add", eps=1e-8), {"SDRMSNorm": 1}),
    (lambda: l2_norm([2, 5, 8], [-1], root="ReduceMean", clamp="Max", eps=1e-6), {"SDRMSNorm": 1}),
    # Qwen-Image's RMS_norm: F.normalize(x, dim=1) * sqrt(C) * gamma [C, 1, 1, 1], one SDRMSNorm scaled by gamma
    (lambda: l2_norm([1, 8, 1, 3, 5], [1], after=[("Mul", np.array(8 ** 0.5, np.float32)),
                                                  ("Mul", w(8, 1, 1, 1) + 1)]), {"SDRMSNorm": 1}),
    # another scalar, or a gamma without sqrt(D): the norm alone (its 1/sqrt(D) as its weight) and SDMul
    (lambda: l2_norm([2, 5, 8], [-1], after=[("Mul", np.array(3.0, np.float32))]), {"SDRMSNorm": 1, "SDMul": 1}),
    (lambda: l2_norm([2, 5, 8], [-1], after=[("Mul", w(8) + 1)]), {"SDRMSNorm": 1, "SDMul": 1}),
])
def test_an_l2_norm_is_an_rms_norm_scaled_by_the_root_of_its_width(build, expected):
    m = build()
    irm = lowered(m)
    assert dispatch_ops(irm) == expected, ops(irm)
    assert not {"ReduceL2", "ReduceSum", "ReduceMean", "Clip", "Max", "Expand", "Div", "Sqrt"} & set(ops(irm))
    assert_same(m, irm)


def test_qwen_images_scale_and_gamma_are_the_rms_norms_weight():
    m = l2_norm([1, 8, 1, 3, 5], [1], after=[("Mul", np.array(8 ** 0.5, np.float32)), ("Mul", w(8, 1, 1, 1) + 1)])
    irm = lowered(m)
    node = next(x for x in irm.graph if x.op_type == "SDRMSNorm")
    gamma = onnx.numpy_helper.to_array(next(i for i in m.graph.initializer if i.name == "k1")).reshape(8)
    np.testing.assert_array_equal(node.inputs[1].const_value.numpy(), gamma)
    assert list(node.attributes["input_shape"].value) == [1, 3, 5, 8]  # [B, T*H, W, C]
    assert node.attributes["epsilon"].value == pytest.approx(1e-24 / 8, rel=1e-6)  # (1e-12)^2 / D: no underflow


@pytest.mark.parametrize(("build", "anchor_op", "reason"), [
    (lambda: l2_norm([2, 8, 3, 5], [2]), "ReduceL2", "normalizes axis 2 of [2, 8, 3, 5]"),
    (lambda: l2_norm([2, 8, 3, 5], [1, 2]), "ReduceL2", "the norm reduces axes [1, 2]"),
    # eps outside the root where it is not negligible: sqrt(mean) + 0.1 vs sqrt(mean + 0.01)
    (lambda: l2_norm([2, 5, 8], [-1], root="ReduceMean", clamp="Add", eps=0.1), "Sqrt", "outside the square root"),
    (lambda: l2_norm([2, 5, 8], [-1], eps=0.5), "Clip", "outside the square root"),
    # added, eps moves the result by eps / |x|: 1e-6 is beyond bf16's rounding for norms below 5.1e-4
    (lambda: l2_norm([2, 5, 8], [-1], clamp="Add", eps=1e-6), "Add", "for norms below 512 x eps = 0.00051"),
    (lambda: l2_norm([2, 5, 8], [-1], eps=1e-30), "Clip", "below float32's range"),
])
def test_a_norm_sdrmsnorm_does_not_compute_says_why(build, anchor_op, reason):
    m = build()
    irm = lowered(m)
    assert "SDRMSNorm" not in dispatch_ops(irm) and ops(irm)[anchor_op] == 1
    assert any(reason in why for why in declined(irm)), declined(irm)
    assert_same(m, irm)


def test_a_norm_of_another_tensor_is_no_norm():
    """y / ||x||: the numerator is not what was reduced."""
    m = l2_norm([2, 5, 8], [-1], numerator="z")
    irm = lowered(m)
    assert "SDRMSNorm" not in dispatch_ops(irm) and ops(irm)["ReduceL2"] == 1
    assert_same(m, irm)


# --- the norms as torch's exporters write them ------------------------------------------------------------------------

class _Fn(torch.nn.Module):
    def __init__(self, fn, **params: torch.Tensor) -> None:
        super().__init__()
        self.fn = fn
        self.p = torch.nn.ParameterDict({k: torch.nn.Parameter(v) for k, v in params.items()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.p)


def _qwen_rms(images: bool) -> torch.nn.Module:
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageRMS_norm  # diffusers: only here

    return QwenImageRMS_norm(8, images=images)


def _gamma(c: int, rank: int) -> torch.Tensor:
    return 1 + 0.3 * torch.randn(c, *[1] * (rank - 2), generator=torch.Generator().manual_seed(1))


TORCH_NORMS = {  # name: (module, input shape, the dispatch ops, or a reason)
    "InstanceNorm2d(affine)": (lambda: torch.nn.InstanceNorm2d(8, affine=True), (2, 8, 4, 4), {"SDGroupNorm": 1}),
    "InstanceNorm2d": (lambda: torch.nn.InstanceNorm2d(8), (2, 8, 4, 4), {"SDGroupNorm": 1}),
    "InstanceNorm1d(affine) of a flattened image": (
        lambda: _Fn(lambda x, p: F.instance_norm(x.flatten(2), weight=p["w"], bias=p["b"]),
                    w=_gamma(8, 2), b=0.3 * torch.ones(8)), (2, 8, 4, 4), {"SDGroupNorm": 1}),
    "InstanceNorm3d(affine)": (lambda: torch.nn.InstanceNorm3d(8, affine=True), (1, 8, 2, 4, 4), {"SDGroupNorm": 1}),
    "GroupNorm + SiLU": (lambda: torch.nn.Sequential(torch.nn.GroupNorm(4, 8), torch.nn.SiLU()), (2, 8, 4, 4),
                         {"SDGroupNorm": 1}),
    "GroupNorm of frames (SVD's temporal resnets)": (lambda: torch.nn.GroupNorm(4, 8), (1, 8, 2, 4, 4),
                                                     {"SDGroupNorm": 1}),
    "F.normalize(dim=1)": (lambda: _Fn(lambda x, p: F.normalize(x, dim=1)), (2, 8, 4, 4), {"SDRMSNorm": 1}),
    "F.normalize(dim=-1)": (lambda: _Fn(lambda x, p: F.normalize(x, dim=-1)), (2, 5, 8), {"SDRMSNorm": 1}),
    "QwenImageRMS_norm (video)": (lambda: _qwen_rms(False), (1, 8, 1, 4, 4), {"SDRMSNorm": 1}),
    "QwenImageRMS_norm (image)": (lambda: _qwen_rms(True), (1, 8, 4, 4), {"SDRMSNorm": 1}),
    "RMS norm over channels": (
        lambda: _Fn(lambda x, p: x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6) * p["g"], g=_gamma(8, 4)),
        (2, 8, 4, 4), {"SDRMSNorm": 1}),
    "x / max(|x|, eps)": (lambda: _Fn(lambda x, p: x / torch.maximum(x.norm(dim=-1, keepdim=True),
                                                                     torch.tensor(1e-8))), (2, 5, 8), {"SDRMSNorm": 1}),
    "x / (|x| + eps)": (lambda: _Fn(lambda x, p: x / (x.norm(dim=-1, keepdim=True) + 1e-8)), (2, 5, 8),
                        {"SDRMSNorm": 1}),
    # near misses
    "F.normalize(dim=2)": (lambda: _Fn(lambda x, p: F.normalize(x, dim=2)), (2, 8, 4, 4), "normalizes axis 2"),
    "x / |x| over two axes": (lambda: _Fn(lambda x, p: x / x.norm(dim=(1, 2), keepdim=True).clamp_min(1e-12)),
                              (2, 8, 4, 4), "the norm reduces axes [1, 2]"),
    "x / (rms(x) + 0.1)": (lambda: _Fn(lambda x, p: x / (x.pow(2).mean(-1, keepdim=True).sqrt() + 0.1)), (2, 5, 8),
                           "outside the square root"),
}


def _seeded(module: torch.nn.Module) -> torch.nn.Module:
    """Every affine parameter drawn (torch starts them at ones and zeros, which would hide a lost weight)."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return module.eval()


def _export(name: str, exporter: str, path, table: dict | None = None) -> onnx.ModelProto:
    """The module ``table[name]`` (``TORCH_NORMS`` by default) exported, every value's shape inferred (the bf16
    check perturbs each value, so it needs them; TorchScript writes none)."""
    build, shape, _ = (TORCH_NORMS if table is None else table)[name]
    module, x = _seeded(build()), torch.randn(shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if exporter == "dynamo":
            torch.onnx.export(module, (x,), dynamo=True, opset_version=18, input_names=["x"], output_names=["y"],
                              verbose=False, report=False).save(str(path))
        else:
            torch.onnx.export(module, (x,), str(path), dynamo=False, opset_version=17, input_names=["x"],
                              output_names=["y"])
    return onnx.shape_inference.infer_shapes(onnx.load(str(path)), strict_mode=True, data_prop=True)


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("name", list(TORCH_NORMS))
def test_the_norms_torch_exports_fuse_or_say_why(name, exporter, tmp_path):
    """Each module exported by torch (dynamo at opset 18, TorchScript at 17): the norm is one dispatch op whose
    numbers are the graph's (fp32 before the precision pass; the whole compile within bf16's tolerance, onnx's
    full check at every stage), or it stays as written with the reason. (Qwen-Image's ``+ self.bias`` of 0.0 is an
    Add of its own, the glue's.)"""
    m = _export(name, exporter, tmp_path / "m.onnx")
    expected = TORCH_NORMS[name][2]
    irm = lowered(m)
    norms = {k: v for k, v in dispatch_ops(irm).items() if k in ("SDRMSNorm", "SDGroupNorm")}
    if isinstance(expected, str):
        assert not norms, ops(irm)
        assert any(expected in why for why in declined(irm)), declined(irm)
    else:
        assert norms == expected and not {"SDGemm", "SDMul"} & set(ops(irm)), ops(irm)
        norms = {"InstanceNormalization", "ReduceL2", "ReduceMean", "ReduceSum", "Clip", "Max", "Div", "Sqrt", "Pow"}
        assert not norms & set(ops(irm)), ops(irm)
    assert_same(m, irm)
    check(m, "bf16")


# --- the video convolutions as torch's exporters write them (issue 42): a 2-D conv over a view ------------------------

class _Causal(torch.nn.Module):
    """Wan's / Qwen-Image's CausalConv3d: ``F.pad`` with the temporal padding all in front, then Conv3d."""

    def __init__(self, channels: int, frames_pad: int, groups: int = 1) -> None:
        super().__init__()
        self.conv = torch.nn.Conv3d(channels, 8, 3, groups=groups)
        self.pad = (1, 1, 1, 1, frames_pad, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, self.pad))


class _Replicated(torch.nn.Module):
    """CogVideoX's CausalConv3d: ``torch.cat([x[:, :, :1]] * (k - 1) + [x], dim=2)``, then Conv3d padded on H, W."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv3d(8, 8, 3, padding=(0, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([x[:, :, :1]] * 2 + [x], dim=2))


def _causal(channels: int, frames_pad: int, groups: int = 1) -> torch.nn.Module:
    return _Causal(channels, frames_pad, groups)


TORCH_CONVS = {  # name: (module, input shape, the ops left beside the SDConvs, or a reason)
    "Conv3d (1, 3, 3) over frames": (lambda: torch.nn.Conv3d(8, 8, (1, 3, 3), padding=(0, 1, 1)), (1, 8, 3, 4, 4),
                                     {"Transpose", "Reshape"}),
    "Conv3d (3, 1, 1) over frames (SVD's temporal resnets)": (
        lambda: torch.nn.Conv3d(8, 8, (3, 1, 1), padding=(1, 0, 0)), (1, 8, 2, 4, 4), {"Transpose", "Reshape"}),
    "causal Conv3d over one frame (Wan, Qwen-Image)": (lambda: _causal(8, 2), (1, 8, 1, 4, 4),
                                                       {"Transpose", "Reshape"}),
    "causal Conv3d over two frames (frames in channels)": (lambda: _causal(8, 2), (1, 8, 2, 4, 4),
                                                           {"Transpose", "Reshape"}),
    "CogVideoX's causal Conv3d (the first frame repeated in front)": (lambda: _Replicated(), (1, 8, 2, 4, 4),
                                                                         {"Transpose", "Reshape"}),
    "Conv1d (k=1)": (lambda: torch.nn.Conv1d(8, 8, 1), (2, 8, 5), {"Transpose", "Reshape"}),
    "Conv1d (k=3)": (lambda: torch.nn.Conv1d(8, 8, 3, padding=1), (2, 8, 5), {"Transpose", "Reshape"}),
    # near misses
    "Conv3d (3, 3, 3) over eight frames": (lambda: torch.nn.Conv3d(8, 8, 3, padding=1), (1, 8, 8, 4, 4),
                                           "it would take 2.9x its multiply-accumulates"),
    "grouped causal Conv3d over two frames": (lambda: _causal(8, 2, groups=2), (1, 8, 2, 4, 4),
                                              "with groups the frames cannot be stacked"),
}


def _export_conv(name: str, exporter: str, path) -> onnx.ModelProto:
    return _export(name, exporter, path, TORCH_CONVS)


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("name", list(TORCH_CONVS))
def test_the_video_convs_torch_exports_fuse_or_say_why(name, exporter, tmp_path):
    """Each module exported by torch: the Conv3d / Conv1d is one SDConv (a 2-D conv over a view of its input,
    ``passes.canonical.convs``) with only movement at the graph's edges beside it, and the graph's numbers (fp32
    before precision; the whole compile within bf16's tolerance, onnx's full check at every stage); or it stays
    as written with the reason."""
    m = _export_conv(name, exporter, tmp_path / "m.onnx")
    expected = TORCH_CONVS[name][2]
    irm = lowered(m)
    if isinstance(expected, str):
        assert "SDConv" not in ops(irm) and ops(irm)["Conv"] == 1, ops(irm)
        assert any(expected in why for why in declined(irm)), declined(irm)
    else:
        assert dispatch_ops(irm) == {"SDConv": 1}, ops(irm)
        assert set(ops(irm)) - {"SDConv"} <= expected, ops(irm)
    assert_same(m, irm)
    # the bf16 check reads every value's shape from onnx's inference, which cannot see through TorchScript's pads
    # computed in float (ConstantOfShape ... Cast): it checks the graph with its constants folded; the rewrite
    # above read them as exported
    check(_folded(m) if exporter == "torchscript" else m, "bf16")


def _folded(m: onnx.ModelProto) -> onnx.ModelProto:
    irm = to_ir(m)
    for step in (constants.lift_constants, constants.infer_shapes, constants.fold_constants, constants.infer_shapes,
                 constants.fold_small, sweep):
        step(irm)
    return onnx.shape_inference.infer_shapes(to_proto(irm), strict_mode=True, data_prop=True)


# --- grouped and transposed convolutions as torch's exporters write them (issue 42) -----------------------------------

class _ConvNeXt(torch.nn.Module):
    """Stable Cascade's SDCascadeResBlock's start: a depthwise conv, then the channels permuted last for a Linear."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.depthwise = torch.nn.Conv2d(channels, channels, 3, padding=1, groups=channels)
        self.linear = torch.nn.Linear(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.depthwise(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


TORCH_GROUPED = {  # name: (module, input shape, {dispatch op: count}, or a reason)
    "grouped Conv2d, 2 groups, stride 2": (lambda: torch.nn.Conv2d(8, 16, 3, stride=2, padding=1, groups=2),
                                           (1, 8, 6, 6), {"SDConv": 1}),
    "ConvTranspose2d k2 s2 (Kandinsky 3's upsampling)": (lambda: torch.nn.ConvTranspose2d(8, 4, 2, stride=2),
                                                          (1, 8, 3, 5), {"SDConv": 2, "SDConcat": 1}),
    "ConvTranspose2d k3 s3, no bias": (lambda: torch.nn.ConvTranspose2d(8, 4, 3, stride=3, bias=False),
                                       (1, 8, 2, 3), {"SDConv": 3, "SDConcat": 2}),
    "ConvTranspose2d k1 s1": (lambda: torch.nn.ConvTranspose2d(8, 4, 1), (1, 8, 3, 3), {"SDConv": 1}),
    # near misses
    "depthwise Conv2d (Stable Cascade's ResBlock)": (lambda: torch.nn.Conv2d(8, 8, 3, padding=1, groups=8),
                                                     (1, 8, 5, 5), "8 times the grouped conv's multiply-accumulates"),
    "grouped Conv2d, 4 groups": (lambda: torch.nn.Conv2d(8, 8, 3, padding=1, groups=4), (1, 8, 5, 5),
                                 "group=4: SDConv has no groups"),
    "depthwise Conv2d over 704 channels": (lambda: torch.nn.Conv2d(704, 704, 3, padding=1, groups=704),
                                           (1, 704, 2, 2), "group=704: SDConv has no groups"),
    "ConvTranspose2d k4 s2 p1 (overlapping windows)": (
        lambda: torch.nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1), (1, 8, 3, 3),
        "only a square kernel equal to its stride (non-overlapping windows), unpadded"),
    "grouped ConvTranspose2d k2 s2": (lambda: torch.nn.ConvTranspose2d(8, 8, 2, stride=2, groups=2), (1, 8, 3, 3),
                                      "group 2: the target has no transposed conv"),
}


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("name", list(TORCH_GROUPED))
def test_the_grouped_and_transposed_convs_torch_exports_fuse_or_say_why(name, exporter, tmp_path):
    """A grouped conv of 2 groups is the dense SDConv with a block-diagonal weight (twice its MACs, the bound; a
    depthwise conv would be C times them: declined with the reason); a
    ConvTranspose whose kernel is its stride is s 1x1 SDConvs, one a row phase, and their SDConcat: no CPU node
    but the graph's edge Transposes. Every other one keeps its op with the reason. The numbers are the graph's
    (fp32 before precision; the whole compile within bf16's tolerance, onnx's full check at every stage)."""
    m = _export(name, exporter, tmp_path / "m.onnx", TORCH_GROUPED)
    expected = TORCH_GROUPED[name][2]
    irm = lowered(m)
    if isinstance(expected, str):
        assert not dispatch_ops(irm), ops(irm)
        assert any(expected in why for why in declined(irm)), declined(irm)
    else:
        assert dispatch_ops(irm) == expected, ops(irm)
        assert set(ops(irm)) - set(expected) <= {"Transpose", "Reshape"}, ops(irm)
    assert_same(m, irm, atol=1e-4)
    check(_folded(m) if exporter == "torchscript" else m, "bf16")


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_a_depthwise_conv_past_the_dense_bound_is_one_cpu_island(exporter, tmp_path):
    """Stable Cascade's ResBlock (here 704 channels; as a dense conv 704 times the MACs and past the weight
    bound), after a 1x1 conv: the depthwise conv stays on the CPU with the registry's reason, its layout Transposes and
    casts beside it in one CPU island between the NPU's convolution and Linear."""
    block = {"ConvNeXt block": (lambda: torch.nn.Sequential(torch.nn.Conv2d(8, 704, 1), _ConvNeXt(704)),
                                (1, 8, 2, 2), None)}
    m = _export("ConvNeXt block", exporter, tmp_path / "m.onnx", block)
    irm = to_ir(m)
    records = compile_model(irm, CompileOptions())
    counts = next(r.result.counts for r in records if r.name == "partition")
    assert counts["CPU islands around ops the registry lacks"] == 1 and counts["CPU islands avoidable"] == 0, counts
    assert ops(irm)["Conv"] == 1 and dispatch_ops(irm) == {"SDConv": 1, "SDGemm": 1}, ops(irm)
    assert any("group=704: SDConv has no groups" in why for why in declined(irm)), declined(irm)


class _MaskedCrossAttention(torch.nn.Module):
    """diffusers' Attention over a caption with its padding mask as Kandinsky 3 and diffusers' UNets give it:
    ``(1 - mask) * -10000`` over the keys, which ``prepare_attention_mask`` repeats over the heads and views as
    [B, H, 1, N] (TorchScript writes the repeat; dynamo's graph broadcasts)."""

    def __init__(self) -> None:
        from diffusers.models.attention_processor import Attention

        super().__init__()
        self.attention = Attention(32, 24, heads=2, dim_head=16, out_bias=False)

    def forward(self, x, context, mask):
        bias = ((1 - mask) * -10000.0).unsqueeze(1)
        return self.attention(x, context, bias)


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_a_caption_mask_repeated_over_the_heads_rides_in_q_and_k_in_both_exporters(exporter, tmp_path):
    """The caption's padding mask is one row over the keys per batch, however the exporter repeats it over the
    heads: the attention is an SDFlatMHA with the mask as a key channel (one Expand over the heads on the CPU),
    no MultiHeadAttention left on the CPU; the numbers are the graph's."""
    module = _seeded(_MaskedCrossAttention())
    mask = torch.ones(1, 6)
    mask[:, 4:] = 0
    args = (torch.randn(1, 10, 32, generator=torch.Generator().manual_seed(0)),
            torch.randn(1, 6, 24, generator=torch.Generator().manual_seed(1)), mask)
    path = tmp_path / "m.onnx"
    with torch.no_grad():
        if exporter == "dynamo":
            torch.onnx.export(module, args, dynamo=True, opset_version=20, input_names=["x", "context", "mask"],
                              output_names=["y"], verbose=False, report=False).save(str(path))
        else:
            torch.onnx.export(module, args, str(path), dynamo=False, opset_version=20,
                              input_names=["x", "context", "mask"], output_names=["y"])
    m = onnx.shape_inference.infer_shapes(onnx.load(str(path)), strict_mode=True, data_prop=True)
    irm = lowered(m)
    assert dispatch_ops(irm).get("SDFlatMHA") == 1 and "MultiHeadAttention" not in ops(irm), ops(irm)
    assert any("key mask over the heads" in why for why in declined(irm)), declined(irm)
    feeds = {"x": args[0].numpy(), "context": args[1].numpy(), "mask": mask.numpy()}
    want = run(m, feeds)[0]
    got = run(with_functions(irm, TARGET), feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


class _FilledMaskAttention(torch.nn.Module):
    """diffusers' Attention over a caption whose padding mask is a ``torch.where`` of a fill (transformers'
    ``finfo.min``, or -inf) per key, as [B, 1, N] (``prepare_attention_mask`` repeats it over the heads); or,
    with no fill, the mask input is that additive row itself (its values not in the graph)."""

    def __init__(self, fill: float | None) -> None:
        from diffusers.models.attention_processor import Attention

        super().__init__()
        self.fill = fill
        self.attention = Attention(32, 24, heads=2, dim_head=16, out_bias=False)

    def forward(self, x, context, mask):
        bias = mask if self.fill is None else torch.where(mask > 0.5, 0.0, self.fill)
        return self.attention(x, context, bias[:, None, :])


def _filled_mask_export(fill: float | None, args: tuple, path) -> onnx.ModelProto:
    torch.manual_seed(0)  # the Linear layers' own draws too: the modules of every fill have one set of weights
    module = _seeded(_FilledMaskAttention(fill))
    with torch.no_grad():
        torch.onnx.export(module, args, dynamo=True, opset_version=20, input_names=["x", "context", "mask"],
                          output_names=["y"], verbose=False, report=False).save(str(path))
    return onnx.load(str(path))


@pytest.mark.parametrize("fill", ["finfo.min", "-inf", "input"])
def test_a_caption_mask_that_masks_every_key_keeps_the_graphs_numbers(fill, tmp_path):
    """A batch row whose caption is all padding. With the fill finfo.min the graph weighs every key alike (a
    finite mean), which the key channel must keep (2 sqrt(d) times finfo.min overflowed to -inf and made it
    NaN): one Max raises the row to what the channel holds as it spreads it over the heads. A Where of 0 and
    -inf has nothing to raise (an Expand, as before) and its row stays the graph's NaN. A row given as an input
    (its values unknown) is raised, -inf too, with no NaN guard to read it: that row is the finfo.min graph's
    mean (``attention_masks._mask_floor``). The other row is the graph's in all three."""
    mask = torch.ones(2, 6)
    mask[0, 4:] = 0
    mask[1] = 0
    args = (torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(0)),
            torch.randn(2, 6, 24, generator=torch.Generator().manual_seed(1)), mask)
    finite = _filled_mask_export(float(np.finfo(np.float32).min), args, tmp_path / "finite.onnx")
    feeds = {"x": args[0].numpy(), "context": args[1].numpy(), "mask": mask.numpy()}
    want_finite = run(finite, feeds)[0]
    if fill == "input":
        additive = torch.where(mask > 0.5, 0.0, float("-inf"))
        m = _filled_mask_export(None, (*args[:2], additive), tmp_path / "input.onnx")
        feeds["mask"] = additive.numpy()
    else:
        m = finite if fill == "finfo.min" else _filled_mask_export(float("-inf"), args, tmp_path / "inf.onnx")
    irm = lowered(m)
    assert dispatch_ops(irm).get("SDFlatMHA") == 1 and "MultiHeadAttention" not in ops(irm), ops(irm)
    raised = fill != "-inf"
    assert ops(irm).get("Max", 0) == int(raised) and ops(irm).get("Expand", 0) == int(not raised), ops(irm)
    want, got = run(m, feeds)[0], run(with_functions(irm, TARGET), feeds)[0]
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-4)
    assert np.isnan(want[1]).all() == (fill != "finfo.min")
    if fill == "-inf":
        assert np.isnan(got[1]).all()
    else:
        np.testing.assert_allclose(got[1], want_finite[1], rtol=1e-4, atol=1e-4)


class _SequenceFirstAttention(torch.nn.Module):
    """torch's ``MultiheadAttention`` as HunyuanDiT's attention pool calls it: sequence first ([S, B, C]), one
    query (the tokens' mean) over the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(24, 2)

    def forward(self, x):
        x = x.permute(1, 0, 2)
        x = torch.cat([x.mean(dim=0, keepdim=True), x], dim=0)
        return self.attention(x[:1], x, x, need_weights=False)[0]


@pytest.mark.parametrize("batch", [1, 2])
def test_a_sequence_first_attention_of_batch_one_is_its_batch_first_view(batch, tmp_path):
    """[S, 1, C] is the [1, S, C] it views: the head split of torch's sequence-first attention (q, k, v viewed
    [S, B * H, D], the heads moved first) is an SDFlatMHA at batch 1, its numbers the graph's. At batch 2 the
    heads interleave the batch (no view of [B, S, C] splits so): the products stay, saying why."""
    module = _seeded(_SequenceFirstAttention()).eval()
    x = torch.randn(batch, 7, 24, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "m.onnx"
    with torch.no_grad():
        torch.onnx.export(module, (x,), dynamo=True, opset_version=20, input_names=["x"], output_names=["y"],
                          verbose=False, report=False).save(str(path))
    m = onnx.load(str(path))
    irm = lowered(m)
    if batch == 2:
        assert "SDFlatMHA" not in dispatch_ops(irm)
        assert any("not a split into 2 heads" in why for why in declined(irm)), declined(irm)
        return
    assert dispatch_ops(irm).get("SDFlatMHA") == 1 and "Softmax" not in ops(irm), ops(irm)
    feeds = {"x": x.numpy()}
    np.testing.assert_allclose(run(with_functions(irm, TARGET), feeds)[0], run(m, feeds)[0], rtol=1e-4, atol=1e-5)
