"""Qwen-Image: the presets, the export of every component (Qwen2.5-VL's language model as the text encoder, the
one-frame VAE, the transformer on packed latents with the caption's mask), their offload, and the pipeline
against diffusers' own ``QwenImagePipeline`` (PyTorch, the same weights)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from sdnpu.runtime import GenerateOptions, Pipeline
from tests.images import levels, psnr

OPTS = GenerateOptions("a photo of a cat", negative_prompt="blurry, low quality", steps=3, guidance=4.0, seed=4)


def _diffusers_pipeline(folder: Path):
    """diffusers' QwenImagePipeline over tiny-qwen-image's seeded modules, with the converted folder's scheduler
    and tokenizer (read by diffusers' own Qwen2Tokenizer, the slow one)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from transformers import Qwen2Tokenizer

    from sdnpu.convert import resolve_source

    src = resolve_source("tiny-qwen-image")
    return QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(folder / "scheduler"),
                             vae=src.load_module("vae"), text_encoder=src.load_module("text_encoder"),
                             tokenizer=Qwen2Tokenizer.from_pretrained(folder / "tokenizer"),
                             transformer=src.load_module("transformer"))


def _diffusers_images(pipe, ours: Pipeline, opts: GenerateOptions = OPTS) -> list[np.ndarray]:
    """What diffusers draws from ``ours``' starting latents: ``true_cfg_scale`` the guidance, the negative prompt
    given where the guidance is above 1 (as sdnpu runs the unconditional half), the same prompt tokens."""
    import torch

    from sdnpu.runtime.flux import pack

    h, w = ours.image_size
    negative = {"negative_prompt": opts.negative_prompt} if opts.guidance > 1 else {}
    images = []
    for k in range(opts.num_images):
        latents = torch.from_numpy(pack(ours.noise(opts.seed + k)))
        out = pipe(opts.prompt, num_inference_steps=opts.steps, true_cfg_scale=opts.guidance, height=h, width=w,
                   latents=latents, max_sequence_length=ours.text_len, output_type="np", **negative).images[0]
        images.append((out * 255).round().astype(np.uint8))
    return images


@pytest.fixture(scope="module")
def diffusers_pipe(tiny_qwen_image):
    return _diffusers_pipeline(tiny_qwen_image.out)


def test_every_component_exports_and_matches_pytorch(tiny_qwen_image):
    out = tiny_qwen_image.out
    got = {c.component: c for c in tiny_qwen_image.components}
    assert list(got) == ["text_encoder", "vae_encoder", "vae_decoder", "transformer"]
    for c in got.values():
        assert c.check["max_rel_error"] < 1e-5, (c.component, c.check)  # measured: at most 7.5e-7
    export = {c: json.loads((out / c / "export.json").read_text()) for c in got}
    shapes = {c: [(i["name"], i["shape"]) for i in e["inputs"]] for c, e in export.items()}
    # 64 px: 32 x 32 latents (the VAE's 2) packed 2 x 2 into 256 tokens of 16; 64 prompt tokens (the preset's
    # generation.json) past the template's 34; true CFG: batch 2
    assert shapes == {
        "text_encoder": [("input_ids", [1, 98])],
        "vae_encoder": [("sample", [1, 3, 1, 64, 64])],
        "vae_decoder": [("latent_sample", [1, 4, 1, 32, 32])],
        "transformer": [("hidden_states", [2, 256, 16]), ("timestep", [2]), ("encoder_hidden_states", [2, 64, 48]),
                        ("encoder_hidden_states_mask", [2, 64])]}
    assert export["text_encoder"]["module_class"] == "Qwen2_5_VLForConditionalGeneration"
    assert export["text_encoder"]["outputs"] == ["last_hidden_state"]
    assert export["vae_decoder"]["module_class"] == "AutoencoderKLQwenImage"
    for name in ("tokenizer", "scheduler"):
        assert (out / name).is_dir()
    assert json.loads((out / "generation.json").read_text())["max_sequence_length"] == 64


# what each dispatch model leaves on the CPU, as measured (the offload by AMD's formula, the CPU nodes): the text
# encoder's causal attention has no dispatch op (FACTS: SDMHA's mask has no query axis), as in AMD's own SD
# pipelines, which run their text encoders on the CPU. The transformer: main 9cd8d05's code gives (151, 17) (its
# joint attentions' streams); the modulations' `1 +` an SDAdd after the layer where the bf16 bias cannot hold it
# (passes/rules/gemm.py): 8 more
OFFLOAD = {"text_encoder": (47, 43), "vae_encoder": (42, 5), "vae_decoder": (56, 6), "transformer": (159, 17)}


