"""Fuse: every op family into its dispatch op. The order matters and is the list below:

- attention first: it owns the MatMuls, Softmax and reshapes inside attention, which the Gemm and
  glue rules would otherwise take apart;
- GroupNorm and Conv before SiLU: each absorbs the SiLU that follows it;
- GEGLU before GELU: the gate owns its Gelu;
- QuickGelu before SiLU: x·sigmoid(1.702x) is not x·sigmoid(x), but both end in Mul(x, Sigmoid(..));
- Gemm before MatMul: a MatMul with a constant weight is a linear layer, the rest are activation products.
"""

from __future__ import annotations

import onnx_ir as ir

from sdnpu.passes.manager import PassResult
from sdnpu.passes.rules.activation import SDGeGLUFusion, SDGeluFusion, SDQuickGeluFusion, SDSiluFusion
from sdnpu.passes.rules.attention import SDMHAFusion
from sdnpu.passes.rules.base import Rule, RuleStats, apply_rules
from sdnpu.passes.rules.conv import SDConvFusion
from sdnpu.passes.rules.gemm import SDGemmFusion, SDMatMulFusion
from sdnpu.passes.rules.norm import SDGroupNormFusion, SDLayerNormFusion
from sdnpu.passes.rules.resize import SDResizeFusion
from sdnpu.passes.rules.text import SDEmbeddingFusion, SDTokenPoolFusion

FUSION_RULES: tuple[Rule, ...] = (
    SDMHAFusion(),
    SDGroupNormFusion(),
    SDConvFusion(),
    SDLayerNormFusion(),
    SDGeGLUFusion(),
    SDGeluFusion(),
    SDQuickGeluFusion(),
    SDSiluFusion(),
    SDGemmFusion(),
    SDMatMulFusion(),
    SDResizeFusion(),
    SDEmbeddingFusion(),
    SDTokenPoolFusion(),
)


def fuse(model: ir.Model, rules: tuple[Rule, ...] = FUSION_RULES) -> PassResult:
    stats = apply_rules(model.graph, rules, RuleStats())
    return PassResult(modified=bool(stats.fired), counts=dict(stats.fired), details={"declined": stats.declined})
