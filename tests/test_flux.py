"""Flux.1 (dev and schnell): the presets, the export of every component (CLIP-L's pooled output, T5 as
``text_encoder_2``, the packed-latent transformer with its ids and guidance), the transformer's offload, and the
pipeline against diffusers' own ``FluxPipeline`` (PyTorch, the same weights)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sdnpu.runtime import GenerateOptions, Pipeline

OPTS = GenerateOptions("a photo of a cat", steps=3, guidance=3.5, seed=4)


def _diffusers_images(folder: Path, ours: Pipeline, opts: GenerateOptions = OPTS) -> list[np.ndarray]:
    import torch
    from diffusers import FluxPipeline

    from sdnpu.runtime.flux import pack

    pipe = FluxPipeline.from_pretrained(folder)
    h, w = ours.image_size
    images = []
    for k in range(opts.num_images):
        latents = torch.from_numpy(pack(ours.noise(opts.seed + k)))
        out = pipe(opts.prompt, num_inference_steps=opts.steps, guidance_scale=opts.guidance, height=h, width=w,
                   latents=latents, max_sequence_length=ours.text_len, output_type="np").images[0]
        images.append((out * 255).round().astype(np.uint8))
    return images


def _close(a: np.ndarray, b: np.ndarray) -> tuple[int, float]:
    diff = np.abs(a.astype(int) - b.astype(int))
    return int(diff.max()), float(np.mean(diff > 0))


def test_every_component_exports_and_matches_pytorch(tiny_flux):
    out = tiny_flux.out
    got = {c.component: c for c in tiny_flux.components}
    assert list(got) == ["text_encoder", "text_encoder_2", "vae_encoder", "vae_decoder", "transformer"]
    for c in got.values():
        assert c.check["max_rel_error"] < 1e-5, (c.component, c.check)  # measured: at most 2.3e-6
    export = json.loads((out / "transformer" / "export.json").read_text())
    assert export["module_class"] == "FluxTransformer2DModel"
    # 256 px: 32 x 32 latents packed 2 x 2 into 256 tokens of 64; 32 T5 tokens (the preset's generation.json)
    assert [(i["name"], i["shape"]) for i in export["inputs"]] == [
        ("hidden_states", [1, 256, 64]), ("timestep", [1]), ("encoder_hidden_states", [1, 32, 128]),
        ("pooled_projections", [1, 32]), ("img_ids", [256, 3]), ("txt_ids", [32, 3]), ("guidance", [1])]
    t5 = json.loads((out / "text_encoder_2" / "export.json").read_text())
    assert t5["module_class"] == "T5EncoderModel" and t5["outputs"] == ["last_hidden_state"]
    assert t5["inputs"][0]["shape"] == [1, 32]
    # Flux reads CLIP-L's pooled output alone: the dispatch model keeps that one
    report = json.loads((out / "text_encoder" / "dd" / "report.json").read_text())
    assert list(report["outputs"]) == ["pooler_output"]
    for name in ("tokenizer", "tokenizer_2", "scheduler"):
        assert (out / name).is_dir()
    assert json.loads((out / "generation.json").read_text())["embedded_guidance"] is True


def test_the_presets_describe_flux_dev_and_schnell():
    """flux-dev and flux-schnell at their public size: 19 double- and 38 single-stream blocks, 3072 wide, RoPE
    axes (16, 56, 56); dev embeds the guidance and takes 512 T5 tokens, schnell neither and 256; both run at
    batch 1 (no classifier-free guidance)."""
    from sdnpu.convert import resolve_source

    for name, guided, tokens in (("flux-dev", True, 512), ("flux-schnell", False, 256)):
        src = resolve_source(name)
        config = src.module_config("transformer")
        assert (config["num_layers"], config["num_single_layers"], config["axes_dims_rope"]) == (19, 38, [16, 56, 56])
        assert config["num_attention_heads"] * config["attention_head_dim"] == 3072
        assert config["guidance_embeds"] is guided and src.generation().batch == 1
        spec = src.pipeline_config().spec("transformer")
        sig = {t.name: t.shape for t in spec.signature(1024, 1).inputs}
        assert sig["hidden_states"] == (1, 4096, 64) and sig["encoder_hidden_states"] == (1, tokens, 4096)
        assert ("guidance" in sig) is guided
        assert src.pipeline_config().spec("text_encoder_2").signature(1024).inputs[0].shape == (1, tokens)


def test_generate_draws_what_diffusers_draws(tiny_flux, tiny_flux_folder):
    """`sdnpu generate --reference` on tiny-flux draws what diffusers' FluxPipeline draws from the same weights,
    seed and starting latents (the same T5 tokens, guidance embedded, the dynamic shift); the dispatch models
    stay close."""
    ours = Pipeline(tiny_flux.out, reference=True)
    assert type(ours).__name__ == "FluxPipeline" and ours.batches == [1]
    image = ours(OPTS)
    assert image.shape == (256, 256, 3) and image.std() > 10
    worst, share = _close(_diffusers_images(tiny_flux_folder, ours)[0], image)
    assert worst <= 1 and share < 1e-3, (worst, share)
    dispatch = Pipeline(tiny_flux.out)(OPTS)
    psnr = 10 * np.log10(255**2 / np.mean((dispatch.astype(float) - image) ** 2))
    assert psnr > 40, psnr


def test_several_images_each_its_own_seed(tiny_flux, tiny_flux_folder):
    """`--num-images 2` on the batch-1 transformer: two calls, image k from seed + k, each what diffusers draws
    from its latents."""
    opts = GenerateOptions("a red bicycle", steps=2, guidance=2.0, seed=7, num_images=2)
    ours = Pipeline(tiny_flux.out, reference=True)
    images = ours.generate(opts)
    assert len(images) == 2 and not np.array_equal(images[0], images[1])
    for got, want in zip(images, _diffusers_images(tiny_flux_folder, ours, opts), strict=True):
        worst, share = _close(want, got)
        assert worst <= 1 and share < 1e-3, (worst, share)


def test_a_local_flux_folder_converts_like_the_preset(tiny_flux, tiny_flux_folder, tmp_path):
    """A FluxPipeline folder (save_pretrained) converts as the preset does: the same graphs' outputs."""
    from sdnpu.convert import convert
    from sdnpu.convert.compile import run_onnx
    from sdnpu.reports.fidelity import generic_inputs

    result = convert(tiny_flux_folder, "text_encoder_2,transformer", out=tmp_path / "local", compile=False)
    assert [c.component for c in result.components] == ["text_encoder_2", "transformer"]
    for comp in ("text_encoder_2", "transformer"):
        feeds = generic_inputs(tiny_flux.out / comp / "model.onnx", seed=1)
        a = run_onnx(tiny_flux.out / comp / "model.onnx", feeds)
        b = run_onnx(result.out / comp / "model.onnx", feeds)
        assert all(np.allclose(a[k], b[k], rtol=0, atol=1e-5 * np.abs(a[k]).max()) for k in a), comp


