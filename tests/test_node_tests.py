"""ONNX's own conformance node tests (``tests/node_tests.py``) through ``sdnpu compile``: every one of the
1,884 either compiles or is refused in one line; none ends in a traceback. In four chunks, so the suite's
workers share them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import pytest

from . import node_tests

CHUNKS = 4


@pytest.mark.slow
@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_no_node_test_ends_in_a_traceback(chunk, tmp_path):
    import logging

    logging.getLogger("sdnpu").setLevel(logging.ERROR)
    cases = list(node_tests.cases())[chunk::CHUNKS]
    assert len(cases) > 400
    outcomes = {}
    for i, case in enumerate(cases):
        kind, text = node_tests.outcome(case, tmp_path / f"{i}_{case.name}")
        outcomes[case.name] = (kind, text)
    tracebacks = {name: text.splitlines()[-1] for name, (kind, text) in outcomes.items() if kind == "traceback"}
    assert not tracebacks, tracebacks
    assert sum(kind == "compiled" for kind, _ in outcomes.values()) > 0.8 * len(cases)


def test_a_resize_given_its_scales_as_an_input_is_checked_with_its_own(tmp_path):
    """ONNX's test_resize_upsample_scales_nearest: the scales are a graph input. The fidelity run takes the
    test's own inputs beside the model (test_data_set_0/), not random scales."""
    case = next(node_tests.cases("^test_resize_upsample_scales_nearest$"))
    kind, text = node_tests.outcome(case, tmp_path / "case")
    assert kind == "compiled" and "min cosine 1.000000" in text, text


def test_a_shape_input_without_test_data_is_said(tmp_path):
    """Without the test's inputs, an input that decides a shape (a Reshape's) has no seeded value: the compile
    goes on without the check and says why."""
    import shutil

    from sdnpu.convert.compile import compile_file

    case = next(node_tests.cases("^test_reshape_extended_dims$"))
    path = node_tests.write_case(case, tmp_path / "case")
    shutil.rmtree(tmp_path / "case" / "test_data_set_0")
    report = compile_file(Path(path), tmp_path / "case" / "dd")
    assert report["fidelity"] is None and "a shape" in report["fidelity_skipped"]


@pytest.mark.parametrize("name", ["test_resize_upsample_scales_nearest_axes_2_3",
                                  "test_resize_upsample_scales_nearest_axes_3_2",
                                  "test_resize_upsample_sizes_nearest_axes_2_3"])
def test_a_resize_with_axes_gets_its_scales_for_those_axes_only(tmp_path, name):
    """A Resize with ``axes`` (opset 18) holds scales or sizes for those axes only, in their order: without the
    test's own inputs, the seeded ones are read from its input and output shapes so (a ValueError before)."""
    from onnx import numpy_helper

    from sdnpu.reports.fidelity import generic_inputs

    case = next(node_tests.cases(f"^{name}$"))
    path = tmp_path / "model.onnx"
    path.write_bytes(case.model.SerializeToString())  # no test_data_set_0 beside it
    feeds = generic_inputs(path)
    own = dict(zip([vi.name for vi in case.model.graph.input], case.data_sets[0][0], strict=False))
    key = next(k for k in ("scales", "sizes") if k in feeds)
    np.testing.assert_allclose(feeds[key], numpy_helper.to_array(numpy_helper.from_array(own[key])))


def test_ids_that_reach_a_gather_through_a_view_are_drawn_below_its_table(tmp_path):
    """UMT5's ids pass through a Reshape before the embedding's Gather: the seeded ids stay below the table's
    512 rows (they were drawn up to 999, and onnxruntime refused the graph's run, "often an exporter bug")."""
    from onnx import TensorProto as T
    from onnx import helper, numpy_helper

    from sdnpu.onnxrun import run_onnx
    from sdnpu.reports.fidelity import generic_inputs

    table = numpy_helper.from_array(np.ones((512, 4), np.float32), "table")
    shape = numpy_helper.from_array(np.asarray([-1], np.int64), "flat")
    g = helper.make_graph([helper.make_node("Reshape", ["ids", "flat"], ["row"]),
                           helper.make_node("Gather", ["table", "row"], ["emb"])], "g",
                          [helper.make_tensor_value_info("ids", T.INT64, [1, 64])],
                          [helper.make_tensor_value_info("emb", T.FLOAT, [64, 4])], [table, shape])
    path = tmp_path / "model.onnx"
    path.write_bytes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    feeds = generic_inputs(path)
    assert feeds["ids"].max() < 512
    assert run_onnx(path, feeds)["emb"].shape == (64, 4)
