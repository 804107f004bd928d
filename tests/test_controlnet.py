"""ControlNet (issue 14), first step: the ``controlnet`` component from presets, single-module folders and
pipeline folders, exported against PyTorch and compiled under the default target."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from sdnpu.convert import convert, parse_components, resolve_source
from sdnpu.convert.compile import generic_inputs, run_onnx
from sdnpu.errors import SdnpuError
from sdnpu.signatures import controlnet_outputs, sample_inputs, signature
from tests.conftest import once


@pytest.fixture(scope="module", params=["tiny-controlnet-sdxl", "tiny-controlnet-sd15"])
def converted(request, tmp_path_factory):
    return request.param, once(tmp_path_factory, request.param,
                               lambda out: convert(request.param, "controlnet", out=out, res=256))


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
    # the residuals leave the dispatch model in the NPU's form (bf16, NHWC) for the UNet's dispatch model:
    # no Transpose or CastAvx at the edge; the scale is an SDMul whose operand one CPU Expand spreads to the
    # narrowest residual width (each wider one, twice the one before, is SDConcat of it with itself)
    import onnx

    from sdnpu.formats import handoff

    model = onnx.load(str(folder / "dd" / "replaced.onnx"), load_external_data=False)
    assert handoff.of_proto(model) == {o: (0, 3, 1, 2) for o in outputs}
    for vi in model.graph.output:
        dims = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        assert vi.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16 and dims[3] > 3, (vi.name, dims)
    # on the CPU in this graph: the control image's Transpose and cast, the scale's spread and cast; the work
    # on the step inputs it shares with the UNet (the sinusoids, the latents' Transpose, the casts) is in its
    # step prologue
    cpu = report["cpu_nodes"]
    assert sorted(n["op_type"] for n in cpu) == ["CastAvx", "CastAvx", "Expand", "Transpose"], cpu
    assert report["offloaded_by_type"]["SDMul"] >= len(outputs)
    spreads = [n["reason"] for n in cpu if n["op_type"] == "Expand"]
    assert len(spreads) == 1 and "spreads a runtime scalar to the [2, 1, 1, 32]" in spreads[0], spreads
    steps = report["prologue"]
    assert steps["inputs"] == names[:-2] and steps["file"] == "prologue.onnx"
    assert sorted(model_input.name for model_input in model.graph.input) == sorted(
        [*steps["outputs"], "controlnet_cond", "conditioning_scale"])
    ops = sorted(n["op_type"] for n in steps["cpu_nodes"])
    assert ops.count("Sin") == ops.count("Mul") == (2 if text_time else 1) and ops.count("Transpose") == 1
    assert ops.count("CastAvx") == len(steps["inputs"])  # each input cast once, there
    s = report["summary"]
    assert steps["offload_rate_with_it"] == s["offloaded_nodes"] / (s["total_nodes"] + len(ops))
    assert "step prologue" in (folder / "dd" / "onnx_report.txt").read_text()


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
    # the dispatch model's SDMul by the spread scale: 0.4 of its own residuals, to bf16's rounding (2^-8)
    dispatch = result.out / "controlnet" / "dd" / "replaced.onnx"
    full = run_onnx(dispatch, {**feeds, "conditioning_scale": np.array(1.0, np.float32)})
    part = run_onnx(dispatch, {**feeds, "conditioning_scale": np.array(0.4, np.float32)})
    for k, v in full.items():
        assert v.dtype == np.float32 and v.shape == part[k].shape  # run_onnx gives the fp32 graph's form
        np.testing.assert_allclose(part[k], 0.4 * v, rtol=2**-7, atol=2**-7 * np.abs(v).max())
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
    # a second size is re-derived from the first one's dispatch model, its step prologue's values at that size
    import onnx

    convert("tiny-controlnet-sdxl", "controlnet", out=tmp_path, res="256,320x256", check=False)
    dd = tmp_path / "controlnet" / "dd"
    report = json.loads((dd / "report.320x256.json").read_text())
    assert report["specialized_from"] == "256x256" and report["prologue"]["file"] == "prologue.onnx"
    model = onnx.load(str(dd / "replaced.320x256.onnx"), load_external_data=False)
    dims = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert dims["prologue.sample"] == [2, 32, 40, 4] and dims["controlnet_cond"] == [2, 3, 256, 320]
    fp32 = tmp_path / "controlnet" / "model.320x256.onnx"
    feeds = generic_inputs(fp32)
    expected, got = run_onnx(fp32, feeds), run_onnx(dd / "replaced.320x256.onnx", feeds)
    for name, ref in expected.items():
        cosine = float(np.dot(ref.ravel(), got[name].ravel()) / np.linalg.norm(ref) / np.linalg.norm(got[name]))
        assert cosine > 0.999, (name, cosine)  # measured 0.99992 at conversion


@pytest.fixture(scope="module")
def control_setup(tiny_conversion, tmp_path_factory):
    """tiny-sdxl's conversion with its unet_controlnet added; the tiny SDXL ControlNet converted, and a second
    one (other seeded output convolutions) from a local folder; a control image (white edges on black)."""
    import torch
    from PIL import Image

    root = tmp_path_factory.mktemp("control")
    folder = root / "tiny-sdxl"
    shutil.copytree(tiny_conversion.out, folder)
    convert("tiny-sdxl", "unet_controlnet", out=folder, res=256)  # checked against PyTorch, fidelity run
    first = convert("tiny-controlnet-sdxl", "controlnet", out=root / "cn1", res=256, check=False).out
    module = resolve_source("tiny-controlnet-sdxl").load_module("controlnet")
    torch.manual_seed(1)
    for name, m in module.named_modules():
        if name.startswith("controlnet_down_blocks.") or name == "controlnet_mid_block":
            m.reset_parameters()
    module.save_pretrained(root / "cn2-module")
    second = convert(root / "cn2-module", "controlnet", out=root / "cn2", res=256, check=False,
                     compile=False).out  # the test of several ControlNets runs the fp32 graphs
    rng = np.random.default_rng(0)
    edges = np.zeros((256, 256), np.uint8)
    edges[rng.integers(0, 256, 40), :] = 255
    edges[:, rng.integers(0, 256, 40)] = 255
    image = root / "edges.png"
    Image.fromarray(edges).convert("RGB").save(image)
    return folder, first, second, image, module


def _diffusers_controlnet(tiny_pipeline_folder, controlnet, opts, latents, image, scale, start, end):
    import torch
    from diffusers import StableDiffusionXLControlNetPipeline
    from PIL import Image

    pipe = StableDiffusionXLControlNetPipeline.from_pretrained(tiny_pipeline_folder, controlnet=controlnet)
    images = [Image.open(i).convert("RGB") for i in image] if isinstance(image, list) else \
        Image.open(image).convert("RGB")
    out = pipe(opts.prompt, negative_prompt=opts.negative_prompt or None,  # None: SDXL's zeros, as ours
               image=images, num_inference_steps=opts.steps,
               guidance_scale=opts.guidance, height=256, width=256, latents=torch.from_numpy(latents),
               controlnet_conditioning_scale=scale, control_guidance_start=start, control_guidance_end=end,
               output_type="np").images[0]
    return (out * 255).round().astype(np.uint8)


def test_generate_with_a_controlnet_draws_what_diffusers_draws(control_setup, tiny_pipeline_folder, monkeypatch):
    """`sdnpu generate --controlnet ... --reference` against diffusers' StableDiffusionXLControlNetPipeline on
    the same weights, control image, seed and starting latents; the dispatch models stay close, and the step
    prologue the ControlNet and the UNet share runs once a step."""
    from sdnpu import onnxrun
    from sdnpu.runtime import ControlSpec, GenerateOptions, Pipeline
    from sdnpu.runtime.session import Component

    folder, first, _, image, _ = control_setup
    spec = ControlSpec(first, image, scale=0.8, start=0.0, end=0.7)
    opts = GenerateOptions("a photo of a cat", negative_prompt="blurry", steps=3, seed=5, controlnets=(spec,))
    ours = Pipeline(folder, reference=True)
    drawn = ours(opts)
    controlnet = resolve_source("tiny-controlnet-sdxl").load_module("controlnet")
    theirs = _diffusers_controlnet(tiny_pipeline_folder, controlnet, opts, ours.noise(5), image, 0.8, 0.0, 0.7)
    diff = np.abs(theirs.astype(int) - drawn.astype(int))
    # measured: 1 level at most, on 0.006% of the values (rounding); the dispatch models 48.5 dB
    assert diff.max() <= 1 and np.mean(diff > 0) < 1e-3, (diff.max(), np.mean(diff > 0))
    plain = Pipeline(folder, reference=True)(GenerateOptions("a photo of a cat", negative_prompt="blurry", steps=3,
                                                             seed=5))
    assert np.abs(plain.astype(int) - drawn.astype(int)).max() > 10  # the ControlNet changed the picture
    runs = []
    monkeypatch.setattr(onnxrun, "run_prologue", lambda session, feeds, run=onnxrun.run_prologue: runs.append(1) or run(
        session, feeds))
    nets = []
    monkeypatch.setattr(Component, "run", lambda self, *a, run=Component.run, **k: (
        nets.append(1) if self.name == "controlnet" else None) or run(self, *a, **k))
    steps: list[int] = []
    dispatch = Pipeline(folder)(opts, progress=lambda i, n: steps.append(n))
    assert len(runs) == len(steps) == steps[-1] == 3  # one run a step for both models (the same digest)
    assert len(nets) == 2  # not on the last step, past end=0.7: its residuals would be 0 (the UNet adds zeros)
    psnr = 10 * np.log10(255**2 / np.mean((dispatch.astype(float) - drawn) ** 2))
    assert psnr > 40, psnr


def test_several_controlnets_are_summed_as_diffusers_does(control_setup, tiny_pipeline_folder):
    from sdnpu.runtime import ControlSpec, GenerateOptions, Pipeline

    folder, first, second, image, module = control_setup
    specs = (ControlSpec(first, image, scale=0.7), ControlSpec(second, image, scale=0.5, start=0.3))
    opts = GenerateOptions("a photo of a cat", steps=3, seed=6, controlnets=specs)
    ours = Pipeline(folder, reference=True)
    drawn = ours(opts)
    nets = [resolve_source("tiny-controlnet-sdxl").load_module("controlnet"), module]
    theirs = _diffusers_controlnet(tiny_pipeline_folder, nets, opts, ours.noise(6), [image, image], [0.7, 0.5],
                                   [0.0, 0.3], [1.0, 1.0])
    diff = np.abs(theirs.astype(int) - drawn.astype(int))
    assert diff.max() <= 1 and np.mean(diff > 0) < 1e-3, (diff.max(), np.mean(diff > 0))  # measured: 0.008%


def test_a_folder_with_only_the_unet_that_takes_the_residuals(control_setup, tmp_path):
    """A folder converted with unet_controlnet but no plain unet draws with a ControlNet (what it was converted
    for) as the full folder does, and without one says what is missing."""
    from sdnpu.runtime import ControlSpec, GenerateOptions, Pipeline

    folder, first, _, image, _ = control_setup
    lean = tmp_path / "lean"
    shutil.copytree(folder, lean, ignore=shutil.ignore_patterns("unet"))
    opts = GenerateOptions("a photo of a cat", steps=1, seed=4, controlnets=(ControlSpec(first, image),))
    np.testing.assert_array_equal(Pipeline(lean)(opts), Pipeline(folder)(opts))
    with pytest.raises(SdnpuError, match="unet/dd/replaced.onnx not found"):
        Pipeline(lean)(GenerateOptions("a photo of a cat", steps=1, seed=4))


def test_the_stage_chooses_graph_optimizations_for_the_unet_and_its_controlnets_together(control_setup, monkeypatch):
    """Where each model alone would fit onnxruntime's graph optimizations but the UNet and its ControlNet
    together would not (they are open together, a step runs both), the stage has them off for both."""
    from sdnpu.runtime import ControlSpec, GenerateOptions, Pipeline, session

    folder, first, _, image, _ = control_setup
    paths = [folder / "unet_controlnet" / session.DISPATCH_MODEL, first / "controlnet" / session.DISPATCH_MODEL]
    largest = max(session.weight_bytes(p) for p in paths)
    monkeypatch.setattr(session, "available_bytes", lambda: int(5.05 * largest))
    assert all(session.choose_optimize(p, reference=False) for p in paths)
    assert not session.choose_optimize(paths, reference=False)
    pipe = Pipeline(folder)
    controls = pipe._controls(GenerateOptions("a cat", steps=1, controlnets=(ControlSpec(first, image),)))
    stage = pipe._stage_runtime("unet_controlnet", controls, 2)
    assert stage.optimize is False and stage.shared_arena  # and one activation arena for the two
    assert pipe._stage_runtime("unet", [], 2).optimize is None  # alone: each session chooses as it opens


def test_controlnet_bad_inputs(control_setup, tiny_conversion, tmp_path, capsys):
    from PIL import Image

    from sdnpu.cli import main

    folder, first, _, image, _ = control_setup
    argv = ["generate", "--models", str(folder), "--prompt", "a cat", "--steps", "1", "--out", str(tmp_path / "x.png")]
    # a ControlNet for another base model (SD 1.5's text width and blocks)
    other = convert("tiny-controlnet-sd15", "controlnet", out=tmp_path / "sd15", res=256, check=False, compile=False)
    assert main([*argv, "--reference", "--controlnet", str(other.out), "--control-image", str(image)]) == 2
    assert "was made for another base model: its cross_attention_dim (the text width) is 32" in capsys.readouterr().err
    # a control image that cannot be read, and one of another aspect ratio
    (tmp_path / "bad.png").write_bytes(b"not a png")
    assert main([*argv, "--controlnet", str(first), "--control-image", str(tmp_path / "bad.png")]) == 2
    assert "cannot read the control image" in capsys.readouterr().err
    Image.new("RGB", (300, 200)).save(tmp_path / "wide.png")
    assert main([*argv, "--controlnet", str(first), "--control-image", str(tmp_path / "wide.png")]) == 2
    err = capsys.readouterr().err
    assert "is 300x200, the image is 256x256: another aspect ratio" in err and "crop it to 256:256" in err
    # counts that do not pair up; a folder without the UNet that takes the residuals; not a ControlNet
    assert main([*argv, "--controlnet", str(first)]) == 2
    assert "1 --controlnet and 0 --control-image" in capsys.readouterr().err
    assert main([*argv[:2], str(tiny_conversion.out), *argv[3:], "--controlnet", str(first), "--control-image",
                 str(image)]) == 2
    assert "unet_controlnet" in capsys.readouterr().err
    assert main([*argv, "--controlnet", str(folder), "--control-image", str(image)]) == 2
    assert "holds no converted ControlNet" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
    assert main([*argv, "--reference", "--controlnet", str(first / "controlnet"), "--control-image", str(image),
                 "--control-scale", "0.5", "--control-end", "0.5"]) == 0  # the component folder names it too
    assert (tmp_path / "x.png").is_file()


def test_the_unet_that_takes_the_residuals(control_setup, tiny_conversion):
    """``unet_controlnet``: the UNet with a ControlNet's residuals as inputs, added where diffusers adds them.
    Chained through onnxruntime, the fp32 ControlNet and this UNet give what diffusers' UNet gives with the
    ControlNet's residuals in PyTorch; the dispatch model's residual additions are dispatch ops, it takes the
    residuals in the NPU's form (bf16, NHWC), and its CPU nodes are the plain UNet's."""
    import torch

    from sdnpu.signatures import residual_shapes

    folder, first, _, _, _ = control_setup
    export = json.loads((folder / "unet_controlnet" / "export.json").read_text())
    assert export["check"]["max_rel_error"] < 1e-4  # against PyTorch
    config = resolve_source("tiny-sdxl").module_config("unet")
    sig = signature("unet_controlnet", config, 256)
    names = [s.name for s in sig.inputs]
    assert names[5:] == [*(f"down_block_additional_residuals.{i}" for i in range(6)), "mid_block_additional_residual"]
    assert [s.shape for s in sig.inputs[5:]] == residual_shapes(config, 32, 32)
    # the ControlNet's residuals into the UNet, both fp32 graphs, against diffusers in PyTorch
    cn_config = resolve_source("tiny-controlnet-sdxl").module_config("controlnet")
    feeds = sample_inputs(signature("controlnet", cn_config, 256), cn_config, 256)
    residuals = run_onnx(first / "controlnet" / "model.onnx", feeds)
    unet_feeds = {k: v for k, v in feeds.items() if k in names}
    unet_feeds.update({n: residuals[o] for n, o in zip(names[5:], controlnet_outputs(cn_config), strict=True)})
    ours = run_onnx(folder / "unet_controlnet" / "model.onnx", unet_feeds)["out_sample"]
    module = resolve_source("tiny-sdxl").load_module("unet")
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
    plain = run_onnx(tiny_conversion.out / "unet" / "model.onnx", {k: unet_feeds[k] for k in names[:5]})
    assert np.abs(ours - plain["out_sample"]).max() > 1e-3  # the residuals change the result
    report = json.loads((folder / "unet_controlnet" / "dd" / "report.json").read_text())
    base = json.loads((tiny_conversion.out / "unet" / "dd" / "report.json").read_text())["summary"]
    summary = report["summary"]
    assert summary["offloaded_nodes"] == base["offloaded_nodes"] + 7  # one SDAdd per residual
    # no Transpose or CastAvx at the residuals' edge: the plain UNet's CPU nodes, here or in its step prologue,
    # the same prologue as the ControlNet's (one run of it a step serves both)
    steps = report["prologue"]
    assert summary["cpu_nodes"] + len(steps["cpu_nodes"]) == base["cpu_nodes"]
    assert summary["cpu_nodes"] == 2  # out_sample's cast and Transpose
    theirs = json.loads((first / "controlnet" / "dd" / "report.json").read_text())["prologue"]
    assert steps["digest"] == theirs["digest"]
    assert sorted(report["handoff"]) == sorted(names[5:])  # bf16 in the NPU's layout, the rest fp32
    assert report["inputs"][names[5]] == [2, 32, 32, 32]  # NHWC
    assert report["fidelity"]["min_cosine"] > 0.999 and summary["npu_regions"] == 1


def test_sd15_controlnet_draws_what_diffusers_draws(tiny_sd15_conversion, tmp_path, monkeypatch):
    """SD 1.5: `generate --controlnet ... --reference` against diffusers' StableDiffusionControlNetPipeline on the
    same weights, control image, seed and starting latents; the dispatch models, residuals handed over in the
    NPU's form, stay close, and share one step prologue."""
    import torch
    from diffusers import PNDMScheduler, StableDiffusionControlNetPipeline
    from PIL import Image
    from transformers import CLIPTokenizer

    from sdnpu import onnxrun
    from sdnpu.runtime import ControlSpec, GenerateOptions, Pipeline

    folder = tmp_path / "sd15"
    shutil.copytree(tiny_sd15_conversion.out, folder)
    convert("tiny-sd15", "unet_controlnet", out=folder, check=False)
    net = convert("tiny-controlnet-sd15", "controlnet", out=tmp_path / "cn", res=256, check=False).out
    rng = np.random.default_rng(1)
    edges = np.zeros((256, 256), np.uint8)
    edges[rng.integers(0, 256, 30), :] = 255
    edges[:, rng.integers(0, 256, 30)] = 255
    Image.fromarray(edges).convert("RGB").save(tmp_path / "edges.png")
    opts = GenerateOptions("a photo of a cat", negative_prompt="blurry", steps=3, seed=2,
                           controlnets=(ControlSpec(net, tmp_path / "edges.png", scale=0.9, end=0.8),))
    ours = Pipeline(folder, reference=True)
    drawn = ours(opts)
    src = resolve_source("tiny-sd15")
    src.write_pipeline_files(tmp_path / "files")
    pipe = StableDiffusionControlNetPipeline(
        vae=src.load_module("vae"), text_encoder=src.load_module("text_encoder"),
        tokenizer=CLIPTokenizer.from_pretrained(tmp_path / "files" / "tokenizer"), unet=src.load_module("unet"),
        controlnet=resolve_source("tiny-controlnet-sd15").load_module("controlnet"),
        scheduler=PNDMScheduler.from_pretrained(tmp_path / "files" / "scheduler"), safety_checker=None,
        feature_extractor=None, requires_safety_checker=False)
    theirs = pipe(opts.prompt, negative_prompt=opts.negative_prompt, image=Image.open(tmp_path / "edges.png"),
                  num_inference_steps=3, guidance_scale=opts.guidance, height=256, width=256,
                  latents=torch.from_numpy(ours.noise(2)), controlnet_conditioning_scale=0.9,
                  control_guidance_start=0.0, control_guidance_end=0.8, output_type="np").images[0]
    theirs = (theirs * 255).round().astype(np.uint8)
    diff = np.abs(theirs.astype(int) - drawn.astype(int))
    assert diff.max() <= 1 and np.mean(diff > 0) < 1e-3, (diff.max(), np.mean(diff > 0))
    runs = []
    monkeypatch.setattr(onnxrun, "run_prologue", lambda session, feeds, run=onnxrun.run_prologue: runs.append(1) or run(
        session, feeds))
    steps: list[int] = []
    dispatch = Pipeline(folder)(opts, progress=lambda i, n: steps.append(n))
    assert len(runs) == len(steps) == steps[-1]  # one run a step for both models (the same digest), not one each
    psnr = 10 * np.log10(255**2 / np.mean((dispatch.astype(float) - drawn) ** 2))
    assert psnr > 40, psnr


