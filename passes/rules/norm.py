"""SDGroupNorm and SDLayerNorm: the normalizations in the spellings the exporters write.

GroupNorm as the exporters write it (both torch exporters, opset 17-20):

    Reshape(x [B, C, *S] -> [B, G, -1]) -> InstanceNormalization(scale=1, bias=0, eps)
      -> Reshape(-> [B, C, *S]) -> Mul(gamma [C, 1, ..]) -> Add(beta [C, 1, ..]) [-> SiLU]
    (the second Reshape is gone when it changed nothing, [B, C, L] with G = C: the canonical steps drop it)
    ==> Reshape(-> [B, C, S1, S2]) -> Transpose(NCHW->NHWC) -> SDGroupNorm(x', wts [2C] = gamma ++ beta,
        nonlinear='Silu' with the SiLU) -> Transpose back -> Reshape back

InstanceNormalization normalizes each row of its input's first two axes, so any first Reshape whose rows are
whole (sample, group) blocks is a GroupNorm: [B, G, -1], the batch folded in ([1, B*G, -1]), the groups'
channels on an axis of their own ([B, G, C/G, H*W]). The group count is rows / B, never the Reshape's second
axis alone (an earlier version read [1, B*G, -1] as B*G groups and was 0.28 off at an output scale of 2.58).
Rows that straddle two samples or split a channel are no GroupNorm of x: that form is declined (and the
InstanceNormalization taken alone, below).

InstanceNormalization is itself the GroupNorm with one group per channel: ``InstanceNormalization(x [N, C, *S],
scale [C], bias [C])`` is SDGroupNorm(groups=C, wts = scale ++ bias). torch writes it so for InstanceNorm1d/2d/3d
(affine or not: ones and zeros), TorchScript's InstanceNorm1d after a flattening Reshape, and diffusers' video
UNets' GroupNorms over [B, C, F, H, W] (SVD's temporal resnets). Anchored at the InstanceNormalization, the rule
takes it with the Reshapes around it where they are a GroupNorm's (its scale and bias then hold one value per
group, each repeated over the group's channels), else alone on its own input; it leaves it to the affine form
above (anchored at the Add) wherever that one matches, so a Mul/Add affine is taken into wts, not left as glue.
SDGroupNorm takes [B, H, W, C]: an input of another rank is viewed as 4-D first, [B, C, L] -> [B, C, L, 1],
[B, C, T, H, W] -> [B, C, T*H, W] (a view: each channel's values stay in place, so the statistics of a group,
over its channels and every position, are the same).

LayerNorm: one ``LayerNormalization`` over the last axis (opset >= 17) ==> SDLayerNorm on the [B, M, K] view
of its input, then a view back to the input's rank where that differs.

RMS and L2 norms (SDRMSNorm) are rms_norm.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from sdnpu.passes.irutil import Builder, attr, bmk_view, const, producer, static_shape, unview
from sdnpu.passes.provenance import Step, step
from sdnpu.passes.rules.activation import silu_after
from sdnpu.passes.rules.base import Declined, Match, Rule
from sdnpu.passes.rules.conv import NCHW_TO_NHWC, NHWC_TO_NCHW, nhwc_shape


def per_channel(v: ir.Value | None, c: int, rank: int) -> np.ndarray | None:
    """A constant that scales the channels (axis 1) of a rank-``rank`` tensor: [C, 1, ..] or [1, C, 1, ..]."""
    a = const(v)
    ones = (1,) * (rank - 2)
    if a is None or a.shape not in ((c, *ones), (1, c, *ones)):
        return None
    return a.reshape(c).astype(np.float32)


def channels_view(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The 4-D [B, C, S1, S2] view of a channels-first [B, C, *S] tensor that NHWC ops read: [B, C, L] ->
    [B, C, L, 1], [B, C, H, W] as it is, [B, C, T, H, W] -> [B, C, T*H, W]."""
    if len(shape) == 3:
        return (*shape, 1)
    return (shape[0], shape[1], int(np.prod(shape[2:-1])), shape[-1])