def test_the_offload_of_each_component(tiny_qwen_image):
    for comp, (npu, cpu) in OFFLOAD.items():
        report = json.loads((tiny_qwen_image.out / comp / "dd" / "report.json").read_text())
        summary = report["summary"]
        assert (summary["offloaded_nodes"], summary["cpu_nodes"]) == (npu, cpu), (comp, summary)
        assert summary["cpu_islands"]["avoidable"] == 0, comp
        assert report["fidelity"]["min_cosine"] > 0.999, comp


def test_the_presets_describe_qwen_image():
    """qwen-image at its public size: 60 blocks 3072 wide (24 heads of 128), rotary axes (16, 56, 56), the
    caption's 3584-wide states from Qwen2.5-VL-7B's language model (28 layers), a 16-channel VAE of 8; drawn at
    1024 px (QwenImagePipeline's 128 latent pixels), 50 steps at true_cfg_scale 4 (batch 2), 512 prompt tokens."""
    from sdnpu.convert import resolve_source

    src = resolve_source("qwen-image")
    config = src.module_config("transformer")
    assert (config["num_layers"], config["axes_dims_rope"], config["joint_attention_dim"]) == (60, [16, 56, 56], 3584)
    assert config["num_attention_heads"] * config["attention_head_dim"] == 3072
    text = src.module_config("text_encoder")["text_config"]
    assert (text["num_hidden_layers"], text["hidden_size"]) == (28, 3584)
    pipeline = src.pipeline_config()
    assert pipeline.vae_factor == 8 and pipeline.default_resolution() == 1024
    assert (src.generation().steps, src.generation().guidance, src.generation().batch) == (50, 4.0, 2)
    sig = {t.name: t.shape for t in pipeline.spec("transformer").signature(1024).inputs}
    assert sig["hidden_states"] == (2, 4096, 64) and sig["encoder_hidden_states"] == (2, 512, 3584)
    assert pipeline.spec("text_encoder").signature(1024).inputs[0].shape == (1, 34 + 512)
    assert pipeline.spec("vae_decoder").signature(1024).inputs[0].shape == (1, 16, 1, 128, 128)


def test_the_prompt_is_diffusers_encode_prompt(tiny_qwen_image, diffusers_pipe):
    """The converted text encoder's states, the template's tokens dropped and padded to the transformer's
    tokens, are diffusers' ``encode_prompt`` (one prompt: its states unpadded, no mask); a long prompt is cut at
    the transformer's tokens as ``max_sequence_length`` cuts it."""
    import torch

    ours = Pipeline(tiny_qwen_image.out, reference=True)
    with ours._using("text_encoder") as parts:
        for prompt in ("a photo of a cat", "A red bicycle leaning on a wall in the rain, at night, " * 8):
            states, mask = ours.encode(parts, prompt)
            with torch.no_grad():
                want, want_mask = diffusers_pipe.encode_prompt(prompt, max_sequence_length=ours.text_len)
            n = want.shape[1]
            assert want_mask is None  # one prompt: nothing padded, so diffusers gives no mask
            assert mask[0, :n].all() and not mask[0, n:].any() and (n < ours.text_len) == (len(prompt) < 200)
            np.testing.assert_allclose(states[:, :n], want.numpy(), rtol=0, atol=1e-5 * np.abs(want.numpy()).max())
            assert not states[:, n:].any()


def test_generate_draws_what_diffusers_draws(tiny_qwen_image, diffusers_pipe):
    """`sdnpu generate --reference` on tiny-qwen-image draws what diffusers' QwenImagePipeline draws from the
    same weights, seed and starting latents (true CFG with the negative prompt, the norm rescale, the dynamic
    shift, latents_mean/std); the dispatch models stay close."""
    ours = Pipeline(tiny_qwen_image.out, reference=True)
    assert type(ours).__name__ == "QwenImagePipeline" and ours.batches == [2]
    image = ours(OPTS)
    assert image.shape == (64, 64, 3) and image.std() > 10
    worst, share = levels(_diffusers_images(diffusers_pipe, ours)[0], image)
    assert worst <= 1 and share < 1e-3, (worst, share)  # measured: 0 levels apart
    assert psnr(Pipeline(tiny_qwen_image.out)(OPTS), image) > 40  # measured: 54.6 dB


def test_without_guidance_one_row_an_image(tiny_qwen_image, diffusers_pipe, tmp_path):
    """Guidance at most 1 runs no unconditional half: two images fill the batch-2 transformer, one row each
    from its own seed; one image needs batch 1 (`convert --batch 1 --add`, named by the refusal). Each is what
    diffusers draws at true_cfg_scale 1."""
    from sdnpu.convert import convert
    from sdnpu.errors import SdnpuError

    folder = tmp_path / "qwen"
    shutil.copytree(tiny_qwen_image.out, folder)
    opts = GenerateOptions("a red bicycle", steps=2, guidance=1.0, seed=7, num_images=2)
    ours = Pipeline(folder, reference=True)
    images = ours.generate(opts)
    wanted = _diffusers_images(diffusers_pipe, ours, opts)
    assert len(images) == 2 and not np.array_equal(images[0], images[1])
    for got, want in zip(images, wanted, strict=True):
        worst, share = levels(want, got)
        assert worst <= 1 and share < 1e-3, (worst, share)
    one = GenerateOptions("a red bicycle", steps=2, guidance=1.0, seed=7)
    with pytest.raises(SdnpuError, match="add batch 1"):
        ours(one)
    convert("tiny-qwen-image", "transformer", out=folder, res=64, batch=1, add=True)
    worst, share = levels(wanted[0], Pipeline(folder, reference=True)(one))
    assert worst <= 1 and share < 1e-3, (worst, share)


