"""Rotary (``sdnpu.passes.canonical.rotary``) on tiny graphs: the rotary embeddings' rotation, spelled as
``rotate_half`` (cat(-x2, x1)) or as interleaved pairs (stack(-x_odd, x_even)), becomes a MatMul by a constant
signed permutation, bit for bit (each output is one input times plus or minus one, the rest zeros); the result
passes onnx's full check; a rotation of the CPU's edge region (computed from the graph's inputs alone) and a
movement across the rows (no [D, D] matrix does it) stay."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

from sdnpu.passes.canonical import rotary
from sdnpu.passes.canonical.driver import sweep
from sdnpu.passes.pipeline import canonicalize

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


H = 2
PAIR = SUMS = "rotations by constant tables -> x * A + (x @ P) * B"


def rope_matrices(pick: str = "gather", tables: str = "constant", source: str = "heads") -> onnx.ModelProto:
    """BFL's and HiDream's ``apply_rope``: x viewed [B, S, H, D/2, 1, 2], ``f[..., 0] * x[..., 0] + f[..., 1] *
    x[..., 1]`` with f [1, S, 1, D/2, 2, 2] (each pair's 2 x 2 rotation: cos -sin / sin cos), viewed back to
    [B, S, H, D]. ``pick``: the pair's element as a Gather (both exporters' ``x[..., 0]``) or a Slice keeping
    its axis; ``tables``: constants, Slices of longer constant buffers, or computed from a graph input (the
    CPU's edge region); ``source``: x
    the [B, S, H, D] heads, or the [B, S, H * D] projection the view splits (HiDream's single-stream blocks);
    ``"across"``: the second term reads the next position's pair (a movement across the rows)."""
    angle = R.standard_normal((1, S, 1, D // 2)).astype(np.float32)
    c, s = np.cos(angle), np.sin(angle)
    f = np.stack([np.stack([c, -s], -1), np.stack([s, c], -1)], -2)  # [1, S, 1, D/2, 2, 2]
    inits: dict[str, np.ndarray] = {"wq": (R.standard_normal((H * D, H * D)) * 0.3).astype(np.float32),
                                    "pairs": np.array([B, S, H, D // 2, 1, 2]), "flat": np.array([B, S, H, D])}
    nodes = [n("MatMul", ["x", "wq"], ["proj"])]
    if source == "heads":
        inits["heads"] = np.array([B, S, H, D])
        nodes += [n("Reshape", ["proj", "heads"], ["q"]), n("Reshape", ["q", "pairs"], ["qp"])]
    else:
        nodes += [n("Reshape", ["proj", "pairs"], ["qp"])]
    inputs = {"x": [B, S, H * D]}
    for k in (0, 1):
        table = f[..., k] if pick == "gather" else f[..., k : k + 1]
        if tables == "constant":
            inits[f"f{k}"] = table
        elif tables == "sliced":  # a Slice of a longer buffer (the folder leaves a large one): still constant
            inits[f"buf{k}"] = np.concatenate([table, table[:, :1]], axis=1)
            inits |= {"p0": np.array([0]), "pS": np.array([S]), "ax1": np.array([1])}
            nodes.append(n("Slice", [f"buf{k}", "p0", "pS", "ax1"], [f"f{k}"]))
        else:  # the table times a graph input's [1]: computed on the CPU
            inits[f"t{k}"] = table
            inputs["scale"] = [1]
            nodes.append(n("Mul", [f"t{k}", "scale"], [f"f{k}"]))
        if pick == "gather":
            inits[f"i{k}"] = np.array(k)
            nodes.append(n("Gather", ["qp", f"i{k}"], [f"x{k}"], axis=-1))
        else:
            inits |= {f"lo{k}": np.array([k]), f"hi{k}": np.array([k + 1]), "last": np.array([-1])}
            nodes.append(n("Slice", ["qp", f"lo{k}", f"hi{k}", "last"], [f"x{k}"]))
        if source == "across" and k == 1:  # the next position's pair: a row of another row
            inits |= {"s1": np.array([1]), "sn": np.array([S]), "s0": np.array([0]), "ax1": np.array([1])}
            nodes += [n("Slice", [f"x{k}", "s1", "sn", "ax1"], ["tail"]),
                      n("Slice", [f"x{k}", "s0", "s1", "ax1"], ["head"]), n("Concat", ["tail", "head"], [f"x{k}r"], axis=1)]
            nodes.append(n("Mul", [f"f{k}", f"x{k}r"], [f"m{k}"]))
        else:
            nodes.append(n("Mul", [f"f{k}", f"x{k}"], [f"m{k}"]))
    nodes += [n("Add", ["m0", "m1"], ["sum"]), n("Reshape", ["sum", "flat"], ["y"])]
    return model(nodes, inputs, {"y": [B, S, H, D]}, inits)


@pytest.mark.parametrize("pick", ["gather", "slice"])
@pytest.mark.parametrize("source", ["heads", "projection"])
def test_a_rotation_by_2x2_tables_is_two_products(pick, source):
    """BFL's / HiDream's spelling becomes x * A + (x @ P) * B, bit for bit (the same two products a value, their
    sum taken either way round): P swaps each pair, A and B keep the tables' own broadcast (one row for the heads
    and the batch)."""
    irm, counts = rewritten(rope_matrices(pick, source=source), rotary.write_rotations_as_matmuls, sweep)
    assert counts[PAIR] == 1
    assert dict(ops(irm)) == {"MatMul": 2, "Mul": 2, "Add": 1, "Reshape": 1}  # the heads' view, or x's in y's shape
    swap = next(x for x in irm.graph if x.op_type == "MatMul" and x.inputs[1].name != "wq").inputs[1]
    p = swap.const_value.numpy()
    assert np.array_equal(p, np.kron(np.eye(D // 2), [[0, 1], [1, 0]]).astype(np.float32))
    tables = [x.inputs[1].const_value.numpy() for x in irm.graph if x.op_type == "Mul"]
    assert all(t.shape == (1, S, 1, D) for t in tables)


def test_tables_sliced_from_a_buffer_are_constant_tables():
    """A table the folder left unfolded for its size (Wan's ``freqs_cos[..., 0::2]``: a Slice of a buffer) is a
    constant all the same: read once, the rotation is the two products, the Slices gone."""
    irm, counts = rewritten(rope_matrices(tables="sliced"), rotary.write_rotations_as_matmuls, sweep)
    assert counts[PAIR] == 1
    assert dict(ops(irm)) == {"MatMul": 2, "Mul": 2, "Add": 1, "Reshape": 1}


@pytest.mark.parametrize("case", ["computed tables", "across the rows"])
def test_a_rotation_by_2x2_tables_near_misses_stay(case):
    """Tables the CPU computes from the graph's inputs, and a term reading another position's pair: no
    x * A + (x @ P) * B says them, so the graph stays as it is."""
    m = rope_matrices(tables="computed") if case == "computed tables" else rope_matrices(source="across")
    irm, counts = rewritten(m, rotary.write_rotations_as_matmuls, sweep)
    assert counts[PAIR] == 0
    assert ops(irm)["Gather"] == 2


def test_a_rotation_of_the_projection_a_head_split_views():
    """sdnpu's real rotary (Lumina-Next's, exported in ``real_rotary``): the [B, S, H * D] projection viewed as
    [B, S, H, D/2, 2], stack(-x_odd, x_even), viewed as [B, S, H, D]: no value of the rotation's own shape lies
    on the way up, only the projection of as many elements. It is that projection viewed in the rotation's
    shape, times the signed permutation."""
    inits = {"wq": (R.standard_normal((H * D, H * D)) * 0.3).astype(np.float32),
             "pairs": np.array([B, S, H, D // 2, 2]), "heads": np.array([B, S, H, D]), "one": np.array([1]),
             "last": np.array([-1]), "i0": np.array([0]), "i1": np.array([1]), "i2": np.array([2]),
             "cos": R.standard_normal((1, S, 1, D)).astype(np.float32),
             "sin": R.standard_normal((1, S, 1, D)).astype(np.float32)}
    nodes = [n("MatMul", ["x", "wq"], ["q"]), n("Reshape", ["q", "pairs"], ["qp"]),
             n("Slice", ["qp", "i0", "i1", "last"], ["qe"]), n("Slice", ["qp", "i1", "i2", "last"], ["qo"]),
             n("Neg", ["qo"], ["nqo"]), n("Concat", ["nqo", "qe"], ["rp"], axis=-1), n("Reshape", ["rp", "heads"], ["rot"]),
             n("Reshape", ["q", "heads"], ["qh"]), n("Mul", ["qh", "cos"], ["qc"]), n("Mul", ["rot", "sin"], ["rs"]),
             n("Add", ["qc", "rs"], ["y"])]
    irm, counts = rewritten(model(nodes, {"x": [B, S, H * D]}, {"y": [B, S, H, D]}, inits),
                            rotary.write_rotations_as_matmuls, sweep)
    assert counts["signed permutations (rotary embeddings) -> MatMul"] == 1
    assert not ops(irm)["Neg"] and not ops(irm)["Slice"] and ops(irm)["MatMul"] == 2


ULPS = 2.0  # measured: 0 (bit for bit) on all three


class _ExportedRope(torch.nn.Module):
    """A projection, its heads, a rotary with constant tables in one of its exported spellings, the heads moved
    first (as attention reads them). ``wan``: diffusers' ``WanAttnProcessor`` (``out[..., 0::2] = x1 c - x2 s``,
    two ScatterNDs once dynamo exports it); ``cat``: the halves' products joined (``cat(x1 c - x2 s, x1 s + x2
    c)``); ``computed``: that, its tables scaled by a graph input (the CPU's: it stays)."""

    def __init__(self, spelling: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.spelling, self.proj = spelling, torch.nn.Linear(H * D, H * D)
        angle = torch.randn(1, S, 1, D // 2)
        self.register_buffer("cos", angle.cos().repeat_interleave(2, -1) if spelling == "wan" else angle.cos())
        self.register_buffer("sin", angle.sin().repeat_interleave(2, -1) if spelling == "wan" else angle.sin())

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        q = self.proj(x).unflatten(2, (H, D))
        if self.spelling == "wan":
            x1, x2 = q.unflatten(-1, (-1, 2)).unbind(-1)
            c, s = self.cos[..., 0::2], self.sin[..., 1::2]
            out = torch.empty_like(q)
            out[..., 0::2] = x1 * c - x2 * s
            out[..., 1::2] = x1 * s + x2 * c
        else:
            c, s = (self.cos * t, self.sin * t) if self.spelling == "computed" else (self.cos, self.sin)
            x1, x2 = q.chunk(2, -1)
            out = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)
        return out.transpose(1, 2)


@pytest.mark.parametrize("spelling", ["wan", "cat", "computed"])
def test_an_exported_rotation_of_sums_is_two_products(tmp_path, spelling):
    """dynamo's export of each spelling through the canonical steps: x * A + (x @ P) * B, P a [D, D] movement
    of each head's row, no ScatterND, Slice or Split left; within 2 float32 ulps of onnxruntime's run of the
    export at the output's scale (measured: bit for bit on all three). Tables the graph computes from its
    inputs (``computed``): nothing rewritten."""
    path = tmp_path / "rope.onnx"
    args = (torch.randn(B, S, H * D), torch.ones(1))
    torch.onnx.export(_ExportedRope(spelling).eval(), args, str(path), dynamo=True, input_names=["x", "t"],
                      verbose=False)
    m = onnx.load(str(path))
    assert (spelling == "wan") == any(x.op_type == "ScatterND" for x in m.graph.node)
    irm, counts = rewritten(m, canonicalize, ulps=ULPS)
    kinds = ops(irm)
    rotations = [x for x in irm.graph if x.op_type == "MatMul" and x.inputs[1].const_value is not None
                 and x.inputs[1].const_value.numpy().shape == (D, D) and "rotation" in x.inputs[1].name]
    if spelling == "computed":
        assert counts[SUMS] == 0 and not rotations
        return
    assert counts[SUMS] == 1 and len(rotations) == 1
    assert not kinds["ScatterND"] and not kinds["Slice"] and not kinds["Split"], dict(kinds)
