"""Inpainting against diffusers' own pipelines on the same weights: 9-channel inpainting UNets (SDXL's and SD 1.5's
architectures, presets tiny-sdxl-inpaint and tiny-sd15-inpaint) and a text-to-image UNet inpainting by keeping the
picture outside the mask (diffusers' 4-channel path).

diffusers' pipelines draw the VAE encoder's latents as a sample of its distribution with their generator; sdnpu
takes the distribution's mean. The comparisons make diffusers take the mean too (``_mean_latents``), so that the
same weights, starting latents and seed give the same image."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sdnpu.cli import main
from sdnpu.convert import convert, resolve_source
from sdnpu.errors import SdnpuError
from sdnpu.runtime import GenerateOptions, Pipeline
from tests.conftest import once
from tests.images import levels, psnr, uint8


def _pictures(folder: Path, size: tuple[int, int]) -> tuple[Path, Path]:
    """A seeded picture and a mask (a white rectangle off-centre, soft edge: the binarization at one half
    decides it) at ``size`` (height, width), as PNG files."""
    from PIL import Image

    h, w = size
    rng = np.random.default_rng(5)
    ys, xs = np.mgrid[0:h, 0:w]
    picture = np.stack([128 + 100 * np.sin(xs / 9.0), 128 + 100 * np.cos(ys / 7.0), rng.integers(0, 255, (h, w))], -1)
    mask = np.clip((np.minimum(xs - w // 5, 4 * w // 5 - xs) / 3.0), 0, 1) * (ys > h // 3) * (ys < 5 * h // 6)
    Image.fromarray(picture.clip(0, 255).astype(np.uint8)).save(folder / "in.png")
    Image.fromarray((mask * 255).astype(np.uint8)).save(folder / "mask.png")
    return folder / "in.png", folder / "mask.png"


def _mean_latents(monkeypatch, module) -> None:
    """diffusers' pipeline ``module`` takes the VAE encoder's mean (as sdnpu does) instead of a sample."""
    original = module.retrieve_latents
    monkeypatch.setattr(module, "retrieve_latents",
                        lambda output, generator=None, sample_mode="sample": original(output, generator, "argmax"))


def _diffusers(preset: str, folder: Path):
    """diffusers' inpainting pipeline for ``preset``'s architecture on its seeded weights, with the converted
    folder's tokenizers and scheduler."""
    import diffusers
    from transformers import CLIPTokenizer

    src = resolve_source(preset)
    config = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    scheduler = getattr(diffusers, config["_class_name"]).from_config(config)
    modules = {"vae": src.load_module("vae"), "text_encoder": src.load_module("text_encoder"),
               "tokenizer": CLIPTokenizer.from_pretrained(folder / "tokenizer"), "unet": src.load_module("unet"),
               "scheduler": scheduler}
    if "text_encoder_2" in src.modules:
        return diffusers.StableDiffusionXLInpaintPipeline(
            **modules, text_encoder_2=src.load_module("text_encoder_2"),
            tokenizer_2=CLIPTokenizer.from_pretrained(folder / "tokenizer_2"), requires_aesthetics_score=False)
    return diffusers.StableDiffusionInpaintPipeline(**modules, safety_checker=None, feature_extractor=None,
                                                    requires_safety_checker=False)


@pytest.fixture(scope="module")
def sdxl_inpaint(tmp_path_factory) -> Path:
    return once(tmp_path_factory, "sdxl-inpaint",
                lambda root: convert("tiny-sdxl-inpaint", "all", out=root / "tiny-sdxl-inpaint").out)


@pytest.fixture(scope="module")
def sd15_inpaint(tmp_path_factory) -> Path:
    return once(tmp_path_factory, "sd15-inpaint",
                lambda root: convert("tiny-sd15-inpaint", "all", out=root / "tiny-sd15-inpaint").out)


def _agree(ours: np.ndarray, theirs: np.ndarray) -> None:
    worst, share = levels(ours, theirs)
    assert worst <= 1 and share <= 1e-3, (worst, share)


@pytest.mark.parametrize("preset", ["tiny-sdxl-inpaint", "tiny-sd15-inpaint"])
def test_an_inpainting_unet_draws_what_diffusers_inpainting_pipeline_draws(preset, sdxl_inpaint, sd15_inpaint,
                                                                            tmp_path, monkeypatch):
    """A 9-channel UNet (latents, mask, masked-picture latents) at strength 1, guidance 5, 3 steps, against
    StableDiffusionXLInpaintPipeline / StableDiffusionInpaintPipeline; the dispatch models above 40 dB."""
    import torch
    from diffusers.pipelines.stable_diffusion import pipeline_stable_diffusion_inpaint as sd_module
    from diffusers.pipelines.stable_diffusion_xl import pipeline_stable_diffusion_xl_inpaint as sdxl_module
    from PIL import Image

    folder = sdxl_inpaint if preset == "tiny-sdxl-inpaint" else sd15_inpaint
    ours = Pipeline(folder, reference=True)
    assert ours.inpainting_unet and ours.latent_shape[1] == 4
    picture, mask = _pictures(tmp_path, ours.image_size)
    opts = GenerateOptions("a red chair", negative_prompt="blurry", steps=3, seed=4, image=picture, mask=mask)
    image = ours(opts)
    _mean_latents(monkeypatch, sdxl_module if "sdxl" in preset else sd_module)
    h, w = ours.image_size
    out = _diffusers(preset, folder)(
        opts.prompt, negative_prompt=opts.negative_prompt, image=Image.open(picture), mask_image=Image.open(mask),
        strength=1.0, num_inference_steps=3, guidance_scale=opts.guidance, height=h, width=w,
        latents=torch.from_numpy(ours.noise(opts.seed)), output_type="np").images
    _agree(image, uint8(out)[0])
    dispatch = Pipeline(folder)(opts)
    assert psnr(dispatch, image) > 40, psnr(dispatch, image)


