"""Export forms (convert/exportforms.py): each form computes its class's forward, is chosen by the class while
sdnpu exports, and is put back; HiDream's transformer exports through sdnpu's path and agrees with PyTorch."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from sdnpu.convert.export import Exporter, export_module
from sdnpu.convert.exportforms import FORMS, export_forms, forms_for

from .zoo import seeded

HIDREAM = dict(patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=32,
               num_attention_heads=2, caption_channels=[48, 40], text_emb_dim=32, num_routed_experts=4,
               num_activated_experts=2, axes_dims_rope=[8, 12, 12], max_resolution=[64, 64], llama_layers=[0, 1])


def _moe(routed: int = 4, activated: int = 2):
    from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

    torch.manual_seed(0)
    return seeded(MOEFeedForwardSwiGLU(32, 64, routed, activated))


@pytest.mark.parametrize(("routed", "activated"), [(4, 2), (4, 1), (8, 3)])
def test_dense_routing_is_the_routed_sum(routed, activated):
    """Every expert on every token, weighted by the gate's top-k weights (0 where not picked), against
    diffusers' own moe_infer (tokens sorted by expert): measured 0.0 apart (bit for bit) on all three, at outputs
    of about 1; held to 1e-6, the rounding a matmul over more rows may differ by."""
    moe = _moe(routed, activated)
    x = torch.randn(2, 37, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = moe(x)
        with export_forms(moe, "dynamo") as used:
            got = moe(x)
    assert used == {FORMS[0].cls: 1}
    assert "forward" not in vars(moe)  # put back
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=1e-6)
    # the gate picks experts per token: a form that ignored the routing (an expert's weight taken as 1) is off
    with torch.no_grad():
        assert float((moe.shared_experts(x) + sum(e(x) for e in moe.experts) - want).abs().max()) > 1e-2


@pytest.mark.parametrize("eps", [1e-6, None])
def test_the_rms_norm_written_out_is_torchs(eps):
    """Measured 0.0 apart (bit for bit) at outputs of magnitude 3.2; held to 1e-6."""
    norm = torch.nn.RMSNorm(24, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24, generator=torch.Generator().manual_seed(2)))
    x = torch.randn(3, 5, 24, generator=torch.Generator().manual_seed(3)) * 4
    with torch.no_grad():
        want = norm(x)
        with export_forms(norm, "torchscript") as used:
            got = norm(x)
        with export_forms(norm, "dynamo") as none:  # dynamo exports torch's own
            same = norm(x)
    assert used == {"torch.nn.modules.normalization.RMSNorm": 1} and none == {}
    assert torch.equal(same, want)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=1e-6)


def test_torchscript_exports_torchs_rms_norm_at_opset_17(tmp_path):
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj, self.norm = torch.nn.Linear(16, 32), torch.nn.RMSNorm(32, eps=1e-6)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
            return (self.norm(self.proj(x)),)

    torch.manual_seed(0)
    block = seeded(Block())
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = block(x)[0].numpy()
        export_module(block, (x,), ["x"], ["y"], tmp_path / "m.onnx", Exporter("torchscript", 17))
    got = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"x": x.numpy()})[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_a_subclass_keeps_its_own_forward():
    class Scaled(torch.nn.RMSNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    assert forms_for(Scaled(4), "torchscript") == {}


def _hidream():
    import diffusers

    torch.manual_seed(0)
    m = seeded(diffusers.HiDreamImageTransformer2DModel.from_config(HIDREAM))

    class Call(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = m

        def forward(self, h, t, t5, llama, pooled):
            return (self.m(h, t, t5, llama, pooled, return_dict=False)[0],)

    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(1, 4, 16, 16, generator=g), torch.tensor([500.0]), torch.randn(1, 8, 48, generator=g),
              torch.randn(2, 1, 8, 40, generator=g), torch.randn(1, 32, generator=g))
    return Call().eval(), inputs, ["hidden_states", "timesteps", "encoder_hidden_states_t5",
                                   "encoder_hidden_states_llama3", "pooled_embeds"]


def test_hidreams_positions_cast_first_are_its_rotary_table():
    import diffusers

    torch.manual_seed(0)
    embed = diffusers.HiDreamImageTransformer2DModel.from_config(HIDREAM).pe_embedder
    ids = torch.rand(1, 72, 3, generator=torch.Generator().manual_seed(5)) * 64  # float32 positions
    with torch.no_grad():
        want = embed(ids)
        with export_forms(embed, "torchscript") as used:
            got = embed(ids)
    assert used and want.dtype == got.dtype and torch.equal(got, want)  # measured: bit for bit


@pytest.mark.slow
@pytest.mark.parametrize("exporter", [("dynamo", 20), ("torchscript", 17)])
def test_hidreams_transformer_exports_through_sdnpus_path(tmp_path, exporter):
    """Its MoE feed-forward routed densely (both exporters; TorchScript also with torch's RMSNorm written out and
    its rotary positions cast first): onnxruntime against PyTorch's routed run, measured 6.0e-7 (dynamo) and
    3.6e-7 (TorchScript) at an output of magnitude 1.78; held to 4e-6 of the output's scale."""
    call, inputs, names = _hidream()
    with torch.no_grad():
        want = call(*inputs)[0].numpy()
        export_module(call, inputs, names, ["out_sample"], tmp_path / "model.onnx", Exporter(*exporter))
    got = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {n: v.numpy() for n, v in zip(names, inputs, strict=True)})[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=4e-6 * max(1.0, float(np.abs(want).max())))