def test_guidance_in_two_calls_on_a_batch_1_transformer(tiny_qwen_image, diffusers_pipe, tmp_path):
    """A transformer converted at batch 1 alone (as the full-size one is, `bench/results.md`) draws guided images
    as QwenImagePipeline runs them: the unconditional and the conditional row in two calls a step. Two images:
    two such calls, each what diffusers draws."""
    from sdnpu.convert import convert

    folder = tmp_path / "qwen"
    shutil.copytree(tiny_qwen_image.out, folder)
    shutil.rmtree(folder / "transformer")
    convert("tiny-qwen-image", "transformer", out=folder, res=64, batch=1, compile=False)
    ours = Pipeline(folder, reference=True)
    assert ours.batches == [1]
    opts = GenerateOptions(OPTS.prompt, negative_prompt=OPTS.negative_prompt, steps=2, guidance=OPTS.guidance,
                           seed=OPTS.seed, num_images=2)
    images = ours.generate(opts)
    for got, want in zip(images, _diffusers_images(diffusers_pipe, ours, opts), strict=True):
        worst, share = levels(want, got)
        assert worst <= 1 and share < 1e-3, (worst, share)


def test_another_size_draws_what_diffusers_draws(tiny_qwen_image, diffusers_pipe, tmp_path):
    """128x96 added to a copy of the folder (`convert --res 128x96 --add`): the transformer's rotary tables are
    constants of its size, so the specializer declines and the graph is exported and compiled anew at the new
    size (and so is the VAE decoder); it draws what diffusers draws at that size (the fp32 graphs), the dispatch
    models close to it."""
    from sdnpu.convert import convert
    from sdnpu.formats.sizes import sizes_of
    from sdnpu.imagesize import Size

    folder = tmp_path / "qwen"
    shutil.copytree(tiny_qwen_image.out, folder)
    convert("tiny-qwen-image", "transformer,vae_decoder", out=folder, res="128x96", add=True)
    assert [str(v.size) for v in sizes_of(folder / "transformer")] == ["64x64", "128x96"]
    size = Size.of("128x96")
    ours = Pipeline(folder, reference=True, size=size)
    image = ours(OPTS)
    assert image.shape == (96, 128, 3)
    worst, share = levels(_diffusers_images(diffusers_pipe, ours)[0], image)
    assert worst <= 1 and share < 1e-3, (worst, share)  # measured: 0 levels (before the word tokens: 1 level on 0.0054%)
    assert psnr(Pipeline(folder, size=size)(OPTS), image) > 40  # measured: 54.8 dB


def test_qwen_image_refuses_what_it_does_not_run(tiny_qwen_image, tmp_path):
    from sdnpu.errors import SdnpuError
    from sdnpu.runtime import RuntimeOptions

    with pytest.raises(SdnpuError, match="Qwen-Image pipeline: sdnpu runs it text-to-image only"):
        Pipeline(tiny_qwen_image.out, reference=True)(GenerateOptions("a cat", image=tmp_path / "x.png"))
    with pytest.raises(SdnpuError, match="applies no LoRA to it yet"):
        Pipeline(tiny_qwen_image.out, reference=True, runtime=RuntimeOptions(loras=("x.safetensors",)))
    with pytest.raises(SdnpuError, match="takes no sigmas"):
        Pipeline(tiny_qwen_image.out, reference=True)(GenerateOptions("a cat", steps=1, scheduler="DDIMScheduler"))


def test_verify_feeds_the_transformer_qwen_image_inputs(tiny_qwen_image):
    """`sdnpu verify` on a Qwen-Image folder feeds the transformer diffusers' timesteps as it takes them (a
    thousandth) and its caption mask as a mask (every token kept), not as token ids."""
    from sdnpu.reports.fidelity import range_inputs, timestep_scale

    path = tiny_qwen_image.out / "transformer" / "model.onnx"
    config = json.loads((tiny_qwen_image.out / "transformer" / "config.json").read_text())
    feeds = range_inputs(path, 0, 999.0, timestep_scale(config))
    assert np.allclose(feeds["timestep"], 0.999)
    mask = feeds["encoder_hidden_states_mask"]
    assert mask.dtype == np.int64 and mask.shape == (2, 64) and (mask == 1).all()
