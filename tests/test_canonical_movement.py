"""Movement normal forms (``sdnpu.passes.canonical.movement``) on tiny graphs: each rewrite fires where its
pattern is, the result passes onnx's full check and onnxruntime computes the same numbers, bit for bit; and its
near miss stays as it was."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper

from sdnpu.passes.canonical import movement
from sdnpu.passes.canonical.driver import sweep
from sdnpu.passes.pipeline import canonicalize

from .graphs import model, ops, rewritten, run, to_ir, to_proto

R = np.random.default_rng(0)


def n(op: str, ins: list[str], outs: list[str], **attrs) -> onnx.NodeProto:
    return helper.make_node(op, ins, outs, **attrs)


def w(*shape: int) -> np.ndarray:
    return (R.standard_normal(shape) * 0.2).astype(np.float32)


@pytest.mark.parametrize(("node", "inits", "shape"), [
    (n("Squeeze", ["x", "ax"], ["m"]), {"ax": np.array([1])}, [2, 3]),
    (n("Unsqueeze", ["x", "ax"], ["m"]), {"ax": np.array([0])}, [1, 2, 1, 3]),
    (n("Flatten", ["x"], ["m"], axis=1), {}, [2, 3]),
])
def test_squeeze_unsqueeze_and_flatten_are_a_reshape(node, inits, shape):
    m = model([node, n("Relu", ["m"], ["y"])], {"x": [2, 1, 3]}, {"y": shape}, inits)
    irm, counts = rewritten(m, movement.reshape_squeezes, sweep)
    assert counts["squeeze/unsqueeze/flatten -> reshape"] == 1 and dict(ops(irm)) == {"Reshape": 1, "Relu": 1}


def test_a_squeeze_of_an_unknown_shape_stays():
    """Without static shapes there is no Reshape target (a dynamic batch axis)."""
    g = helper.make_graph([n("Squeeze", ["x", "ax"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", T.FLOAT, ["batch", 1, 3])],
                          [helper.make_tensor_value_info("y", T.FLOAT, ["batch", 3])],
                          [onnx.numpy_helper.from_array(np.array([1]), "ax")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])
    irm, counts = rewritten(m, movement.reshape_squeezes, feeds={"x": w(2, 1, 3)})
    assert counts["squeeze/unsqueeze/flatten -> reshape"] == 0 and dict(ops(irm)) == {"Squeeze": 1}


@pytest.mark.parametrize("perm", [None, [0, 2, 1]])
def test_a_transpose_without_perm_gets_it_written_out(perm):
    """The default reverses the axes (a fuzz regression: glue read the missing perm and crashed); a written
    perm stays as it is."""
    attrs = {"perm": perm} if perm else {}
    out = [4, 3, 2] if perm is None else [2, 4, 3]
    m = model([n("Transpose", ["x"], ["y"], **attrs)], {"x": [2, 3, 4]}, {"y": out})
    irm, counts = rewritten(m, movement.write_out_perms)
    assert counts["transpose perm written out"] == int(perm is None)
    assert list(next(iter(irm.graph)).attributes["perm"].value) == (perm or [2, 1, 0])


@pytest.mark.parametrize(("shape", "reps", "fires"), [((2, 3, 1, 4), (1, 1, 3, 1), True),
                                                     ((2, 3, 2, 4), (1, 1, 3, 1), False)])
def test_a_tile_of_a_size_one_axis_is_a_concat(shape, reps, fires):
    """Grouped-query attention's heads repeated (k.unsqueeze(3).repeat(1, 1, 1, r, 1), rank 4 here). Near miss:
    the repeated axis has two elements (a Concat of the view would interleave them)."""
    out = [s * r for s, r in zip(shape, reps, strict=True)]
    m = model([n("Tile", ["x", "reps"], ["y"])], {"x": list(shape)}, {"y": out}, {"reps": np.array(reps)})
    irm, counts = rewritten(m, movement.concat_tiles)
    assert counts["tiles of a size-1 axis -> Concat"] == int(fires)
    assert dict(ops(irm)) == ({"Reshape": 2, "Concat": 1} if fires else {"Tile": 1})


@pytest.mark.parametrize(("pads", "mode", "fires"), [
    ([0, 0, 0, 0, 0, 0, 1, 1], "constant", True),   # the VAE encoder's downsampler: right and bottom by one
    ([0, 0, 1, 2, 0, 0, 2, 1], "constant", True),
    ([0, 0, -1, 0, 0, 0, 0, -1], "constant", False),  # a crop (a fuzz regression: the Conv got pads -1)
    ([0, 0, 1, 1, 0, 0, 1, 1], "reflect", False),
])
def test_a_zero_pad_before_a_conv_becomes_its_pads(pads, mode, fires):
    p = np.array(pads)
    h, wd = 6 + p[2] + p[6], 6 + p[3] + p[7]
    m = model([n("Pad", ["x", "pads"], ["p"], mode=mode), n("Conv", ["p", "k"], ["y"], pads=[0, 0, 0, 0])],
              {"x": [1, 2, 6, 6]}, {"y": [1, 3, int(h) - 2, int(wd) - 2]}, {"pads": p, "k": w(3, 2, 3, 3)})
    irm, counts = rewritten(m, movement.merge_pad_into_conv, sweep)
    assert counts["Pad merged into Conv"] == int(fires)
    conv = next(x for x in irm.graph if x.op_type == "Conv")
    if fires:
        assert dict(ops(irm)) == {"Conv": 1}
        assert list(conv.attributes["pads"].value) == [int(p[2]), int(p[3]), int(p[6]), int(p[7])]
    else:
        assert dict(ops(irm)) == {"Pad": 1, "Conv": 1}


@pytest.mark.parametrize(("eq", "shapes", "out", "expect"), [
    ("nhwpqc->nchpwq", [(1, 2, 3, 2, 2, 4)], (1, 4, 2, 2, 3, 2), {"Transpose": 1}),  # the DiTs' unpatchify
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)], (2, 3, 5), {"Reshape": 3, "MatMul": 1}),
    ("bhqd,bhkd->bhqk", [(2, 2, 3, 4), (2, 2, 5, 4)], (2, 2, 3, 5), {"Transpose": 1, "Reshape": 3, "MatMul": 1}),
    ("i,j->ij", [(3,), (4,)], (3, 4), {"Reshape": 3, "Mul": 1}),  # torch.outer: nothing summed, a broadcast Mul
])
def test_an_einsum_that_moves_or_multiplies_is_those_ops(eq, shapes, out, expect):
    names = [f"x{i}" for i in range(len(shapes))]
    m = model([n("Einsum", names, ["y"], equation=eq)], {k: list(s) for k, s in zip(names, shapes, strict=True)},
              {"y": list(out)})
    irm, counts = rewritten(m, movement.lower_einsum)  # bit for bit: onnxruntime's Einsum sums as its MatMul does
    assert counts["Einsum -> Transpose / MatMul"] == 1 and dict(ops(irm)) == expect


@pytest.mark.parametrize(("eq", "shapes", "out"), [("ij->i", [(3, 4)], (3,)),  # a sum over one operand's index
                                                   ("ii->i", [(3, 3)], (3,)),  # a diagonal
                                                   ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)], (2, 3, 5))])
def test_another_einsum_stays(eq, shapes, out):
    names = [f"x{i}" for i in range(len(shapes))]
    m = model([n("Einsum", names, ["y"], equation=eq)], {k: list(s) for k, s in zip(names, shapes, strict=True)},
              {"y": list(out)})
    irm, counts = rewritten(m, movement.lower_einsum)
    assert counts["Einsum -> Transpose / MatMul"] == 0 and dict(ops(irm)) == {"Einsum": 1}


@pytest.mark.parametrize(("rows", "fires"), [([1, 2, 3], True), ([0, 2], False)])
def test_a_scatter_of_a_block_of_rows_is_a_concat(rows, fires):
    """CogView4's ``query[:, text:] = rope(query[:, text:])``: rows 1-3 of 5 along axis 1 written by the
    updates, the Concat of the rows before, the updates, the rows after. Near miss: rows 0 and 2 (no block)."""
    idx = np.stack(np.meshgrid([0, 1], rows, indexing="ij"), -1)  # [2, k, 2]: (batch, row) of each update row
    m = model([n("Relu", ["u"], ["r"]), n("ScatterND", ["x", "idx", "r"], ["y"])],
              {"x": [2, 5, 3], "u": [2, len(rows), 3]}, {"y": [2, 5, 3]}, {"idx": idx})
    irm, counts = rewritten(m, movement.concat_row_scatters)
    assert counts["row-block ScatterND -> Concat"] == int(fires)
    assert dict(ops(irm)) == ({"Relu": 1, "Slice": 2, "Concat": 1} if fires else {"Relu": 1, "ScatterND": 1})


@pytest.mark.parametrize("case", ["interleave", "transposed", "three", "computed", "half", "unordered"])
def test_scatters_of_every_row_in_turn_are_an_interleave(case):
    """``out[..., 0::2] = a; out[..., 1::2] = b`` as dynamo exports it: the axis moved first, two ScatterNDs
    writing rows 0, 2, 4 and 1, 3, 5 over zeros (Wan's rotary). An interleave (each update viewed [3, 1, ..], a
    Concat, a Reshape), and where the updates are Transposes of one perm, of their inputs then one Transpose;
    bit for bit; a computed value the scatters overwrite everywhere goes. Near misses stay: rows left with the
    data's (half), rows written out of order (unordered)."""
    stride = 3 if case == "three" else 2
    rows = 3 * stride
    nodes, inputs, inits = [], {}, {"base": np.zeros((rows, 2, 4), np.float32)}
    data = "base"
    if case == "computed":
        nodes.append(n("Relu", ["v"], ["data"]))
        inputs["v"], data = [rows, 2, 4], "data"
    for r in range(1 if case == "half" else stride):
        at = np.arange(r, rows, stride)
        inits[f"i{r}"] = (at[::-1] if case == "unordered" and r == 1 else at)[:, None].astype(np.int64)
        if case == "transposed":  # the update [3, 2, 4] moved from [2, 4, 3]
            inputs[f"u{r}"] = [2, 4, 3]
            nodes.append(n("Transpose", [f"u{r}"], [f"t{r}"], perm=[2, 0, 1]))
        else:
            inputs[f"u{r}"] = [3, 2, 4]
            nodes.append(n("Relu", [f"u{r}"], [f"t{r}"]))
        nodes.append(n("ScatterND", [data, f"i{r}", f"t{r}"], [f"s{r}"]))
        data = f"s{r}"
    nodes.append(n("Identity", [data], ["y"]))
    irm, counts = rewritten(model(nodes, inputs, {"y": [rows, 2, 4]}, inits), movement.interleave_row_scatters, sweep)
    fires = case not in ("half", "unordered")
    assert counts["strided ScatterND rows -> interleave"] == int(fires)
    kinds = dict(ops(irm))
    assert ("ScatterND" in kinds) != fires
    if case == "transposed":
        assert kinds == {"Reshape": 3, "Concat": 1, "Transpose": 1, "Identity": 1}
        cat = next(x for x in irm.graph if x.op_type == "Concat")
        assert cat.attributes["axis"].value == 3  # the updates' inputs' last axis, interleaved there
    if case == "computed":
        assert kinds == {"Relu": 2, "Reshape": 3, "Concat": 1, "Identity": 1}


