"""SD3's MMDiT rules on tiny graphs spelled as torch's dynamo exporter writes diffusers' SD3 blocks: joint
attention (one SDMHA per query part), the per-head RMSNorm (SDRMSNorm), the AdaLayerNorm projection's chunks
(one SDGemm each) and the position-embedding crop (a constant); what must not fuse, and why."""

from __future__ import annotations

import numpy as np
import pytest

from .graphs import model, ops
from .lowering import assert_same, declined, dispatch_ops, lowered, n, w

B, S1, S2, H, D = 2, 6, 3, 2, 4
C = H * D


def _rms(nodes: list, inits: dict, x: str, y: str, spelling: str = "dynamo", scale: bool = True,
         axis: int = -1, scale_shape: tuple[int, ...] = (D,)) -> None:
    """x normalized by its root mean square over ``axis`` (torch's RMSNorm; the last axis unless a near miss)."""
    t = f"{y}_"
    inits.setdefault("two", np.array(2.0, np.float32))
    inits.setdefault("eps", np.array(1e-6, np.float32))
    inits[f"{t}axes"] = np.array([axis])
    sq = [n("Pow", [x, "two"], [f"{t}sq"])] if spelling == "dynamo" else [n("Mul", [x, x], [f"{t}sq"])]
    nodes += [*sq, n("ReduceMean", [f"{t}sq", f"{t}axes"], [f"{t}m"], keepdims=1),
              n("Add", [f"{t}m", "eps"], [f"{t}a"]), n("Sqrt", [f"{t}a"], [f"{t}r"])]
    if spelling == "dynamo":
        nodes += [n("Reciprocal", [f"{t}r"], [f"{t}ir"]), n("Mul", [x, f"{t}ir"], [f"{t}n" if scale else y])]
    else:
        nodes += [n("Div", [x, f"{t}r"], [f"{t}n" if scale else y])]
    if scale:
        inits[f"{t}w"] = (1 + w(*scale_shape)).astype(np.float32)
        nodes.append(n("Mul", [f"{t}n", f"{t}w"], [y]))