def channels_last(b: Builder, x: ir.Value, shape: tuple[int, ...]) -> ir.Value:
    """``x`` [B, C, *S] as [B, S1, S2, C]: its 4-D view, then the NCHW->NHWC Transpose the layout pass cancels
    against its neighbours' (a Reshape where it moves no data: one channel, or one position)."""
    view = channels_view(shape)
    if _moves_nothing(view):
        return unview(b, x, tuple(nhwc_shape(view)))
    x = unview(b, x, view)
    return b.op("Transpose", [x], {"perm": NCHW_TO_NHWC}, dtype=x.dtype, shape=nhwc_shape(view)).outputs[0]


def channels_first(b: Builder, y: ir.Value, shape: tuple[int, ...], out: tuple[int, ...] | None = None) -> ir.Value:
    """The inverse of ``channels_last``: [B, S1, S2, C] back to ``shape`` (or to ``out``, a view of it)."""
    view = channels_view(shape)
    if not _moves_nothing(view):
        y = b.op("Transpose", [y], {"perm": NHWC_TO_NCHW}, dtype=y.dtype, shape=view).outputs[0]
    return unview(b, y, out or shape)


def _moves_nothing(view: tuple[int, ...]) -> bool:
    """Whether NCHW->NHWC keeps [B, C, S1, S2]'s elements in place: one channel, or one position."""
    return view[1] == 1 or view[2] * view[3] == 1


@dataclass(frozen=True)
class GroupNormParams:
    x: ir.Value
    out_shape: tuple[int, ...]  # x's, or the rows' an InstanceNormalization taken alone wrote ([B, G, L])
    gamma: tuple[ir.Value, list[Step]]  # a weight and the steps that make it [C] float32
    beta: tuple[ir.Value, list[Step]]
    groups: int
    eps: float
    silu: bool
    name: str
    assumed: list[str]


def only_reader(v: ir.Value, op_type: str) -> ir.Node | None:
    """The node of ``op_type`` that alone reads ``v`` (which is no graph output)."""
    uses = list(v.uses())
    if v.is_graph_output() or len(uses) != 1:
        return None
    node = uses[0].node
    return node if node.op_type == op_type and node.domain in ("", "ai.onnx") else None


def _readers(v: ir.Value, *op_types: str) -> list[ir.Node]:
    """The nodes of the last of ``op_types`` reached from ``v`` through readers of those types in order (the
    first optional): ``_readers(v, "Reshape", "Mul", "Add")`` are the Adds of v [-> Reshape] -> Mul -> Add."""
    found, frontier = [], [v]
    for i, op_type in enumerate(op_types):
        nxt = [u.node for w in frontier for u in w.uses()
               if u.node.op_type == op_type and u.node.domain in ("", "ai.onnx")]
        if i == len(op_types) - 1:
            found = nxt
        frontier = [o for n in nxt for o in n.outputs] + (frontier if i == 0 else [])
    return found


