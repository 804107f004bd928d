"""The runtime on a tiny-sdxl conversion: sessions, providers, the text-to-image pipeline, its errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from sdnpu.cli import main
from sdnpu.errors import SdnpuError
from sdnpu.runtime import GenerateOptions, Pipeline, RuntimeOptions, open_component
from sdnpu.runtime.session import CUSTOM_OPS_ENV, session_options


def _extensions_library():
    """onnxruntime-extensions' custom-op library: a real one that installs here. It registers ops of its own
    domain (ai.onnx.contrib) and claims none of ours, so the dispatch model still runs its reference bodies."""
    import onnxruntime_extensions

    from pathlib import Path

    return Path(onnxruntime_extensions.get_library_path())


def _contrib_model():
    """A model only a session with onnxruntime-extensions registered can run (StringUpper)."""
    from onnx import TensorProto as T
    from onnx import helper

    node = helper.make_node("StringUpper", ["s"], ["u"], domain="ai.onnx.contrib")
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("s", T.STRING, [1])],
                          [helper.make_tensor_value_info("u", T.STRING, [1])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("ai.onnx.contrib", 1)],
                             ir_version=9).SerializeToString()


def test_dispatch_models_load_as_amds_sd_runtime_does(tiny_conversion, tmp_path):
    """The recipe of AMD's SD server: graph optimizations off, dd_cache (the model's folder, where a cache
    folder sits beside the model) and onnx_custom_ops_const_key set, then the library registered."""
    import shutil

    import onnxruntime as ort

    library = _extensions_library()
    folder = tmp_path / "conv"
    shutil.copytree(tiny_conversion.out, folder)
    (folder / "unet" / "dd" / ".cache").mkdir()
    runtime = RuntimeOptions(custom_ops=library)
    unet = open_component(folder, "unet", options=runtime)
    model = folder / "unet" / "dd" / "replaced.onnx"
    assert unet.custom_ops == library
    assert unet.options.get_session_config_entry("dd_cache") == model.parent.as_posix()
    assert unet.options.get_session_config_entry("onnx_custom_ops_const_key") == model.as_posix()
    assert unet.options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    # the library is registered: these options run an op only it provides
    upper = ort.InferenceSession(_contrib_model(), unet.options, providers=["CPUExecutionProvider"])
    assert upper.run(None, {"s": np.array(["npu"], object)})[0].tolist() == ["NPU"]
    # and the dispatch model gives the same numbers as without it (the library claims no com.amd op)
    feeds = {"sample": np.ones((2, 4, 32, 32), np.float32), "timestep": np.asarray(500.0, np.float32),
             "encoder_hidden_states": np.ones((2, 77, 64), np.float32), "text_embeds": np.ones((2, 32), np.float32),
             "time_ids": np.ones((2, 6), np.float32)}
    plain = open_component(folder, "unet", options=RuntimeOptions(optimize=False)).run(feeds)
    np.testing.assert_array_equal(unet.run(feeds)["out_sample"], plain["out_sample"])
    # no cache folder: no dd_cache entry (the library makes one); text encoders stay on the CPU by default
    vae = open_component(folder, "vae_decoder", options=runtime)
    with pytest.raises(RuntimeError, match="does not have configuration with key: dd_cache"):
        vae.options.get_session_config_entry("dd_cache")
    assert vae.options.get_session_config_entry("onnx_custom_ops_const_key").endswith("vae_decoder/dd/replaced.onnx")
    assert open_component(folder, "text_encoder", options=runtime).custom_ops is None
    assert open_component(folder, "text_encoder", options=RuntimeOptions(library, npu_text_encoders=True)).custom_ops
    assert open_component(folder, "unet", reference=True, options=runtime).custom_ops is None


def test_custom_ops_library_errors(tmp_path, monkeypatch):
    monkeypatch.setenv(CUSTOM_OPS_ENV, str(tmp_path / "missing.so"))
    with pytest.raises(SdnpuError, match="does not exist"):
        RuntimeOptions.from_env()
    not_a_library = tmp_path / "lib.so"
    not_a_library.write_bytes(b"not a shared object")
    with pytest.raises(SdnpuError, match="cannot register the custom-op library"):
        session_options(tmp_path / "m.onnx", not_a_library, optimize=False)
    monkeypatch.delenv(CUSTOM_OPS_ENV)
    assert RuntimeOptions.from_env().custom_ops is None


def test_components_run_and_check_shapes(tiny_conversion):
    vae = open_component(tiny_conversion.out, "vae_decoder")
    out = vae.run({"latent_sample": np.zeros((1, 4, 32, 32), np.float32)})
    assert out["sample"].shape == (1, 3, 256, 256)
    with pytest.raises(SdnpuError, match=r"has shape \[1, 4, 16, 16\], the model takes \[1, 4, 32, 32\]"):
        vae.run({"latent_sample": np.zeros((1, 4, 16, 16), np.float32)})
    with pytest.raises(SdnpuError, match="not found"):
        open_component(tiny_conversion.out / "nope", "unet")


def test_text_to_image_is_seeded_and_close_to_the_fp32_graphs(tiny_conversion):
    opts = GenerateOptions("a photo of a cat", steps=3, seed=7)
    pipe = Pipeline(tiny_conversion.out)
    seen = []
    image = pipe(opts, progress=lambda i, n: seen.append((i, n)))
    assert image.shape == (256, 256, 3) and image.dtype == np.uint8
    assert seen == [(1, 3), (2, 3), (3, 3)]
    assert np.array_equal(image, pipe(opts))  # same seed, same image
    assert not np.array_equal(image, pipe(GenerateOptions("a photo of a cat", steps=3, seed=8)))
    reference = Pipeline(tiny_conversion.out, reference=True)(opts)
    psnr = 10 * np.log10(255**2 / np.mean((reference.astype(float) - image) ** 2))
    assert psnr > 35  # measured 48.3 dB (seed 0, 3 steps) for dispatch vs fp32 graphs on tiny-sdxl


def test_generate_cli_writes_a_png(tiny_conversion, tmp_path, capsys):
    out = tmp_path / "cat.png"
    assert main(["-q", "generate", "--models", str(tiny_conversion.out), "--prompt", "a cat", "--steps", "2",
                 "--scheduler", "DDIMScheduler", "--out", str(out)]) == 0
    assert Image.open(out).size == (256, 256)
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--prompt", "  "], "the prompt is empty"),
     (["--prompt", "a cat", "--scheduler", "NoSuchScheduler"], "unknown scheduler 'NoSuchScheduler'"),
     (["--prompt", "a cat", "--steps", "0"], "steps must be at least 1")],
)
def test_generate_bad_input(tiny_conversion, tmp_path, argv, message, capsys):
    assert main(["generate", "--models", str(tiny_conversion.out), *argv, "--out", str(tmp_path / "x.png")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_not_a_converted_folder(tmp_path):
    with pytest.raises(SdnpuError, match="not a converted pipeline folder"):
        Pipeline(tmp_path)
    (tmp_path / "model_index.json").write_text(json.dumps({"unet": ["diffusers", "UNet2DConditionModel"]}))
    with pytest.raises(SdnpuError, match="not found"):
        Pipeline(tmp_path)


def test_image_to_image(tiny_conversion, tmp_path):
    start = tmp_path / "start.png"
    Image.fromarray(np.linspace(0, 255, 300 * 200 * 3).reshape(300, 200, 3).astype(np.uint8)).save(start)
    pipe = Pipeline(tiny_conversion.out)
    seen = []
    image = pipe(GenerateOptions("a cat", steps=4, image=start, strength=0.5), progress=lambda i, n: seen.append(n))
    assert image.shape == (256, 256, 3) and seen == [2, 2]  # half of 4 steps
    bad = tmp_path / "not.png"
    bad.write_text("not an image")
    with pytest.raises(SdnpuError, match="cannot read .* as an image"):
        pipe(GenerateOptions("a cat", steps=4, image=bad))
    with pytest.raises(SdnpuError, match="leaves no step"):
        pipe(GenerateOptions("a cat", steps=2, image=start, strength=0.1))


def test_verify_fills_the_reports(tiny_conversion, tmp_path, capsys):
    import shutil

    folder = tmp_path / "tiny"
    shutil.copytree(tiny_conversion.out, folder)
    assert main(["-q", "verify", str(folder), "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "pipeline (2 steps, seed 0): image PSNR" in out
    summary = json.loads((folder / "verify.json").read_text())
    assert set(summary["components"]) == {"text_encoder", "text_encoder_2", "vae_encoder", "vae_decoder", "unet"}
    assert summary["pipeline"]["psnr_db"] > 35
    report = json.loads((folder / "vae_decoder" / "dd" / "report.json").read_text())
    assert report["fidelity"]["inputs"] == "worst of seed 0, seed 1, seed 2 (sdnpu verify)"
    assert "psnr_db" in report["fidelity"]["outputs"]["sample"]
    for name in summary["components"]:  # both ends of the range, for every component
        both = json.loads((folder / name / "dd" / "report.json").read_text())
        assert both["fidelity"]["min_cosine"] > 0.99 and both["fidelity_pessimistic"]["min_cosine"] > 0.99
        assert both["fidelity_pessimistic"]["inputs"].endswith("every body intermediate in bf16")
    unet = json.loads((folder / "unet" / "dd" / "report.json").read_text())
    assert unet["fidelity"]["inputs"] == ("worst of seed 0 at timestep 999, seed 1 at timestep 500, "
                                          "seed 2 at timestep 1 (sdnpu verify)")
    assert "whole pipeline, 2 steps" in (folder / "unet" / "dd" / "onnx_report.txt").read_text()
    from sdnpu.reports.show import validate

    validate(report, folder)


@pytest.mark.parametrize("scheduler", [None, "DDIMScheduler"])
def test_optimum_pipeline_draws_the_same_image(tiny_conversion, scheduler):
    """A client we did not write: optimum's ORTStableDiffusionXLPipeline loads the converted folder (its fp32
    graphs) and, from the same starting noise and scheduler, draws what `sdnpu generate --reference` draws.
    Measured on tiny-sdxl: at most 1 level apart (rounding) on a few pixels."""
    import diffusers
    import torch
    from optimum.onnxruntime import ORTStableDiffusionXLPipeline

    opts = GenerateOptions("a photo of a cat", negative_prompt="blurry", steps=3, seed=3, scheduler=scheduler)
    ours = Pipeline(tiny_conversion.out, reference=True)
    image = ours(opts)
    theirs = ORTStableDiffusionXLPipeline.from_pretrained(tiny_conversion.out, provider="CPUExecutionProvider")
    if scheduler:
        theirs.scheduler = getattr(diffusers, scheduler).from_config(theirs.scheduler.config)
    noise = ours.noise(opts.seed)
    out = theirs(opts.prompt, negative_prompt=opts.negative_prompt, num_inference_steps=opts.steps,
                 guidance_scale=opts.guidance, height=image.shape[0], width=image.shape[1],
                 latents=torch.from_numpy(noise), output_type="np").images[0]
    other = (out * 255).round().astype(np.uint8)
    diff = np.abs(other.astype(int) - image.astype(int))
    assert diff.max() <= 1 and np.mean(diff > 0) < 1e-3


def test_graph_optimizations_only_where_they_fit(tiny_conversion, monkeypatch):
    """onnxruntime's optimizations fold a dispatch model's bf16 weight casts into fp32 copies: auto turns
    them on only where four times the weight bytes fit in 80% of the available memory."""
    from sdnpu.runtime import session

    path = tiny_conversion.out / "unet" / session.DISPATCH_MODEL
    size = path.stat().st_size
    monkeypatch.setattr(session, "available_bytes", lambda: 6 * size)
    assert session.choose_optimize(path, reference=False)
    monkeypatch.setattr(session, "available_bytes", lambda: 4 * size)
    assert not session.choose_optimize(path, reference=False)
    assert session.choose_optimize(path, reference=True)  # an fp32 graph needs twice its bytes
    monkeypatch.setattr(session, "available_bytes", lambda: None)
    assert not session.choose_optimize(path, reference=False)  # unknown: the lean choice
    latent = {"latent_sample": np.ones((1, 4, 32, 32), np.float32)}
    lean = open_component(tiny_conversion.out, "vae_decoder", options=RuntimeOptions(optimize=False)).run(latent)
    fast = open_component(tiny_conversion.out, "vae_decoder", options=RuntimeOptions(optimize=True)).run(latent)
    lean, fast = lean["sample"], fast["sample"]
    assert np.max(np.abs(lean - fast)) < 0.05 * np.max(np.abs(lean))  # bf16 rounding may flip, no more


def test_a_non_square_size_draws_what_diffusers_draws(two_sizes, tiny_pipeline_folder):
    """tiny-sdxl with 320x256 (320 wide) added: the UNet and the VAE decoder take the real (height, width), as
    SDXL's time_ids do, and `sdnpu generate --reference` at that size draws what diffusers' own
    StableDiffusionXLPipeline (PyTorch, the same weights) draws from the same starting latents, as optimum's
    pipeline does for the square folder; the dispatch models (re-derived from the primary's) stay close."""
    import torch
    from diffusers import StableDiffusionXLPipeline

    from sdnpu.imagesize import Size

    export = json.loads((two_sizes / "unet" / "export.320x256.json").read_text())
    assert export["resolution"] is None and export["size"] == {"height": 256, "width": 320}
    assert json.loads((two_sizes / "unet" / "dd" / "report.320x256.json").read_text())["size"] == export["size"]
    opts = GenerateOptions("a photo of a cat", negative_prompt="blurry", steps=3, seed=4)
    ours = Pipeline(two_sizes, reference=True, size=Size(256, 320))
    image = ours(opts)
    assert image.shape == (256, 320, 3)
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_pipeline_folder)
    out = pipe(opts.prompt, negative_prompt=opts.negative_prompt, num_inference_steps=opts.steps,
               guidance_scale=opts.guidance, height=256, width=320, latents=torch.from_numpy(ours.noise(opts.seed)),
               output_type="np").images[0]
    theirs = (out * 255).round().astype(np.uint8)
    diff = np.abs(theirs.astype(int) - image.astype(int))
    # measured: 1 level at most, on 0.009% of the values (rounding)
    assert diff.max() <= 1 and np.mean(diff > 0) < 1e-3, (diff.max(), np.mean(diff > 0))
    dispatch = Pipeline(two_sizes, size=Size(256, 320))(opts)
    psnr = 10 * np.log10(255**2 / np.mean((dispatch.astype(float) - image) ** 2))
    assert psnr > 35, psnr


def test_generate_refuses_a_size_the_folder_was_not_converted_for(tiny_conversion, tmp_path, capsys):
    from sdnpu.cli import main

    argv = ["generate", "--models", str(tiny_conversion.out), "--prompt", "a cat", "--steps", "1",
            "--out", str(tmp_path / "x.png")]
    assert main([*argv, "--width", "320"]) == 2
    err = capsys.readouterr().err
    assert "is not converted at 320x256 (converted: 256x256)" in err
    assert "--source tiny-sdxl --model unet,vae_encoder,vae_decoder" in err and "--res 320x256 --add" in err
    assert not (tmp_path / "x.png").exists()
    assert main([*argv, "--width", "256", "--height", "256"]) == 0
