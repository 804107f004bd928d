"""The denoiser's batch as a conversion choice (``--batch``), guidance-free models (Turbo, LCM) at batch 1, and
several images per prompt (``--num-images``), against diffusers' own pipelines on the same weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from sdnpu.cli import main
from sdnpu.convert import ConvertOptions, convert, resolve_source
from sdnpu.errors import SdnpuError
from sdnpu.formats.sizes import sizes_of
from sdnpu.runtime import GenerateOptions, Pipeline
from sdnpu.runtime.stages import plan_calls
from tests.conftest import once
from tests.images import levels, psnr, uint8


def _diffusers_sdxl(preset: str, folder: Path, scheduler: str | None = None):
    """diffusers' StableDiffusionXLPipeline on ``preset``'s seeded weights, with the converted folder's tokenizers
    and scheduler (or diffusers' ``scheduler`` made from its config)."""
    import diffusers
    from transformers import CLIPTokenizer

    src = resolve_source(preset)
    config = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    cls = getattr(diffusers, scheduler or config["_class_name"])
    return diffusers.StableDiffusionXLPipeline(
        vae=src.load_module("vae"), text_encoder=src.load_module("text_encoder"),
        text_encoder_2=src.load_module("text_encoder_2"),
        tokenizer=CLIPTokenizer.from_pretrained(folder / "tokenizer"),
        tokenizer_2=CLIPTokenizer.from_pretrained(folder / "tokenizer_2"),
        unet=src.load_module("unet"), scheduler=cls.from_config(config))


@pytest.fixture(scope="module")
def turbo(tmp_path_factory) -> Path:
    """tiny-sdxl-turbo converted as it comes (guidance-free: its UNet at batch 1), then batch 2 added."""
    return once(tmp_path_factory, "turbo", lambda root: _turbo(root / "tiny-sdxl-turbo"))


def _turbo(out: Path) -> Path:
    result = convert("tiny-sdxl-turbo", "all", out=out)
    assert result.batches == [1] and [c.batch for c in result.components if c.component == "unet"] == [1]
    added = convert("tiny-sdxl-turbo", "unet", out=out, batch=2, add=True)
    assert [(c.component, c.batch) for c in added.components] == [("unet", 2)]
    return out


def test_a_guidance_free_preset_converts_its_denoiser_at_batch_1_and_holds_another_over_its_weights(turbo):
    comp = turbo / "unet"
    export = json.loads((comp / "export.json").read_text())
    assert export["batch"] == 1
    assert {i["name"]: i["shape"][0] for i in export["inputs"] if i["shape"]} == {
        "sample": 1, "encoder_hidden_states": 1, "text_embeds": 1, "time_ids": 1}
    assert [(f.batch, f.dispatch) for f in sizes_of(comp)] == [(1, "dd/replaced.onnx"),
                                                               (2, "dd/replaced.256x256.b2.onnx")]
    manifest = json.loads((comp / "sizes.json").read_text())
    assert manifest["sizes"][1]["shared"]["dispatch"]["own"] == 0  # every weight in the primary's data file
    one, two = (json.loads((comp / "dd" / name).read_text())["summary"]
                for name in ("report.json", "report.256x256.b2.json"))
    # half the NPU work per call for the one image a guidance-free step needs, the same offload
    assert 2 * one["macs_total"] == two["macs_total"] and one["macs_offloaded_share"] == two["macs_offloaded_share"]
    assert (one["offload_rate"], one["cpu_nodes"], one["npu_regions"]) == (
        two["offload_rate"], two["cpu_nodes"], two["npu_regions"])
    assert json.loads((turbo / "generation.json").read_text())["guidance"] == 0.0
    assert "batch 1" in (comp / "dd" / "onnx_report.txt").read_text()


def test_turbo_at_guidance_0_in_one_step_draws_what_diffusers_draws(turbo):
    """SDXL-Turbo's way (EulerAncestral, trailing timesteps, 1 step, guidance 0: no unconditional half) on the
    batch-1 UNet, against diffusers' StableDiffusionXLPipeline on the same weights and starting latents."""
    import torch

    ours = Pipeline(turbo, reference=True)
    assert ours.batches == [1, 2] and (ours.generation.steps, ours.generation.guidance) == (1, 0.0)
    opts = GenerateOptions("a photo of a cat", steps=1, guidance=0.0, seed=3)
    image = ours(opts)
    pipe = _diffusers_sdxl("tiny-sdxl-turbo", turbo)
    out = pipe(opts.prompt, num_inference_steps=1, guidance_scale=0.0, height=256, width=256,
               latents=torch.from_numpy(ours.noise(opts.seed)), output_type="np").images
    worst, share = levels(uint8(out)[0], image)
    assert worst <= 1 and share <= 1e-3, (worst, share)
    dispatch = Pipeline(turbo)(opts)
    assert psnr(dispatch, image) > 40, psnr(dispatch, image)


def test_sd_turbo_converts_at_batch_1_and_draws_what_diffusers_draws(tmp_path):
    """SD-Turbo's way on the SD 2.1 architecture (tiny-sd-turbo): its UNet at batch 1, its OpenCLIP tokenizer
    padding with ``!``, one step at guidance 0, against diffusers' StableDiffusionPipeline."""
    import diffusers
    import torch
    from transformers import CLIPTokenizer

    out = tmp_path / "tiny-sd-turbo"
    result = convert("tiny-sd-turbo", "text_encoder,unet,vae_decoder", out=out)
    assert [(c.component, c.batch) for c in result.components if c.component == "unet"] == [("unet", 1)]
    tokenizer = CLIPTokenizer.from_pretrained(out / "tokenizer")
    assert tokenizer.pad_token == "!" and tokenizer("a cat", padding="max_length").input_ids[-1] == 0
    ours = Pipeline(out, reference=True)
    opts = GenerateOptions("a photo of a cat", steps=1, guidance=0.0, seed=5)
    image = ours(opts)
    src = resolve_source("tiny-sd-turbo")
    config = json.loads((out / "scheduler" / "scheduler_config.json").read_text())
    pipe = diffusers.StableDiffusionPipeline(
        vae=src.load_module("vae"), text_encoder=src.load_module("text_encoder"), tokenizer=tokenizer,
        unet=src.load_module("unet"), scheduler=diffusers.EulerDiscreteScheduler.from_config(config),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    h, w = ours.image_size
    theirs = pipe(opts.prompt, num_inference_steps=1, guidance_scale=0.0, height=h, width=w,
                  latents=torch.from_numpy(ours.noise(opts.seed)), output_type="np").images
    worst, share = levels(uint8(theirs)[0], image)
    assert worst <= 1 and share <= 1e-3, (worst, share)
    assert psnr(Pipeline(out)(opts), image) > 40
    from sdnpu.runtime import verify

    checked = verify(out, steps=1)["pipeline"]  # at the folder's guidance: its batch-1 UNet is all it has
    assert checked["guidance"] == 0.0 and checked["psnr_db"] > 40, checked


def test_an_lcm_at_guidance_1_runs_at_batch_1_and_agrees_with_diffusers(turbo):
    """LCMScheduler at guidance 1 (what an LCM LoRA is run with), 4 steps: it draws noise between steps from the
    seed; diffusers with a generator of that seed draws the same."""
    import torch

    ours = Pipeline(turbo, reference=True)
    opts = GenerateOptions("a photo of a cat", steps=4, guidance=1.0, seed=7, scheduler="LCMScheduler")
    image = ours(opts)
    pipe = _diffusers_sdxl("tiny-sdxl-turbo", turbo, "LCMScheduler")
    out = pipe(opts.prompt, num_inference_steps=4, guidance_scale=1.0, height=256, width=256,
               latents=torch.from_numpy(ours.noise(opts.seed)), generator=torch.Generator().manual_seed(opts.seed),
               output_type="np").images
    worst, share = levels(uint8(out)[0], image)
    assert worst <= 1 and share <= 1e-3, (worst, share)


def test_several_images_go_through_the_batches_and_equal_each_seed_drawn_alone(turbo):
    """Three images at guidance 0 over batches 1 and 2: one call of two, one of one; image k equals seed + k drawn
    alone (bit for bit here), and the three equal diffusers' num_images_per_prompt=3 from the same latents."""
    import torch

    ours = Pipeline(turbo, reference=True)
    opts = GenerateOptions("a photo of a cat", steps=1, guidance=0.0, seed=10, num_images=3)
    calls = []
    images = ours.generate(opts, progress=lambda i, n: calls.append(i))
    assert len(images) == 3 and calls == [1, 1]  # two denoiser calls of one step each
    for k, image in enumerate(images):
        alone = ours(GenerateOptions(opts.prompt, steps=1, guidance=0.0, seed=opts.seed + k))
        np.testing.assert_array_equal(image, alone)
    assert levels(images[0], images[1])[0] > 0
    pipe = _diffusers_sdxl("tiny-sdxl-turbo", turbo)
    latents = np.concatenate([ours.noise(opts.seed + k) for k in range(3)])
    out = pipe(opts.prompt, num_inference_steps=1, guidance_scale=0.0, height=256, width=256, num_images_per_prompt=3,
               latents=torch.from_numpy(latents), output_type="np").images
    for theirs, image in zip(uint8(out), images, strict=True):
        worst, share = levels(theirs, image)
        assert worst <= 1 and share <= 1e-3, (worst, share)


def test_several_images_with_guidance_agree_with_diffusers(tiny_conversion):
    """Two images at guidance 5 on the batch-2 UNet (two calls: each image's two halves), against diffusers'
    num_images_per_prompt=2 (one call of four rows) from the same latents."""
    import torch

    ours = Pipeline(tiny_conversion.out, reference=True)
    opts = GenerateOptions("a photo of a cat", negative_prompt="blurry", steps=2, seed=1, num_images=2)
    images = ours.generate(opts)
    pipe = _diffusers_sdxl("tiny-sdxl", tiny_conversion.out)
    latents = np.concatenate([ours.noise(opts.seed + k) for k in range(2)])
    out = pipe(opts.prompt, negative_prompt=opts.negative_prompt, num_inference_steps=2, guidance_scale=opts.guidance,
               height=256, width=256, num_images_per_prompt=2, latents=torch.from_numpy(latents),
               output_type="np").images
    for theirs, image in zip(uint8(out), images, strict=True):
        worst, share = levels(theirs, image)
        assert worst <= 1 and share <= 1e-3, (worst, share)


def test_a_batch_the_folder_lacks_is_refused_with_the_add_that_fixes_it(tiny_conversion, turbo):
    with pytest.raises(SdnpuError, match="converted at batch 2: none draws the 1 image at guidance at most 1") as e:
        Pipeline(tiny_conversion.out, reference=True)(GenerateOptions("a cat", steps=1, guidance=0.0))
    assert "--model unet" in e.value.hint and "--batch 1 --add" in e.value.hint
    assert "or generate with --guidance above 1" in e.value.hint
    shutil.rmtree(turbo.parent / "copy", ignore_errors=True)
    only_one = turbo.parent / "copy"
    shutil.copytree(turbo, only_one)
    manifest = json.loads((only_one / "unet" / "sizes.json").read_text())
    manifest["sizes"] = manifest["sizes"][:1]  # as converted, before batch 2 was added
    (only_one / "unet" / "sizes.json").write_text(json.dumps(manifest))
    with pytest.raises(SdnpuError, match="guidance above 1") as e:
        Pipeline(only_one, reference=True)(GenerateOptions("a cat", steps=1, guidance=5.0))
    assert "--batch 2 --add" in e.value.hint


def test_the_calls_a_number_of_images_takes():
    def add(b: int) -> str:
        return f"--batch {b} --add"

    assert plan_calls(3, False, [1, 2], add) == [(2, 2), (1, 1)]
    assert plan_calls(3, True, [2], add) == [(2, 1)] * 3
    assert plan_calls(2, True, [4, 2], add) == [(4, 2)]
    assert plan_calls(5, True, [2, 4, 8], add) == [(8, 4), (2, 1)]
    # the guidance's halves apart (QwenImagePipeline's way): a batch of k draws k guided images in two runs; for
    # as many images, a batch of 2k in one run is taken first
    assert plan_calls(3, True, [1], add, apart=True) == [(1, 1)] * 3
    assert plan_calls(3, True, [2, 1], add, apart=True) == [(2, 2), (2, 1)]
    assert plan_calls(5, True, [4, 1], add, apart=True) == [(4, 4), (1, 1)]
    assert plan_calls(2, True, [4, 2], add, apart=True) == [(4, 2)]
    with pytest.raises(SdnpuError, match="none draws the 2 images"):  # a batch larger than the images asked for
        plan_calls(2, False, [4], add)
    with pytest.raises(SdnpuError, match="none draws the last 1 image") as e:
        plan_calls(3, True, [4], add)
    assert e.value.hint.startswith("add batch 2: --batch 2 --add")
    with pytest.raises(SdnpuError, match="none draws the 1 image at guidance at most 1"):
        plan_calls(1, False, [2], add)


def test_batch_option_errors():
    assert ConvertOptions(batch="1,1,2").batches == (1, 2)
    assert ConvertOptions(batch=4).batches == (4,)
    for bad in ("0", "two", "", -1, 1.5):
        with pytest.raises(SdnpuError, match="batch"):
            ConvertOptions(batch=bad)


def test_generate_takes_the_folders_defaults_and_writes_each_image(turbo, tmp_path, capsys):
    out = tmp_path / "cat.png"
    assert main(["-q", "generate", "--models", str(turbo), "--prompt", "a cat", "--num-images", "2", "--seed", "4",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "wrote 2 images (256x256" in printed and "1 step at guidance 0" in printed
    assert f"{tmp_path / 'cat-2.png'}  seed 5" in printed
    assert (tmp_path / "cat-1.png").is_file() and (tmp_path / "cat-2.png").is_file() and not out.exists()
    assert main(["generate", "--models", str(turbo), "--prompt", "a cat", "--num-images", "0"]) == 2
    assert "--num-images must be at least 1" in capsys.readouterr().err
