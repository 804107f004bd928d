"""passes/frames.py: a video transformer's token transposes absorbed, on torch's own exports of diffusers'
TransformerSpatioTemporalModel (SVD's spatial + temporal transformer) and on hand-built near misses."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from sdnpu.passes.frames import absorb_frame_transposes

from .fuzz_repro import check
from .graphs import ops
from .test_fuse import _folded
from .lowering import TARGET, assert_same, dispatch_ops, lowered, n, w


def _svd_transformer(pixels: int):
    from diffusers.models.transformers.transformer_temporal import TransformerSpatioTemporalModel

    torch.manual_seed(0)
    m = TransformerSpatioTemporalModel(num_attention_heads=2, attention_head_dim=16, in_channels=32, num_layers=1,
                                       cross_attention_dim=24).eval()
    with torch.no_grad():
        for p in m.parameters():  # torch starts norms at ones and zeros, which would hide a lost weight
            p.add_(0.2 * torch.randn(p.shape))
    frames, side = 2, pixels
    x = torch.randn(frames, 32, side, side)
    context = torch.randn(frames, 1, 24)
    indicator = torch.zeros(1, frames)
    return m, (x, context, indicator)


def _export(exporter: str, path, pixels: int = 9) -> onnx.ModelProto:
    m, args = _svd_transformer(pixels)

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = m

        def forward(self, x, context, indicator):
            return self.m(x, encoder_hidden_states=context, image_only_indicator=indicator).sample

    names = ["x", "context", "indicator"]
    with torch.no_grad():
        if exporter == "dynamo":
            torch.onnx.export(Wrapper(), args, dynamo=True, opset_version=20, input_names=names, output_names=["y"],
                              verbose=False, report=False).save(str(path))
        else:
            torch.onnx.export(Wrapper(), args, str(path), dynamo=False, opset_version=20, input_names=names,
                              output_names=["y"])
    return onnx.shape_inference.infer_shapes(onnx.load(str(path)), strict_mode=True, data_prop=True)


def _frame_transposes(irm) -> int:
    return sum(1 for node in irm.graph if node.op_type == "Transpose" and node.attributes.get("perm") is not None
               and tuple(node.attributes["perm"].value) == (0, 2, 1, 3))


@pytest.mark.parametrize("side", [9, 4])
@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_svd_temporal_transformer_runs_without_its_token_transposes(exporter, side, tmp_path):
    """9 x 9 and 4 x 4 pixels of 2 frames (the context's broadcast over 81 pixels stays an Expand, as at SVD's
    sizes; over 16 the canonical steps write it as SDConcats of 16 copies): the temporal block's two transposes go, its attention over frames takes the pixels as heads (an assumed
    capability, recorded), its cross-attention the frames as the batch; the numbers are the graph's (fp32 before
    precision, the whole compile within bf16's tolerance, onnx's full check at every stage)."""
    m = _export(exporter, tmp_path / "m.onnx", side)
    irm = lowered(m)
    assert _frame_transposes(irm) == 2, ops(irm)
    result = absorb_frame_transposes(irm, TARGET)
    assert result.counts.get("frame transposes -> views") == 1, result.counts
    assert result.counts.get("attentions over frames -> pixels as heads") == 1, result.counts
    assert result.counts.get("cross-attentions -> frames as the batch") == 1, result.counts
    assert _frame_transposes(irm) == 0, ops(irm)
    heads = [node for node in irm.graph if node.op_type in ("SDMHA", "SDFlatMHA")
             and int(node.attributes["num_heads"].value) == 2 * side * side]
    assert len(heads) == 1 and "pixels as heads" in heads[0].metadata_props.get("sdnpu.assumed", ""), \
        [dict(node.metadata_props) for node in heads]
    assert_same(m, irm)
    # TorchScript's graph carries its shapes as computed values, which onnx's inference (the bf16 check's) cannot
    # see through: checked with its constants folded, as test_fuse's video convs
    outcome = check(_folded(m) if exporter == "torchscript" else m, "bf16")
    assert outcome.cpu_ops.get("Transpose", 0) <= 2, outcome.cpu_ops  # the NCHW edges alone


# --- near misses: the region is not token-wise, so the transposes stay and the pass says why --------------------

B, F, S, C = 1, 2, 4, 8


def _region(middle: list[onnx.NodeProto], inits: list[onnx.TensorProto], extra_inputs=()) -> onnx.ModelProto:
    """x [B*F, S, C] -> tokens [B*S, F, C] -> ``middle`` (reads t, writes u) -> back to [B*F, S, C]."""
    nodes = [
        n("Reshape", ["x", "s4"], ["x4"]), n("Transpose", ["x4"], ["xt"], perm=[0, 2, 1, 3]),
        n("Reshape", ["xt", "s3t"], ["t"]), *middle,
        n("Reshape", ["u", "s4t"], ["u4"]), n("Transpose", ["u4"], ["ut"], perm=[0, 2, 1, 3]),
        n("Reshape", ["ut", "s3"], ["y"]),
    ]
    shapes = [helper.make_tensor(k, TensorProto.INT64, [len(v)], v) for k, v in
              {"s4": [B, F, S, C], "s3t": [B * S, F, C], "s4t": [B, S, F, C], "s3": [B * F, S, C]}.items()]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [B * F, S, C]),
                                       *extra_inputs],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [B * F, S, C])], [*shapes, *inits])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])


def _linear(name: str, x: str, y: str) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    return ([n("MatMul", [x, f"{name}_w"], [f"{name}_m"]), n("Add", [f"{name}_m", f"{name}_b"], [y])],
            [onnx.numpy_helper.from_array(w(C, C), f"{name}_w"), onnx.numpy_helper.from_array(w(C), f"{name}_b")])


def _token_wise() -> onnx.ModelProto:
    lin, inits = _linear("l", "t", "h")
    return _region([*lin, n("Add", ["h", "t"], ["u"])], inits)


def _per_frame_scale() -> onnx.ModelProto:
    """A [B*S, F, 1]-shaped operand (it varies along the frames, not along the channels alone)."""
    lin, inits = _linear("l", "t", "h")
    scale = onnx.numpy_helper.from_array(w(1, F, 1) + 1.0, "per_frame")
    return _region([*lin, n("Mul", ["h", "per_frame"], ["u"])], [*inits, scale])


def _cpu_reader() -> onnx.ModelProto:
    """A Softmax over the frames (on the CPU: not a token-wise dispatch op)."""
    lin, inits = _linear("l", "t", "h")
    return _region([*lin, n("Softmax", ["h"], ["u"], axis=1)], inits)


def _across_tokens() -> onnx.ModelProto:
    """A linear layer over both frames of a pixel ([B*S, F*C] x [F*C, F*C]): it mixes the tokens, so their order
    matters (the SDGemm reads the tokens through a view whose rows are pixels, not tokens)."""
    nodes = [n("Reshape", ["t", "rows"], ["r"]), n("MatMul", ["r", "wide"], ["m"]), n("Reshape", ["m", "s3t"], ["h"]),
             n("Add", ["h", "t"], ["u"])]
    return _region(nodes, [onnx.numpy_helper.from_array(w(F * C, F * C), "wide"),
                           helper.make_tensor("rows", TensorProto.INT64, [2], [B * S, F * C])])


NEAR_MISSES = {
    "a per-frame scale": (_per_frame_scale, "varies by token"),
    "a linear layer across the frames": (_across_tokens, "does not keep its tokens"),
    "a CPU reader": (_cpu_reader, "on the CPU"),
}


def test_a_token_wise_region_loses_its_transposes():
    """The positive twin of the near misses: a linear layer and a residual Add between the transposes."""
    m = _token_wise()
    irm = lowered(m)
    assert _frame_transposes(irm) == 2, ops(irm)
    result = absorb_frame_transposes(irm, TARGET)
    assert result.modified and _frame_transposes(irm) == 0, (result.counts, ops(irm))
    assert dispatch_ops(irm) == {"SDGemm": 1, "SDAdd": 1}, ops(irm)
    assert_same(m, irm)
    check(m, "bf16")


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_near_misses_keep_their_transposes_and_say_why(name):
    build, why = NEAR_MISSES[name]
    m = build()
    irm = lowered(m)
    before = _frame_transposes(irm)
    result = absorb_frame_transposes(irm, TARGET)
    assert not result.modified and _frame_transposes(irm) == before == 2, (result.counts, ops(irm))
    assert any(why in k for k in result.counts), result.counts
    assert_same(m, irm)
    assert np.isfinite(before)


# --- video UNets' temporal layers: [B*F, C, H, W] read as [B, C, F, H, W] and per pixel over the frames -----------

class _TemporalBlock(torch.nn.Module):
    """A per-frame conv, a video UNet's temporal transformer on its NCHW output, a conv after: ModelScope's
    ``TransformerTemporalModel`` (UNet3DConditionModel) or AnimateDiff's motion module
    (``AnimateDiffTransformer3D``: a sinusoidal position embedding over the frames), configured as their UNets
    build them. Each views [B*F, C, H, W] as [B, C, F, H, W], group-norms it, and permutes it to one sequence of
    F frames per pixel; its output comes back the same way to a residual Add."""

    def __init__(self, kind: str, channels: int = 16, heads: int = 2) -> None:
        from diffusers.models.transformers.transformer_temporal import TransformerTemporalModel
        from diffusers.models.unets.unet_motion_model import AnimateDiffTransformer3D

        super().__init__()
        self.conv_in = torch.nn.Conv2d(4, channels, 3, padding=1)
        if kind == "modelscope":
            self.temporal = TransformerTemporalModel(channels // heads, heads, in_channels=channels, num_layers=1,
                                                     norm_num_groups=8)
        else:
            self.temporal = AnimateDiffTransformer3D(num_attention_heads=heads, in_channels=channels, num_layers=1,
                                                     norm_num_groups=8, activation_fn="geglu",
                                                     positional_embeddings="sinusoidal", num_positional_embeddings=32,
                                                     attention_head_dim=channels // heads)
        self.conv_out = torch.nn.Conv2d(channels, 4, 3, padding=1)
        self.kind = kind

    def forward(self, x):
        h = self.conv_in(x)
        out = self.temporal(h, num_frames=2)
        h = out.sample if self.kind == "modelscope" else out
        return self.conv_out(h)


@pytest.mark.parametrize("kind", ["modelscope", "animatediff"])
def test_a_video_unets_temporal_transformer_runs_without_its_transposes(kind, tmp_path):
    """Exported by dynamo: the layout pass writes each temporal transformer's movement chains (NCHW ->
    [B, C, F, H, W] -> [B*H*W, F, C], and back to the NCHW residual Add) as the frame swap they are, with the
    channels-first Transpose after it exposed and carried down to cancel (``layout.frame_swap``); the frames
    pass then reads the region in the spatial order, AnimateDiff's position embedding as [1, F, 1, C] rows.
    What stays on the CPU is the NCHW edges; the numbers are the graph's (fp32 before precision)."""
    torch.manual_seed(0)
    module = _TemporalBlock(kind).eval()
    with torch.no_grad():
        for p in module.parameters():  # torch starts norms at ones and zeros, which would hide a lost weight
            p.add_(0.2 * torch.randn(p.shape))
    x = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(1))
    path = tmp_path / "m.onnx"
    with torch.no_grad():
        torch.onnx.export(module, (x,), dynamo=True, opset_version=20, input_names=["x"], output_names=["y"],
                          verbose=False, report=False).save(str(path))
    m = onnx.load(str(path))
    irm = lowered(m)
    assert _frame_transposes(irm) == 2, ops(irm)
    result = absorb_frame_transposes(irm, TARGET)
    assert result.counts.get("frame transposes -> views") == 1, result.counts
    assert result.counts.get("attentions over frames -> pixels as heads") == 2, result.counts
    # the embedding is added before each of the block's two self-attentions
    assert result.counts.get("per-frame operands -> [1, F, 1, C]", 0) == 2 * (kind == "animatediff"), result.counts
    cpu = {k: v for k, v in ops(irm).items() if not TARGET.is_dispatch(TARGET.domain, k)}
    assert cpu.get("Transpose", 0) <= 2 and "Add" not in cpu, ops(irm)  # the input's and the output's
    assert_same(m, irm, atol=1e-4)
