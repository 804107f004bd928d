"""ControlNet (issue 14), first step: the ``controlnet`` component from presets, single-module folders and
pipeline folders, exported against PyTorch and compiled under the default target."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from sdnpu.convert import convert, parse_components, resolve_source
from sdnpu.convert.compile import run_onnx
from sdnpu.errors import SdnpuError
from sdnpu.pipelines import controlnet_outputs, sample_inputs, signature


@pytest.fixture(scope="module", params=["tiny-controlnet-sdxl", "tiny-controlnet-sd15"])
def converted(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    return request.param, convert(request.param, "controlnet", out=out, res=256)


def test_a_controlnet_exports_matches_pytorch_and_compiles(converted):
    name, result = converted
    (comp,) = result.components
    assert comp.component == "controlnet" and comp.size == "256x256"
    config = resolve_source(name).module_config("controlnet")
    folder = result.out / "controlnet"
    export = json.loads((folder / "export.json").read_text())
    names = [s["name"] for s in export["inputs"]]
    text_time = name.endswith("sdxl")
    assert names == ["sample", "timestep", "encoder_hidden_states", *(["text_embeds", "time_ids"] if text_time else []),
                     "controlnet_cond", "conditioning_scale"]
    # diffusers' order: conv_in's residual, each down block's resnets and downsampler, then the mid block's
    outputs = controlnet_outputs(config)
    assert export["outputs"] == list(outputs) and outputs[-1] == "mid_block_res_sample"
    assert len(outputs) == (7 if text_time else 5)
    assert comp.check["max_rel_error"] < 1e-4  # against PyTorch (measured: about 1e-6)
    report = json.loads((folder / "dd" / "report.json").read_text())
    assert report["fidelity"]["min_cosine"] > 0.999  # measured 0.99993 / 0.99994
    assert report["summary"]["offloaded_nodes"] > 100 and report["summary"]["macs_offloaded_share"] == 1.0
    assert (folder / "dd" / "onnx_report.txt").is_file()


def test_the_residuals_are_not_zero_and_follow_the_scale(converted):
    """A new ControlNet's output convolutions are zero (training grows them); a seeded preset draws them, so
    that every comparison means something. The scale is an input: 0.4 gives 0.4 of the residuals."""
    name, result = converted
    config = resolve_source(name).module_config("controlnet")
    feeds = sample_inputs(signature("controlnet", config, 256), config, 256)
    model = result.out / "controlnet" / "model.onnx"
    full = run_onnx(model, {**feeds, "conditioning_scale": np.array(1.0, np.float32)})
    part = run_onnx(model, {**feeds, "conditioning_scale": np.array(0.4, np.float32)})
    for k, v in full.items():
        assert np.std(v) > 1e-3, k
        np.testing.assert_allclose(part[k], 0.4 * v, rtol=1e-5, atol=1e-6)
    from sdnpu.reports.fidelity import generic_inputs  # what sdnpu compile and verify feed it: realistic too

    generic = generic_inputs(model)
    cond = generic["controlnet_cond"]
    assert generic["conditioning_scale"] == 1.0 and 0 <= cond.min() < cond.max() <= 1


def test_controlnet_folders_alone_and_beside_a_pipeline(tmp_path, tiny_pipeline_folder):
    src = resolve_source("tiny-controlnet-sdxl")
    module = src.load_module("controlnet")
    module.save_pretrained(tmp_path / "cn")
    alone = resolve_source(tmp_path / "cn")
    assert alone.kind == "component" and alone.components == ["controlnet"]
    assert parse_components("all", alone) == ["controlnet"]
    with pytest.raises(SdnpuError, match="single ControlNetModel folder: it has no 'unet' module"):
        alone.module_dir("unet")
    # a ControlNet pipeline's folder (StableDiffusionXLControlNetPipeline.save_pretrained lists it)
    pipe = tmp_path / "pipe"
    shutil.copytree(tiny_pipeline_folder, pipe)
    shutil.copytree(tmp_path / "cn", pipe / "controlnet")
    index = json.loads((pipe / "model_index.json").read_text())
    index.update({"_class_name": "StableDiffusionXLControlNetPipeline", "controlnet": ["diffusers", "ControlNetModel"]})
    (pipe / "model_index.json").write_text(json.dumps(index))
    beside = resolve_source(pipe)
    assert "controlnet" in beside.components and "unet" in beside.components
    # the folder's weights are the preset's: converted, it matches PyTorch as the preset does
    result = convert(tmp_path / "cn", "controlnet", out=tmp_path / "out", res=256, compile=False)
    assert result.components[0].check["max_rel_error"] < 1e-4
    assert not (tmp_path / "out" / "model_index.json").exists()  # one module brings no pipeline files


def test_a_controlnet_takes_the_unets_sizes(tmp_path):
    with pytest.raises(SdnpuError, match="does not fit the controlnet: each side must be a multiple of 32"):
        convert("tiny-controlnet-sdxl", "controlnet", out=tmp_path, res="250x256")


def test_the_unet_that_takes_the_residuals(tmp_path):
    """``unet_controlnet``: the UNet with a ControlNet's residuals as inputs, added where diffusers adds them.
    Chained through onnxruntime, the fp32 ControlNet and this UNet give what diffusers' UNet gives with the
    ControlNet's residuals in PyTorch; the dispatch model's residual additions are dispatch ops, and its CPU
    nodes are the plain UNet's plus each residual's NHWC transpose and bf16 cast at the graph's edge."""
    import torch

    from sdnpu.pipelines import residual_shapes

    out = tmp_path / "m"
    cn = convert("tiny-controlnet-sdxl", "controlnet", out=out, res="320x256", check=False, compile=False)
    unet = convert("tiny-sdxl", "unet,unet_controlnet", out=out, res="320x256", check=True)
    (plain, with_res) = unet.components
    assert with_res.component == "unet_controlnet" and with_res.check["max_rel_error"] < 1e-4
    config = resolve_source("tiny-sdxl").module_config("unet")
    sig = signature("unet_controlnet", config, "320x256")
    names = [s.name for s in sig.inputs]
    assert names[5:] == [*(f"down_block_additional_residuals.{i}" for i in range(6)), "mid_block_additional_residual"]
    assert [s.shape for s in sig.inputs[5:]] == residual_shapes(config, 32, 40)
    # the ControlNet's residuals into the UNet, both fp32 graphs, against diffusers in PyTorch
    cn_config = resolve_source("tiny-controlnet-sdxl").module_config("controlnet")
    feeds = sample_inputs(signature("controlnet", cn_config, "320x256"), cn_config, "320x256")
    residuals = run_onnx(cn.out / "controlnet" / "model.onnx", feeds)
    unet_feeds = {k: v for k, v in feeds.items() if k in names}
    unet_feeds.update({n: residuals[o] for n, o in zip(names[5:], controlnet_outputs(cn_config), strict=True)})
    ours = run_onnx(out / "unet_controlnet" / "model.onnx", unet_feeds)["out_sample"]
    src = resolve_source("tiny-sdxl")
    module = src.load_module("unet")
    controlnet = resolve_source("tiny-controlnet-sdxl").load_module("controlnet")
    t = {k: torch.from_numpy(v) for k, v in feeds.items()}
    added = {"text_embeds": t["text_embeds"], "time_ids": t["time_ids"]}
    with torch.no_grad():
        down, mid = controlnet(t["sample"], t["timestep"], t["encoder_hidden_states"],
                               controlnet_cond=t["controlnet_cond"], added_cond_kwargs=added,
                               conditioning_scale=float(feeds["conditioning_scale"]), return_dict=False)
        theirs = module(t["sample"], t["timestep"], t["encoder_hidden_states"], added_cond_kwargs=added,
                        down_block_additional_residuals=down, mid_block_additional_residual=mid,
                        return_dict=False)[0].numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * np.abs(theirs).max())
    assert np.abs(ours - run_onnx(out / "unet" / "model.onnx", {k: unet_feeds[k] for k in names[:5]})["out_sample"]
                  ).max() > 1e-3  # the residuals change the result
    summary, base = with_res.report, plain.report
    assert summary["offloaded_nodes"] == base["offloaded_nodes"] + 7  # one SDAdd per residual
    assert summary["cpu_nodes"] == base["cpu_nodes"] + 2 * 7  # each residual's Transpose and CastAvx
    report = json.loads((out / "unet_controlnet" / "dd" / "report.json").read_text())
    assert report["fidelity"]["min_cosine"] > 0.999 and summary["npu_regions"] == 1
