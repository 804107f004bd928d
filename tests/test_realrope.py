"""Complex rotary embeddings exported in real arithmetic (convert/realrope.py): the rotation equals the
complex product, both exporters take it, the tables are put back, and what it does not handle says so."""

from __future__ import annotations

import functools
import logging

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from sdnpu.convert.realrope import has_complex_tables, real_rotary
from sdnpu.errors import SdnpuError


class Rotary(torch.nn.Module):
    """diffusers' apply_rotary_emb(use_real=False), on a complex table held in a list (as Lumina 2 holds it),
    gathered by position ids and concatenated per axis."""

    def __init__(self, dims: tuple[int, ...] = (4, 6), length: int = 16) -> None:
        super().__init__()
        self.tables = [torch.polar(torch.ones(length, d // 2), torch.outer(torch.arange(length, dtype=torch.float32),
                                   1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))) for d in dims]
        self.proj = torch.nn.Linear(20, 2 * sum(dims))  # two heads of sum(dims)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        freqs = torch.cat([t[ids[:, i]] for i, t in enumerate(self.tables)], dim=-1)  # [S, D/2]
        q = self.proj(x).unflatten(-1, (2, -1))  # [B, S, H, D]
        qc = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
        out = torch.view_as_real(qc * freqs[None, :, None, :]).flatten(3)
        return out.flatten(2)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 5, 20, generator=g), torch.randint(0, 16, (5, 2), generator=g)


def test_the_real_rotation_is_the_complex_product():
    m = Rotary((4, 6))
    x, ids = _inputs()
    with torch.no_grad():
        want = m(x, ids)
        assert has_complex_tables(m)
        with real_rotary(m) as n:
            assert n == 1 and not m.tables[0].is_complex()
            got = m(x, ids)
    assert m.tables[0].is_complex()  # put back
    assert torch.view_as_complex is not None and torch.view_as_complex(torch.ones(2, 2)).is_complex()
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=2e-6)