def test_the_transformer_is_offloaded_but_for_its_tables(tiny_flux):
    """Every attention, norm, projection and modulation of diffusers' own Flux graph is a dispatch op and every
    MAC is on the NPU, in one region; what stays on the CPU is the graph's edge: the inputs' casts, the timestep's
    and the guidance's sinusoids in fp32, and the rotary tables computed from the ids (a Gather of the ids'
    Concat, its Cos and Sin, and the tables' Splits)."""
    report = json.loads((tiny_flux.out / "transformer" / "dd" / "report.json").read_text())
    summary = report["summary"]
    assert summary["macs_offloaded_share"] == 1.0 and summary["npu_regions"] == 1
    assert summary["cpu_islands"]["avoidable"] == 0
    assert report["offloaded_by_type"]["SDMHA"] + report["offloaded_by_type"].get("SDFlatMHA", 0) == 5
    cpu = sorted(n["op_type"] for n in report["cpu_nodes"])
    assert cpu == sorted(["CastAvx"] * 8 + ["Mul", "Add", "Sin"] * 2 + ["Concat", "Gather", "Mul", "Cos", "Sin"]
                         + ["Split"] * 2), cpu
    assert report["fidelity"]["min_cosine"] > 0.9999  # measured: 0.999982


def test_flux_refuses_what_it_does_not_run(tiny_flux, tmp_path):
    from sdnpu.errors import SdnpuError
    from sdnpu.runtime import RuntimeOptions

    with pytest.raises(SdnpuError, match="Flux.1 pipeline: sdnpu runs it text-to-image only"):
        Pipeline(tiny_flux.out, reference=True)(GenerateOptions("a cat", image=tmp_path / "x.png"))
    with pytest.raises(SdnpuError, match="Flux.1 pipeline: sdnpu applies LoRAs"):
        Pipeline(tiny_flux.out, reference=True, runtime=RuntimeOptions(loras=("x.safetensors",)))(
            GenerateOptions("a cat"))
    with pytest.raises(SdnpuError, match="takes no sigmas"):
        Pipeline(tiny_flux.out, reference=True)(GenerateOptions("a cat", steps=1, scheduler="DDIMScheduler"))
