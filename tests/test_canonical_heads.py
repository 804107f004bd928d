"""Heads (``sdnpu.passes.canonical.heads``) on tiny graphs in transformers' decoder form: the head split's
Transpose moves below the rotary (Mul by cos / sin tables, the rotation's MatMul, their Add) and the
grouped-query repeat (Reshape, Expand, Reshape), bit for bit, and stops at the attention's products; the repeat
then is a Concat of copies (``movement.concat_head_repeats``); a Transpose with a reader it cannot pass stays
where it is, as does one of another perm."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from sdnpu.passes.canonical import heads, movement
from sdnpu.passes.canonical.driver import sweep

from .graphs import model, ops, rewritten

B, S, H, KV, D = 2, 5, 4, 2, 6
R = np.random.default_rng(0)


def n(op: str, ins: list[str], outs: list[str], **attrs) -> onnx.NodeProto:
    return helper.make_node(op, ins, outs, **attrs)


def w(*shape: int) -> np.ndarray:
    return (R.standard_normal(shape) * 0.3).astype(np.float32)


def decoder(cos_rank: int = 4, repeat: bool = True, perm: tuple[int, ...] = (0, 2, 1, 3),
            extra_reader: bool = False, cos_shape: list[int] | None = None) -> onnx.ModelProto:
    """q, k = x Wq, x Wk split into heads [B, S, h, D] -> Transpose(perm) -> q cos + (q R) sin; k's KV heads
    repeated to H (``repeat``); the output q · kᵀ (the attention's scores). ``extra_reader``: q's Transpose is
    also read by a Softmax (no per-head arithmetic: it cannot take the Transpose)."""
    cos_shape = cos_shape or [1, 1, S, D][4 - cos_rank:]
    kv = KV if repeat else H  # without the repeat, as many k heads as q heads
    inits = {"wq": w(H * D, H * D), "wk": w(H * D, kv * D), "cos": w(*cos_shape), "sin": w(*cos_shape),
             "rot": np.eye(D, dtype=np.float32)[:, ::-1].copy(), "qs": np.array([B, S, H, D]),
             "ks": np.array([B, S, kv, D]), "k5": np.array([B, KV, 1, S, D]), "kx": np.array([B, KV, H // KV, S, D]),
             "kh": np.array([B, H, S, D])}
    nodes = [n("MatMul", ["x", "wq"], ["q0"]), n("Reshape", ["q0", "qs"], ["q1"]),
             n("Transpose", ["q1"], ["q"], perm=list(perm)),
             n("MatMul", ["x", "wk"], ["k0"]), n("Reshape", ["k0", "ks"], ["k1"]),
             n("Transpose", ["k1"], ["k"], perm=list(perm))]
    for t in ("q", "k"):
        nodes += [n("Mul", [t, "cos"], [f"{t}_cos"]), n("MatMul", [t, "rot"], [f"{t}_rot"]),
                  n("Mul", [f"{t}_rot", "sin"], [f"{t}_sin"]), n("Add", [f"{t}_cos", f"{t}_sin"], [f"{t}_emb"])]
    k = "k_emb"
    if repeat:
        nodes += [n("Reshape", ["k_emb", "k5"], ["k5v"]), n("Expand", ["k5v", "kx"], ["kxv"]),
                  n("Reshape", ["kxv", "kh"], ["kr"])]
        k = "kr"
    nodes += [n("Transpose", [k], ["kt"], perm=[0, 1, 3, 2]), n("MatMul", ["q_emb", "kt"], ["y"])]
    outputs: dict[str, list[int] | None] = {"y": None}
    if extra_reader:
        nodes.append(n("Softmax", ["q"], ["p"], axis=-1))
        outputs["p"] = None
    return model(nodes, {"x": [B, S, H * D]}, outputs, inits)


@pytest.mark.parametrize("cos_rank", [2, 4])
def test_the_head_transpose_moves_below_the_rotary_and_the_repeat(cos_rank):
    """Below the rotary's Mul, MatMul, Mul and Add, and k's repeat, down to the scores' MatMul: the rotary and
    the repeat computed on [B, S, h, D], the tables transposed offline; then the repeat is a Concat."""
    m = decoder(cos_rank)
    irm, counts = rewritten(m, heads.sink_head_transposes, sweep, movement.concat_head_repeats, sweep)
    assert counts["head transposes sunk past per-head arithmetic"] > 0
    assert counts["head repeats (Expand of a size-1 axis) -> Concat"] == 1
    assert ops(irm)["Expand"] == 0 and ops(irm)["Concat"] == 1
    by_output = {v.name: node for node in irm.graph for v in node.outputs}
    scores = by_output["y"]
    for side in scores.inputs:  # each operand of the scores comes straight from a movement chain
        p = side.producer()
        while p.op_type in ("Transpose", "Reshape"):
            p = p.inputs[0].producer()
        assert p.op_type in ("Add", "Concat"), p.op_type
    for node in irm.graph:  # every Transpose is right in front of the scores (no per-head op reads one)
        if node.op_type == "Transpose":
            assert all(u.node.op_type in ("Transpose", "MatMul", "Reshape") for u in node.outputs[0].uses())
            assert all(u.node.op_type != "MatMul" or u.node is scores for u in node.outputs[0].uses())
    for node in irm.graph:  # the rotary reads [B, S, h, D]
        if node.op_type in ("Mul", "Add"):
            assert list(node.outputs[0].shape)[1] == S, node


def test_a_transpose_with_another_reader_stays():
    """q's Transpose is also read by a Softmax: it stays where it is for both (a copy left behind would be one
    more Transpose); k's moves."""
    m = decoder(extra_reader=True)
    irm, _ = rewritten(m, heads.sink_head_transposes, sweep)
    q = next(node for node in irm.graph if node.op_type == "Transpose" and node.inputs[0].name == "q1")
    assert {u.node.op_type for u in q.outputs[0].uses()} == {"Mul", "MatMul", "Softmax"}
    k_cos = [node for node in irm.graph if node.op_type == "Mul" and node.inputs[0].name == "k1"]
    assert len(k_cos) == 1  # k's rotary reads its [B, S, KV, D] split: its Transpose went below