@pytest.mark.parametrize("dynamo", [True, False])
def test_both_exporters_take_it(tmp_path, dynamo):
    m = Rotary((4, 6)).eval()
    x, ids = _inputs()
    with torch.no_grad():
        want = m(x, ids).numpy()
        path = tmp_path / "m.onnx"
        with real_rotary(m):
            if dynamo:
                torch.onnx.export(m, (x, ids), dynamo=True, input_names=["x", "ids"], opset_version=20,
                                  verbose=False, report=False).save(str(path))
            else:
                torch.onnx.export(m, (x, ids), str(path), dynamo=False, input_names=["x", "ids"], opset_version=20)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, {"x": x.numpy(), "ids": ids.numpy()})[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_another_complex_product_is_named():
    class Both(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = torch.view_as_complex(x.reshape(2, 2))
            return torch.view_as_real(a * a)

    with real_rotary(Both()), pytest.raises(SdnpuError, match="multiplies two complex values"):
        Both()(torch.ones(4))


# --- the tables' own arithmetic (Qwen-Image cuts its table per rotary axis, in complex numbers) --------------

class Cut(torch.nn.Module):
    """A complex table cut along its complex axis as Qwen-Image's rotary embedder cuts it (a split per axis in
    complex numbers, rows selected, viewed, expanded and concatenated back; a memo cache of the cut, as
    diffusers' ``lru_cache_unless_export`` keeps), then rotating two heads."""

    def __init__(self, dims: tuple[int, ...] = (4, 6, 6), length: int = 16, cut: str = "split") -> None:
        super().__init__()
        d = sum(dims)
        self.dims, self.cut = dims, cut
        self.table = torch.polar(torch.ones(length, d // 2), torch.outer(torch.arange(length, dtype=torch.float32),
                                 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)))
        self.proj = torch.nn.Linear(20, 2 * d)

    @functools.lru_cache(maxsize=None)  # noqa: B019 -- the memo cache real_rotary must empty
    def freqs(self, h: int, w: int) -> torch.Tensor:
        halves = [n // 2 for n in self.dims]
        if self.cut == "split":
            a, b, c = self.table.split(halves, dim=1)
        else:  # the same cut by narrow and by slices along the last axis
            a = self.table.narrow(-1, 0, halves[0])
            b = self.table[:, halves[0]:halves[0] + halves[1]]
            c = self.table[..., -halves[2]:]
        rows = a[:1].view(1, 1, -1).expand(h, w, -1)
        cols = torch.cat([b[:h].view(h, 1, -1).expand(h, w, -1), c[:w].view(1, w, -1).expand(h, w, -1)], dim=-1)
        return torch.cat([rows, cols], dim=-1).reshape(h * w, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        freqs = self.freqs(2, 3)  # [6, D/2]
        q = self.proj(x).unflatten(-1, (2, -1))  # [B, 6, H, D]
        qc = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
        return torch.view_as_real(qc * freqs.unsqueeze(1)).flatten(2)


@pytest.mark.parametrize("cut", ["split", "narrow-and-slices"])
def test_a_cut_along_the_complex_axis_counts_complex_numbers(cut):
    m = Cut(cut=cut).eval()
    x = torch.randn(2, 6, 20, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = m(x)  # also leaves a complex cut in the memo cache
        with real_rotary(m):
            got = m(x)
            assert not m.freqs(2, 3).is_complex()  # cut inside from the real view, not read from the cache
        assert m.freqs(2, 3).is_complex()  # and the real cut does not outlive the context
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=2e-6)


def test_the_cuts_are_counted_and_the_forward_put_back():
    m = Cut().eval()
    with torch.no_grad(), real_rotary(m):
        assert "forward" in vars(m)
        m(torch.zeros(1, 6, 20))
    assert "forward" not in vars(m)


@pytest.mark.parametrize(("op", "words"), [
    (lambda t: t.flip(-1), "flip"),
    (lambda t: t[..., 0], "indexed by single entries"),
    (lambda t: t[:, ::2], "indexed with a step"),
    (lambda t: t.transpose(0, 1), "transpose"),
    (lambda t: t.unsqueeze(-1), "new axis after its complex axis"),
    (lambda t: t.unbind(-1), "unbound"),
])
def test_what_would_part_a_pair_is_refused(op, words):
    class Parts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.polar(torch.ones(4, 3), torch.ones(4, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * op(self.table).sum()

    m = Parts()
    with real_rotary(m), pytest.raises(SdnpuError, match=words):
        m(torch.ones(2))


def test_cuts_along_other_axes_pass_untouched(caplog):
    m = Cut()
    caplog.set_level(logging.INFO, logger="sdnpu.convert.realrope")
    with torch.no_grad(), real_rotary(m):
        m(torch.zeros(1, 6, 20))
    # Cut's forward takes rows (a[:1], b[:h], c[:w]) and views, expands and reshapes with -1 last: only the split
    # along the complex axis counts differently
    assert caplog.records[-1].getMessage().endswith("along their last axis: split")


# --- diffusers' own Qwen-Image transformer, exported through sdnpu's path ---------------------------------

# onnxruntime against PyTorch's complex run, measured on the cases below (both exporters): at most 7.2e-7 at an
# output of magnitude 2.06; held to 4e-6 of the output's scale
QWEN_ATOL = 4e-6


def _qwen_image(shapes: list[tuple[int, int, int]], text: int, padded: int, **config: object):
    """A tiny seeded QwenImageTransformer2DModel called as QwenImagePipeline calls it (packed latents, the
    caption's mask, img_shapes), its inputs, and their names."""
    import diffusers

    from tests.zoo import seeded

    torch.manual_seed(0)
    m = seeded(diffusers.QwenImageTransformer2DModel.from_config(dict(
        patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=32, num_attention_heads=2,
        joint_attention_dim=48, axes_dims_rope=[8, 12, 12], **config)))

    class Call(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = m

        def forward(self, h, e, mask, t):
            return (self.m(h, e, mask, t, img_shapes=[shapes], return_dict=False)[0],)

    g = torch.Generator().manual_seed(1)
    mask = torch.ones(1, text, dtype=torch.long)
    mask[:, text - padded:] = 0
    tokens = sum(f * h * w for f, h, w in shapes)
    inputs = (torch.randn(1, tokens, 16, generator=g), torch.randn(1, text, 48, generator=g), mask, torch.tensor([0.5]))
    return Call().eval(), inputs, ["hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep"]


@pytest.mark.slow
@pytest.mark.parametrize(("shapes", "text", "padded", "config", "exporter"), [
    ([(1, 8, 8)], 8, 0, {}, ("dynamo", 20)),
    ([(1, 6, 10)], 5, 2, {}, ("dynamo", 20)),  # not square, an odd half (scale_rope's negative rows), padding
    ([(1, 6, 10)], 5, 2, {}, ("torchscript", 17)),
    ([(1, 4, 4), (1, 4, 4)], 6, 0, {"use_layer3d_rope": True}, ("dynamo", 20)),  # Qwen-Image-Layered's tables
], ids=["8x8-dynamo", "6x10-dynamo", "6x10-torchscript", "layered-dynamo"])
def test_qwen_images_transformer_exports_through_sdnpus_path(tmp_path, shapes, text, padded, config, exporter):
    from sdnpu.convert.export import Exporter, export_module

    call, inputs, names = _qwen_image(shapes, text, padded, **config)
    assert has_complex_tables(call)
    with torch.no_grad():
        want = call(*inputs)[0].numpy()  # also fills diffusers' memo caches with complex tables
        export_module(call, inputs, names, ["out_sample"], tmp_path / "model.onnx", Exporter(*exporter))
    got = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {n: v.numpy() for n, v in zip(names, inputs, strict=True)})[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=QWEN_ATOL * max(1.0, float(np.abs(want).max())))
    assert call.m.pos_embed.pos_freqs.is_complex() and "forward" not in vars(call)  # all put back
    # the tables are cut while exporting: the graph holds the rotations for this size (cos and sin, for the
    # image and the text; TorchScript writes a copy per use), not the 4096-row tables and their arithmetic
    model = onnx.load(str(tmp_path / "model.onnx"))
    constants = [onnx.numpy_helper.to_array(i) for i in model.graph.initializer] + [
        onnx.numpy_helper.to_array(a.t) for n in model.graph.node if n.op_type == "Constant" for a in n.attribute
        if a.name == "value"]
    assert not [c.shape for c in constants if 4096 in c.shape]
    tokens = sum(f * h * w for f, h, w in shapes)
    for rows in (tokens, text):
        assert len({c.tobytes() for c in constants if c.shape == (rows, 1, 32)}) == 2  # cos, sin
