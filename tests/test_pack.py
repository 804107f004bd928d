"""`sdnpu pack`: a clear refusal where AMD's packer is missing, and the plumbing around it (which tensors
reach the packer, in which layout and dtype, and what the packed copy holds), checked with a stand-in packer:
AMD's own cannot be installed here, so its output is not."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import types

import numpy as np
import onnx
import pytest

from sdnpu.cli import main
from sdnpu.errors import SdnpuError
from sdnpu.formats.keys import PACKED_KEY
from sdnpu.runtime import ddpackage
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


def _install_stand_in(monkeypatch) -> list:
    """The stand-in as AMD's package holds its packer: ``sd``, an attribute of ``ryzenai_dynamic_dispatch`` (a
    submodule of its extension), not a module of its own."""
    calls: list = []
    parent = types.ModuleType("ryzenai_dynamic_dispatch")
    parent.sd = _stand_in(calls)
    monkeypatch.setitem(sys.modules, "ryzenai_dynamic_dispatch", parent)
    return calls


def test_pack_feeds_the_packer_what_it_takes(tiny_conversion, tmp_path, monkeypatch):
    folder = tmp_path / "conv"
    shutil.copytree(tiny_conversion.out / "vae_decoder", folder / "vae_decoder")
    dd = folder / "vae_decoder" / "dd"
    before = (dd / "replaced.onnx").read_bytes()
    calls = _install_stand_in(monkeypatch)
    (folder / "model_index.json").write_text((tiny_conversion.out / "model_index.json").read_text())
    counts = pack(folder)["vae_decoder"]
    assert counts == {"SDConv weights -> bfp16ebs8 blob": 27, "SDGemm weights -> bfp16ebs8 blob": 4,
                      "bf16 constants -> uint16 words": 1,  # the VAE attention's mask
                      "DynamicDispatch nodes (DECODER, sdxl_unet_vae_combined_new.xclbin)": 1,
                      "ops inside them": counts["ops inside them"], "nodes left on the CPU": 4}
    assert (dd / "replaced.onnx").read_bytes() == before  # the runnable model is untouched
    conv = next(c for c in calls if c[0] == "conv")
    assert conv[1] == np.float32 and conv[3] == np.float32 and conv[5] == "SDConv" and conv[6] == np.int32
    assert conv[2][1] == conv[2][2]  # OHWI: [OC, KH, KW, IC] with a square kernel
    gemm = next(c for c in calls if c[0] == "gemm")
    assert gemm[4] == "SDGemm" and gemm[6] is True and gemm[5][2] == gemm[2][0]  # input_shape [B, M, K], W [K, N]
    packed = onnx.load(str(dd / "packed" / "replaced.onnx"))
    assert not packed.functions and {p.key: p.value for p in packed.metadata_props}[PACKED_KEY]
    onnx.checker.check_model(packed, full_check=True)
    # what AMD's kernels read is in the DD cache: each op with its packed constants, at their sizes
    (node,) = [n for n in packed.graph.node if n.op_type == "DynamicDispatch"]
    meta = json.loads((dd / "packed" / ".cache" / f"{node.name}_meta.json").read_text())
    tmap = meta["tensor_map"]
    for op in meta["op_list"]:
        if op["type"] in ("SDConv", "SDGemm"):
            assert len(op["const_args"]) == 1 and tmap[op["const_args"][0]]["dtype"] == "uint8"
        if op["type"] == "SDMHA_VAE":
            assert tmap[op["const_args"][0]]["dtype"] == "uint16"
    assert counts["ops inside them"] == len(meta["op_list"]) == 27 + 4 + len(
        [o for o in meta["op_list"] if o["type"] not in ("SDConv", "SDGemm")])


def test_pack_packs_every_size(two_sizes, tmp_path, monkeypatch):
    folder = tmp_path / "conv"
    shutil.copytree(two_sizes / "vae_decoder", folder / "vae_decoder")
    (folder / "model_index.json").write_text((two_sizes / "model_index.json").read_text())
    _install_stand_in(monkeypatch)
    counts = pack(folder)
    assert set(counts) == {"vae_decoder", "vae_decoder 320x256"}
    assert counts["vae_decoder 320x256"] == counts["vae_decoder"]
    packed = folder / "vae_decoder" / "dd" / "packed"
    for name, width in (("replaced.onnx", 256), ("replaced.320x256.onnx", 320)):
        model = onnx.load(str(packed / name))
        onnx.checker.check_model(model)
        assert model.graph.input[0].type.tensor_type.shape.dim[3].dim_value == width // 8
    names = [n.name for f in ("replaced.onnx", "replaced.320x256.onnx")
             for n in onnx.load(str(packed / f)).graph.node if n.op_type == "DynamicDispatch"]
    assert len(set(names)) == 2 and names[1].startswith("s320x256_")  # one cache, a node of each size
    assert all((packed / ".cache" / f"{n}_meta.json").is_file() for n in names)


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
            for i in model.graph.input}


def test_the_package_carries_the_whole_computation(tiny_conversion, tmp_path):
    """AMD's loading format written from the runnable dispatch model (its constants as they are) and read back
    the way DD reads it (the meta.json's op list, arguments and attributes; the constant files at their
    sizes) gives the same model: the same numbers, bit for bit. So the meta.json and the .const files hold
    everything the region computes, in an order DD can run."""
    import onnxruntime as ort

    src = tiny_conversion.out / "unet" / "dd" / "replaced.onnx"
    dispatch = onnx.load(str(src))
    model = onnx.load(str(src))
    kernels = ddpackage.kernels_for("sdxl", "unet", 256)
    result = ddpackage.package_model(model, tmp_path, "replaced.onnx", kernels)
    onnx.save(model, str(tmp_path / "replaced.onnx"))
    onnx.checker.check_model(model, full_check=True)
    report = json.loads((tiny_conversion.out / "unet" / "dd" / "report.json").read_text())["summary"]
    assert len(result.nodes) == report["npu_regions"] == 1
    assert sum(result.nodes.values()) == report["offloaded_nodes"] and result.cpu_nodes == report["cpu_nodes"]
    assert {(n.domain, n.op_type) for n in model.graph.node if n.domain} == {("com.ryzenai", "CastAvx"),
                                                                           ("com.ryzenai", "DynamicDispatch")}
    assert not model.functions and "com.amd" not in {o.domain for o in model.opset_import}
    (node,) = [n for n in model.graph.node if n.op_type == "DynamicDispatch"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["xclbin"] == b"/xclbin/stx/sdxl_unet_vae_combined_new.xclbin" and attrs["model_type"] == 0
    assert len(attrs["replaced"]) == report["offloaded_nodes"]
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in dispatch.graph.value_info}
    assert [attrs[f"input_shape_{i}"] for i in range(len(node.input))] == [shapes[x] for x in node.input]
    meta = json.loads((tmp_path / ".cache" / f"{node.name}_meta.json").read_text())
    assert (meta["dd_meta_major_version"], meta["dd_meta_minor_version"]) == (1, 1)
    assert list(meta["fused_tensors"]) == ["in", "out", "scratch", "const", "super_instr"]
    assert meta["fused_tensors"]["in"]["packed_tensors"] == list(node.input)
    assert meta["fused_tensors"]["out"]["packed_tensors"] == list(node.output)
    for label, buf in meta["fused_tensors"].items():
        ends = [meta["tensor_map"][t]["offset"] + meta["tensor_map"][t]["size_in_bytes"] for t in buf["packed_tensors"]]
        assert all(meta["tensor_map"][t]["offset"] % 4 == 0 for t in buf["packed_tensors"])
        assert buf["buffer_size"] >= max(ends, default=0) and buf["buffer_size"] % 4 == 0
    for t in meta["fused_tensors"]["const"]["packed_tensors"]:
        info = meta["tensor_map"][t]
        assert (tmp_path / info["file_name"]).stat().st_size == info["file_size"] == info["size_in_bytes"]
    back = ddpackage.unpackage(tmp_path / "replaced.onnx", functions_from=dispatch)
    onnx.checker.check_model(back, full_check=True)
    feeds = _feeds(dispatch)
    want = ort.InferenceSession(dispatch.SerializeToString()).run(None, feeds)
    got = ort.InferenceSession(back.SerializeToString()).run(None, feeds)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)
    # a constant file cut short is found, as DD finds it
    first = meta["fused_tensors"]["const"]["packed_tensors"][0]
    (tmp_path / meta["tensor_map"][first]["file_name"]).write_bytes(b"\0")
    with pytest.raises(SdnpuError, match="1 bytes, the meta.json says"):
        ddpackage.unpackage(tmp_path / "replaced.onnx")


def test_model_classes_are_amds_and_the_rest_is_declined():
    assert ddpackage.kernels_for("sd", "unet", 512).model_type == "SD15_UNET"
    assert ddpackage.kernels_for("sd3", "vae_decoder", 1024).xclbin.endswith("SD3_1K_VAE_2x4x4.xclbin")
    assert ddpackage.kernels_for("sd3", "vae_decoder", 512).xclbin.endswith("SD3_VAE_2x4x4.xclbin")
    assert "text encoders on the CPU" in ddpackage.kernels_for("sdxl", "text_encoder_2", 1024)
    assert "none for a flux pipeline" in ddpackage.kernels_for("flux", "transformer", 1024)


def test_pack_out_writes_a_folder_for_amds_server(tiny_conversion, tmp_path, monkeypatch, capsys):
    """``pack --out``: a new folder as AMD's SD server reads it (each denoiser's and VAE's dd/replaced.onnx is
    the package, its .cache beside it; the text encoders' graphs, tokenizers and scheduler as they were), the
    converted folder untouched; without AMD's library the package is refused with the way out."""
    from sdnpu.runtime.session import RuntimeOptions, open_component

    _install_stand_in(monkeypatch)
    out = tmp_path / "npu"
    before = sorted(p.relative_to(tiny_conversion.out) for p in tiny_conversion.out.rglob("*"))
    assert main(["pack", str(tiny_conversion.out), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "text_encoder    not packaged: text_encoder: AMD runs the text encoders on the CPU" in printed
    assert sorted(p.relative_to(tiny_conversion.out) for p in tiny_conversion.out.rglob("*")) == before
    for comp in ("unet", "vae_decoder", "vae_encoder"):
        assert ddpackage.is_package(out / comp / "dd" / "replaced.onnx")
        assert any((out / comp / "dd" / ".cache").glob("*_meta.json"))
    for kept in ("text_encoder/model.onnx", "text_encoder_2/model.onnx", "tokenizer/vocab.json",
                 "tokenizer_2/merges.txt", "scheduler/scheduler_config.json", "model_index.json"):
        assert (out / kept).read_bytes() == (tiny_conversion.out / kept).read_bytes()
    assert not ddpackage.is_package(out / "text_encoder" / "dd" / "replaced.onnx")
    with pytest.raises(SdnpuError, match="only AMD's custom-op library runs it") as e:
        open_component(out, "unet", options=RuntimeOptions(optimize=False))
    assert "--custom-ops" in e.value.hint
    with pytest.raises(SdnpuError, match="exists and is not empty"):
        pack(tiny_conversion.out, out=out)


def test_custom_ops_sessions_open_the_package(tiny_conversion, tmp_path, monkeypatch):
    """With a custom-op library, a folder packed in place opens dd/packed/replaced.onnx (the package, its
    cache as dd_cache); onnxruntime-extensions' library does not provide DynamicDispatch, so onnxruntime says
    which op it lacks. LoRAs are refused there: they would not reach the packed constants."""
    from sdnpu.runtime.session import RuntimeOptions, open_component
    from tests.test_runtime import _extensions_library

    folder = tmp_path / "conv"
    shutil.copytree(tiny_conversion.out / "vae_decoder", folder / "vae_decoder")
    shutil.copyfile(tiny_conversion.out / "model_index.json", folder / "model_index.json")
    _install_stand_in(monkeypatch)
    pack(folder)
    runtime = RuntimeOptions(custom_ops=_extensions_library())
    with pytest.raises(SdnpuError, match=r"dd/packed/replaced.onnx: .*com.ryzenai:\w+\(-1\) is not a registered"):
        open_component(folder, "vae_decoder", options=runtime)
    with pytest.raises(SdnpuError, match="LoRAs do not reach AMD's packed form"):
        open_component(folder, "vae_decoder", options=dataclasses.replace(runtime, loras=("a LoRA",)))
    assert open_component(folder, "vae_decoder", options=RuntimeOptions(optimize=False)).run  # the CPU model


def test_convert_pack_checks_the_packer_first(tmp_path, capsys):
    out = tmp_path / "conv"
    assert main(["convert", "--source", "tiny-sdxl", "--model", "vae_decoder", "--out", str(out), "--pack"]) == 2
    assert "needs AMD's weight packer" in capsys.readouterr().err
    assert not out.exists()


def test_convert_pack_writes_amds_loading_format(tmp_path, monkeypatch, capsys):
    """`sdnpu convert ... --pack` where the packer imports (here a stand-in): the converted folder, then its
    dispatch models packed in AMD's loading format beside them."""
    _install_stand_in(monkeypatch)
    out = tmp_path / "conv"
    assert main(["convert", "--source", "tiny-sdxl", "--model", "vae_decoder", "--out", str(out), "--pack",
                 "--no-check"]) == 0
    assert "DynamicDispatch nodes (DECODER" in capsys.readouterr().out
    packed = out / "vae_decoder" / "dd" / "packed"
    assert ddpackage.is_package(packed / "replaced.onnx") and (out / "vae_decoder" / "dd" / "replaced.onnx").is_file()