def test_inpainting_from_part_of_the_schedule_starts_from_the_picture(sd15_inpaint, tmp_path, monkeypatch):
    """strength 0.5: the picture's latents noised to half the schedule, its last 2 of 4 steps run (tiny-sd15's
    PNDM runs 4 steps as 5 timesteps, so 3 of them); diffusers' pipeline starts from given latents only at
    strength 1, so its noise is handed to it where it draws it."""
    from diffusers.pipelines.stable_diffusion import pipeline_stable_diffusion_inpaint as module
    from PIL import Image
    import torch

    ours = Pipeline(sd15_inpaint, reference=True)
    picture, mask = _pictures(tmp_path, ours.image_size)
    opts = GenerateOptions("a red chair", steps=4, seed=9, image=picture, mask=mask, strength=0.5)
    seen: list[int] = []
    image = ours(opts, progress=lambda i, n: seen.append(n))
    assert seen == [3, 3, 3]
    _mean_latents(monkeypatch, module)
    noise = torch.from_numpy(ours.noise(opts.seed))
    monkeypatch.setattr(module, "randn_tensor", lambda shape, **kw: noise.clone())
    h, w = ours.image_size
    out = _diffusers("tiny-sd15-inpaint", sd15_inpaint)(
        opts.prompt, image=Image.open(picture), mask_image=Image.open(mask), strength=0.5, num_inference_steps=4,
        guidance_scale=opts.guidance, height=h, width=w, output_type="np").images
    _agree(image, uint8(out)[0])
    assert levels(image, ours(GenerateOptions("a red chair", steps=4, seed=9, image=picture, mask=mask)))[0] > 0


def test_a_text_to_image_unet_inpaints_keeping_the_picture_outside_the_mask(tiny_conversion, tmp_path, monkeypatch):
    """tiny-sdxl's 4-channel UNet with a mask: after each step the picture's latents, noised to the next step's
    level, replace what the UNet drew outside the mask (diffusers' 4-channel path); at the last step the picture's
    own latents, so outside the mask the image is the picture through the VAE."""
    import torch
    from diffusers.pipelines.stable_diffusion_xl import pipeline_stable_diffusion_xl_inpaint as module
    from PIL import Image

    folder = tiny_conversion.out
    ours = Pipeline(folder, reference=True)
    assert not ours.inpainting_unet
    picture, mask = _pictures(tmp_path, ours.image_size)
    opts = GenerateOptions("a red chair", steps=3, seed=2, image=picture, mask=mask)
    image = ours(opts)
    _mean_latents(monkeypatch, module)
    h, w = ours.image_size
    out = _diffusers("tiny-sdxl", folder)(
        opts.prompt, image=Image.open(picture), mask_image=Image.open(mask), strength=1.0, num_inference_steps=3,
        guidance_scale=opts.guidance, height=h, width=w, latents=torch.from_numpy(ours.noise(opts.seed)),
        output_type="np").images
    _agree(image, uint8(out)[0])
    plain = ours(GenerateOptions("a red chair", steps=3, seed=2))
    assert levels(image, plain)[0] > 10  # the mask and picture changed what was drawn


def test_verify_draws_an_inpainting_folder_over_a_seeded_picture_and_mask(sdxl_inpaint):
    from sdnpu.runtime import verify

    checked = verify(sdxl_inpaint, steps=2)["pipeline"]
    assert checked["inpainting"] and checked["psnr_db"] > 40, checked


def test_inpainting_refusals(sdxl_inpaint, tiny_conversion, tmp_path):
    picture, mask = _pictures(tmp_path, (256, 256))
    with pytest.raises(SdnpuError, match="inpainting UNet") as e:
        Pipeline(sdxl_inpaint, reference=True)(GenerateOptions("a cat", steps=1))
    assert "--mask" in e.value.hint
    with pytest.raises(SdnpuError, match="--mask needs the picture"):
        Pipeline(tiny_conversion.out, reference=True)(GenerateOptions("a cat", steps=1, mask=mask))
    (tmp_path / "bad.png").write_text("not a picture")
    with pytest.raises(SdnpuError, match="cannot read .*bad.png as an image"):
        Pipeline(sdxl_inpaint, reference=True)(GenerateOptions("a cat", steps=1, image=picture,
                                                               mask=tmp_path / "bad.png"))
    with pytest.raises(SdnpuError, match="strength must be in"):
        Pipeline(sdxl_inpaint, reference=True)(GenerateOptions("a cat", steps=1, image=picture, mask=mask,
                                                               strength=1.5))


def test_generate_inpaints_from_the_command_line(sdxl_inpaint, tmp_path, capsys):
    picture, mask = _pictures(tmp_path, (256, 256))
    out = tmp_path / "chair.png"
    assert main(["-q", "generate", "--models", str(sdxl_inpaint), "--prompt", "a red chair", "--steps", "2",
                 "--image", str(picture), "--mask", str(mask), "--reference", "--out", str(out)]) == 0
    assert out.is_file() and "inpainting" in capsys.readouterr().out
