"""The views pass (``sdnpu.passes.views``) on a tiny graph, through the passes up to it: a Reshape in front of a
dispatch op absorbed into the op, which records the view it reads, computing the same."""

from __future__ import annotations

import numpy as np

from sdnpu.formats.keys import VIEWS_TAG

from .graphs import model, ops
from .lowering import assert_same, dispatch_ops, lowered, n, w


def test_views_are_absorbed_by_the_op_that_reads_them():
    """GroupNorm [B, C, H, W] -> [B, H*W, C] -> Linear: the Reshape between them goes; SDGemm reads the NHWC
    tensor as [B, H*W, C] (its input_shape) and records the view."""
    nodes = [n("Reshape", ["x", "g_shape"], ["r"]), n("InstanceNormalization", ["r", "ones", "zeros"], ["i"]),
             n("Reshape", ["i", "x_shape"], ["r2"]), n("Mul", ["r2", "gamma"], ["m"]), n("Add", ["m", "beta"], ["gn"]),
             n("Transpose", ["gn"], ["t"], perm=[0, 2, 3, 1]), n("Reshape", ["t", "flat"], ["f"]),
             n("MatMul", ["f", "wl"], ["y"])]
    m = model(nodes, {"x": [2, 8, 4, 4]}, {"y": [2, 16, 6]},
              {"g_shape": np.array([0, 4, -1]), "x_shape": np.array([2, 8, 4, 4]), "ones": np.ones(4, np.float32),
               "zeros": np.zeros(4, np.float32), "gamma": w(8, 1, 1) + 1, "beta": w(8, 1, 1),
               "flat": np.array([2, 16, 8]), "wl": w(8, 6)})
    irm = lowered(m)
    assert dispatch_ops(irm) == {"SDGroupNorm": 1, "SDGemm": 1}
    assert "Reshape" not in ops(irm)
    gemm = next(x for x in irm.graph if x.op_type == "SDGemm")
    assert list(gemm.attributes["input_shape"].value) == [2, 16, 8]
    assert gemm.inputs[0].producer().op_type == "SDGroupNorm"  # reads [2, 4, 4, 8] through its view
    assert gemm.metadata_props[VIEWS_TAG] == "0:2x4x4x8>2x16x8"
    assert_same(m, irm)
