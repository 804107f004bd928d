"""The joint pass (``sdnpu.passes.joint.split_joint_attention``) on small graphs: SD3's joint
attention split by query part and its head Transposes moved below the per-head norms, the numbers kept
(plain ONNX, fp32), and the graphs it must leave as they are."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from sdnpu.passes.joint import split_joint_attention
from sdnpu.passes.pipeline import CompileOptions, canonicalize, pass_names

from .graphs import feeds_for, model, ops, run, to_ir, to_proto
from .test_mmdit import S1, S2, B, C, H, joint_attention, n, w

SPLIT = "sequence cuts computed as their parts"
SUNK = "head transposes moved below row ops"


def jointed(m: onnx.ModelProto):
    """The canonical steps, then the joint pass: (its result, the model)."""
    irm = to_ir(m)
    canonicalize(irm)
    before = Counter(ops(irm))
    return split_joint_attention(irm), irm, before


def assert_same(m: onnx.ModelProto, irm: ir.Model) -> onnx.ModelProto:
    out = to_proto(irm)
    onnx.checker.check_model(out, full_check=True)
    feeds = feeds_for(m)
    for a, b in zip(run(m, feeds), run(out, feeds), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    return out


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("spelling", ["dynamo", "torchscript"])
def test_one_attention_per_query_part_and_the_slices_go(norm, spelling):
    m = joint_attention(norm=norm, spelling=spelling)
    result, irm, before = jointed(m)
    assert result.modified and result.counts[SPLIT] == 2  # each stream's Slice
    after = ops(irm)
    assert before["Slice"] == 2 and after["Slice"] == 0  # the streams' cut: gone
    assert before["Softmax"] == 1 and after["Softmax"] == 2  # one per query part, over the joint keys
    assert after["MatMul"] == before["MatMul"] + 2  # Q K^T and P V for each part: the same MACs, split
    assert_same(m, irm)


def test_a_masked_joint_attention_is_split_through_its_nan_guard():
    """Qwen-Image's: a key mask computed from an input, and dynamo's ``Where(IsNaN(p), 0, p)`` after the softmax
    (row by row, so each query part keeps it); before, the cut stayed whole ("IsNaN is not computed row by
    row") and each block kept a CPU Split between two NPU regions."""
    m = joint_attention(norm=False, masked=True)
    result, irm, before = jointed(m)
    assert result.counts[SPLIT] == 2
    after = ops(irm)
    assert after["Slice"] == 0 and after["Softmax"] == 2 and after["IsNaN"] == 2
    assert_same(m, irm)


def test_the_per_head_norms_run_on_rows_before_the_head_transpose():
    """SD3.5's Q/K RMSNorm over D commutes with the head split's Transpose, which moves below it: the norms'
    ReduceMean then reads [B, S, H, D] rows."""
    m = joint_attention(norm=True)
    result, irm, _ = jointed(m)
    assert result.counts[SUNK] > 0
    shapes = {tuple(node.inputs[0].shape) for node in irm.graph if node.op_type == "ReduceMean"}
    assert shapes == {(B, S1, H, C // H), (B, S2, H, C // H)}
    assert_same(m, irm)


def test_the_last_blocks_image_only_cut_is_split_too():
    m = joint_attention(parts="image")
    result, irm, _ = jointed(m)
    assert result.counts[SPLIT] == 1 and ops(irm)["Slice"] == 0
    assert_same(m, irm)


@pytest.mark.parametrize("kwargs", [{"parts": "misaligned"}, {"softmax_axis": 2}],
                         ids=["a cut that is not the streams'", "a softmax over the queries"])
def test_near_misses_keep_the_attention_whole(kwargs):
    m = joint_attention(**kwargs)
    result, irm, before = jointed(m)
    assert result.counts[SPLIT] == 0
    assert ops(irm)["Softmax"] == 1 and ops(irm)["Slice"] == before["Slice"] == 2
    assert_same(m, irm)


def test_a_graph_without_joint_attention_is_left_as_it_is():
    """A UNet's self-attention (one stream, no Concat): nothing to split, nothing moves, ``modified`` False."""
    s, d = S1 + S2, C // H
    nodes = [n("MatMul", ["x", "wq"], ["q"]), n("MatMul", ["x", "wk"], ["k"]),
             n("Reshape", ["q", "split"], ["q4"]), n("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3]),
             n("Reshape", ["k", "split"], ["k4"]), n("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]),
             n("MatMul", ["qh", "kt"], ["sc"]), n("Softmax", ["sc"], ["y"], axis=-1)]
    m = model(nodes, {"x": [B, s, C]}, {"y": [B, H, s, s]},
              {"wq": w(C, C), "wk": w(C, C), "split": np.array([B, s, H, d])})
    irm = to_ir(m)
    canonicalize(irm)
    before = to_proto(irm).SerializeToString(deterministic=True)
    result = split_joint_attention(irm)
    assert not result.modified and not any(result.counts.values())
    assert to_proto(irm).SerializeToString(deterministic=True) == before


def test_the_joint_pass_runs_right_after_the_canonical_steps():
    names = pass_names(CompileOptions())
    assert names[names.index("joint") - 1:names.index("joint") + 2] == ["canonical/finish", "joint", "fuse"]
    assert all(n.startswith("canonical/") for n in names[:names.index("joint")])
    both = pass_names(CompileOptions(handoff=frozenset({"a"}), prologue=frozenset({"b"})), steps=False)
    assert both == ["canonical", "joint", "fuse", "layout", "glue", "views", "frames", "parallel", "precision",
                    "cuts", "handoff", "cleanup", "prologue", "partition"]


def test_a_cut_given_up_part_way_leaves_no_reader_behind():
    """The planner makes the parts of one operand (the Mul's, through the projection) before it meets one it
    cannot cut (a softmax over the cut axis): the parts it made are dropped, and none of them stays among its
    inputs' readers (such a reader, in no graph, kept a dead producer looking read: HiDream's six avoidable CPU
    islands of CastAvx's after the attention took its rotary)."""
    s1, s = 8, 16  # parts of 8 rows and more: the layer is worth cutting (``streams.MIN_ROWS``)
    nodes = [n("MatMul", ["x", "wp"], ["h"]), n("Mul", ["h", "c"], ["hc"]), n("Softmax", ["h"], ["sm"], axis=1),
             n("Add", ["hc", "sm"], ["y"]), n("Slice", ["y", "s0", "s1", "ax"], ["out"])]
    m = model(nodes, {"x": [B, s, C]}, {"out": [B, s1, C]},
              {"wp": w(C, C), "c": w(C), "s0": np.array([0]), "s1": np.array([s1]), "ax": np.array([1])})
    result, irm, _ = jointed(m)
    assert result.counts[SPLIT] == 0 and ops(irm)["Slice"] == 1
    values = [*irm.graph.inputs, *irm.graph.initializers.values(), *(o for x in irm.graph for o in x.outputs)]
    assert all(u.node.graph is irm.graph for v in values for u in v.uses())
    assert_same(m, irm)


def test_the_head_merge_moves_above_the_per_head_gate_and_sum():
    """Lumina-Next's block: its cross-attention's output gated per head (``* tanh(gate).view(1, 1, H, 1)``) and
    added to its self-attention's, both still [B, H, M, D], then one head merge (Transpose, Reshape) and the
    output projection. The merge's Transpose moves above the Add and the Mul, so each attention's output goes
    straight into a merge of its own and both become the target's attention op (before: both stayed on the
    CPU, "the output is not merged back to [B, M, C]")."""
    from .lowering import assert_same as lowered_same, dispatch_ops, lowered

    m_, n_, h, d = 16, 8, 2, 4
    c = h * d
    qk = [0, 2, 1, 3]
    nodes = [n("MatMul", ["x", "wq"], ["q"]), n("MatMul", ["x", "wk"], ["k"]), n("MatMul", ["x", "wv"], ["v"]),
             n("MatMul", ["ctx", "wk2"], ["k2"]), n("MatMul", ["ctx", "wv2"], ["v2"])]
    for name, s in (("q", m_), ("k", m_), ("v", m_), ("k2", n_), ("v2", n_)):
        nodes += [n("Reshape", [name, f"split{s}"], [f"{name}4"]), n("Transpose", [f"{name}4"], [f"{name}h"], perm=qk)]
    for i, (kk, vv) in enumerate((("kh", "vh"), ("k2h", "v2h"))):
        nodes += [n("Transpose", [kk], [f"kt{i}"], perm=[0, 1, 3, 2]), n("MatMul", ["qh", f"kt{i}"], [f"s{i}"]),
                  n("Mul", [f"s{i}", "scale"], [f"ss{i}"]), n("Softmax", [f"ss{i}"], [f"p{i}"], axis=-1),
                  n("MatMul", [f"p{i}", vv], [f"a{i}"])]
    nodes += [n("Mul", ["a1", "gate"], ["g1"]), n("Add", ["a0", "g1"], ["mix"]),
              n("Transpose", ["mix"], ["mixm"], perm=qk), n("Reshape", ["mixm", "flat"], ["merged"]),
              n("MatMul", ["merged", "wo"], ["y"])]
    m = model(nodes, {"x": [B, m_, c], "ctx": [B, n_, c]}, {"y": [B, m_, c]},
              {**{k: w(c, c) for k in ("wq", "wk", "wv", "wk2", "wv2", "wo")},
               f"split{m_}": np.array([B, m_, h, d]), f"split{n_}": np.array([B, n_, h, d]),
               "scale": np.array(d ** -0.5, np.float32), "gate": np.tanh(w(1, h, 1, 1)),
               "flat": np.array([B, m_, c])})
    irm = lowered(m)
    assert not ops(irm)["Softmax"] and sum(v for k, v in dispatch_ops(irm).items() if "MHA" in k) == 2
    lowered_same(m, irm)
