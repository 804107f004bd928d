"""`sdnpu pack`: a clear refusal where AMD's packer is missing, and the plumbing around it (which tensors
reach the packer, in which layout and dtype, and what the packed copy holds), checked with a stand-in packer:
AMD's own cannot be installed here, so its output is not."""

from __future__ import annotations

import shutil
import sys
import types

import numpy as np
import onnx
import pytest

from sdnpu.cli import main
from sdnpu.errors import SdnpuError
from sdnpu.formats.keys import PACKED_KEY
from sdnpu.runtime.pack import pack


def test_without_amds_packer_it_says_so_and_writes_nothing(tiny_conversion, tmp_path, capsys):
    folder = tmp_path / "conv"
    shutil.copytree(tiny_conversion.out / "vae_decoder", folder / "vae_decoder")
    with pytest.raises(SdnpuError, match=r"needs AMD's weight packer \(ryzenai_dynamic_dispatch.sd"):
        pack(folder)
    assert main(["pack", str(folder)]) == 2
    assert "cannot be imported here" in capsys.readouterr().err
    assert not (folder / "vae_decoder" / "dd" / "packed").exists()


def _stand_in(calls: list) -> types.ModuleType:
    """A module with the packer's three functions: it records its arguments and returns blobs of the sizes
    AMD's C++ computes for them (bfp16ebs8: 9 bytes per 8 weights; bf16: 2 bytes each)."""
    sd = types.ModuleType("ryzenai_dynamic_dispatch.sd")

    def conv_to_bfp16(w, b, op, shape):
        calls.append(("conv", w.dtype, w.shape, b.dtype, b.shape, op, shape.dtype, shape.tolist()))
        return np.zeros(w.size // 8 * 9 + 4 * b.size, np.uint8)

    def gemm_to_bfp16(w, b, op, shape, bias):
        calls.append(("gemm", w.dtype, w.shape, b.shape, op, shape.tolist(), bias))
        return np.zeros(w.size // 8 * 9 + 2 * b.size, np.uint8)

    sd.conv_to_bfp16, sd.gemm_to_bfp16 = conv_to_bfp16, gemm_to_bfp16
    sd.matmul_to_bf16 = lambda w, b, m: np.zeros(w.size, np.uint16)
    return sd


def test_pack_feeds_the_packer_what_it_takes(tiny_conversion, tmp_path, monkeypatch):
    folder = tmp_path / "conv"
    shutil.copytree(tiny_conversion.out / "vae_decoder", folder / "vae_decoder")
    dd = folder / "vae_decoder" / "dd"
    before = (dd / "replaced.onnx").read_bytes()
    calls: list = []
    parent = types.ModuleType("ryzenai_dynamic_dispatch")
    parent.sd = _stand_in(calls)
    monkeypatch.setitem(sys.modules, "ryzenai_dynamic_dispatch", parent)
    monkeypatch.setitem(sys.modules, "ryzenai_dynamic_dispatch.sd", parent.sd)
    counts = pack(folder)["vae_decoder"]
    assert counts == {"SDConv weights -> bfp16ebs8 blob": 27, "SDGemm weights -> bfp16ebs8 blob": 4,
                      "bf16 constants -> uint16 words": 1}  # the VAE attention's mask
    assert (dd / "replaced.onnx").read_bytes() == before  # the runnable model is untouched
    conv = next(c for c in calls if c[0] == "conv")
    assert conv[1] == np.float32 and conv[3] == np.float32 and conv[5] == "SDConv" and conv[6] == np.int32
    assert conv[2][1] == conv[2][2]  # OHWI: [OC, KH, KW, IC] with a square kernel
    gemm = next(c for c in calls if c[0] == "gemm")
    assert gemm[4] == "SDGemm" and gemm[6] is True and gemm[5][2] == gemm[2][0]  # input_shape [B, M, K], W [K, N]
    packed = onnx.load(str(dd / "packed" / "replaced.onnx"))
    assert not packed.functions and {p.key: p.value for p in packed.metadata_props}[PACKED_KEY]
    inits = {t.name: t for t in packed.graph.initializer}
    for node in packed.graph.node:
        if node.op_type in ("SDConv", "SDGemm"):
            assert len(node.input) == 2 and inits[node.input[1]].data_type == onnx.TensorProto.UINT8
        if node.op_type == "SDMHA_VAE":
            assert inits[node.input[3]].data_type == onnx.TensorProto.UINT16
    onnx.checker.check_model(packed)


def test_pack_packs_every_size(two_sizes, tmp_path, monkeypatch):
    folder = tmp_path / "conv"
    shutil.copytree(two_sizes / "vae_decoder", folder / "vae_decoder")
    calls: list = []
    parent = types.ModuleType("ryzenai_dynamic_dispatch")
    parent.sd = _stand_in(calls)
    monkeypatch.setitem(sys.modules, "ryzenai_dynamic_dispatch", parent)
    monkeypatch.setitem(sys.modules, "ryzenai_dynamic_dispatch.sd", parent.sd)
    counts = pack(folder)
    assert set(counts) == {"vae_decoder", "vae_decoder 320x256"}
    assert counts["vae_decoder 320x256"] == counts["vae_decoder"]
    packed = folder / "vae_decoder" / "dd" / "packed"
    for name, width in (("replaced.onnx", 256), ("replaced.320x256.onnx", 320)):
        model = onnx.load(str(packed / name))
        onnx.checker.check_model(model)
        assert model.graph.input[0].type.tensor_type.shape.dim[3].dim_value == width // 8
