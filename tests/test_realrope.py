"""Complex rotary embeddings exported in real arithmetic (convert/realrope.py): the rotation equals the
complex product, both exporters take it, the tables are put back, and what it does not handle says so."""

from __future__ import annotations

import numpy as np
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
