"""Target ``amd-xdna2``: AMD's DynamicDispatch (DD) stack on Strix (XDNA2) NPUs, the op contract its Stable
Diffusion flow writes.

Sources (facts only; the code is ours):

- ``DD``: github.com/amd/DynamicDispatch at b3051f0 (March 2025): the op registry
  ``src/ops/op_registration_db.def``, the SD kernels' wrappers ``src/ops/sd/*.cpp``, and the test models
  ``tests/cpp/sd_*/model.py`` that show each op's ONNX signature.
- ``ROU``: AMD's ``ryzenai_onnx_utils`` ONNX passes for SD (newer than the DD snapshot), as stored in the
  public code index; cited by module where an import line names it, else by the index's id.

The two differ where the stack moved on (ROU's ``SDFlatMHA``, ``SDMHA_VAE`` and ``_bfp`` ops are not in the
DD snapshot's registry; ROU splits Q/K/V into heads inside SDGemm). We follow DD's kernel ABI where the
issue of compatibility is the tensors (MHA takes Q ``[B, M, K]``, K/V ``[B, N, K]`` and a mask), and ROU for
the op names, variants and the attributes its passes write or copy.

``in_dtypes`` / ``out_dtypes`` are what DD's op builder keys kernels on: their concatenation must match the
registered type list at the registered positions (``ICreatePolicy::verify``, DD include/ops/op_policy.hpp).
Weights are stored bf16 (fp32 for SDConv's bias, as the registry says) in the layout AMD's packer takes;
``sdnpu pack`` turns them into AMD's physical formats (``Input.packed``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sdnpu.ops.target import (FLOAT, INT, INTS, STRING, STRINGS, Attr, DispatchTarget, Input, Limit, OpSpec,
                              Params, prod, register)

NAME = "amd-xdna2"
DOMAIN = "com.amd"

SOURCES = {
    "DD": "github.com/amd/DynamicDispatch @ b3051f0 (2025-03-06): src/ops/op_registration_db.def, "
          "src/ops/sd/*.cpp, tests/cpp/sd_*/model.py",
    "ROU": "AMD ryzenai_onnx_utils SD passes (public code index; module or index id given per entry)",
}

BF16, BFP, F32 = "bfloat16", "bfp16ebs8", "float"
_DTYPES = (Attr("in_dtypes", STRINGS, "the kernel's input dtypes, as the registry keys them"),
           Attr("out_dtypes", STRINGS, "the kernel's output dtypes"))


def _shape(name: str, doc: str, kind: str = "amd") -> Attr:
    return Attr(name, INTS, doc, kind)


# --- limits -----------------------------------------------------------------------------------------------

def _square_kernel(p: Params) -> str | None:
    kh, kw = p["w"][1], p["w"][2]
    return None if kh == kw else f"kernel {kh}x{kw} is not square (DD's SDConv takes OHWI weights with KH == KW)"


def _group_one(p: Params) -> str | None:
    return None if p["group"] == 1 else f"group={p['group']}: SDConv has no groups (IC is the weight's last axis)"


def _no_dilation(p: Params) -> str | None:
    return None if all(d == 1 for d in p["dilations"]) else f"dilations {list(p['dilations'])}: SDConv has none"


def _square_stride(p: Params) -> str | None:
    s = list(p["strides"])
    return None if s[0] == s[1] else f"strides {s} differ between H and W (the stride is implied by IH/OH)"


def _listed_stride(p: Params) -> str | None:
    s, k = p["strides"][0], p["w"][1]
    if s in (1, 2) or s == k:
        return None
    return f"stride {s}: AMD's conv shapes have strides 1 and 2, and the kernel's own (patch embeddings)"


def _asymmetric_pads(p: Params) -> str | None:
    top, left, bottom, right = p["pads"]
    if (top, left) == (bottom, right):
        return None
    return "padding (top, left) != (bottom, right)"


def _rank(ranks: tuple[int, ...], what: str = "input") -> Limit:
    def rule(p: Params) -> str | None:
        r = len(p["x"])
        return None if r in ranks else f"{what} of rank {r}; the kernel takes rank {' or '.join(map(str, ranks))}"

    return Limit(f"rank {ranks}", f"{what} rank in {ranks}", "see the op's sources", rule)


def _mha_heads(p: Params) -> str | None:
    k = p["q"][2]
    return None if k % p["heads"] == 0 else f"{k} channels do not split into {p['heads']} heads"


def _mha_causal(p: Params) -> str | None:
    return "a causal mask varies per query; SDMHA's mask is one row of N keys" if p.get("causal") else None


def _mha_scale(p: Params) -> str | None:
    d = p["q"][2] // p["heads"]
    s = p.get("scale", d ** -0.5)
    if abs(s * d ** 0.5 - 1) < 1e-4:
        return None
    return f"scale {s:.6g} is not 1/sqrt({d}): the kernel has no scale parameter"


def _mha_key_channel(p: Params) -> str | None:
    if not p.get("key_channel"):
        return None
    return ("a computed key mask carried as one more channel per head (the head width padded to 4x): no "
            "public source lists such a head width")


def _mha_frame_heads(p: Params) -> str | None:
    s = p.get("frame_heads")
    if not s:
        return None
    return (f"an attention over frames with each of {s} pixels' heads a head of its own ({p['heads']} heads of "
            f"{p['q'][2] // p['heads']} channels over {p['q'][1]} frames): no public source lists a head count "
            "or width this large")


def _mha_same_batch(p: Params) -> str | None:
    q, k, v = p["q"], p["k"], p.get("v", p["k"])
    if q[0] == k[0] == v[0] and q[2] == k[2] == v[2] and k[1] == v[1]:
        return None
    return f"Q {list(q)}, K {list(k)}, V {list(v)}: the kernel takes Q [B, M, K] and K, V [B, N, K]"


def _ln_last_axis(p: Params) -> str | None:
    return None if p.get("last_axis", True) else "normalizes over more than the last axis"


def _gn_groups(p: Params) -> str | None:
    return None if p["x"][3] % p["groups"] == 0 else f"{p['x'][3]} channels do not split into {p['groups']} groups"


def _gn_not_32(p: Params) -> str | None:
    return None if p["groups"] == 32 else f"{p['groups']} groups (AMD's sources show 32)"


def _gelu_tanh(p: Params) -> str | None:
    return "tanh GELU" if p.get("approximate", "none") == "tanh" else None


def _rms_registry(p: Params) -> str | None:
    return "SDRMSNorm: not in the DD snapshot's registry; ROU's pass lists SD3.5's shapes commented out"


def _concat_constant(p: Params) -> str | None:
    return "a constant operand" if p.get("b_const") else None


def _resize_2x(p: Params) -> str | None:
    a, c = p["x"], p["y"]
    if len(a) != 4 or c != [a[0], 2 * a[1], 2 * a[2], a[3]]:
        return f"{a} -> {c} is not a 2x upsampling of H and W"
    if p.get("mode") != "nearest" or p.get("nearest_mode") != "floor" or p.get("coord") != "asymmetric":
        return "only nearest (asymmetric, floor) resizing: what torch's nearest upsampling exports"
    return None


def _broadcast(p: Params) -> str | None:
    a, b = list(p["a"]), list(p["b"])
    if a == b:
        return None
    if len(b) == 1 and p.get("b_const") and b[0] == a[-1]:
        return None  # a bias vector along the last axis (is_bias_add)
    if len(a) == len(b) and all(y in (1, x) for x, y in zip(a, b, strict=True)) and any(y != 1 for y in b):
        return None  # same rank, b broadcast along its size-1 axes (DD's "Nx1x1xC" path)
    return f"{a} and {b} do not broadcast the way SD{p['op']} does (equal, [.., 1, .., C] or a [C] constant)"


def _not_both_2d(p: Params) -> str | None:
    return "both operands are 2-D" if len(p["a"]) == 2 and len(p["b"]) == 2 else None


def _elementwise_rank(p: Params) -> str | None:
    r = len(p["a"])
    return None if 2 <= r <= 4 else f"rank {r}: the element-wise kernels take rank 2 to 4"


# --- MACs ---------------------------------------------------------------------------------------------------

def _conv_macs(a: Params) -> int:
    return prod(a["output_shape"]) * prod(a["weight_shape"][1:])


def _gemm_macs(a: Params) -> int:
    return prod(a["input_shape"]) * a["weight_shape"][-1]


def _mha_macs(a: Params) -> int:
    b, m, k, n = a["input_shape"]
    return 2 * b * m * n * k  # Q·Kᵀ and P·V


# --- output shapes (from the attributes) ---------------------------------------------------------------------

def _conv_out(a: Params) -> list[int]:
    b, h, w, _ = a["input_shape"]
    oc, kh, kw, _ = a["weight_shape"]
    (sh, sw), (dh, dw) = a["strides"], a.get("dilations", (1, 1))
    top, left, bottom, right = a["pads"]
    return [b, (h + top + bottom - dh * (kh - 1) - 1) // sh + 1, (w + left + right - dw * (kw - 1) - 1) // sw + 1, oc]


def _gemm_out(a: Params) -> list[int]:
    return [*a["input_shape"][:-1], a["weight_shape"][-1]]


def _same_out(a: Params) -> list[int]:
    return list(a["input_shape"])


def _mha_out(a: Params) -> list[int]:
    return list(a["input_shape"][:3])


def _resize_out(a: Params) -> list[int]:
    b, h, w, c = a["a_shape"]
    return [b, 2 * h, 2 * w, c]


def _broadcast_out(a: Params) -> list[int]:
    return [int(d) for d in np.broadcast_shapes(tuple(a["a_shape"]), tuple(a["b_shape"]))]


def _concat_out(a: Params) -> list[int]:
    x, y = list(a["a_shape"]), list(a["b_shape"])
    axis = a["axis"] % len(x)
    return [d + y[axis] if i == axis else d for i, d in enumerate(x)]


# --- the table ----------------------------------------------------------------------------------------------

_CONV = OpSpec(
    "SDConv",
    "2-D convolution in NHWC. X: [B, H, W, C] bf16, W: [OC, KH, KW, C] (OHWI; packed to bfp16ebs8 blocks of 8 "
    "input channels by AMD's packer, bias folded in), B: [OC] fp32 -> [B, OH, OW, OC]. The stride and padding "
    "are implied by the shapes for DD's kernel; AMD's pass copies the Conv's own attributes onto the node.",
    inputs=(Input("X", "activation", BF16, "[B, H, W, C]"),
            Input("W", "weight", BF16, "[OC, KH, KW, C]", packed="uint8 bfp16ebs8 blob with the bias (conv_to_bfp16)",
                  block_axis=-1),
            Input("B", "bias", F32, "[OC]", packed="folded into W's blob")),
    attrs=(_shape("input_shape", "[B, H, W, C] (the view of X)"), _shape("output_shape", "[B, OH, OW, OC]"),
           _shape("weight_shape", "[OC, KH, KW, C]"), *_DTYPES,
           Attr("strides", INTS, "the Conv's strides", "copied"), Attr("pads", INTS, "the Conv's pads", "copied"),
           Attr("dilations", INTS, "the Conv's dilations", "copied"), Attr("group", INT, "1", "copied"),
           Attr("kernel_shape", INTS, "[KH, KW]", "copied")),
    in_dtypes=(BF16, BFP, F32), out_dtypes=(BF16,), layout="NHWC",
    sources=("DD src/ops/op_registration_db.def:253-254 (SDConv {bfloat16, bfp16ebs8, float, bfloat16} at 0..3)",
             "DD tests/cpp/sd_conv/model.py:60-87 (X NHWC, w OHWI packed, input/output/weight_shape)",
             "DD src/ops/sd/conv2d.cpp:325-431 (weight_shape OHWI, KH == KW, IC/OC padded to 8/16)",
             "ROU passes.sd15.conv_to_sd_conv2d (index 67074667776) L333-358: inputs [x, W, B], "
             "copy_attributes(conv), in_dtypes [bfloat16, bfp16ebs8, float]"),
    limits=(Limit("square kernel", "KH == KW", "DD src/ops/sd/conv2d.cpp:325-337", _square_kernel),
            Limit("no groups", "group == 1", "DD src/ops/sd/conv2d.cpp:410-418", _group_one),
            Limit("no dilation", "dilations == 1", "DD src/ops/sd/conv2d.cpp:410-431", _no_dilation),
            Limit("square stride", "stride_h == stride_w", "ROU conv_to_sd_conv2d L245-248 (the shape key "
                  "(CI,YI,XI,CO,YO,XO,KY,KX) implies the stride)", _square_stride),
            Limit("listed strides", "stride 1, 2, or the kernel size", "ROU conv_to_sd_conv2d L143-248 (every "
                  "SD/SD3 shape: strides 1 and 2; k=2 s=2 and phi3.5's k=14 s=14 patch embeddings); DD "
                  "src/ops/sd/conv2d.cpp:429-431 (stride implied)", _listed_stride),
            Limit("asymmetric padding", "a conv padded (0, 0, 1, 1), as diffusers' VAE encoder downsamples: the "
                  "shape key cannot tell it from (1, 1, 1, 1); AMD lists SD3's VAE-encoder strided shapes, whose "
                  "padding is this one, but no source says which padding the kernel applies",
                  "ROU conv_to_sd_conv2d (index 67074667776) sd3 vae_encoder shapes", _asymmetric_pads,
                  assumed=True)),
    views=(("input_shape", 0),), exact_inputs=(("weight_shape", 1),), exact_outputs=(("output_shape", 0),),
    macs=_conv_macs, output=_conv_out, bfp="SDConv_bfp", bfp_in_dtypes=(BFP, BFP, F32))

_GEMM = OpSpec(
    "SDGemm",
    "Linear layer. X: [B, M, K] bf16, W: [K, N] (packed to bfp16ebs8 blocks of 8 along K), B: [N] bf16 "
    "(zeros where the layer has none, as AMD's pass writes a fake bias) -> [B, M, N]. nonlinear='Gelu' applies "
    "GELU to the result (GEGLU's gate half).",
    inputs=(Input("X", "activation", BF16, "[B, M, K]"),
            Input("W", "weight", BF16, "[K, N]", packed="uint8 bfp16ebs8 blob with the bias (gemm_to_bfp16)",
                  block_axis=0),
            Input("B", "bias", BF16, "[N]", packed="folded into W's blob")),
    attrs=(_shape("input_shape", "[B, M, K] (the view of X; a [B, K] input is [B, 1, K])"),
           _shape("output_shape", "[B, M, N]"), _shape("weight_shape", "[K, N]"), *_DTYPES,
           Attr("bias_enable", INT, "1 (AMD writes a zero bias for a layer without one)"),
           Attr("nonlinear", STRING, "'Gelu' when the GELU after the layer is fused", "pass", required=False)),
    in_dtypes=(BF16, BFP, BF16), out_dtypes=(BF16,), layout="BMK",
    sources=("DD src/ops/op_registration_db.def:304-305 (SDGemm {bfloat16, bfp16ebs8, bfloat16, bfloat16})",
             "DD tests/cpp/sd_gemm/model.py:63-92 (X [2, 1, 1280], input/output/weight_shape, bias_enable)",
             "DD src/ops/sd/gemm.cpp:244-333 (bias_enable as bool or ints)",
             "ROU passes.sd15.matmul_add_to_sd_gemm (index 66571986511) L236-275: fake bias, nonlinear='Gelu'"),
    limits=(_rank((3,)),),
    views=(("input_shape", 0),), exact_inputs=(("weight_shape", 1),), exact_outputs=(("output_shape", 0),),
    macs=_gemm_macs, output=_gemm_out, bfp="SDGemm_bfp", bfp_in_dtypes=(BFP, BFP, BF16))

_MATMUL = OpSpec(
    "SDMatMul",
    "Activation x constant weight without bias, bf16 weights. X: [B, M, K], W: [K, N] -> [B, M, N]. AMD's "
    "SDXL lists use SDGemm with a zero bias instead; the rules do too.",
    inputs=(Input("X", "activation", BF16, "[B, M, K]"),
            Input("W", "weight", BF16, "[K, N]", packed="uint16 bf16 tiles (matmul_to_bf16)")),
    attrs=(_shape("input_shape", "[B, M, K]"), _shape("output_shape", "[B, M, N]"),
           _shape("weight_shape", "[K, N]"), *_DTYPES),
    in_dtypes=(BF16, BF16), out_dtypes=(BF16,), layout="BMK",
    sources=("DD src/ops/op_registration_db.def:256-257", "DD tests/cpp/sd_matmul/model.py:101-133",
             "ROU passes.sd15.matmul_to_sd_matmul (index 66541020914)"),
    limits=(_rank((3,)),),
    views=(("input_shape", 0),), exact_inputs=(("weight_shape", 1),), exact_outputs=(("output_shape", 0),),
    macs=_gemm_macs, output=_gemm_out)

_MHA_DOC = ("softmax(Q Kᵀ / sqrt(K / num_heads) + mask) V per head. Q: [B, M, K], K, V: [B, N, K] bf16, mask: "
            "[L] bf16 (0 for the N keys, -inf for padding up to L) -> [B, M, K].")
_MHA_INPUTS = (Input("Q", "activation", BF16, "[B, M, K]"), Input("K", "activation", BF16, "[B, N, K]"),
               Input("V", "activation", BF16, "[B, N, K]"),
               Input("mask", "mask", BF16, "[L]", packed="uint16 bf16 bits"))
_MHA_LIMITS = (Limit("heads", "K divides into num_heads", "DD src/ops/sd/mha.cpp:139-171", _mha_heads),
               Limit("no causal mask", "the mask is one row over the keys", "DD src/ops/sd/mha.cpp:173-219 "
                     "(mask of max(N, 128) / align(N, 256) / M elements)", _mha_causal),
               Limit("default scale", "1/sqrt(head dim)", "DD src/ops/sd/mha.cpp:139-171 (no scale attribute)",
                     _mha_scale),
               Limit("Q, K, V agree", "same batch and width", "DD src/ops/sd/mha.cpp:173-176", _mha_same_batch),
               Limit("pixels as heads", "the frames of every pixel attended as one head each (the temporal "
                     "layers' tokens read in their spatial order, passes/frames.py): the kernel splits K into "
                     "num_heads heads of K / num_heads channels; that it takes thousands of them is assumed",
                     "DD src/ops/sd/mha.cpp:139-171 (num_heads splits K)", _mha_frame_heads, assumed=True),
               Limit("key mask channel", "a key-padding row per batch (a constant one, or Lumina 2's caption mask, "
                     "computed at run time) rides in Q and K as one more channel per head, the heads padded to 4x their width; the kernel's own "
                     "mask is a load-time constant", "DD src/ops/sd/mha.cpp:269-308 (initialize_const_params: "
                     "the mask; execute: Q, K, V)", _mha_key_channel, assumed=True))


def _mha(op: str, version: str, flag: str | None, doc: str, bfp: str | None = None) -> OpSpec:
    attrs = [_shape("input_shape", "[B, M, K, N]"), Attr("num_heads", INT, "heads"), *_DTYPES,
             Attr("op_version", STRING, f"'{version}'", "pass")]
    if flag:
        attrs.append(Attr(flag, INT, "1", "pass"))
    return OpSpec(
        op, f"{_MHA_DOC} {doc}", inputs=_MHA_INPUTS, attrs=tuple(attrs), in_dtypes=(BF16, BF16, BF16),
        out_dtypes=(BF16,), layout="BMK",
        sources=("DD src/ops/op_registration_db.def:280-281 (SDMHA)",
                 "DD tests/cpp/sd_mha/model.py:38-66 (Q [B,M,K], K/V [B,N,K], mask, input_shape [B,M,K,N], "
                 "num_heads INT)", "DD src/ops/sd/mha.cpp:139-219",
                 "ROU passes.sd15.mha_to_sd_mha (index 66997991739) L160-277: op_version v1.0 -> SDMHA_VAE, "
                 "v1.1 -> SDFlatMHA, v2 -> SDMHA (M >= 256 and N >= 128); mask 0 / -inf"),
        limits=_MHA_LIMITS, exact_outputs=(), macs=_mha_macs, output=_mha_out, bfp=bfp,
        bfp_in_dtypes=(BFP, BF16) if bfp else ())


_LAYER_NORM = OpSpec(
    "SDLayerNorm",
    "LayerNorm over the last axis. X: [B, M, K] bf16, gamma, beta: [K] bf16 -> [B, M, K].",
    inputs=(Input("X", "activation", BF16, "[B, M, K]"),
            Input("gamma", "weight", BF16, "[K]", packed="uint16 bf16 bits"),
            Input("beta", "weight", BF16, "[K]", packed="uint16 bf16 bits")),
    attrs=(_shape("input_shape", "[B, M, K]"), _shape("output_shape", "[B, M, K]"), *_DTYPES,
           _shape("gamma_shape", "[K]"), _shape("beta_shape", "[K]"),
           Attr("epsilon", FLOAT, "the LayerNormalization's epsilon", "copied"),
           Attr("axis", INT, "-1", "copied")),
    in_dtypes=(BF16, BF16, BF16), out_dtypes=(BF16,), layout="BMK",
    sources=("DD src/ops/op_registration_db.def:277-278", "DD tests/cpp/sd_layernorm/model.py:101-128",
             "DD src/ops/sd/layernorm.cpp:118-146 (input_shape and output_shape of rank 3)",
             "ROU SDLayerNorm pass (index 67074094816): copies the LayerNormalization's attributes"),
    limits=(_rank((3,)), Limit("last axis", "normalizes over the last axis only", "ROU index 67074094816",
                               _ln_last_axis)),
    views=(("input_shape", 0),), exact_inputs=(("gamma_shape", 1), ("beta_shape", 2)),
    exact_outputs=(("output_shape", 0),), output=_same_out)

_RMS_NORM = OpSpec(
    "SDRMSNorm",
    "RMSNorm over the last axis: X / sqrt(mean(X^2) + epsilon) * scale. X: [..., K] bf16 (SD3.5's per-head Q/K "
    "norms: [B, S, H, D]), scale: [K] bf16 -> X's shape.",
    inputs=(Input("X", "activation", BF16, "[..., K]"),
            Input("scale", "weight", BF16, "[K]", packed="uint16 bf16 bits")),
    attrs=(_shape("input_shape", "X's shape", "pass"), _shape("output_shape", "= input_shape", "pass"), *_DTYPES,
           _shape("beta_shape", "[K] (the scale's shape; ROU's name)", "pass"),
           Attr("epsilon", FLOAT, "the norm's epsilon", "copied"), Attr("axis", INT, "-1", "copied")),
    in_dtypes=(BF16, BF16), out_dtypes=(BF16,), layout="any",
    sources=("ROU sd3 SDRMSNorm pass (index 66479835781): SimplifiedLayerNormalization -> SDRMSNorm, attributes "
             "input_shape, output_shape, beta_shape, in_dtypes [bf16, bf16, bf16], out_dtypes [bf16], the norm's "
             "own copied; supported shapes ((2, 160, 24, 64), (64,)) and ((2, 1024, 24, 64), (64,)) commented out",
             "DD src/ops/op_registration_db.def: no SDRMSNorm (its RMSNorm is the LLM kernel MLADFRMSNORM, "
             "transaction/stx/mladfrmsnorm: widths 1536-4096 only)"),
    limits=(_rank((2, 3, 4)), Limit("registry", "AMD's pass writes it for SD3.5's transformer, but no DD source "
                                    "registers or lists a kernel for it", "ROU index 66479835781", _rms_registry,
                                    assumed=True)),
    views=(("input_shape", 0),), exact_inputs=(("beta_shape", 1),), exact_outputs=(("output_shape", 0),),
    output=_same_out)

_GROUP_NORM = OpSpec(
    "SDGroupNorm",
    "GroupNorm in NHWC. X: [B, H, W, C] bf16, wts: [2C] bf16 (gamma then beta) -> [B, H, W, C]; "
    "nonlinear='Silu' applies the SiLU that follows it.",
    inputs=(Input("X", "activation", BF16, "[B, H, W, C]"), Input("wts", "weight", BF16, "[2C]")),
    attrs=(_shape("input_shape", "[B, H, W, C]"), _shape("output_shape", "[B, H, W, C]"), *_DTYPES,
           _shape("wts_shape", "[2C]"), _shape("gamma_shape", "[C]", "pass"), _shape("beta_shape", "[C]", "pass"),
           Attr("epsilon", FLOAT, "the GroupNorm's epsilon", "copied"),
           Attr("groups", INT, "the number of groups", "copied"),
           Attr("activation", INT, "0 (the SiLU is `nonlinear`)", "copied"),
           Attr("channels_last", INT, "1", "copied"),
           Attr("nonlinear", STRING, "'Silu' when the SiLU after it is fused", "pass", required=False)),
    in_dtypes=(BF16, BF16), out_dtypes=(BF16,), layout="NHWC",
    sources=("DD src/ops/op_registration_db.def:286-287", "DD tests/cpp/sd_groupnorm/model.py:40-67 (wts = "
             "concat(gamma, beta), wts_shape [2C])", "DD src/ops/sd/groupnorm.cpp:153-225",
             "ROU SDGroupNorm pass (index 66800325324) L144-233: channels_last, copies the GroupNorm's "
             "attributes, gamma_shape/beta_shape, nonlinear='Silu' for GroupNorm -> Sigmoid -> Mul"),
    limits=(_rank((4,)), Limit("groups", "C divides into groups", "ROU index 66800325324", _gn_groups),
            Limit("32 groups", "a group count other than diffusers' 32 (an InstanceNormalization is one group a "
                  "channel): the kernel's sources and tests show SD's GroupNorms, 32 groups, only; that it takes "
                  "another count is assumed", "DD tests/cpp/sd_groupnorm/model.py:40-67; ROU index 66800325324",
                  _gn_not_32, assumed=True)),
    views=(("input_shape", 0),), exact_inputs=(("wts_shape", 1),), exact_outputs=(("output_shape", 0),),
    output=_same_out)

_DUMMY_SILU = Input("wts", "dummy", "uint8", "[128]", dummy_shape=(128,))
_SILU = OpSpec(
    "SDSilu", "x · sigmoid(x). X: any shape of rank 2-4 bf16; wts: a 128-byte buffer the kernel needs.",
    inputs=(Input("X", "activation", BF16, "[..]"), _DUMMY_SILU),
    attrs=(_shape("input_shape", "the view of X"), _shape("output_shape", "= input_shape"), *_DTYPES,
           _shape("weight_shape", "[128]")),
    in_dtypes=(BF16,), out_dtypes=(BF16,), layout="any",
    sources=("DD src/ops/op_registration_db.def:262-263", "DD tests/cpp/sd_silu/model.py:40-66",
             "DD src/ops/sd/silu.cpp:145-197 (shapes incl. [2, 1280], the time embedding)",
             "ROU SDSilu pass (index 66439740860)"),
    limits=(_rank((2, 3, 4)),),
    views=(("input_shape", 0),), exact_inputs=(("weight_shape", 1),), exact_outputs=(("output_shape", 0),),
    output=_same_out)

_GELU = OpSpec(
    "SDGelu", "GELU. X: [B, M, N] bf16; w: a 128-byte buffer the kernel needs.",
    inputs=(Input("X", "activation", BF16, "[B, M, N]"), Input("w", "dummy", "uint16", "[64]", dummy_shape=(64,))),
    attrs=(_shape("input_shape", "[B, M, N]"), _shape("output_shape", "[B, M, N]"), *_DTYPES,
           Attr("approximate", STRING, "the Gelu's approximate ('none')", "copied")),
    in_dtypes=(BF16, BF16), out_dtypes=(BF16,), layout="BMK",
    sources=("DD src/ops/op_registration_db.def:259-260", "DD tests/cpp/sd_gelu/model.py:19-43",
             "ROU SDGelu pass (index 66602077881): 3-D input"),
    limits=(_rank((3,)), Limit("tanh GELU", "the tanh approximation: AMD lists SD3's GELU shapes (SD3 uses tanh "
                               "GELU) but no source says the kernel computes it", "ROU index 66602077881",
                               _gelu_tanh, assumed=True)),
    views=(("input_shape", 0),), exact_outputs=(("output_shape", 0),), output=_same_out)

_RESIZE = OpSpec(
    "SDResize", "2x nearest-neighbour upsampling in NHWC. A: [B, H, W, C] bf16 -> [B, 2H, 2W, C]; w: a 128-byte "
    "buffer the kernel needs.",
    inputs=(Input("A", "activation", BF16, "[B, H, W, C]"), Input("w", "dummy", F32, "[32]", dummy_shape=(32,))),
    attrs=(_shape("a_shape", "[B, H, W, C]"), _shape("c_shape", "[B, 2H, 2W, C]"), *_DTYPES),
    in_dtypes=(BF16,), out_dtypes=(BF16,), layout="NHWC",
    sources=("DD src/ops/op_registration_db.def:274-275", "DD tests/cpp/sd_resize/model.py:38-61",
             "ROU SDResize pass (index 67086530820): scales [1, 2, 2, 1], mode nearest, nearest_mode floor"),
    limits=(Limit("2x nearest", "nearest (asymmetric, floor), H and W doubled", "ROU index 67086530820",
                  _resize_2x),),
    views=(("a_shape", 0),), exact_outputs=(("c_shape", 0),), output=_resize_out)


def _binary(op: str, doc: str, sources: tuple[str, ...], extra: tuple[Attr, ...] = (),
            limits: tuple[Limit, ...] = (), output: Any = _broadcast_out) -> OpSpec:
    return OpSpec(
        op, doc, inputs=(Input("A", "activation", BF16, "[..]"), Input("B", "activation", BF16, "[..]")),
        attrs=(_shape("a_shape", "the view of A"), _shape("b_shape", "the view of B"),
               _shape("c_shape", "the output's shape"), *_DTYPES, *extra),
        in_dtypes=(BF16, BF16), out_dtypes=(BF16,), layout="any", sources=sources,
        limits=(Limit("rank", "rank 2 to 4", sources[0], _elementwise_rank), *limits),
        views=(("a_shape", 0), ("b_shape", 1)), exact_outputs=(("c_shape", 0),), output=output)


_BROADCAST = Limit("broadcast", "B equals A, or is A's shape with some axes 1 ([B, 1, 1, C], [B, 1, C], "
                   "[1, M, C]), or a constant [C] along A's last axis",
                   "DD src/ops/sd/elwadd.cpp:127-350 and elwmul.cpp:126-200 (shape tables, Nx1x1xC path)", _broadcast)
_ADD = _binary(
    "SDAdd", "A + B (B broadcast; a constant B is a bias: is_bias_add=1).",
    ("DD src/ops/op_registration_db.def:268-269", "DD tests/cpp/sd_elwadd/model.py:120-153",
     "DD src/ops/sd/elwadd.cpp:306-350", "ROU passes.sd15.add_to_sd_add (index 66778064293) L190-271: "
     "activation first, constant as bf16, is_bias_add"),
    extra=(Attr("is_bias_add", INT, "1 when B is a constant", "pass"),), limits=(_BROADCAST,))
_MUL = _binary(
    "SDMul", "A · B (B broadcast; the larger operand first).",
    ("DD src/ops/op_registration_db.def:271-272", "DD tests/cpp/sd_elwmul/model.py:120-153",
     "DD src/ops/sd/elwmul.cpp:172-200", "ROU SDMul pass (index 66489073600): the larger input first, "
     "not 2-D x 2-D"),
    limits=(_BROADCAST, Limit("not 2-D", "not both operands 2-D", "ROU index 66489073600", _not_both_2d)))
_CONCAT = _binary(
    "SDConcat", "Concatenation of two tensors along `axis`.",
    ("DD src/ops/op_registration_db.def:265-266 (positions 0 and 2: the second input is not keyed)",
     "DD tests/cpp/sd_concat/model.py:40-63", "DD src/ops/sd/concat.cpp:159-185, 253 (axis, two tensors)",
     "ROU passes.sd15.concat_to_sd_concat (index 66831085692): two activations, not both 2-D, copies axis"),
    extra=(Attr("axis", INT, "the Concat's axis", "copied"),),
    limits=(Limit("not 2-D", "not both operands 2-D", "ROU index 66831085692", _not_both_2d),
            Limit("constant operand", "one operand a constant (AuraFlow's register tokens): AMD's test models and "
                  "passes concatenate two activations; a constant is a bf16 initializer as SDAdd's B may be",
                  "DD tests/cpp/sd_concat/model.py:40-63", _concat_constant, assumed=True)), output=_concat_out)
_SLICE = OpSpec(
    "SDSlice", "A slice keyed only by its (input, output) shapes: the kernel has no start/end attributes, and "
    "AMD's passes use it for SD3's joint-attention splits only. The rules do not emit it.",
    inputs=(Input("X", "activation", BF16, "[..]"), Input("wts", "dummy", "uint8", "[128]", dummy_shape=(128,))),
    attrs=(_shape("input_shape", "[..]"), _shape("output_shape", "[..]"), *_DTYPES, _shape("weight_shape", "[128]")),
    in_dtypes=(BF16,), out_dtypes=(BF16,), layout="BMK",
    sources=("DD src/ops/op_registration_db.def:283-284", "DD tests/cpp/sd_slice/model.py:40-66",
             "DD src/ops/sd/slice.cpp:140-181", "ROU SDSlice pass (index 66562319709)"),
    views=(("input_shape", 0),), exact_outputs=(("output_shape", 0),))

_CAST_AVX = OpSpec(
    "CastAvx", "The CPU<->NPU boundary cast (AVX on the CPU): Cast to `to`. Not a dispatch op.",
    inputs=(Input("X", "activation", F32, "[..]"),),
    attrs=(Attr("to", INT, "the target dtype (TensorProto enum)", "pass"),),
    in_dtypes=(), out_dtypes=(), layout="any",
    sources=("ROU ryzenai_onnx_utils.transform.cast (index 67008965389) L13-62: op CastAvx, one attribute `to`, "
             "the SD ops' domain",))

_CPU_REASONS = {
    "Sin": "Sin: not in the amd-xdna2 registry (the sinusoidal embeddings stay fp32 on the CPU)",
    "Cos": "Cos: not in the amd-xdna2 registry (the sinusoidal embeddings stay fp32 on the CPU)",
    "Gather": "Gather: not in the amd-xdna2 registry (integer indices)",
    "GatherND": "GatherND: not in the amd-xdna2 registry (integer indices)",
    "ArgMax": "ArgMax: not in the amd-xdna2 registry (integer indices)",
    "Transpose": "Transpose: not in the amd-xdna2 registry (a real data movement, not a view)",
    "Reshape": "Reshape: read by the CPU, so no dispatch op absorbs it as a view",
    "Expand": "Expand: not in the amd-xdna2 registry",
    "Clip": ("Clip: not in the amd-xdna2 registry (no clamp, ReLU or ReLU6 kernel: a VAE's output clamp to [-1, 1] "
             "stays on the CPU)"),
    "Softmax": "Softmax: not in the amd-xdna2 registry outside SDMHA",
    "Sigmoid": "Sigmoid: not in the amd-xdna2 registry outside SiLU",
    "Slice": "Slice: SDSlice has no start/end attributes (DD keys it on shapes only)",
    "Split": "Split: SDSlice has no start/end attributes (DD keys it on shapes only)",
    "Sub": "Sub: not in the amd-xdna2 registry (x - c for a constant c becomes SDAdd)",
    "Div": "Div: not in the amd-xdna2 registry (x / c for a constant c becomes SDMul)",
    "MatMul": "MatMul of two activations: not in the amd-xdna2 registry (SDMatMul takes a constant weight)",
}


# what the rules ask for -> AMD's op (the attention's three variants: ``mha_variant``)
FAMILIES = {"conv": "SDConv", "gemm": "SDGemm", "matmul": "SDMatMul", "layer_norm": "SDLayerNorm",
            "rms_norm": "SDRMSNorm", "group_norm": "SDGroupNorm", "silu": "SDSilu", "gelu": "SDGelu",
            "resize": "SDResize", "add": "SDAdd", "mul": "SDMul", "concat": "SDConcat", "slice": "SDSlice"}


def build() -> DispatchTarget:
    ops = [_CONV, _GEMM, _MATMUL,
           _mha("SDMHA", "v2", "is_flash_mha", "The flash variant: M >= 256 and N >= 128.", bfp="SDMHA_bfp"),
           _mha("SDFlatMHA", "v1.1", "is_flat_mha_1_1", "Below M 256 or N 128 (cross-attention on 77 tokens).",
                bfp="SDFlatMHA_bfp"),
           _mha("SDMHA_VAE", "v1.0", None, "The VAE's single-head attention over all pixels."),
           _LAYER_NORM, _RMS_NORM, _GROUP_NORM, _SILU, _GELU, _RESIZE, _ADD, _MUL, _CONCAT, _SLICE]
    table = {op.op_type: op for op in ops}
    return DispatchTarget(name=NAME, doc=__doc__ or "", precisions=("bf16", "bfp16"), domain=DOMAIN,
                          domain_version=1, ops=table, boundary=_CAST_AVX, sources=SOURCES, cpu_reasons=_CPU_REASONS,
                          mha_variant=mha_variant, mha_mask_length=mha_mask_length, families=FAMILIES)


def mha_variant(m: int, n: int, heads: int) -> str:
    """The MHA op for Q length ``m``, K/V length ``n``: ROU's get_op_version (index 66997991739 L160-194)."""
    if heads == 1:
        return "SDMHA_VAE"
    return "SDMHA" if m >= 256 and n >= 128 else "SDFlatMHA"


def mha_mask_length(b: int, m: int, k: int, n: int) -> int:
    """The mask's element count: DD src/ops/sd/mha.cpp:173-219 (VAE, batch 1: M; SD3's MMDiT, K 1536: N
    aligned to 256; the UNet: max(N, 128)); never shorter than N."""
    if b == 1:
        return max(m, n)
    if k == 1536:
        return -(-n // 256) * 256
    return max(n, 128)


register(NAME, build)
