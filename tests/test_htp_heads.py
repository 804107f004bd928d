"""An attention's scores in head groups (``sdnpu.passes.htp.heads``) on small graphs, as op counts, onnx's full
check and onnxruntime's numbers before and after (fp32: every rewrite is exact or changes float32's last bits)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper

from sdnpu.passes import htp

from .graphs import feeds_for, ops, run, to_ir, to_proto


def _attention(read_probs: bool = False, heads: int = 6) -> onnx.ModelProto:
    """softmax((Q Kᵀ) s + bias + mask) V over [2, heads, 16, 20] scores, as diffusers' eager attentions export it:
    a scale, a per-head bias (sliced with the heads) and a mask broadcast along them (read whole by each group)."""
    rng = np.random.default_rng(0)
    b, m, n, d = 2, 16, 20, 8
    inits = [onnx.numpy_helper.from_array(np.where(rng.random((1, 1, m, n)) > 0.2, 0, -1e4).astype(np.float32),
                                          "mask"),
             onnx.numpy_helper.from_array(rng.standard_normal((1, heads, m, n)).astype(np.float32), "bias"),
             onnx.numpy_helper.from_array(np.asarray(0.35, np.float32), "scale")]
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Mul", ["s", "scale"], ["s2"]),
             helper.make_node("Add", ["bias", "s2"], ["s3"]),
             helper.make_node("Add", ["s3", "mask"], ["s4"]),
             helper.make_node("Softmax", ["s4"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["o"])]
    outs = [helper.make_tensor_value_info("o", T.FLOAT, [b, heads, m, d])]
    if read_probs:
        outs.append(helper.make_tensor_value_info("p", T.FLOAT, [b, heads, m, n]))
    ins = [helper.make_tensor_value_info(x, T.FLOAT, [b, heads, m if x == "q" else n, d]) for x in "qkv"]
    g = helper.make_graph(nodes, "attention", ins, outs, initializer=inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]))


@pytest.mark.parametrize(("limit_heads", "groups"), [(2, [2, 2, 2]), (4, [3, 3]), (1, [1] * 6), (5, [3, 3])])
def test_an_attention_past_the_scores_limit_is_computed_in_head_groups(monkeypatch, limit_heads, groups):
    """The scores past the limit (here ``limit_heads`` heads' worth): the fewest even groups that fit, each its
    own products and softmax over its heads, concatenated; bit for bit the attention's numbers."""
    from sdnpu.passes.htp import heads

    proto = _attention()
    monkeypatch.setattr(heads, "SCORES_LIMIT", limit_heads * 2 * 16 * 20 * 4)
    m = to_ir(proto)
    result = htp.group_attention_heads(m)
    out = to_proto(m)
    onnx.checker.check_model(out, full_check=True)
    assert result.counts == {"attentions in head groups": 1, "head groups": len(groups)}
    assert ops(out)["Softmax"] == ops(out)["Concat"] * len(groups) == len(groups)
    splits = [n for n in out.graph.node if n.op_type == "Split"]
    sizes = {tuple(onnx.numpy_helper.to_array(i)) for i in out.graph.initializer if i.name.endswith("_sizes")}
    assert len(splits) == 4 and sizes == {tuple(groups)}  # Q, Kᵀ, V and the per-head bias; the mask read whole
    feeds = feeds_for(proto)
    np.testing.assert_array_equal(run(out, feeds)[0], run(proto, feeds)[0])


def test_an_attention_within_the_limit_or_whose_probabilities_are_read_keeps_its_form(monkeypatch):
    from sdnpu.passes.htp import heads

    monkeypatch.setattr(heads, "SCORES_LIMIT", 2 * 2 * 16 * 20 * 4)
    m = to_ir(_attention(read_probs=True))
    assert not htp.group_attention_heads(m).modified  # the probabilities are a graph output: nothing to split
    monkeypatch.setattr(heads, "SCORES_LIMIT", 6 * 2 * 16 * 20 * 4)
    assert not htp.group_attention_heads(to_ir(_attention())).modified  # all six heads' scores fit
