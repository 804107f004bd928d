"""The cleanup pass (``sdnpu.passes.cleanup``): one movement of a value for several readers merged into one
(through the whole compile), and its check of every dispatch op against the target's table naming what breaks
it."""

from __future__ import annotations

import onnx

from sdnpu.ops.target import get_target
from sdnpu.passes.cleanup import contract_violations

TARGET = get_target()


def test_one_value_moved_for_several_readers_is_moved_once(tmp_path):
    """An input read by three convolutions: layout moves it into NHWC for each reader, and the three identical
    Transposes are one (layout's own merge of twin movements, before precision casts them; cleanup's merge of
    repeated nodes is what catches twins made later), so one cast and one Transpose; the dispatch model computes
    what the graph computes."""
    import numpy as np
    from onnx import TensorProto as T
    from onnx import helper
    from onnx import numpy_helper as nh

    from sdnpu.convert.compile import compile_file

    rng = np.random.default_rng(0)
    nodes, inits = [], []
    for i in range(3):
        inits += [nh.from_array(rng.standard_normal((8, 4, 3, 3)).astype(np.float32), f"w{i}"),
                  nh.from_array(rng.standard_normal(8).astype(np.float32), f"b{i}")]
        nodes.append(helper.make_node("Conv", ["x", f"w{i}", f"b{i}"], [f"c{i}"], pads=[1, 1, 1, 1]))
    nodes += [helper.make_node("Add", ["c0", "c1"], ["s"]), helper.make_node("Add", ["s", "c2"], ["y"])]
    graph = helper.make_graph(nodes, "three_readers", [helper.make_tensor_value_info("x", T.FLOAT, [1, 4, 16, 16])],
                              [helper.make_tensor_value_info("y", T.FLOAT, [1, 8, 16, 16])], initializer=inits)
    (tmp_path / "m").mkdir()
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "m" / "model.onnx"))
    report = compile_file(tmp_path / "m" / "model.onnx", tmp_path / "dd")
    dd = onnx.load(str(tmp_path / "dd" / "replaced.onnx"))
    moves = [n for n in dd.graph.node if n.op_type == "Transpose"]
    assert len(moves) == 2 and len({tuple(n.input) for n in moves}) == 2  # the input's once, the output's once
    layout = next(p for p in report["passes"] if p["name"] == "layout")
    assert layout["counts"]["twin movements merged"] == 2  # the Transpose's two repeats
    precision = next(p for p in report["passes"] if p["name"] == "precision")
    assert precision["counts"]["CastAvx in"] == 1 and sum(n.op_type == "CastAvx" for n in dd.graph.node) == 2
    assert report["fidelity"]["min_cosine"] > 0.999


def test_a_node_that_breaks_the_table_is_named():
    import onnx_ir as ir

    node = ir.Node(TARGET.domain, "SDSilu", [ir.Value(name="x")],
                   attributes=ir.convenience.convert_attributes({"input_shape": [1, 2], "num_heads": 3.0}),
                   name="bad")
    problems = contract_violations(TARGET, node)
    assert any("no attribute output_shape" in p for p in problems)
    assert any("1 inputs, the table says 2" in p for p in problems)
    node = ir.Node(TARGET.domain, "SDMHA", [ir.Value(name=n) for n in "qkvm"], attributes=ir.convenience.convert_attributes(
        {"input_shape": [1, 2, 3, 4], "num_heads": [2], "in_dtypes": ["bfloat16"], "out_dtypes": ["bfloat16"],
         "op_version": "v2", "is_flash_mha": 1}), name="heads")
    assert contract_violations(TARGET, node) == ["SDMHA heads: num_heads is INTS, the table says INT"]
