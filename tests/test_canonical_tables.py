"""The tables (``sdnpu.passes.canonical.tables``): on tiny hand-built tables, unary ops sunk below a Concat and
a value computed twice computed once, bit for bit, each with its near miss; and on the rotary tables Flux.1
computes from its position ids, at the token count of its public size: the per-axis gathers, casts, products and
repeats collapse into one Gather and one Mul whatever the number of positions, computing what it computed (in
float32: the step's own choice)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_ir as ir
import pytest
import torch

from onnx import helper

from sdnpu.onnxrun import run_onnx
from sdnpu.passes.canonical import noops, tables
from sdnpu.passes.canonical.driver import sweep
from sdnpu.passes.manager import run_passes
from sdnpu.passes.pipeline import TABLES, canonicalize

from .graphs import model, ops, rewritten


class _Angles(torch.nn.Module):
    """Flux.1's rotary angles (``FluxPosEmbed``'s per-axis position x frequency, repeated pairwise, in float64)
    from its ids [S, 3], and their cosine."""

    def __init__(self, axes: tuple[int, ...] = (16, 56, 56), theta: float = 10000.0, outer: bool = False) -> None:
        super().__init__()
        self.axes, self.theta, self.outer = axes, theta, outer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        parts = []
        for i, d in enumerate(self.axes):
            if self.outer:  # float32 and torch.outer (an Einsum in TorchScript's graph): diffusers' on MPS
                freqs = 1.0 / self.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
                angles = torch.outer(ids[:, i], freqs)
            else:
                freqs = 1.0 / self.theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
                angles = ids[:, i].to(torch.float64)[:, None] * freqs[None, :]
            parts.append(angles.repeat_interleave(2, dim=1))
        return torch.cos(torch.cat(parts, dim=-1)).float()


@pytest.mark.parametrize("tokens", [64, 4608])  # 4608: 4096 image + 512 text tokens, flux-dev at 1024 px
def test_the_rotary_tables_collapse_at_any_token_count(tokens, tmp_path):
    """At 4608 positions a probe's quotient 13824 * f / f is 13824.000000000002: the range check reads the
    rounded index (it once read the quotient, and the full-size table kept 22 extra CPU nodes)."""
    ids = torch.stack([torch.zeros(tokens), torch.arange(tokens) // 64, torch.arange(tokens) % 64], dim=1).float()
    path = tmp_path / "angles.onnx"
    torch.onnx.export(_Angles().eval(), (ids,), str(path), input_names=["ids"], output_names=["table"], dynamo=True)
    model = ir.load(path)
    counts: Counter[str] = Counter()
    for record in run_passes(model, [TABLES]):  # the tables' steps, as CANONICAL runs them
        counts.update(record.result.counts)
    assert counts["table chains -> gather and scale"] == 1, counts
    ops = Counter(n.op_type for n in model.graph)
    assert ops["Gather"] == 1 and ops["Mul"] == 1 and ops["Cos"] == 1 and ops["Expand"] == 0, ops
    out = tmp_path / "collapsed.onnx"
    ir.save(model, out)
    want = run_onnx(path, {"ids": ids.numpy()})["table"]
    # the pass computes the float64 table in float32 (documented in the pass): the angles then err by half an
    # ulp of float32 at most, so the cosines by one ulp of the largest angle at most (flux-dev: 71 rad, 7.6e-6)
    bound = float(np.spacing(np.float32(ids.max().item())))
    np.testing.assert_allclose(run_onnx(out, {"ids": ids.numpy()})["table"], want, rtol=0, atol=bound)


def test_torchscripts_float32_outer_product_tables_collapse_too(tmp_path):
    """TorchScript writes ``torch.outer`` as an Einsum (``i,j->ij``), which the canonical form makes a broadcast
    Mul (a MatMul of one summed element was a weight-bearing layer to the edge region, and the table was cut
    and computed per stream, 64 CPU nodes in the zoo's Flux.1 dev); in float32, ``i * f / f`` is not i to 1e-6
    at 4608 positions, within float32's rounding of it. One Gather, one Mul, one Cos, bit for bit."""
    tokens = 4608
    ids = torch.stack([torch.zeros(tokens), torch.arange(tokens) // 64, torch.arange(tokens) % 64], dim=1).float()
    path = tmp_path / "angles.onnx"
    torch.onnx.export(_Angles(outer=True).eval(), (ids,), str(path), input_names=["ids"], output_names=["table"],
                      dynamo=False, opset_version=17)
    assert any(n.op_type == "Einsum" for n in ir.load(path).graph)
    model = ir.load(path)
    canonicalize(model)
    ops = Counter(n.op_type for n in model.graph)
    assert ops["Gather"] == 1 and ops["Mul"] == 1 and ops["Cos"] == 1 and not ops["Einsum"] and not ops["MatMul"], ops
    out = tmp_path / "collapsed.onnx"
    ir.save(model, out)
    np.testing.assert_array_equal(run_onnx(out, {"ids": ids.numpy()})["table"],
                                  run_onnx(path, {"ids": ids.numpy()})["table"])


@pytest.mark.parametrize(("second", "sinks"), [("Cos", True), ("Sin", False)])
def test_the_same_unary_op_on_every_part_runs_once_below_the_concat(second, sinks):
    """Concat(Cos(a'), Cos(b')) of the inputs' views is Cos(Concat(a', b')): the trigonometry once on the whole
    table. Near miss: Cos of one part, Sin of the other."""
    m = model([helper.make_node("Reshape", ["a", "flat"], ["fa"]), helper.make_node("Cos", ["fa"], ["ca"]),
               helper.make_node(second, ["b"], ["cb"]), helper.make_node("Concat", ["ca", "cb"], ["y"], axis=-1)],
              {"a": [2, 3, 1], "b": [2, 3]}, {"y": [2, 6]}, {"flat": np.array([2, 3])})
    irm, counts = rewritten(m, tables.sink_unary_ops, sweep)
    assert counts["unary ops moved below data movement"] == int(sinks)
    assert dict(ops(irm)) == ({"Reshape": 1, "Concat": 1, "Cos": 1} if sinks else
                              {"Reshape": 1, "Cos": 1, "Sin": 1, "Concat": 1})


@pytest.mark.parametrize(("other", "once"), [("ids", True), ("ids2", False)])
def test_a_value_computed_twice_is_computed_once(other, once):
    """The same Sin of the same input, twice (one per rotary axis, as exporters write it), is one Sin; near
    miss: the second reads another input."""
    m = model([helper.make_node("Sin", ["ids"], ["s1"]), helper.make_node("Sin", [other], ["s2"]),
               helper.make_node("Mul", ["s1", "s2"], ["y"])], {"ids": [4], "ids2": [4]}, {"y": [4]})
    irm, counts = rewritten(m, tables.compute_repeats_once, sweep)
    assert counts["repeated table ops computed once"] == int(once)
    assert dict(ops(irm)) == {"Sin": 1 if once else 2, "Mul": 1}


@pytest.mark.parametrize(("reader", "repeated"), [("Add", True), ("Concat", False)])
def test_a_table_repeated_over_an_axis_its_reader_broadcasts_is_written_once(reader, repeated):
    """A caption mask ``(1 - m) * -1e4`` repeated over 4 heads (TorchScript's repeat_interleave: a Gather of the
    columns 4 times) and viewed [1, 4, 1, 8], then added to the scores: the table once ([1, 1, 1, 8], every
    column in order: no Gather) and an Expand the canonical ``broadcast_expands`` drops, so the Add reads the
    one key row. Near miss: read by a Concat, which does not broadcast: the repeat stays part of the table."""
    other = {"Add": [1, 4, 5, 8], "Concat": [1, 4, 1, 8]}[reader]
    out = {"Add": [1, 4, 5, 8], "Concat": [1, 8, 1, 8]}[reader]
    m = model([helper.make_node("Sub", ["one", "mask"], ["inv"]),
               helper.make_node("Gather", ["inv", "cols"], ["rep"], axis=1),
               helper.make_node("Mul", ["rep", "big"], ["neg"]),
               helper.make_node("Reshape", ["neg", "heads"], ["bias"]),
               helper.make_node(reader, ["scores", "bias"], ["y"], **({"axis": 1} if reader == "Concat" else {}))],
              {"mask": [1, 8], "scores": other}, {"y": out},
              {"one": np.array(1.0, np.float32), "cols": np.tile(np.arange(8), 4), "big": np.array(-1e4, np.float32),
               "heads": np.array([1, 4, 1, 8])})
    irm, _ = rewritten(m, tables.collapse_table_chains, noops.drop_broadcast_expands, sweep,
                       feeds={"mask": np.array([[1, 1, 1, 1, 1, 1, 0, 0]], np.float32),
                              "scores": np.random.default_rng(0).standard_normal(other).astype(np.float32)})
    found = ops(irm)
    if repeated:
        assert found["Gather"] == 0 and found["Expand"] == 0, found
        bias = next(n for n in irm.graph if n.op_type == "Add").inputs[1]
        assert list(bias.shape) == [1, 1, 1, 8]
    else:
        assert found["Gather"] == 1 and found["Expand"] == 0, found