def test_another_perm_stays():
    """Only the head split's (0, 2, 1, 3) moves: another perm read by the rotary stays as it is."""
    m = decoder(repeat=False, perm=(2, 1, 0, 3), cos_shape=[1, S, 1, D])
    irm, counts = rewritten(m, heads.sink_head_transposes)
    assert counts["head transposes sunk past per-head arithmetic"] == 0
    assert ops(irm) == ops(onnx.shape_inference.infer_shapes(m))


def test_an_expand_not_merged_into_the_heads_stays():
    """An Expand of a size-1 axis whose reader does not merge it into the axis before (it stays [.., r, ..])
    is not the head repeat: it stays, its reason the registry's."""
    m = model([n("Relu", ["x"], ["a"]), n("Expand", ["a", "wide"], ["e"]), n("Relu", ["e"], ["y"])],
              {"x": [2, 3, 1, 4]}, {"y": None}, {"wide": np.array([2, 3, 2, 4])})
    irm, counts = rewritten(m, movement.concat_head_repeats)
    assert counts["head repeats (Expand of a size-1 axis) -> Concat"] == 0 and ops(irm)["Expand"] == 1


def test_the_transpose_passes_a_rotary_applied_to_parts_of_each_head():
    """Allegro's 3-D rotary: each head's D cut into parts along its last axis (Slice), each part rotated by its
    axis' tables, the parts put back together (Concat on the last axis). The Transpose passes the Slices, the
    rotation of each part and the Concat, bit for bit: the attention's products read q as the projection's
    view (before: the attention stayed on the CPU, "q, k, v are not rank-3 tensors behind their reshapes")."""
    half = D // 2
    inits = {"wq": w(H * D, H * D), "qs": np.array([B, S, H, D]), "rot": np.eye(half, dtype=np.float32)[:, ::-1].copy(),
             "z": np.array([0]), "m": np.array([half]), "e": np.array([D]), "ax": np.array([-1])}
    nodes = [n("MatMul", ["x", "wq"], ["q0"]), n("Reshape", ["q0", "qs"], ["q1"]),
             n("Transpose", ["q1"], ["q"], perm=[0, 2, 1, 3]),
             n("Slice", ["q", "z", "m", "ax"], ["p0"]), n("Slice", ["q", "m", "e", "ax"], ["p1"])]
    for i in (0, 1):
        inits |= {f"cos{i}": w(1, 1, S, half), f"sin{i}": w(1, 1, S, half)}
        nodes += [n("Mul", [f"p{i}", f"cos{i}"], [f"c{i}"]), n("MatMul", [f"p{i}", "rot"], [f"r{i}"]),
                  n("Mul", [f"r{i}", f"sin{i}"], [f"s{i}"]), n("Add", [f"c{i}", f"s{i}"], [f"e{i}"])]
    nodes += [n("Concat", ["e0", "e1"], ["qe"], axis=-1), n("Transpose", ["qe"], ["kt"], perm=[0, 1, 3, 2]),
              n("MatMul", ["qe", "kt"], ["y"])]
    irm, counts = rewritten(model(nodes, {"x": [B, S, H * D]}, {"y": None}, inits), heads.sink_head_transposes, sweep)
    assert counts["head transposes sunk past per-head arithmetic"] > 0
    producers = {x.outputs[0].name: x for x in irm.graph}
    scores = next(x for x in irm.graph if x.op_type == "MatMul" and x.outputs[0].name == "y")
    q = producers[scores.inputs[0].name]
    assert q.op_type == "Transpose" and producers[q.inputs[0].name].op_type == "Concat"  # the Transpose at the end
