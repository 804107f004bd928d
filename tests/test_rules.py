"""Each fusion rule on tiny graphs: what must fuse (and computes the same), what must not (and why)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from sdnpu.passes.canonicalize import canonicalize
from sdnpu.passes.fuse import fuse
from sdnpu.passes.rules.attention import SDMHAFusion
from sdnpu.passes.rules.base import RuleStats, apply_rules
from sdnpu.passes.rules.conv import SDConvFusion
from sdnpu.passes.rules.norm import SDGroupNormFusion
from sdnpu.passes.rules.resize import SDResizeFusion

from .graphs import feeds_for, model, ops, run, to_ir, with_functions

R = np.random.default_rng(0)


def w(*shape: int) -> np.ndarray:
    return (R.standard_normal(shape) * 0.2).astype(np.float32)


def n(op: str, ins: list[str], outs: list[str], **attrs) -> object:
    return helper.make_node(op, ins, outs, **attrs)


def _fused(m):
    irm = to_ir(m)
    canonicalize(irm)
    result = fuse(irm)
    return irm, result


def assert_same(m, irm, atol: float = 1e-5) -> None:
    """The fused model computes what the original did (fp32: fusion changes no precision)."""
    feeds = feeds_for(m)
    for a, b in zip(run(m, feeds), run(with_functions(irm), feeds), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=atol)


# ---- graphs as the exporters write them ----------------------------------------------------------------

def conv_silu():
    return model([n("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), n("Sigmoid", ["c"], ["s"]),
                  n("Mul", ["c", "s"], ["y"])], {"x": [1, 4, 6, 6]}, {"y": [1, 8, 6, 6]},
                 {"w": w(8, 4, 3, 3), "b": w(8)})


def group_norm(silu: bool, rank: int = 4):
    shape = [2, 8, 4, 4] if rank == 4 else [2, 8, 16]
    bshape = [8, 1, 1] if rank == 4 else [8, 1]
    nodes = [n("Reshape", ["x", "g_shape"], ["r"]),
             n("InstanceNormalization", ["r", "ones", "zeros"], ["i"], epsilon=1e-5),
             n("Reshape", ["i", "x_shape"], ["r2"]), n("Mul", ["r2", "gamma"], ["m"]), n("Add", ["m", "beta"], ["y0"])]
    if silu:
        nodes += [n("Sigmoid", ["y0"], ["s"]), n("Mul", ["y0", "s"], ["y"])]
    else:
        nodes += [n("Identity", ["y0"], ["y"])]
    return model(nodes, {"x": shape}, {"y": shape},
                 {"g_shape": np.array([0, 4, -1]), "x_shape": np.array(shape), "ones": np.ones(4, np.float32),
                  "zeros": np.zeros(4, np.float32), "gamma": w(*bshape) + 1, "beta": w(*bshape)})


def attention(variant: str):
    """Self-attention over x [2, 5, 16] with 4 heads, spelled as dynamo or TorchScript write it."""
    b, s, c, h, d = 2, 5, 16, 4, 4
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
        inits["scale"] = np.array(d ** -0.5, np.float32)
        nodes += [n("Transpose", ["kh"], ["kt"], perm=[0, 1, 3, 2]), n("MatMul", ["qh", "kt"], ["sc0"]),
                  n("Mul", ["sc0", "scale"], ["sc"])]
    nodes += [n("Softmax", ["sc"], ["p"], axis=-1), n("MatMul", ["p", "vh"], ["o"]),
              n("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]), n("Reshape", ["ot", "merge"], ["y"])]
    return model(nodes, {"x": [b, s, c]}, {"y": [b, s, c]}, inits)


def linear():
    return model([n("MatMul", ["x", "w"], ["m"]), n("Add", ["m", "b"], ["y0"]),
                  n("Gemm", ["t", "w2", "b2"], ["y1"], transB=1)],
                 {"x": [2, 5, 8], "t": [2, 8]}, {"y0": [2, 5, 6], "y1": [2, 3]},
                 {"w": w(8, 6), "b": w(6), "w2": w(3, 8), "b2": w(3)})


def geglu():
    return model([n("Split", ["x"], ["h", "g"], axis=-1, num_outputs=2), n("Gelu", ["g"], ["gg"]),
                  n("Mul", ["h", "gg"], ["y"])], {"x": [2, 5, 8]}, {"y": [2, 5, 4]})


def layer_norm():
    return model([n("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1, epsilon=1e-5)], {"x": [2, 5, 8]},
                 {"y": [2, 5, 8]}, {"g": w(8) + 1, "b": w(8)})


def upsample():
    return model([n("Resize", ["x", "", "scales"], ["y"], mode="nearest", nearest_mode="floor",
                    coordinate_transformation_mode="asymmetric")], {"x": [1, 4, 3, 3]}, {"y": [1, 4, 6, 6]},
                 {"scales": np.array([1, 1, 2, 2], np.float32)})


@pytest.mark.parametrize(
    ("build", "expected"),
    [(conv_silu, {"SDConv": 1}),
     (lambda: group_norm(True), {"SDGroupNorm": 1}),
     (lambda: group_norm(False), {"SDGroupNorm": 1}),
     (lambda: group_norm(True, rank=3), {"SDGroupNorm": 1}),
     (lambda: attention("dynamo"), {"SDMHA": 1, "SDGemm": 3}),
     (lambda: attention("torchscript"), {"SDMHA": 1, "SDGemm": 3}),
     (linear, {"SDGemm": 2}),
     (geglu, {"SDGeGLU": 1}),
     (layer_norm, {"SDLayerNorm": 1}),
     (upsample, {"SDResize": 1})],
)
def test_rule_fires_and_keeps_numbers(build, expected):
    m = build()
    irm, _ = _fused(m)
    counts = ops(irm)
    for op, count in expected.items():
        assert counts[op] == count, counts
    leftovers = {"Conv", "InstanceNormalization", "Softmax", "Gemm", "LayerNormalization", "Gelu", "Resize", "Sigmoid"}
    assert not leftovers & set(counts), counts
    assert_same(m, irm)


def test_conv_absorbs_silu_and_groupnorm_too():
    irm, result = _fused(conv_silu())
    node = next(x for x in irm.graph if x.op_type == "SDConv")
    assert node.attributes["silu"].value == 1 and node.metadata_props["sdnpu.rule"] == "SDConvFusion"
    irm, _ = _fused(group_norm(True))
    assert next(x for x in irm.graph if x.op_type == "SDGroupNorm").attributes["silu"].value == 1


def test_mha_scale_is_the_product_of_every_scalar():
    for variant in ("dynamo", "torchscript"):
        irm, _ = _fused(attention(variant))
        node = next(x for x in irm.graph if x.op_type == "SDMHA")
        assert node.attributes["scale"].value == pytest.approx(0.5)  # 1/sqrt(4)
        assert list(node.attributes["num_heads"].value) == [4]


# ---- near misses: must not fuse, and say why ---------------------------------------------------------

def conv_dynamic_weight():
    return model([n("Conv", ["x", "w"], ["y"])], {"x": [1, 4, 6, 6], "w": [8, 4, 3, 3]}, {"y": [1, 8, 4, 4]})


def conv_big_kernel():
    return model([n("Conv", ["x", "w"], ["y"])], {"x": [1, 4, 12, 12]}, {"y": [1, 8, 4, 4]}, {"w": w(8, 4, 9, 9)})


def group_norm_shared_intermediate():
    m = group_norm(False)
    m.graph.output.append(helper.make_tensor_value_info("i", 1, [2, 4, 32]))  # InstanceNorm output escapes
    return m


def group_norm_learned_instance_scale():
    m = group_norm(False)
    for init in m.graph.initializer:
        if init.name == "ones":
            init.CopyFrom(onnx.numpy_helper.from_array(np.full(4, 2.0, np.float32), "ones"))
    return m


def attention_wrong_heads():
    """The output merge transposes the wrong axes: not a head merge."""
    m = attention("dynamo")
    for node in m.graph.node:
        if node.op_type == "Transpose" and list(node.attribute[0].ints) == [0, 2, 1, 3] and node.output[0] == "ot":
            del node.attribute[:]
            node.attribute.append(helper.make_attribute("perm", [0, 1, 2, 3]))
    return m


def resize_linear():
    m = upsample()
    for a in m.graph.node[0].attribute:
        if a.name == "mode":
            a.s = b"linear"
    return m


@pytest.mark.parametrize(
    ("build", "rule", "anchor_op", "reason"),
    [(conv_dynamic_weight, SDConvFusion, "Conv", "the weight is not a constant"),
     (conv_big_kernel, SDConvFusion, "Conv", "kernel 9x9 is larger than"),
     (group_norm_shared_intermediate, SDGroupNormFusion, "Add", "is also used outside the pattern"),
     (group_norm_learned_instance_scale, SDGroupNormFusion, "Add", "learned scale/bias"),
     (attention_wrong_heads, SDMHAFusion, "MatMul", "not merged back"),
     (resize_linear, SDResizeFusion, "Resize", "only nearest-neighbour")],
)
def test_near_miss_does_not_fuse_and_says_why(build, rule, anchor_op, reason):
    m = build()
    irm = to_ir(m)
    canonicalize(irm)
    stats = apply_rules(irm.graph, [rule()], RuleStats())
    assert any(reason in why for _, why in stats.declined.values()), stats.declined
    assert ops(irm)[anchor_op] >= 1
    assert_same(m, irm)


def text_embedding_and_pooling(exporter: str = "dynamo", offsets: list[int] | None = None):
    """CLIP's token lookup and end-of-text pooling: dynamo's GatherND on (row, argmax) pairs, or TorchScript's
    (optimum's) Gather of the flattened rows at arange(B) * S + argmax (``offsets`` for a near-miss)."""
    from onnx import TensorProto as T

    nodes = [n("Gather", ["table", "ids"], ["e"], axis=0), n("Cast", ["ids"], ["ids32"], to=T.INT32),
             n("ArgMax", ["ids32"], ["am"], axis=-1, keepdims=0)]
    inits = {"table": w(50, 4)}
    if exporter == "dynamo":
        nodes += [n("Reshape", ["am", "col"], ["am2"]), n("Concat", ["rows", "am2"], ["idx"], axis=-1),
                  n("GatherND", ["e", "idx"], ["pooled"])]
        inits |= {"col": np.array([2, 1]), "rows": np.array([[0], [1]])}
    else:
        nodes += [n("Add", ["am", "offsets"], ["idx"]), n("Reshape", ["e", "flat"], ["rows2d"]),
                  n("Gather", ["rows2d", "idx"], ["pooled"], axis=0)]
        inits |= {"offsets": np.array(offsets if offsets is not None else [0, 7]), "flat": np.array([14, 4])}
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", T.INT64, [2, 7])],
                          [helper.make_tensor_value_info("pooled", T.FLOAT, [2, 4])],
                          [onnx.numpy_helper.from_array(a, k) for k, a in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])
    return onnx.shape_inference.infer_shapes(m, strict_mode=True)


def test_pooling_at_other_rows_does_not_fuse():
    """Rows 0 and 6 of the flattened states are not each prompt's own end-of-text token."""
    m = text_embedding_and_pooling("torchscript", offsets=[0, 6])
    irm, result = _fused(m)
    assert ops(irm)["Gather"] == 1 and "SDTokenPool" not in ops(irm)
    assert any("arange(B) * S" in why for _, why in result.details["declined"].values())
    ids = {"ids": np.array([[1, 3, 49, 7, 1, 1, 1], [0, 49, 2, 2, 2, 2, 2]], np.int64)}
    for a, b in zip(run(m, ids), run(with_functions(irm), ids), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_text_encoder_lookup_and_pooling_fuse(exporter):
    m = text_embedding_and_pooling(exporter)
    irm, _ = _fused(m)
    assert ops(irm) == {"SDEmbedding": 1, "SDTokenPool": 1}
    ids = {"ids": np.array([[49406 % 50, 3, 49, 7, 1, 1, 1], [0, 49, 2, 2, 2, 2, 2]], np.int64)}
    for a, b in zip(run(m, ids), run(with_functions(irm), ids), strict=True):
        np.testing.assert_array_equal(a, b)
