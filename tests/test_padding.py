"""Token padding as torch.export writes it (Z-Image, Lumina 2): the movements that move nothing go, a
constant-mask Where of a pad token becomes a Mul and an Add on the NPU, and what does move data stays."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from .fuzz_repro import check
from .graphs import model, ops, to_ir

ROWS, C = 6, 8
EDGE = {"Reshape": 1}  # the last SDGemm's [ROWS, 1, C] viewed back as the graph's [ROWS, C] output


def _padded(mask: np.ndarray, *, pad: int = 0, half_scatter: bool = False) -> onnx.ModelProto:
    """Linear -> Where(mask, token, .) -> Split(1 part) -> Pad -> [1, ROWS, C] -> select_scatter into a new
    tensor -> Gather of its row -> Linear."""
    rng = np.random.default_rng(0)
    rows_out = 2 if half_scatter else 1
    inits = {"w": rng.standard_normal((C, C)).astype(np.float32) * 0.3, "mask": mask,
             "tok": rng.standard_normal((1, C)).astype(np.float32), "rows": np.asarray([ROWS], np.int64),
             "pads": np.asarray([0, 0, pad, 0], np.int64), "shape3": np.asarray([1, ROWS + pad, C], np.int64),
             "zeros": np.zeros((rows_out, ROWS + pad, C), np.float32),
             "idx": np.zeros((1, ROWS + pad, C), np.int64), "row": np.asarray(0, np.int64)}
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Where", ["mask", "tok", "h"], ["wh"]),
             helper.make_node("Split", ["wh", "rows"], ["sp"], axis=0),
             helper.make_node("Pad", ["sp", "pads"], ["pd"]),
             helper.make_node("Reshape", ["pd", "shape3"], ["r3"]),
             helper.make_node("ScatterElements", ["zeros", "idx", "r3"], ["sc"], axis=0),
             helper.make_node("Gather", ["sc", "row"], ["g"], axis=0),
             helper.make_node("MatMul", ["g", "w"], ["y"])]
    return model(nodes, {"x": [ROWS, C]}, {"y": None}, inits)


def _cpu(m: onnx.ModelProto) -> dict[str, int]:
    from sdnpu.passes.pipeline import compile_model

    compiled = to_ir(m)
    compile_model(compiled)
    return {k: v for k, v in ops(compiled).items() if not k.startswith("SD") and k != "CastAvx"}


def test_nothing_padded_leaves_nothing_on_the_cpu():
    m = _padded(np.zeros((ROWS, 1), bool))
    check(m)  # every stage against onnxruntime's run of the input graph
    assert _cpu(m) == EDGE


def test_padded_rows_are_a_mul_and_an_add_on_the_npu():
    mask = np.zeros((ROWS, 1), bool)
    mask[4:] = True
    m = _padded(mask)
    check(m)
    assert _cpu(m) == EDGE  # no Where left: x * keep + token * mask, both dispatch ops


@pytest.mark.parametrize("kwargs", [{"pad": 1}, {"half_scatter": True}], ids=["a Pad that pads", "half a scatter"])
def test_what_moves_data_stays(kwargs):
    m = _padded(np.zeros((ROWS, 1), bool), **kwargs)
    check(m)
    cpu = _cpu(m)
    assert ("Pad" in cpu) if "pad" in kwargs else ("ScatterElements" in cpu), cpu


@pytest.mark.parametrize("spelling", ["resize nearest", "resize linear", "resize cubic", "depth_to_space 1",
                                      "space_to_depth 1"])
def test_a_movement_to_what_it_has_goes_and_leaves_nothing_on_the_cpu(spelling):
    """A Resize to the size it starts from (a decoder's upsample at scale 1), a DepthToSpace or SpaceToDepth of
    blocks of one: identities that stayed on the CPU between two convolutions (issue 42)."""
    rng = np.random.default_rng(0)
    inits = {"w": rng.standard_normal((4, 4, 3, 3)).astype(np.float32) * 0.3}
    if spelling.startswith("resize"):
        inits["sizes"] = np.asarray([1, 4, 8, 8], np.int64)
        move = helper.make_node("Resize", ["h", "", "", "sizes"], ["m"], mode=spelling.split()[1])
    else:
        op = "DepthToSpace" if spelling.startswith("depth") else "SpaceToDepth"
        move = helper.make_node(op, ["h"], ["m"], blocksize=1)
    nodes = [helper.make_node("Conv", ["x", "w"], ["h"], pads=[1, 1, 1, 1]), move,
             helper.make_node("Conv", ["m", "w"], ["y"], pads=[1, 1, 1, 1])]
    m = model(nodes, {"x": [1, 4, 8, 8]}, {"y": None}, inits)
    check(m)
    cpu = _cpu(m)
    assert not {"Resize", "DepthToSpace", "SpaceToDepth"} & set(cpu), cpu
