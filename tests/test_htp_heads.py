"""An attention's scores in head groups (``sdnpu.passes.htp.heads``) on small graphs, as op counts, onnx's full
check and onnxruntime's numbers before and after (fp32: every rewrite is exact or changes float32's last bits)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from sdnpu.passes import htp

from .graphs import feeds_for, ops, run, to_ir, to_proto
from .htp_graphs import attention


def _attention(read_probs: bool = False, heads: int = 6) -> onnx.ModelProto:
    return attention(16, 20, heads, read_probs=read_probs)


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