class GroupNormFusion(Rule):
    name = "GroupNormFusion"
    anchors = ("Add", "InstanceNormalization")

    def match(self, node: ir.Node) -> Match | str | None:
        if node.op_type == "InstanceNormalization":
            return self._instance_norm(node)
        return self._affine(node)

    def _affine(self, add: ir.Node) -> Match | str | None:
        """[Reshape ->] InstanceNormalization [-> Reshape] -> Mul(gamma) -> Add(beta), anchored at the Add."""
        for y, beta in (add.inputs, reversed(add.inputs)):
            mul = producer(y, "Mul")
            if mul is None:
                continue
            for z, gamma in (mul.inputs, reversed(mul.inputs)):
                r2 = producer(z, "Reshape")
                inorm = producer(r2.inputs[0] if r2 is not None else z, "InstanceNormalization")
                if inorm is None:
                    continue
                reasons = []
                for r1, x in _inputs(inorm):
                    found = self._check(inorm, r1, r2, x, (mul, add, gamma, beta))
                    if isinstance(found, Match):
                        return found
                    reasons.append(found)
                return reasons[0]
        return None

    def _instance_norm(self, inorm: ir.Node) -> Match | str | None:
        """An InstanceNormalization with the Reshapes around it where they make a GroupNorm, else alone: a
        GroupNorm of its own input with one group per channel. Left to the affine form where that matches."""
        out = inorm.outputs[0]
        for add in _readers(out, "Reshape", "Mul", "Add"):  # the affine form's, even where it is refused
            found = self._affine(add)
            if isinstance(found, Match) and inorm in found.nodes:
                return None
        reasons = []
        for r1, x in _inputs(inorm, alone=True):
            found = self._check(inorm, r1, only_reader(out, "Reshape"), x, None)
            if isinstance(found, Match):
                return found
            reasons.append(found)
        return reasons[0]

    def _check(self, inorm: ir.Node, r1: ir.Node | None, r2: ir.Node | None, x: ir.Value,
               affine: tuple[ir.Node, ir.Node, ir.Value | None, ir.Value | None] | None) -> Match | str:
        x_shape, grouped = static_shape(x), static_shape(inorm.inputs[0])
        if x_shape is None or grouped is None or len(x_shape) < 3 or len(grouped) < 3:
            return "GroupNorm input is not a static [B, C, *S] tensor"
        out_shape = static_shape((r2 if r2 is not None else inorm).outputs[0])
        if out_shape is None or (affine is not None and out_shape != x_shape):
            return "the reshape after InstanceNormalization does not restore the input shape"
        rows, c = grouped[0] * grouped[1], x_shape[1]  # InstanceNormalization normalizes each row
        groups = rows // x_shape[0]
        if rows % x_shape[0] or not groups or c % groups:
            return (f"the reshape to {list(grouped)} does not cut {list(x_shape)} into whole (sample, group) "
                    "rows")
        scale, bias = inorm.inputs[1], inorm.inputs[2]
        s, bs = const(scale), const(bias)
        if s is None or bs is None:
            return "InstanceNormalization's scale/bias are not constants"
        nodes = [*([r1] if r1 is not None else []), inorm, *([r2] if r2 is not None else [])]
        if affine is not None:
            mul, add, gamma, beta = affine
            if not (np.all(s == 1) and np.all(bs == 0)):
                return "InstanceNormalization has a learned scale/bias (not the GroupNorm form)"
            if per_channel(gamma, c, len(x_shape)) is None or per_channel(beta, c, len(x_shape)) is None:
                return "gamma/beta are not constant per-channel vectors"
            to_c: list[Step] = [step("reshape", shape=[c]), step("astype", dtype="float32")]  # as per_channel reads it
            weights = ((gamma, to_c), (beta, to_c))
            nodes += [mul, add]
            out, name = add.outputs[0], add.name
        else:
            per_row = [np.tile(a.reshape(-1), grouped[0]).reshape(x_shape[0], groups) for a in (s, bs)]
            if not all(np.all(a == a[0]) for a in per_row):
                return "InstanceNormalization's scale/bias differ between the samples folded into its rows"
            weights = (_group_weights(scale, grouped, x_shape[0], c), _group_weights(bias, grouped, x_shape[0], c))
            out, name = nodes[-1].outputs[0], inorm.name
        silu = silu_after(out)
        if silu is not None:
            nodes += silu[0]
            out = silu[1]
        reason, assumed = self.target.op("group_norm").check({"x": nhwc_shape(channels_view(x_shape)),
                                                               "groups": groups})
        if reason:
            return Declined(reason, nodes)
        return Match(nodes, [out], GroupNormParams(x, out_shape, weights[0], weights[1], groups,
                                                   float(attr(inorm, "epsilon", 1e-5)), silu is not None,
                                                   name or "group_norm", assumed))

    def rewrite(self, b: Builder, m: Match) -> list[ir.Value]:
        p: GroupNormParams = m.params
        x_shape = static_shape(p.x)
        assert x_shape is not None
        c = x_shape[1]
        view = nhwc_shape(channels_view(x_shape))
        wts = b.concatenated([p.gamma, p.beta], [2 * c], f"{p.name}_wts", dtype=ir.DataType.FLOAT)
        attrs = {"input_shape": view, "output_shape": view, "wts_shape": [2 * c], "gamma_shape": [c],
                 "beta_shape": [c], "epsilon": p.eps, "groups": p.groups, "activation": 0, "channels_last": 1}
        if p.silu:
            attrs["nonlinear"] = "Silu"
        gn = b.dispatch(self.target.op("group_norm").op_type, [channels_last(b, p.x, x_shape), wts], attrs,
                        dtype=p.x.dtype, shape=view, assumed=p.assumed)
        return [channels_first(b, gn.outputs[0], x_shape, p.out_shape)]


