"""Neutral and no-op removal (``sdnpu.passes.canonical.noops``) on tiny graphs: each rewrite fires where its
pattern is, the result passes onnx's full check and onnxruntime computes the same numbers, bit for bit; and its
near miss stays as it was."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper
from onnx.reference import ReferenceEvaluator

from sdnpu.passes.canonical import noops
from sdnpu.passes.canonical.driver import apply, sweep
from sdnpu.passes.pipeline import canonicalize

from .graphs import feeds_for, model, ops, rewritten, run, to_ir, to_proto

R = np.random.default_rng(0)


def n(op: str, ins: list[str], outs: list[str], **attrs) -> onnx.NodeProto:
    return helper.make_node(op, ins, outs, **attrs)


def w(*shape: int) -> np.ndarray:
    return (R.standard_normal(shape) * 0.2).astype(np.float32)


# ---- Identity ---------------------------------------------------------------------------------------------------

def test_an_identity_goes_and_its_output_keeps_its_name():
    m = model([n("Relu", ["x"], ["r"]), n("Identity", ["r"], ["y"])], {"x": [2, 3]}, {"y": [2, 3]})
    irm, counts = rewritten(m, noops.drop_identities)
    assert counts["identities dropped"] == 1 and dict(ops(irm)) == {"Relu": 1}
    assert [v.name for v in irm.graph.outputs] == ["y"]


def test_an_identity_between_two_outputs_stays():
    """Sigmoid -> s (an output) -> Identity -> y (an output): the graph returns one value under two names, so
    the Identity stays (onnx_ir's IdentityEliminationPass lost one of them: a fuzz regression)."""
    m = model([n("Sigmoid", ["x"], ["s"]), n("Identity", ["s"], ["y"])], {"x": [2, 3]}, {"y": [2, 3], "s": [2, 3]})
    irm, counts = rewritten(m, noops.drop_identities)
    assert counts["identities dropped"] == 0 and ops(irm)["Identity"] == 1


# ---- x * 1, x / 1, x + 0 --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("op", "value"), [("Mul", 1.0), ("Div", 1.0), ("Add", 0.0)])
def test_a_neutral_scalar_goes(op, value):
    m = model([n("Relu", ["x"], ["r"]), n(op, ["r", "c"], ["s"]), n("Sigmoid", ["s"], ["y"])], {"x": [2, 4]},
              {"y": [2, 4]}, {"c": np.asarray(value, np.float32)})
    irm, counts = rewritten(m, noops.drop_neutral, sweep)
    assert counts["x*1, x/1, x+0 removed"] == 1 and dict(ops(irm)) == {"Relu": 1, "Sigmoid": 1}


def test_a_neutral_scalar_that_raises_the_rank_stays():
    """x * ones([1, 1, 1]) of x [2, 4] is [1, 2, 4]: not x."""
    m = model([n("Mul", ["x", "c"], ["y"])], {"x": [2, 4]}, {"y": [1, 2, 4]}, {"c": np.ones((1, 1, 1), np.float32)})
    irm, counts = rewritten(m, noops.drop_neutral, sweep)
    assert counts["x*1, x/1, x+0 removed"] == 0 and dict(ops(irm)) == {"Mul": 1}


def test_a_weight_that_holds_zeros_or_ones_keeps_its_place():
    """A zero-initialized bias and a norm's gamma of ones (seeded presets, ControlNets' zero convolutions) are
    weights: the compiled graph has the form a trained checkpoint's would, whatever they hold now (a LoRA or
    another checkpoint changes them in place)."""
    m = model([n("MatMul", ["x", "w"], ["h"]), n("Add", ["h", "b"], ["y0"]), n("Mul", ["y0", "g"], ["y"])],
              {"x": [1, 4, 8]}, {"y": None}, {"w": w(8, 6), "b": np.zeros(6, np.float32), "g": np.ones(6, np.float32)})
    irm = to_ir(m)
    canonicalize(irm)
    assert ops(irm)["Add"] == 1 and ops(irm)["Mul"] == 1
    assert {"b", "g"} <= set(irm.graph.initializers)


# ---- Casts ------------------------------------------------------------------------------------------------------

def test_a_cast_to_the_type_it_has_goes():
    m = model([n("Cast", ["x"], ["c"], to=T.FLOAT), n("Relu", ["c"], ["y"])], {"x": [3]}, {"y": [3]})
    irm, counts = rewritten(m, noops.drop_noop_casts, sweep)
    assert counts["casts to the same type dropped"] == 1 and dict(ops(irm)) == {"Relu": 1}


def test_a_cast_that_changes_the_type_stays():
    m = model([n("Cast", ["x"], ["h"], to=T.FLOAT16), n("Cast", ["h"], ["y"], to=T.FLOAT)], {"x": [3]}, {"y": [3]})
    irm, counts = rewritten(m, noops.drop_noop_casts, sweep)
    assert counts["casts to the same type dropped"] == 0 and ops(irm)["Cast"] == 2


# ---- Expands and Reshapes to the shape they have -------------------------------------------------------------

def test_an_expand_to_the_shape_it_has_goes_and_a_broadcast_stays():
    m = model([n("Expand", ["x", "same"], ["e"]), n("Expand", ["e", "wide"], ["y"])], {"x": [2, 1, 3]},
              {"y": [2, 4, 3]}, {"same": np.array([1, 1, 3]), "wide": np.array([2, 4, 3])})
    irm, counts = rewritten(m, noops.drop_noop_expands)
    assert counts["expands and reshapes to the same shape dropped"] == 1 and dict(ops(irm)) == {"Expand": 1}


R_MASK = np.tril(np.ones((3, 3), bool))  # a causal condition, [S, S]


@pytest.mark.parametrize("reader", ["Add", "Mul", "Where"])
def test_an_expand_into_a_broadcasting_reader_goes(reader):
    """A mask [B, 1, 1, S] expanded to [B, 1, S, S] before an Add / Mul / Where that broadcasts it against
    [B, H, S, S] anyway: the reader reads the mask itself, bit for bit."""
    ins = ["e", "s"] if reader != "Where" else ["c", "e", "s"]
    m = model([n("Expand", ["m", "wide"], ["e"]), n(reader, ins, ["y"])],
              {"m": [2, 1, 1, 3], "s": [2, 4, 3, 3]}, {"y": [2, 4, 3, 3]},
              {"wide": np.array([2, 1, 3, 3]), "c": R_MASK})
    irm, counts = rewritten(m, noops.drop_broadcast_expands)
    assert counts["expands into broadcasting readers dropped"] == 1 and ops(irm)["Expand"] == 0


def test_an_expand_that_gives_its_reader_its_shape_stays():
    """The Expand makes the Add's output wider than its other operand would: it stays; so does one that a
    Reshape (no broadcast) reads."""
    m = model([n("Expand", ["m", "wide"], ["e"]), n("Add", ["e", "s"], ["y"]),
               n("Expand", ["m", "wide"], ["e2"]), n("Reshape", ["e2", "flat"], ["z"])],
              {"m": [2, 1, 1, 3], "s": [2, 1, 1, 3]}, {"y": [2, 1, 3, 3], "z": [18]},
              {"wide": np.array([2, 1, 3, 3]), "flat": np.array([18])})
    irm, counts = rewritten(m, noops.drop_broadcast_expands)
    assert counts["expands into broadcasting readers dropped"] == 0 and ops(irm)["Expand"] == 2


def test_an_expand_moves_below_the_element_wise_op_that_only_it_widens():
    """Lumina-Next's key mask: a bool row [B, 1, 1, N] expanded over the heads and queries, then ``Where(mask, 0,
    -inf)`` and the scores' Add. The Where runs on the row, the Expand after it, which the Add broadcasts anyway:
    it goes, and the scores' addend is the row, bit for bit. Near miss: a Reshape reads the Where (no broadcast):
    the Expand moves below the Where and stays."""
    nodes = [n("Cast", ["m"], ["mb"], to=T.BOOL), n("Expand", ["mb", "wide"], ["e"]),
             n("Where", ["e", "zero", "ninf"], ["bias"]), n("Add", ["s", "bias"], ["y"])]
    m = model(nodes, {"m": [2, 1, 1, 3], "s": [2, 4, 5, 3]}, {"y": [2, 4, 5, 3]},
              {"wide": np.array([2, 4, 5, 3]), "zero": np.array(0.0, np.float32),
               "ninf": np.array(-np.inf, np.float32)})
    feeds = {"m": np.array([1, 1, 0, 1, 0, 1], np.float32).reshape(2, 1, 1, 3),
             "s": np.random.default_rng(1).standard_normal((2, 4, 5, 3)).astype(np.float32)}
    irm, counts = rewritten(m, noops.sink_expands, noops.drop_broadcast_expands, feeds=feeds)
    assert counts["expands moved below element-wise ops"] == 1 and counts["expands into broadcasting readers dropped"] == 1
    assert ops(irm)["Expand"] == 0
    bias = next(x for x in irm.graph if x.op_type == "Where").outputs[0]
    assert list(bias.shape) == [2, 1, 1, 3]
    near = model(nodes[:3] + [n("Reshape", ["bias", "flat"], ["y"])], {"m": [2, 1, 1, 3]}, {"y": [120]},
                 {"wide": np.array([2, 4, 5, 3]), "zero": np.array(0.0, np.float32),
                  "ninf": np.array(-np.inf, np.float32), "flat": np.array([120])})
    irm, counts = rewritten(near, noops.sink_expands, noops.drop_broadcast_expands, feeds={"m": feeds["m"]})
    assert counts["expands moved below element-wise ops"] == 1 and ops(irm)["Expand"] == 1
    assert [x.op_type for x in irm.graph].index("Where") < [x.op_type for x in irm.graph].index("Expand")


@pytest.mark.parametrize("case", ["repeat", "grows"])
def test_an_expand_and_a_reshape_chain_to_the_shape_they_have_go(case):
    """TorchScript's attention repeats k and v for grouped-query attention: unsqueeze, expand, reshape back;
    at one group per head the three move nothing and go. Near miss: an Expand that broadcasts (two groups)
    stays a repeat: the Concat of two copies (``movement.concat_head_repeats``), between its views."""
    groups = 2 if case == "grows" else 1
    nodes = [n("Reshape", ["x", "u"], ["x5"]), n("Expand", ["x5", "t"], ["e"]), n("Reshape", ["e", "s"], ["r"]),
             n("Mul", ["r", "k"], ["y"])]
    inits = {"u": np.array([2, 1, 4, 3]), "t": np.array([1, groups, 1, 1]), "s": np.array([2 * groups, 4, 3]),
             "k": w(3)}
    out = [2 * groups, 4, 3]
    m = model(nodes, {"x": [2, 4, 3]}, {"y": out}, inits)
    irm = to_ir(m)
    canonicalize(irm)
    expected = {"repeat": {"Mul": 1}, "grows": {"Reshape": 4, "Concat": 1, "Mul": 1}}
    assert dict(ops(irm)) == expected[case]
    feeds = feeds_for(m)
    np.testing.assert_array_equal(run(to_proto(irm), feeds)[0], run(m, feeds)[0])


# ---- movements that move nothing --------------------------------------------------------------------------------

def _moves() -> dict[str, tuple[list[onnx.NodeProto], dict[str, list[int]], list[int], dict[str, np.ndarray]]]:
    """Each movement that moves nothing, given its constant parameters: (nodes writing ``m``, inputs, m's shape,
    constants); ``m`` then goes through a Relu."""
    return {
        "where_all_true": ([n("Where", ["keep", "x", "pad"], ["m"])], {"x": [2, 3]}, [2, 3],
                           {"keep": np.ones((2, 3), bool), "pad": w(2, 3)}),
        "where_all_false": ([n("Where", ["keep", "pad", "x"], ["m"])], {"x": [2, 3]}, [2, 3],
                            {"keep": np.zeros((2, 1), bool), "pad": w(1, 3)}),
        "split_one_part": ([n("Split", ["x"], ["m"], axis=1, num_outputs=1)], {"x": [2, 3]}, [2, 3], {}),
        "pad_zeros": ([n("Pad", ["x", "pads"], ["m"])], {"x": [2, 3]}, [2, 3], {"pads": np.zeros(4, np.int64)}),
        "scatter_whole": ([n("ScatterElements", ["zeros", "idx", "x"], ["m"], axis=1)], {"x": [2, 3]}, [2, 3],
                          {"zeros": np.zeros((2, 3), np.float32), "idx": np.tile(np.array([0, -2, 2]), (2, 1))}),
        "resize_same": ([n("Resize", ["x", "", "scales"], ["m"], mode="nearest")], {"x": [1, 2, 3, 3]},
                        [1, 2, 3, 3], {"scales": np.ones(4, np.float32)}),
        "depth_to_space_1": ([n("DepthToSpace", ["x"], ["m"], blocksize=1)], {"x": [1, 4, 2, 2]}, [1, 4, 2, 2], {}),
        "gather_size_one": ([n("Gather", ["x", "zero"], ["m"], axis=1)], {"x": [2, 1, 3]}, [2, 3],
                            {"zero": np.asarray(0, np.int64)}),
    }


@pytest.mark.parametrize("case", list(_moves()))
def test_a_movement_that_moves_nothing_goes(case):
    nodes, inputs, shape, inits = _moves()[case]
    m = model([*nodes, n("Relu", ["m"], ["y"])], inputs, {"y": shape}, inits)
    irm, counts = rewritten(m, noops.drop_noop_moves)
    assert counts["movements that move nothing dropped"] == 1
    # the Gather of a size-1 axis is the Reshape that drops it; the others are gone
    assert dict(ops(irm)) == ({"Reshape": 1, "Relu": 1} if case == "gather_size_one" else {"Relu": 1})


@pytest.mark.parametrize("case", ["pad_that_pads", "scatter_half", "where_mixed"])
def test_a_movement_that_moves_data_stays(case):
    nodes, inits, shape = {
        "pad_that_pads": ([n("Pad", ["x", "pads"], ["m"])], {"pads": np.array([0, 1, 0, 0])}, [2, 4]),
        "scatter_half": ([n("ScatterElements", ["zeros", "idx", "u"], ["m"], axis=1)],
                         {"zeros": np.zeros((2, 3), np.float32), "idx": np.array([[0], [2]])}, [2, 3]),
        "where_mixed": ([n("Where", ["keep", "x", "pad"], ["m"])],
                        {"keep": np.array([[True, False, True]] * 2), "pad": w(2, 3)}, [2, 3]),
    }[case]
    inputs = {"x": [2, 3]} | ({"u": [2, 1]} if case == "scatter_half" else {})
    m = model([*nodes, n("Relu", ["m"], ["y"])], inputs, {"y": shape}, inits)
    irm, counts = rewritten(m, noops.drop_noop_moves)
    assert counts["movements that move nothing dropped"] == 0 and len(irm.graph) == 2


# ---- a Where of constant rows -----------------------------------------------------------------------------------

@pytest.mark.parametrize("fill_first", [True, False])
def test_a_where_over_constant_rows_is_a_mul_and_an_add(fill_first):
    """Z-Image's caption padding: rows 1 and 3 of x are the pad token; the others are x's own."""
    mask = np.zeros((1, 4, 1), bool)
    mask[0, [1, 3]] = True
    ins = ["mask", "token", "x"] if fill_first else ["keep", "x", "token"]
    m = model([n("Where", ins, ["y"])], {"x": [1, 4, 3]}, {"y": [1, 4, 3]},
              {"mask": mask, "keep": ~mask, "token": w(1, 1, 3)})
    irm, counts = rewritten(m, noops.rewrite_where_as_arithmetic, sweep)
    assert counts["Where over constant rows -> Mul, Add"] == 1
    assert dict(ops(irm)) == {"Mul": 2, "Add": 1}


def test_a_where_of_two_constants_or_of_a_computed_mask_stays():
    m = model([n("Greater", ["x", "zero"], ["keep"]), n("Where", ["keep", "x", "token"], ["a"]),
               n("Where", ["mask", "t0", "t1"], ["b"]), n("Add", ["a", "b"], ["y"])], {"x": [1, 4, 3]},
              {"y": [1, 4, 3]}, {"zero": np.asarray(0.0, np.float32), "token": w(1, 1, 3),
                                 "mask": np.array([True, False, True, False]).reshape(1, 4, 1),
                                 "t0": w(1, 1, 3), "t1": w(1, 1, 3)})
    irm, counts = rewritten(m, noops.rewrite_where_as_arithmetic, sweep)
    assert counts["Where over constant rows -> Mul, Add"] == 0 and ops(irm)["Where"] == 2


def test_a_where_whose_fill_is_not_finite_stays():
    """A causal mask's -inf over constant rows (ONNX's FlexAttention test): x * keep + fill * mask would be NaN
    where the mask is 0 (-inf * 0), so the Where stays."""
    mask = np.triu(np.ones((4, 4), bool), 1)
    m = model([n("Where", ["mask", "neg_inf", "x"], ["y"])], {"x": [1, 4, 4]}, {"y": [1, 4, 4]},
              {"mask": mask, "neg_inf": np.asarray(-np.inf, np.float32)})
    irm, counts = rewritten(m, noops.rewrite_where_as_arithmetic, sweep)
    assert counts["Where over constant rows -> Mul, Add"] == 0 and ops(irm)["Where"] == 1


# ---- softmax NaN guards -----------------------------------------------------------------------------------------

def _guarded(mask: str) -> onnx.ModelProto:
    """q @ k^T scaled, maybe masked, Softmax, TorchScript's NaN guard ``Where(IsNaN(p), 0, p)``, times v."""
    nodes = [n("MatMul", ["q", "kt"], ["s0"]), n("Mul", ["s0", "scale"], ["s"])]
    inputs = {"q": [2, 3, 4], "kt": [2, 4, 5]}
    scores = "s"
    if mask == "constant":  # a finite offset: no row can be all masked
        nodes.append(n("Add", ["s", "bias"], ["sm"]))
        scores = "sm"
    elif mask == "computed":  # -inf where an input says: a row can be
        inputs["keep"] = [2, 1, 5]
        nodes += [n("Greater", ["keep", "zero"], ["k"]), n("Where", ["k", "zero", "ninf"], ["bias_in"]),
                  n("Add", ["s", "bias_in"], ["sm"])]
        scores = "sm"
    nodes += [n("Softmax", [scores], ["p"], axis=-1), n("IsNaN", ["p"], ["nan"]),
              n("Where", ["nan", "zero", "p"], ["pg"]), n("MatMul", ["pg", "v"], ["y"])]
    inits = {"scale": np.asarray(0.5, np.float32), "zero": np.asarray(0.0, np.float32), "v": w(5, 2)}
    inits |= {"bias": w(1, 1, 5)} if mask == "constant" else {}
    inits |= {"ninf": np.asarray(-np.inf, np.float32)} if mask == "computed" else {}
    return model(nodes, inputs, {"y": [2, 3, 2]}, inits)


@pytest.mark.parametrize("mask", ["none", "constant"])
def test_a_softmax_guard_without_a_mask_goes(mask):
    irm, counts = rewritten(_guarded(mask), noops.drop_softmax_guards)
    assert counts["softmax NaN guards without a mask dropped"] == 1
    assert ops(irm)["IsNaN"] == 0 and ops(irm)["Where"] == 0


def test_a_softmax_guard_behind_a_computed_mask_stays():
    m = _guarded("computed")
    feeds = feeds_for(m) | {"keep": np.array([[[-1, -1, -1, -1, -1]], [[1, -1, 1, 1, -1]]], np.float32)}
    y = run(m, feeds)[0]
    assert not np.isnan(y).any() and not y[0].any()  # batch row 0 has no key: the guard gives it zeros
    irm, counts = rewritten(m, noops.drop_softmax_guards, feeds=feeds)
    assert counts["softmax NaN guards without a mask dropped"] == 0 and ops(irm)["IsNaN"] == 1


@pytest.mark.parametrize("branches", [("c", "a", "b"), ("c", "False", "b"), ("c", "a", "True"), ("c", "True", "b")])
def test_a_where_of_booleans_is_and_or_not(branches):
    """onnxruntime has no boolean Where kernel (dynamo writes ``mask.masked_fill(idx, False)`` so, HunyuanVideo's
    token mask): ``Where(c, a, b)`` becomes ``Or(And(c, a), And(Not(c), b))``, a scalar constant branch its
    shorter form, broadcast as the Where was; the values are the reference evaluator's run of the graph."""
    consts = {"False": np.array(False), "True": np.array(True)}
    inputs = [helper.make_tensor_value_info(k, T.BOOL, shape) for k, shape in
              (("c", [2, 1, 4]), ("a", [2, 3, 4]), ("b", [1, 3, 4]))]
    inputs = [i for i in inputs if i.name in branches]
    g = helper.make_graph([n("Where", list(branches), ["y"])], "g", inputs,
                          [helper.make_tensor_value_info("y", T.BOOL, [2, 3, 4])],
                          [onnx.numpy_helper.from_array(v, k) for k, v in consts.items() if k in branches])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])
    rng = np.random.default_rng(0)
    feeds = {i.name: rng.random([d.dim_value for d in i.type.tensor_type.shape.dim]) > 0.5 for i in inputs}
    irm = to_ir(m)
    assert apply(irm.graph, noops.rewrite_bool_where) == 1
    out = to_proto(irm)
    onnx.checker.check_model(out, full_check=True)
    assert "Where" not in ops(irm), ops(irm)
    np.testing.assert_array_equal(run(out, feeds)[0], ReferenceEvaluator(m).run(None, feeds)[0])