@pytest.mark.parametrize("also_read", [False, True])
def test_a_scalar_broadcast_chain_is_one_expand_or_none(also_read):
    """The timestep broadcast to the batch: one Expand, and none where all it meets is a constant (broadcast
    offline); kept where something else reads it too (near miss)."""
    nodes = [n("Unsqueeze", ["t", "z"], ["u"]), n("Expand", ["u", "b"], ["e"]), n("Unsqueeze", ["e", "o"], ["y0"]),
             n("Mul", ["y0", "f"], ["y"])]
    outputs = {"y": [2, 3]}
    if also_read:
        nodes.append(n("Sin", ["y0"], ["s"]))
        outputs["s"] = [2, 1]
    m = model(nodes, {"t": []}, outputs, {"z": np.array([0]), "b": np.array([2]), "o": np.array([1]), "f": w(1, 3)})
    irm = to_ir(m)
    canonicalize(irm)
    assert dict(ops(irm)) == ({"Expand": 1, "Mul": 1, "Sin": 1} if also_read else {"Mul": 1})
    feeds = {"t": np.array(3.0, np.float32)}
    for a, b in zip(run(to_proto(irm), feeds), run(m, feeds), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_broadcast_chain_is_one_expand():
    """Reshape -> Expand -> Reshape of the timestep is one Expand; a chain over a value of several elements
    stays (near miss: the second input's)."""
    m = model([n("Reshape", ["t", "s1"], ["a"]), n("Expand", ["a", "b"], ["e"]), n("Reshape", ["e", "s2"], ["y"]),
               n("Reshape", ["v", "s1"], ["va"]), n("Expand", ["va", "b"], ["ve"]), n("Relu", ["ve"], ["z"])],
              {"t": [1], "v": [1, 2]}, {"y": [2, 1], "z": [2, 2]},
              {"s1": np.array([1, -1]), "b": np.array([2, 1]), "s2": np.array([2, 1])})
    irm, counts = rewritten(m, movement.merge_broadcast_chains, sweep)
    assert counts["broadcast chains -> Expand"] == 1
    assert dict(ops(irm)) == {"Expand": 2, "Reshape": 1, "Relu": 1}


@pytest.mark.parametrize("shared", [False, True])
def test_an_expand_that_meets_a_constant_is_folded_into_it(shared):
    """Mul(Expand(t), f): t times f broadcast offline, one CPU node; near miss: the Expand is read elsewhere too."""
    nodes = [n("Expand", ["t", "b"], ["e"]), n("Mul", ["e", "f"], ["y"])]
    outputs = {"y": [2, 3]} | ({"e": [2, 1]} if shared else {})
    m = model(nodes, {"t": [1, 1]}, outputs, {"b": np.array([2, 1]), "f": w(1, 3)})
    irm, counts = rewritten(m, movement.fold_expands_into_constants, sweep)
    assert counts["expands folded into constants"] == int(not shared)
    assert dict(ops(irm)) == ({"Expand": 1, "Mul": 1} if shared else {"Mul": 1})


def test_a_nearest_upsampling_gather_is_a_resize():
    """Dynamo's nearest-exact upsampling by 2 (``_unsafe_index``) on the image moved to [H, W, B, C]: GatherND of
    indices (i // 2, j // 2). Near miss: indices that also mirror the columns are no upsampling."""
    idx = np.stack(np.meshgrid(np.arange(6) // 2, np.arange(8) // 2, indexing="ij"), -1)
    m = model([n("GatherND", ["x", "idx"], ["y"])], {"x": [3, 4, 1, 2]}, {"y": [6, 8, 1, 2]}, {"idx": idx})
    irm, counts = rewritten(m, movement.resize_nearest_gathers, sweep)
    assert counts["nearest upsampling gathers -> Resize"] == 1 and dict(ops(irm)) == {"Transpose": 2, "Resize": 1}
    odd = np.stack(np.meshgrid(np.arange(6) // 2, np.arange(8)[::-1] // 2, indexing="ij"), -1)
    m = model([n("GatherND", ["x", "idx"], ["y"])], {"x": [3, 4, 1, 2]}, {"y": [6, 8, 1, 2]}, {"idx": odd})
    irm, counts = rewritten(m, movement.resize_nearest_gathers, sweep)
    assert counts["nearest upsampling gathers -> Resize"] == 0


@pytest.mark.parametrize(("repeats", "fires"), [(4, True), (2, False)])
def test_pixels_repeated_into_blocks_are_a_resize(repeats, fires):
    """Wan 2.2's DupUp3D: each channel repeated, the copies moved into 2x2 blocks of space (Reshape, Expand,
    Reshape, Transpose, Reshape): a nearest upsampling where it repeats each channel 4 times; with 2 repeats it
    mixes channels into space (a near miss)."""
    c, out_c = 4, 4 * repeats // 4
    nodes = [n("Reshape", ["x", "s1"], ["a"]), n("Expand", ["a", "s2"], ["b"]), n("Reshape", ["b", "s3"], ["d"]),
             n("Transpose", ["d"], ["e"], perm=[0, 1, 5, 2, 6, 3, 7, 4]), n("Reshape", ["e", "s4"], ["y"])]
    inits = {"s1": np.array([1, c, 1, 1, 3, 3]), "s2": np.array([1, c, repeats, 1, 3, 3]),
             "s3": np.array([1, out_c, 1, 2, 2, 1, 3, 3]), "s4": np.array([1, out_c, 1, 6, 6])}
    m = model(nodes, {"x": [1, c, 1, 3, 3]}, {"y": [1, out_c, 1, 6, 6]}, inits)
    irm, counts = rewritten(m, movement.resize_repeated_pixels, sweep)
    assert counts["nearest upsampling movements -> Resize"] == int(fires)
    if fires:
        assert dict(ops(irm)) == {"Reshape": 2, "Resize": 1}


@pytest.mark.parametrize(("index", "fires"), [
    (np.array(0), True),          # SVD's frame 0 of the encoder states repeated over two frames (dynamo's Concat)
    (np.array(1), True),          # the second operand
    (np.array([1, 0]), False),    # both frames, swapped: not one operand
    (np.array([0]), True),        # one frame, its axis kept
])
def test_a_gather_of_one_concat_operand_is_a_view_of_it(index, fires):
    """Concat(a, b) of [1, 32] rows along axis 1, viewed [1, 2, 1, 32], Gather along the frames: the pick of one
    operand, whole and in order, is a Reshape of it; anything else stays a Gather."""
    out = [1, *index.shape, 1, 32]
    m = model([n("Concat", ["a", "b"], ["c"], axis=1), n("Reshape", ["c", "s"], ["v"]),
               n("Gather", ["v", "i"], ["y"], axis=1)], {"a": [1, 32], "b": [1, 32]}, {"y": out},
              {"s": np.array([1, 2, 1, 32]), "i": index})
    irm, counts = rewritten(m, movement.select_concat_parts, sweep)
    assert counts["a Gather of one Concat operand -> a view of it"] == int(fires)
    assert ("Gather" in ops(irm)) != fires and ("Concat" in ops(irm)) != fires, ops(irm)


@pytest.mark.parametrize(("index", "fires"), [(np.array(0), True), (np.array(1), True), (np.array([0, 1]), False)])
def test_a_gather_of_one_expanded_copy_is_a_view_of_the_input(index, fires):
    """Expand [1, 1, 1, 32] -> [1, 2, 1, 32] (the repeat before it is a Concat), Gather along the copies: one copy
    is the input itself; two are not."""
    out = [1, *index.shape, 1, 32]
    m = model([n("Expand", ["a", "s"], ["v"]), n("Gather", ["v", "i"], ["y"], axis=1)], {"a": [1, 1, 1, 32]},
              {"y": out}, {"s": np.array([1, 2, 1, 32]), "i": index})
    irm, counts = rewritten(m, movement.select_concat_parts, sweep)
    assert counts["a Gather of one Concat operand -> a view of it"] == int(fires)
    assert ("Gather" in ops(irm)) != fires and ("Expand" in ops(irm)) != fires, ops(irm)
