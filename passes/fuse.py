"""Fuse: the big op families into the target's dispatch ops. The order matters and is the list below:

- attention first: it owns the MatMuls, Softmax and reshapes inside attention, which the Gemm rule would
  otherwise take apart;
- GroupNorm before Conv: it absorbs the SiLU that follows it (``nonlinear='Silu'``); a Conv's SiLU stays for
  the glue pass (SDSilu);
- GEGLU before Gemm: it owns the projection it splits in halves (the Gemm rule takes any other Split or
  Slice of a projection's columns: one SDGemm per part);
- the element-wise ops (SiLU, GELU, Add, Mul, Concat) wait for the glue pass, after layout, which pushes the
  NHWC Transposes through their plain ONNX forms.
"""

from __future__ import annotations

import onnx_ir as ir

from sdnpu.ops.target import DispatchTarget
from sdnpu.passes.manager import PassResult
from sdnpu.passes.rules.activation import GeGLUFusion
from sdnpu.passes.rules.attention import AttentionFusion
from sdnpu.passes.rules.base import Rule, RuleStats, apply_rules
from sdnpu.passes.rules.conv import ConvFusion, PoolFusion, TransposedConvFusion
from sdnpu.passes.rules.gemm import GemmFusion
from sdnpu.passes.rules.norm import GroupNormFusion, LayerNormFusion
from sdnpu.passes.rules.resize import ResizeFusion
from sdnpu.passes.rules.rms_norm import RMSNormFusion

FUSION_RULES: tuple[type[Rule], ...] = (
    AttentionFusion,
    GroupNormFusion,
    ConvFusion,
    PoolFusion,
    TransposedConvFusion,
    LayerNormFusion,
    RMSNormFusion,
    GeGLUFusion,
    GemmFusion,
    ResizeFusion,
)


def fuse(model: ir.Model, target: DispatchTarget, rules: tuple[type[Rule], ...] = FUSION_RULES) -> PassResult:
    stats = apply_rules(model.graph, [rule(target) for rule in rules], RuleStats())
    counts = dict(stats.fired) | {f"{name} declined": n for name, n in stats.declined.items()}
    return PassResult(modified=bool(stats.fired), counts=counts)
