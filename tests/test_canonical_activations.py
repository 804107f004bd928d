"""Activation spellings (``sdnpu.passes.canonical.activations``) on tiny graphs: GELU's Erf and tanh forms
become one Gelu, ``Div(1, x)`` a Reciprocal; each result passes onnx's full check and onnxruntime computes the
same numbers (a Reciprocal bit for bit; a Gelu within two units of rounding at the output's scale, its own
kernel against the written-out formula, measured below); and each near miss stays as it was."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper

from sdnpu.passes.canonical import activations
from sdnpu.passes.canonical.driver import sweep

from .graphs import model, ops, rewritten

# onnxruntime's Gelu kernel against the written-out formula, in units of the output type's rounding at the
# output's scale (eps * max |y|), at most, measured on 20 seeded inputs three times as wide as the tests': Erf
# form fp32 0.41, fp16 0.21 (the formula rounds each of its four steps to fp16), tanh form 1.6
ULPS = 2


def n(op: str, ins: list[str], outs: list[str], **attrs) -> onnx.NodeProto:
    return helper.make_node(op, ins, outs, **attrs)


def erf_gelu(divide: bool = True, root2: float = 2**0.5, half_shape: tuple[int, ...] = (),
             dtype: int = T.FLOAT) -> onnx.ModelProto:
    """x * (erf(x / sqrt 2) + 1) * 0.5, as TorchScript writes it (``divide``) or with the reciprocal's product
    (optimum)."""
    np_dtype = np.float16 if dtype == T.FLOAT16 else np.float32
    scale = ("Div", np.asarray(root2, np_dtype)) if divide else ("Mul", np.asarray(1 / root2, np_dtype))
    out = [1, 2, 8] if half_shape else [2, 8]
    return model([n(scale[0], ["x", "k"], ["d"]), n("Erf", ["d"], ["e"]), n("Add", ["e", "one"], ["a"]),
                  n("Mul", ["x", "a"], ["m"]), n("Mul", ["m", "half"], ["y"])], {"x": [2, 8]}, {"y": out},
                 {"k": scale[1], "one": np.asarray(1, np_dtype), "half": np.full(half_shape, 0.5, np_dtype)},
                 dtype=dtype)


@pytest.mark.parametrize(("divide", "dtype"), [(True, T.FLOAT), (False, T.FLOAT), (True, T.FLOAT16)])
def test_an_erf_gelu_is_one_gelu(divide, dtype):
    """fp16 stores sqrt 2 as 1.4140625, 1.5e-4 off: still GELU (a fuzz regression)."""
    m = erf_gelu(divide, dtype=dtype)
    irm, counts = rewritten(m, activations.collapse_erf_gelu, ulps=ULPS)
    assert counts["Erf GELU -> Gelu"] == 1 and dict(ops(irm)) == {"Gelu": 1}
    gelu = next(iter(irm.graph))
    assert gelu.attributes["approximate"].value == "none"


@pytest.mark.parametrize("miss", ["other_divisor", "rank_raising_half"])
def test_an_erf_gelu_near_miss_stays(miss):
    """erf(x / 1.5) is no GELU; a 0.5 of shape [1, 1, 1] makes the output [1, 2, 8], not x's [2, 8] (a fuzz
    regression: it became Gelu(x) of the wrong rank)."""
    m = erf_gelu(root2=1.5) if miss == "other_divisor" else erf_gelu(half_shape=(1, 1, 1))
    irm, counts = rewritten(m, activations.collapse_erf_gelu)
    assert counts["Erf GELU -> Gelu"] == 0 and ops(irm)["Erf"] == 1 and "Gelu" not in ops(irm)


def tanh_gelu(spelling: str, coeff: float = 0.044715, also_read: bool = False) -> onnx.ModelProto:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + c x^3))) on a Relu's output, in the spellings exporters write."""
    c = {"half": np.array(0.5, np.float32), "one": np.array(1.0, np.float32), "three": np.array(3.0, np.float32),
         "k": np.array(coeff, np.float32), "r": np.array(np.sqrt(2 / np.pi), np.float32)}
    cube = [n("Pow", ["h", "three"], ["h3"])] if spelling != "cube_mul" else \
        [n("Mul", ["h", "h"], ["h2"]), n("Mul", ["h2", "h"], ["h3"])]
    body = [n("Relu", ["x"], ["h"]), *cube, n("Mul", ["h3", "k"], ["kc"]), n("Add", ["h", "kc"], ["in"]),
            n("Mul", ["r", "in"], ["arg"]), n("Tanh", ["arg"], ["t"]), n("Add", ["t", "one"], ["u"])]
    if spelling == "half_last":  # TorchScript's approximate='tanh'
        body += [n("Mul", ["h", "u"], ["hu"]), n("Mul", ["hu", "half"], ["y"])]
    elif spelling == "half_of_sum":  # ((1 + tanh) * 0.5) * x
        body += [n("Mul", ["u", "half"], ["uh"]), n("Mul", ["uh", "h"], ["y"])]
    else:  # transformers' gelu_new (T5): 0.5 * x * (1 + tanh(...))
        body += [n("Mul", ["h", "half"], ["hh"]), n("Mul", ["hh", "u"], ["y"])]
    if spelling == "cube_mul":
        del c["three"]
    outs = {"y": [2, 6]} | ({"t": [2, 6]} if also_read else {})
    return model(body, {"x": [2, 6]}, outs, c)


@pytest.mark.parametrize("spelling", ["half_last", "half_first", "half_of_sum", "cube_mul"])
def test_a_written_out_tanh_gelu_is_one_gelu(spelling):
    irm, counts = rewritten(tanh_gelu(spelling), activations.collapse_tanh_gelu, sweep, ulps=ULPS)
    assert counts["tanh GELU -> Gelu"] == 1 and dict(ops(irm)) == {"Relu": 1, "Gelu": 1}
    gelu = next(x for x in irm.graph if x.op_type == "Gelu")
    assert gelu.attributes["approximate"].value == "tanh"


@pytest.mark.parametrize(("coeff", "also_read"), [(0.04, False), (0.044715, True)])
def test_a_tanh_gelu_near_miss_stays(coeff, also_read):
    """Another cube coefficient is not GELU; a tanh read elsewhere too must stay to be read."""
    irm, counts = rewritten(tanh_gelu("half_first", coeff, also_read), activations.collapse_tanh_gelu, sweep)
    assert counts["tanh GELU -> Gelu"] == 0 and ops(irm)["Tanh"] == 1 and "Gelu" not in ops(irm)


@pytest.mark.parametrize(("numerator", "fires"), [(1.0, True), (2.0, False)])
def test_one_over_x_is_a_reciprocal(numerator, fires):
    """TorchScript's RMS norm: 1 / sqrt(mean(x^2) + eps). 2 / x is not a Reciprocal (the near miss)."""
    m = model([n("Mul", ["x", "x"], ["sq"]), n("ReduceMean", ["sq", "axes"], ["ms"]), n("Add", ["ms", "eps"], ["v"]),
               n("Sqrt", ["v"], ["s"]), n("Div", ["num", "s"], ["r"]), n("Mul", ["x", "r"], ["y"])],
              {"x": [2, 8]}, {"y": [2, 8]}, {"axes": np.array([-1]), "eps": np.asarray(1e-6, np.float32),
                                             "num": np.asarray(numerator, np.float32)})
    irm, counts = rewritten(m, activations.use_reciprocals, sweep)
    assert counts["1 / x -> Reciprocal"] == int(fires)
    assert (ops(irm)["Reciprocal"], ops(irm)["Div"]) == ((1, 0) if fires else (0, 1))
