"""The parallel pass (passes/parallel.py): projections of one input each through the same op the registry
lacks become one SDGemm, one op and one Split, exactly the same numbers; what must not join stays."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from sdnpu.passes.manager import entry_name, run_passes
from sdnpu.passes.pipeline import CompileOptions, compile_model, pipeline

from .graphs import feeds_for, model, ops, run, to_ir, to_proto, with_functions

B, S, C, K = 1, 6, 8, 5


def _gates(n: int, op: str = "Tanh", shared: bool = False, other_op: bool = False) -> onnx.ModelProto:
    """x through a Linear; n gates tanh(Linear_i(silu(cond))), each gating x: Z-Image's residual gates."""
    rng = np.random.default_rng(0)
    inits: dict[str, np.ndarray] = {"wx": rng.standard_normal((C, C)).astype(np.float32) * 0.3,
                                    "wc": rng.standard_normal((K, K)).astype(np.float32) * 0.3}
    nodes = [helper.make_node("MatMul", ["x", "wx"], ["h"]), helper.make_node("MatMul", ["cond", "wc"], ["c0"]),
             helper.make_node("Sigmoid", ["c0"], ["sg"]), helper.make_node("Mul", ["c0", "sg"], ["c"])]
    out = "h"
    for i in range(n):
        inits[f"w{i}"] = rng.standard_normal((K, C)).astype(np.float32) * 0.3
        inits[f"b{i}"] = rng.standard_normal(C).astype(np.float32) * 0.1
        nodes += [helper.make_node("MatMul", ["c", f"w{i}"], [f"p{i}"]),
                  helper.make_node("Add", [f"p{i}", f"b{i}"], [f"q{i}"]),
                  helper.make_node("Sigmoid" if other_op and i == 0 else op, [f"q{i}"], [f"g{i}"]),
                  helper.make_node("Mul", [f"g{i}", "h"], [f"m{i}"]),
                  helper.make_node("Add", [out, f"m{i}"], [f"o{i}"])]
        out = f"o{i}"
        if shared and i == 0:  # the projection read by another op too
            nodes.append(helper.make_node("Add", [out, f"q{i}"], [f"s{i}"]))
            out = f"s{i}"
    nodes.append(helper.make_node("MatMul", [out, "wx"], ["y"]))
    return model(nodes, {"x": [B, S, C], "cond": [B, 1, K]}, {"y": None}, inits)


def _without_parallel(m: onnx.ModelProto):
    ir_model = to_ir(m)
    run_passes(ir_model, [e for e in pipeline(CompileOptions()) if entry_name(e) != "parallel"])
    return ir_model


def test_the_gates_are_one_layer_one_tanh_one_split_and_the_same_numbers():
    m = _gates(4)
    compiled = to_ir(m)
    records = {r.name: r.result.counts for r in compile_model(compiled)}
    assert records["parallel"]["projections joined"] == 4
    cpu = {k: v for k, v in ops(compiled).items() if not k.startswith("SD")}
    assert cpu == {"Tanh": 1, "Split": 1, "CastAvx": 5}, cpu  # cond and x in, y out, and one each way for the Tanh
    without = _without_parallel(m)
    assert ops(without)["Tanh"] == 4 and ops(without)["CastAvx"] > cpu["CastAvx"]
    onnx.checker.check_model(to_proto(compiled), full_check=True)
    feeds = feeds_for(m)
    got = run(with_functions(compiled), feeds)[0]
    want = run(with_functions(without), feeds)[0]
    # one GEMM over the joined weights adds the same products in the same order per column: the same bits
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kwargs", [{"shared": True}, {"other_op": True}], ids=["shared", "other_op"])
def test_a_gate_that_cannot_join_stays_as_it_is(kwargs):
    compiled = to_ir(_gates(3, **kwargs))
    records = {r.name: r.result.counts for r in compile_model(compiled)}
    assert records["parallel"].get("projections joined") == 2  # the other two still join
    assert ops(compiled)["Tanh"] == (2 if "shared" in kwargs else 1)  # the joined one, and the shared gate's own


def test_one_gate_alone_is_left_as_it_is():
    compiled = to_ir(_gates(1))
    records = {r.name: r.result.counts for r in compile_model(compiled)}
    assert not records["parallel"]