def test_a_lora_changes_the_unet_that_takes_the_residuals_as_it_changes_the_unet(control_setup, tmp_path):
    """LoRA with a ControlNet: `sdnpu lora apply` gives ``unet_controlnet`` the UNet's LoRA (the same module: its
    replaced tensors byte-identical to the UNet's), and a ControlNet generation with the applied overlay draws
    what `generate --lora` (the tensors computed as the sessions open) draws, not what the base weights draw."""
    from sdnpu.lora import LoraSpec
    from sdnpu.formats.overlay import overlay_initializers
    from sdnpu.lora.overlay import apply
    from sdnpu.lora.seeded import write_seeded_lora
    from sdnpu.runtime import ControlSpec, GenerateOptions, Pipeline, RuntimeOptions

    folder, first, _, image, _ = control_setup
    work = tmp_path / "m"
    shutil.copytree(folder, work)
    write_seeded_lora(work, tmp_path / "style.safetensors", rank=4, convs=True, components=("unet",))
    spec = LoraSpec.parse(f"{tmp_path / 'style.safetensors'}:0.8")
    applied = {a.component: a for a in apply(work, [spec])}
    assert applied["unet_controlnet"].tensors == applied["unet"].tensors > 100
    weights = {c: json.loads((work / c / "dd" / "weights.json").read_text())["weights"]
               for c in ("unet", "unet_controlnet")}
    tensors = {c: overlay_initializers(work / c / "dd")[0] for c in weights}
    by_origin = {c: {json.dumps(weights[c][k], sort_keys=True): v for k, v in tensors[c].items()} for c in weights}
    assert by_origin["unet"].keys() == by_origin["unet_controlnet"].keys()
    for origin, a in by_origin["unet"].items():
        assert np.asarray(a).tobytes() == np.asarray(by_origin["unet_controlnet"][origin]).tobytes(), origin
    opts = GenerateOptions("a photo of a cat", steps=1, seed=4, controlnets=(ControlSpec(first, image, scale=0.8),))
    with_overlay = Pipeline(work)(opts)
    at_open = Pipeline(folder, runtime=RuntimeOptions(loras=(spec,)))(opts)
    np.testing.assert_array_equal(with_overlay, at_open)
    assert np.abs(Pipeline(folder)(opts).astype(int) - at_open.astype(int)).max() > 2  # the LoRA matters
