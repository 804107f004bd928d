"""The precision pass on small graphs: dispatch ops take and give bf16, each constant they read is stored in
its table dtype, one CastAvx at each CPU<->NPU edge (none between two dispatch ops), bfp16 mode's ``_bfp``
variants where AMD's block rule allows; the numbers within bf16's tolerance of the fp32 graph."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from sdnpu.errors import SdnpuError
from sdnpu.ops.target import get_target
from sdnpu.passes.precision import set_precision

from .graphs import feeds_for, model, ops, run, to_ir, with_functions
from .lowering import lowered, n, w

TARGET = get_target()
# a few bf16 roundings (operands and outputs of two convolutions) on values of order 1: measured under 2**-7
BF16_TOL = 2**-6
# bfp16ebs8 (8-bit mantissas per block of 8, truncated by AMD's packer) on the weights and activations of two
# convolutions: measured at 3% of the output's scale here
BFP16_TOL = 2**-4


def convs(channels: int = 8, side: int = 6) -> onnx.ModelProto:
    """x -> conv -> conv -> y."""
    nodes = [n("Conv", ["x", "w1", "b1"], ["h"], pads=[1, 1, 1, 1]), n("Conv", ["h", "w2", "b2"], ["y"], pads=[1, 1, 1, 1])]
    inits = {"w1": w(channels, channels, 3, 3), "b1": w(channels), "w2": w(channels, channels, 3, 3), "b2": w(channels)}
    return model(nodes, {"x": [1, channels, side, side]}, {"y": [1, channels, side, side]}, inits)


def two_projections() -> onnx.ModelProto:
    """x [B, M, K] read by two projections (SDGemm: no layout Transpose in front of either)."""
    nodes = [n("MatMul", ["x", "w1"], ["m1"]), n("Add", ["m1", "b1"], ["y1"]),
             n("MatMul", ["x", "w2"], ["m2"]), n("Add", ["m2", "b2"], ["y2"])]
    return model(nodes, {"x": [2, 5, 8]}, {"y1": [2, 5, 16], "y2": [2, 5, 16]},
                 {"w1": w(8, 16), "b1": w(16), "w2": w(8, 16), "b2": w(16)})


def assert_close(m: onnx.ModelProto, irm: ir.Model, tol: float = BF16_TOL) -> onnx.ModelProto:
    out = with_functions(irm, TARGET)
    onnx.checker.check_model(out, full_check=True)
    feeds = feeds_for(m)
    for a, b in zip(run(m, feeds), run(out, feeds), strict=True):
        assert b.dtype == np.float32
        np.testing.assert_allclose(b, a, rtol=tol, atol=tol * float(np.abs(a).max()))
    return out


def test_dispatch_ops_take_bf16_and_constants_are_stored_as_the_table_says():
    m = convs()
    irm = lowered(m)
    assert ops(irm)["CastAvx"] == 0
    result = set_precision(irm, TARGET)
    assert result.modified
    assert result.counts["CastAvx in"] == 1 and result.counts["CastAvx out"] == 1  # none between the two convs
    for node in irm.graph:
        if node.op_type == "SDConv":
            x, weight, bias = node.inputs[:3]
            assert x.dtype == ir.DataType.BFLOAT16 and node.outputs[0].dtype == ir.DataType.BFLOAT16
            assert weight.dtype == ir.DataType.BFLOAT16 and bias.dtype == ir.DataType.FLOAT  # SDConv's fp32 bias
    assert irm.graph.outputs[0].dtype == ir.DataType.FLOAT  # the graph's interface keeps its type
    assert_close(m, irm)


def test_an_input_read_by_two_dispatch_ops_is_cast_once():
    m = two_projections()
    irm = lowered(m)
    assert ops(irm)["SDGemm"] == 2
    result = set_precision(irm, TARGET)
    assert result.counts["CastAvx in"] == 1 and result.counts["CastAvx out"] == 2
    assert_close(m, irm)


@pytest.mark.parametrize("channels, bfp", [(8, True), (4, False)])
def test_bfp16_takes_the_bfp_variant_where_the_activations_are_in_blocks_of_8(channels, bfp):
    m = convs(channels, side=8)
    irm = lowered(m)
    result = set_precision(irm, TARGET, "bfp16")
    kinds = ops(irm)
    if bfp:
        assert result.counts["ops -> _bfp"] == 2 and kinds["SDConv_bfp"] == 2 and kinds["SDConv"] == 0
    else:  # 4 channels: the NHWC view's last axis is not a multiple of 8 (AMD's is_bfp_supported_shape)
        assert result.counts["kept bf16 (activations not in blocks of 8)"] == 2 and kinds["SDConv_bfp"] == 0
    assert result.counts["weights -> bfp16 (stored bf16)"] == 2
    assert_close(m, irm, BFP16_TOL)


def test_a_graph_without_dispatch_ops_is_left_as_it_is():
    m = model([n("Sin", ["x"], ["y"])], {"x": [2, 3]}, {"y": [2, 3]})
    irm = to_ir(m)
    result = set_precision(irm, TARGET)
    assert not result.modified and ops(irm) == {"Sin": 1}


def test_an_unknown_precision_is_refused():
    with pytest.raises(SdnpuError, match="unknown precision 'fp8'"):
        set_precision(lowered(convs()), TARGET, "fp8")