def _inputs(inorm: ir.Node, alone: bool = False) -> list[tuple[ir.Node | None, ir.Value]]:
    """What the InstanceNormalization normalizes in groups: the tensor a Reshape cut into its rows (a
    GroupNorm's spelling; ``alone``: only where nothing else reads the rows), then its own input (one group
    per channel)."""
    r1 = producer(inorm.inputs[0], "Reshape")
    if r1 is not None and alone and only_reader(r1.outputs[0], "InstanceNormalization") is None:
        r1 = None
    return [*([(r1, r1.inputs[0])] if r1 is not None else []), (None, inorm.inputs[0])]


def _group_weights(v: ir.Value, grouped: tuple[int, ...], b: int, c: int) -> tuple[ir.Value, list[Step]]:
    """An InstanceNormalization's scale or bias, one value per row of each of its grouped[0] blocks (row r of
    the B * G reads value r % grouped[1]), as the GroupNorm's per-channel [C]: the first sample's G values
    (every sample's are the same), each repeated over its group's C / G channels."""
    lead, rows = grouped[1], grouped[0] * grouped[1]
    groups = rows // b
    steps: list[Step] = [step("astype", dtype="float32"), step("reshape", shape=[lead])]
    if grouped[0] != 1:
        steps += [step("reshape", shape=[1, lead]), step("broadcast", shape=[grouped[0], lead]),
                  step("reshape", shape=[rows])]
    if b != 1:
        steps.append(step("slice", axis=0, start=0, stop=groups))
    if c != groups:
        steps += [step("reshape", shape=[groups, 1]), step("broadcast", shape=[groups, c // groups]),
                  step("reshape", shape=[c])]
    return v, steps


class LayerNormFusion(Rule):
    name = "LayerNormFusion"
    anchors = ("LayerNormalization",)

    def match(self, node: ir.Node) -> Match | str | None:
        shape = static_shape(node.inputs[0])
        if shape is None:
            return "input shape is not static"
        if attr(node, "axis", -1) not in (-1, len(shape) - 1):
            return "normalizes over more than the last axis"
        if any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
            return "its mean / inverse std outputs are used"
        gamma = node.inputs[1]
        beta = node.inputs[2] if len(node.inputs) > 2 else None
        k = shape[-1]
        if const(gamma) is None or (beta is not None and const(beta) is None):
            return "gamma/beta are not constants"
        if (static_shape(gamma) != (k,) and const(gamma).size != k) or (  # type: ignore[union-attr]
                beta is not None and const(beta).size != k):  # type: ignore[union-attr]
            return "gamma/beta do not hold one value per channel"
        view = bmk_view(shape)
        reason, assumed = self.target.op("layer_norm").check({"x": view})
        if reason:
            return reason
        return Match([node], [node.outputs[0]], (node.inputs[0], gamma, beta, view,
                                                 float(attr(node, "epsilon", 1e-5)), assumed))

    def rewrite(self, b: Builder, m: Match) -> list[ir.Value]:
        x, gamma, beta, view, eps, assumed = m.params
        k = view[-1]
        gamma = as_vector(b, gamma, k)
        beta = b.const(np.zeros(k, np.float32), f"{gamma.name}_zero_beta") if beta is None else as_vector(b, beta, k)
        ln = b.dispatch(self.target.op("layer_norm").op_type, [x, gamma, beta],
                        {"input_shape": view, "output_shape": view, "gamma_shape": [k], "beta_shape": [k],
                         "epsilon": eps, "axis": -1}, dtype=x.dtype, shape=view, assumed=assumed)
        return [unview(b, ln.outputs[0], static_shape(m.outputs[0]))]


def as_vector(b: Builder, v: ir.Value, k: int) -> ir.Value:
    """A constant of K values as the [K] float32 weight a norm op takes (itself where it is one)."""
    if static_shape(v) == (k,):
        return v
    return b.derived(v, [step("astype", dtype="float32"), step("reshape", shape=[k])], [k], f"{v.name}_k",
                     dtype=ir.DataType.FLOAT)
