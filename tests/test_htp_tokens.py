"""An attention's tokens padded to a multiple of ``ALIGN`` (``sdnpu.passes.htp.tokens``): on small graphs, with the
alignment lowered to 16, the padded attention computes the same numbers in float32 (the padded keys' weights are
exactly 0, the padded queries' rows dropped), passes onnx's full check, and keeps the graph's interface."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from sdnpu.passes.htp import tokens

from .graphs import feeds_for, ops, run, to_ir, to_proto
from .htp_graphs import attention


def _attention(m: int, n: int, heads: int = 3, mask_rows: bool = True, d: int = 8) -> onnx.ModelProto:
    return attention(m, n, heads, d=d, mask_rows=mask_rows, transposed=True)


@pytest.mark.parametrize(("m", "n", "pads"), [(16, 20, 2), (20, 16, 1), (20, 20, 3), (20, 24, 3)])
@pytest.mark.parametrize("mask_rows", [True, False])
def test_an_attention_over_tokens_not_aligned_computes_the_same_over_padded_ones(monkeypatch, m, n, pads, mask_rows):
    monkeypatch.setattr(tokens, "ALIGN", 16)
    monkeypatch.setattr(tokens, "PAD_FROM", 0)
    proto = _attention(m, n, mask_rows=mask_rows)
    g = to_ir(proto)
    result = tokens.pad_attention_tokens(g)
    out = to_proto(g)
    onnx.checker.check_model(out, full_check=True)
    assert result.counts == {"attentions over padded tokens": 1}
    counted = ops(out)
    assert counted["Pad"] == pads  # Q's rows where m is padded; Kᵀ's columns and V's rows where n is
    assert counted.get("Slice", 0) == (m % 16 != 0)  # the padded queries' rows dropped
    assert [(o.name, [d.dim_value for d in o.type.tensor_type.shape.dim]) for o in out.graph.output] == \
        [(o.name, [d.dim_value for d in o.type.tensor_type.shape.dim]) for o in proto.graph.output]
    scores = next(n for n in out.graph.node if n.op_type == "Softmax").input[0]
    dims = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in onnx.shape_inference.infer_shapes(out).graph.value_info}
    assert dims[scores][-2:] == [-(-m // 16) * 16, -(-n // 16) * 16]
    feeds = feeds_for(proto)
    for a, b in zip(run(proto, feeds), run(out, feeds), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)  # float32: the softmax's sum in another order


def test_an_attention_over_aligned_or_few_tokens_keeps_its_form(monkeypatch):
    monkeypatch.setattr(tokens, "ALIGN", 16)
    monkeypatch.setattr(tokens, "PAD_FROM", 0)
    assert not tokens.pad_attention_tokens(to_ir(_attention(16, 32))).modified  # aligned already
    monkeypatch.setattr(tokens, "PAD_FROM", 21)
    assert not tokens.pad_attention_tokens(to_ir(_attention(20, 20))).modified  # too few tokens to matter


def test_qnn_computes_the_padded_attention_right(tmp_path):
    """On Qualcomm's compiler and its HTP emulator, at the defaults (1030 tokens padded to 1088): taken whole with
    CPU fallback off, and its fp16 numbers agree with the fp32 graph."""
    qnn = pytest.importorskip("sdnpu.backends.qnn_htp")
    proto = _attention(1030, 1030, heads=1, d=64)
    g = to_ir(proto)
    assert tokens.pad_attention_tokens(g).modified
    out = to_proto(g)
    path = tmp_path / "padded.onnx"
    onnx.save(out, str(path))
    feeds = feeds_for(proto)
    ref = run(proto, feeds)
    got = qnn.session(path).run(None, feeds)
    for a, b in zip(ref, got, strict=True):
        a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
        assert np.isfinite(b).all()
        assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) > 0.999