@pytest.mark.parametrize("case", ["latte", "mixed", "matmul", "sinusoid"])
def test_an_expand_of_leading_axes_moves_below_a_reshape_and_a_split(case):
    """Latte repeats its timestep's modulation [1, 6C] for each of the S pixels ([S, 6C]), views it [S, 6, C],
    adds its table and chunks it: the Expand moves below the Reshape, the Add and the Split, and each chunk's
    then goes into the product with the tokens, which broadcasts it anyway: no Expand left, bit for bit. Near
    misses keep it above the Reshape: a Reshape that mixes the repeated axis with the others ([S, 6C] ->
    [2S, 3C]), one a MatMul reads (SVD's context repeated over the pixels for K and V, which the frames pass
    reads as that Expand), and one whose product ends in a Sin and a Cos (a UNet's timestep over the batch
    before its sinusoid: the Expand would stop between them, where the sinusoid step no longer reads it)."""
    s, c = 4, 3
    shape = [2 * s, 3 * c] if case == "mixed" else [s, 6, c]
    nodes = [n("Expand", ["e", "wide"], ["ew"]), n("Reshape", ["ew", "view"], ["v"])]
    if case == "latte":
        nodes += [n("Add", ["v", "table"], ["t"]), n("Split", ["t", "sizes"], [f"p{i}" for i in range(6)], axis=1),
                  *[n("Mul", ["x", f"p{i}"], [f"m{i}"]) for i in range(6)], n("Sum", [f"m{i}" for i in range(6)], ["y"])]
        out = [s, 2, c]
    elif case == "mixed":
        nodes += [n("Relu", ["v"], ["y"])]
        out = shape
    elif case == "matmul":
        nodes += [n("MatMul", ["v", "k"], ["y"])]
        out = [s, 6, 2]
    else:
        nodes += [n("Mul", ["v", "table"], ["a"]), n("Sin", ["a"], ["sa"]), n("Cos", ["a"], ["ca"]),
                  n("Concat", ["sa", "ca"], ["y"], axis=2)]
        out = [s, 6, 2 * c]
    m = model(nodes, {"e": [1, 6 * c], "x": [s, 2, c]} if case == "latte" else {"e": [1, 6 * c]}, {"y": out},
              {"wide": np.array([s, 6 * c]), "view": np.array(shape), "table": w(1, 6, c),
               "sizes": np.ones(6, np.int64), "k": w(c, 2)})
    irm, counts = rewritten(m, noops.sink_expands, noops.drop_broadcast_expands)
    assert ops(irm)["Expand"] == (0 if case == "latte" else 1), (ops(irm), counts)
    if case != "latte":  # where it was: the Reshape reads it
        assert next(x for x in irm.graph if x.op_type == "Reshape").inputs[0].producer().op_type == "Expand"
