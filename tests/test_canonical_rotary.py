"""Rotary (``sdnpu.passes.canonical.rotary``) on tiny graphs: the rotary embeddings' rotation, spelled as
``rotate_half`` (cat(-x2, x1)) or as interleaved pairs (stack(-x_odd, x_even)), becomes a MatMul by a constant
signed permutation, bit for bit (each output is one input times plus or minus one, the rest zeros); the result
passes onnx's full check; a rotation of the CPU's edge region (computed from the graph's inputs alone) and a
movement across the rows (no [D, D] matrix does it) stay."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from sdnpu.passes.canonical import rotary
from sdnpu.passes.canonical.driver import sweep

from .graphs import model, ops, rewritten

B, S, D = 2, 3, 8
R = np.random.default_rng(0)


def n(op: str, ins: list[str], outs: list[str], **attrs) -> onnx.NodeProto:
    return helper.make_node(op, ins, outs, **attrs)


def roped(spelling: str, projected: bool = True) -> onnx.ModelProto:
    """q = x W (a projection: outside the edge region, unless ``projected`` is False), then q cos + rot(q) sin."""
    inits = {"cos": R.standard_normal((S, D)).astype(np.float32), "sin": R.standard_normal((S, D)).astype(np.float32)}
    nodes = [n("MatMul", ["x", "wq"], ["q"])] if projected else [n("Relu", ["x"], ["q"])]
    if projected:
        inits["wq"] = (R.standard_normal((D, D)) * 0.3).astype(np.float32)
    if spelling == "rotate_half":
        inits |= {"s0": np.array([0]), "s1": np.array([D // 2]), "s2": np.array([D]), "ax": np.array([-1])}
        nodes += [n("Slice", ["q", "s0", "s1", "ax"], ["q1"]), n("Slice", ["q", "s1", "s2", "ax"], ["q2"]),
                  n("Neg", ["q2"], ["nq2"]), n("Concat", ["nq2", "q1"], ["rot"], axis=-1)]
    elif spelling == "pairs":  # [.., D/2, 2]: (-x_odd, x_even) per pair
        inits |= {"pairs": np.array([B, S, D // 2, 2]), "flat": np.array([B, S, D])}
        nodes += [n("Reshape", ["q", "pairs"], ["qp"]), n("Split", ["qp"], ["qe", "qo"], axis=-1, num_outputs=2),
                  n("Neg", ["qo"], ["nqo"]), n("Concat", ["nqo", "qe"], ["rp"], axis=-1),
                  n("Reshape", ["rp", "flat"], ["rot"])]
    elif spelling == "swap":  # the halves swapped, no sign: a permutation all the same
        inits |= {"s0": np.array([0]), "s1": np.array([D // 2]), "s2": np.array([D]), "ax": np.array([-1])}
        nodes += [n("Slice", ["q", "s0", "s1", "ax"], ["q1"]), n("Slice", ["q", "s1", "s2", "ax"], ["q2"]),
                  n("Concat", ["q2", "q1"], ["rot"], axis=-1)]
    else:  # "roll": the positions rolled by one, negated: each row reads another row, no [D, D] matrix
        inits |= {"s0": np.array([0]), "s1": np.array([S - 1]), "s2": np.array([S]), "ax": np.array([1])}
        nodes += [n("Slice", ["q", "s1", "s2", "ax"], ["last"]), n("Slice", ["q", "s0", "s1", "ax"], ["rest"]),
                  n("Concat", ["last", "rest"], ["rolled"], axis=1), n("Neg", ["rolled"], ["rot"])]
    nodes += [n("Mul", ["q", "cos"], ["qc"]), n("Mul", ["rot", "sin"], ["rs"]), n("Add", ["qc", "rs"], ["y"])]
    return model(nodes, {"x": [B, S, D]}, {"y": [B, S, D]}, inits)


@pytest.mark.parametrize("spelling", ["rotate_half", "pairs", "swap"])
def test_a_rotation_is_a_matmul_by_a_signed_permutation(spelling):
    """The swapped halves are a permutation too (a Concat moves them), so they are one MatMul as well."""
    irm, counts = rewritten(roped(spelling), rotary.write_rotations_as_matmuls, sweep)
    assert counts["signed permutations (rotary embeddings) -> MatMul"] == 1
    assert dict(ops(irm)) == {"MatMul": 2, "Mul": 2, "Add": 1}
    rotation = next(x for x in irm.graph if x.op_type == "MatMul" and x.inputs[1].name != "wq").inputs[1]
    r = rotation.const_value.numpy()
    assert sorted(np.unique(r).tolist()) == ([-1.0, 0.0, 1.0] if spelling != "swap" else [0.0, 1.0])
    assert np.all(np.abs(r).sum(axis=0) == 1) and np.all(np.abs(r).sum(axis=1) == 1)


def test_a_rotation_of_the_edge_region_stays():
    """q computed from the graph's input alone (no weight-bearing op between): a table the CPU makes, where a
    MatMul would cost MACs; it stays as it is."""
    irm, counts = rewritten(roped("rotate_half", projected=False), rotary.write_rotations_as_matmuls, sweep)
    assert counts["signed permutations (rotary embeddings) -> MatMul"] == 0
    assert ops(irm)["Neg"] == 1 and ops(irm)["MatMul"] == 0


def test_a_movement_across_the_rows_stays():
    irm, counts = rewritten(roped("roll"), rotary.write_rotations_as_matmuls, sweep)
    assert counts["signed permutations (rotary embeddings) -> MatMul"] == 0
    assert ops(irm)["Neg"] == 1 and ops(irm)["MatMul"] == 1
