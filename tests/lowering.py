"""Shared by the tests of the passes from fuse to views on small graphs: a graph lowered through them (the
canonical steps, joint, fuse, layout, glue, views: every dispatch op in place, still fp32), its numbers compared
with the graph's, its dispatch ops and the reasons its nodes were declined; seeded weights."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from sdnpu.formats.keys import DECLINED_TAG
from sdnpu.ops.target import get_target
from sdnpu.passes.fuse import fuse
from sdnpu.passes.glue import lower_glue
from sdnpu.passes.layout import lay_out_nhwc
from sdnpu.passes.joint import split_joint_attention
from sdnpu.passes.pipeline import canonicalize
from sdnpu.passes.views import absorb_views

from .graphs import feeds_for, ops, run, to_ir, with_functions

R = np.random.default_rng(0)
TARGET = get_target()


def w(*shape: int) -> np.ndarray:
    return (R.standard_normal(shape) * 0.2).astype(np.float32)


def n(op: str, ins: list[str], outs: list[str], **attrs) -> onnx.NodeProto:
    return helper.make_node(op, ins, outs, **attrs)


def lowered(m: onnx.ModelProto):
    """The canonical steps, joint, fuse, layout, glue and views: every dispatch op in place, still fp32."""
    irm = to_ir(m)
    canonicalize(irm)
    split_joint_attention(irm)
    fuse(irm, TARGET)
    lay_out_nhwc(irm)
    lower_glue(irm, TARGET)
    absorb_views(irm, TARGET)
    return irm


def assert_same(m: onnx.ModelProto, irm, atol: float = 1e-5) -> None:
    """The lowered model computes what the original did (fp32: no pass before precision changes precision)."""
    feeds = feeds_for(m)
    for a, b in zip(run(m, feeds), run(with_functions(irm, TARGET), feeds), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=atol)


def dispatch_ops(irm) -> dict[str, int]:
    return {k: v for k, v in ops(irm).items() if TARGET.is_dispatch(TARGET.domain, k)}


def declined(irm) -> list[str]:
    return [node.metadata_props[DECLINED_TAG] for node in irm.graph if DECLINED_TAG in node.metadata_props]
