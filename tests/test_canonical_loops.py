"""Loops written out (``sdnpu.passes.canonical.loops``): Lumina 2's per-item loops, unrolled by the exporter,
become the batched data movement they are; each near miss (a block left unwritten, items out of order, one item's
chain another) stays; the numbers are the same element for element, and the graph passes onnx's full check."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from sdnpu.onnxrun import run_onnx
from sdnpu.passes.canonical import loops
from sdnpu.passes.canonical.driver import sweep
from sdnpu.passes.pipeline import canonicalize

from .graphs import rewritten

B, S, C = 2, 3, 4


def _model(nodes: list, inputs: dict[str, tuple[int, ...]], output: str, shape: tuple[int, ...], inits: dict) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(k, TensorProto.FLOAT, v) for k, v in inputs.items()],
                              [helper.make_tensor_value_info(output, TensorProto.FLOAT, shape)],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _loops(miss: str) -> onnx.ModelProto:
    """Lumina 2's joint sequence (two streams written item by item into zeros), then its unpatchify item by item,
    stacked; ``miss``: a near miss."""
    total = 2 * S + (1 if miss == "unwritten" else 0)
    nodes, inits = [], {"zeros": np.zeros((B, total, C), np.float32)}
    joint = "zeros"
    for i in range(B):
        inits[f"i{i}"] = np.asarray(i, np.int64)
        for k, (src, start) in enumerate((("ctx", 0), ("x", S))):
            inits[f"rows{i}{k}"] = np.stack(np.meshgrid([i], np.arange(start, start + S), indexing="ij"), -1)
            nodes += [helper.make_node("Gather", [src, f"i{i}"], [f"g{i}{k}"], axis=0),
                      helper.make_node("Unsqueeze", [f"g{i}{k}", "ax0"], [f"u{i}{k}"]),
                      helper.make_node("ScatterND", [joint, f"rows{i}{k}", f"u{i}{k}"], [f"j{i}{k}"])]
            joint = f"j{i}{k}"
    inits["ax0"] = np.asarray([0], np.int64)
    nodes.append(helper.make_node("Relu", [joint], ["joint"]))  # the sequence goes through a layer
    order = list(reversed(range(B))) if miss == "out_of_order" else list(range(B))
    items = []
    for n, i in enumerate(order):
        perm = [2, 1, 0] if miss == "other_chain" and n == B - 1 else [1, 2, 0]
        inits.update({"s": np.asarray([S], np.int64), "e": np.asarray([2 * S], np.int64), f"v{n}": np.asarray(
            [S, 1, C] if perm == [1, 2, 0] else [S, C, 1], np.int64)})
        nodes += [helper.make_node("Gather", ["joint", f"i{i}"], [f"item{n}"], axis=0),
                  helper.make_node("Slice", [f"item{n}", "s", "e", "ax0"], [f"sl{n}"]),
                  helper.make_node("Reshape", [f"sl{n}", f"v{n}"], [f"r{n}"]),
                  helper.make_node("Transpose", [f"r{n}"], [f"t{n}"], perm=perm),
                  helper.make_node("Unsqueeze", [f"t{n}", "ax0"], [f"o{n}"])]
        items.append(f"o{n}")
    nodes.append(helper.make_node("Concat", items, ["y"], axis=0))
    return _model(nodes, {"ctx": (B, S, C), "x": (B, S, C)}, "y", (B, 1, C, S), inits)


@pytest.mark.parametrize(("miss", "assembled", "stacked"), [("none", 1, 1), ("unwritten", 0, 1),
                                                           ("out_of_order", 1, 0), ("other_chain", 1, 0)])
def test_unrolled_loops_are_the_batched_movement(miss, assembled, stacked, tmp_path):
    """The joint sequence is one Concat of the two streams (not where a block of the zeros stays unwritten),
    the items' unpatchify one batched Slice, Transpose and Reshape (not stacked out of order, not where one
    item's chain differs); the numbers are the same, element for element."""
    model = _loops(miss)
    ir_model = ir.serde.deserialize_model(model)
    counts = canonicalize(ir_model).counts
    assert counts["assembled by movement -> Concat"] == assembled, counts
    assert counts["stacked per-item chains -> batched"] == stacked, counts
    ops = Counter(n.op_type for n in ir_model.graph)
    if assembled:
        assert ops["ScatterND"] == 0
    if stacked:
        assert ops["Gather"] == (0 if assembled else 2 * B), ops
    rng = np.random.default_rng(0)
    feeds = {"ctx": rng.standard_normal((B, S, C)).astype(np.float32),
             "x": rng.standard_normal((B, S, C)).astype(np.float32)}
    onnx.save(model, tmp_path / "a.onnx")
    ir.save(ir_model, tmp_path / "b.onnx")
    np.testing.assert_array_equal(run_onnx(tmp_path / "b.onnx", feeds)["y"], run_onnx(tmp_path / "a.onnx", feeds)["y"])


@pytest.mark.parametrize(("miss", "assembled", "stacked"), [("none", 1, 1), ("unwritten", 0, 1),
                                                           ("out_of_order", 1, 0), ("other_chain", 1, 0)])
def test_each_loop_rewrite_alone(miss, assembled, stacked):
    """The two rewrites by themselves on the exported form (shapes inferred, as the canonical steps before them
    leave it): the same counts, a valid graph, the same numbers bit for bit."""
    m = onnx.shape_inference.infer_shapes(_loops(miss), strict_mode=True, data_prop=True)
    _, counts = rewritten(m, loops.concat_assembled_values, loops.batch_stacked_chains, sweep)
    assert counts["assembled by movement -> Concat"] == assembled, counts
    assert counts["stacked per-item chains -> batched"] == stacked, counts