def joint_attention(norm: bool = True, parts: str = "both", spelling: str = "dynamo", softmax_axis: int = -1,
                    masked: bool = False):
    """SD3's JointAttnProcessor: image x [B, S1, C] and text c [B, S2, C] projected to q, k, v, split into
    heads ([B, H, S, D]), Q and K normalized per head (SD3.5), the streams concatenated along the sequence,
    scaled dot-product attention (dynamo's spelling: q and kᵀ each scaled by D^-1/4), heads merged, the result
    sliced back into the streams (``parts``: both, or the image only as in the last block; ``misaligned``: a
    cut that is not the streams'). ``masked``: a key mask computed from an input (Qwen-Image's caption mask),
    as dynamo writes SDPA's boolean mask: ``Where(keep, 0, -inf)`` added to the scores, and the softmax's fully
    masked rows set to 0 after it (``Where(IsNaN(p), 0, p)``)."""
    s = S1 + S2
    nodes, inits = [], {"split": np.array([B, -1, H, D]), "merge": np.array([B, s, C]),
                        "flat": np.array([-1, s, D]), "back": np.array([B, H, D, s]),
                        "scale": np.array([D ** -0.25], np.float32)}
    for stream in ("x", "c"):
        for t in "qkv":
            inits[f"w{t}{stream}"] = w(C, C)
            nodes += [n("MatMul", [stream, f"w{t}{stream}"], [f"{t}{stream}"]),
                      n("Reshape", [f"{t}{stream}", "split"], [f"{t}{stream}4"]),
                      n("Transpose", [f"{t}{stream}4"], [f"{t}{stream}h"], perm=[0, 2, 1, 3])]
            if norm and t in "qk":
                _rms(nodes, inits, f"{t}{stream}h", f"{t}{stream}n", spelling)
    for t in "qkv":
        end = "n" if norm and t in "qk" else "h"
        nodes.append(n("Concat", [f"{t}x{end}", f"{t}c{end}"], [f"{t}j"], axis=2))
    nodes += [n("Reshape", ["kj", "flat"], ["kf"]), n("Transpose", ["kf"], ["kft"], perm=[0, 2, 1]),
              n("Reshape", ["kft", "back"], ["kt"]), n("Mul", ["qj", "scale"], ["qs"]),
              n("Mul", ["kt", "scale"], ["ks"]),
              n("MatMul", ["qs", "ks"], ["sc"])]
    if masked:
        inits.update(zero=np.array(0.0, np.float32), neg=np.array(-np.inf, np.float32),
                     cut_mask=np.array(-0.5, np.float32))
        nodes += [n("Greater", ["mk", "cut_mask"], ["keep"]), n("Where", ["keep", "zero", "neg"], ["bias"]),
                  n("Add", ["sc", "bias"], ["scm"]), n("Softmax", ["scm"], ["p0"], axis=softmax_axis),
                  n("IsNaN", ["p0"], ["nan"]), n("Where", ["nan", "zero", "p0"], ["p"])]
    else:
        nodes.append(n("Softmax", ["sc"], ["p"], axis=softmax_axis))
    nodes += [n("MatMul", ["p", "vj"], ["o"]),
              n("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]), n("Reshape", ["ot", "merge"], ["y"])]
    cut = {"both": [(0, S1, "yx"), (S1, 2**62, "yc")], "image": [(0, S1, "yx")],
           "misaligned": [(0, S1 - 1, "yx"), (S1 - 1, s, "yc")]}[parts]
    outs = {}
    for lo, hi, name in cut:
        inits[f"{name}_lo"], inits[f"{name}_hi"], inits["ax1"] = np.array([lo]), np.array([hi]), np.array([1])
        nodes.append(n("Slice", ["y", f"{name}_lo", f"{name}_hi", "ax1"], [name]))
        outs[name] = [B, min(hi, s) - lo, C]
    ins = {"x": [B, S1, C], "c": [B, S2, C], **({"mk": [B, 1, 1, s]} if masked else {})}
    return model(nodes, ins, outs, inits)


def rms_norm(spelling: str = "dynamo", scale: bool = True, rank: int = 3, axis: int = -1,
             scale_shape: tuple[int, ...] = (D,)):
    shape = [B, S1, H, D][-rank:] if rank < 4 else [B, S1, H, D]
    shape[-1] = D
    nodes, inits = [], {}
    _rms(nodes, inits, "x", "y", spelling, scale, axis, scale_shape)
    return model(nodes, {"x": shape}, {"y": shape}, inits)


def adaln_chunks(alpha: float = 1.0):
    """AdaLayerNormZero's projection of the conditioning (Linear, as a Gemm) chunked into six; pairs of chunks
    added (each chunk read once)."""
    nodes = [n("Gemm", ["e", "wl", "bl"], ["p"], transB=1, alpha=alpha),
             n("Split", ["p"], [f"c{i}" for i in range(6)], axis=-1, num_outputs=6)]
    nodes += [n("Add", [f"c{i}", f"c{i + 1}"], [f"y{i}"]) for i in range(0, 6, 2)]
    return model(nodes, {"e": [B, C]}, {f"y{i}": [B, 4] for i in range(0, 6, 2)}, {"wl": w(24, C), "bl": w(24)})


def pos_embed_crop():
    """The position-embedding table [1, P*P, C] viewed [1, P, P, C], its top-left h x w cropped, added to the
    patch tokens [B, h*w, C] (a projection's output)."""
    p, h = 4, 2
    nodes = [n("MatMul", ["x", "wp"], ["xp"]), n("Reshape", ["table", "grid"], ["g"]),
             n("Slice", ["g", "z", "hh", "ax1"], ["g1"]), n("Slice", ["g1", "z", "hh", "ax2"], ["g2"]),
             n("Reshape", ["g2", "tok"], ["pe"]), n("Add", ["xp", "pe"], ["y"])]
    return model(nodes, {"x": [B, h * h, C]}, {"y": [B, h * h, C]},
                 {"wp": w(C, C), "table": w(1, p * p, C), "grid": np.array([1, p, p, C]), "z": np.array([0]),
                  "hh": np.array([h]),
                  "ax1": np.array([1]), "ax2": np.array([2]), "tok": np.array([1, h * h, C])})


@pytest.mark.parametrize(
    ("build", "expected"),
    [(joint_attention, {"SDGemm": 6, "SDRMSNorm": 4, "SDConcat": 2, "SDFlatMHA": 2}),
     (lambda: joint_attention(spelling="torchscript"), {"SDGemm": 6, "SDRMSNorm": 4, "SDConcat": 2, "SDFlatMHA": 2}),
     (lambda: joint_attention(norm=False), {"SDGemm": 6, "SDConcat": 2, "SDFlatMHA": 2}),  # SD3.0: no norms
     # the last block keeps the image tokens only: the text query, its projection and norm go with the cut
     (lambda: joint_attention(parts="image"), {"SDGemm": 5, "SDRMSNorm": 3, "SDConcat": 2, "SDFlatMHA": 1}),
     (rms_norm, {"SDRMSNorm": 1}),
     (lambda: rms_norm("torchscript", scale=False, rank=2), {"SDRMSNorm": 1}),
     (lambda: rms_norm(rank=4), {"SDRMSNorm": 1}),
     # scaled per head, not per channel: the norm alone, and the Mul after it the glue's (its [H, 1] operand read
     # as [1, H, 1], numpy's broadcasting, which the kernels' same-rank broadcast takes)
     (lambda: rms_norm(scale_shape=(H, 1)), {"SDRMSNorm": 1, "SDMul": 1}),
     (adaln_chunks, {"SDGemm": 6, "SDAdd": 3}),
      (pos_embed_crop, {"SDGemm": 1, "SDAdd": 1})],
)
def test_mmdit_rule_fires_and_keeps_numbers(build, expected):
    m = build()
    irm = lowered(m)
    assert dispatch_ops(irm) == expected
    left = {"Softmax", "MatMul", "Slice", "Split", "Pow", "ReduceMean", "Sqrt", "Reciprocal", "Gemm", "Concat"}
    assert not left & set(ops(irm)), ops(irm)
    assert_same(m, irm)


def test_joint_attention_keeps_the_streams_apart_and_records_the_assumed_norm():
    """Each query part attends over the joint keys and values: the image part's SDFlatMHA reads Q [B, S1, C]
    and the text part's Q [B, S2, C], both K and V [B, S1 + S2, C]; SDRMSNorm is recorded as an assumed
    capability (AMD's pass writes it; no DD source registers it)."""
    from sdnpu.formats.keys import ASSUMED_TAG

    irm = lowered(joint_attention())
    mha = [node for node in irm.graph if node.op_type == "SDFlatMHA"]
    assert sorted(tuple(node.attributes["input_shape"].value) for node in mha) == [
        (B, S2, C, S1 + S2), (B, S1, C, S1 + S2)]
    norms = [node for node in irm.graph if node.op_type == "SDRMSNorm"]
    assert {tuple(node.attributes["input_shape"].value) for node in norms} == {(B, S1, H, D), (B, S2, H, D)}
    assert all(node.metadata_props[ASSUMED_TAG] == "registry" for node in norms)


def test_a_masked_joint_attention_shares_its_mask_and_widened_keys_between_the_query_parts():
    """Qwen-Image's caption mask, computed from an input: each query part's SDMHA carries it as a channel of Q
    and K (``attention_masks.key_channel_operands``); the mask row is spread over the heads once (one Expand on
    the CPU) and K and V are widened once for both parts (before, each part built its own: three SDConcats more
    a block and an Expand a part, measured on tiny-qwen-image)."""
    m = joint_attention(norm=False, masked=True)
    irm = lowered(m)
    counts = dispatch_ops(irm)
    assert counts.get("SDMHA", 0) + counts.get("SDFlatMHA", 0) == 2
    assert ops(irm)["Expand"] == 1
    # the streams' K and V joined (2), each part's Q widened (2), K widened once (zeros, the mask row, zeros,
    # the NaN guard's sentinel key: 4) and V once (zeros, the sentinel's value: 2); each part its own: 16
    assert counts["SDConcat"] == 10, counts
    assert_same(m, irm)


@pytest.mark.parametrize(
    ("build", "anchor_op", "reason"),
    [(lambda: joint_attention(parts="misaligned"), "Slice", "SDSlice has no start/end attributes"),
     # normalized over the queries: the rows are not independent, no split (and no SDMHA)
     (lambda: joint_attention(softmax_axis=2), "Softmax", "softmax is not over the last axis"),
     # over the heads of [B, S, H, D]: neither the last axis nor the channels (axis 1, last in NHWC)
     (lambda: rms_norm(rank=4, axis=2), "ReduceMean", "normalizes axis 2 of [2, 6, 2, 4]"),
     (lambda: adaln_chunks(alpha=0.5), "Split", "Gemm with transA, alpha or beta other than the defaults")],
)
def test_mmdit_near_miss_does_not_fuse_and_says_why(build, anchor_op, reason):
    """A cut that is not the streams' keeps the joint attention whole and its Slices on the CPU; a norm over
    another axis, or scaled per row, is not an RMSNorm of the last axis; a chunked projection the Gemm rule
    refuses keeps its Split."""
    from sdnpu.ops.target import get_target

    m = build()
    irm = lowered(m)
    target = get_target()
    reasons = [*declined(irm), *(target.cpu_reason(node.op_type) for node in irm.graph if node.op_type == anchor_op)]
    assert ops(irm)[anchor_op] >= 1
    assert any(reason in why for why in reasons), reasons
    assert_same(m, irm)
