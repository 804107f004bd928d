"""Stable Diffusion 3 / 3.5 (MMDiT): the presets, the export of every component, the T5 tokenizer stand-in, and
the pipeline against diffusers' own StableDiffusion3Pipeline (PyTorch, the same weights)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from sdnpu.runtime import GenerateOptions, Pipeline

OPTS = GenerateOptions("a photo of a cat", negative_prompt="blurry", steps=3, seed=4)


def _diffusers_image(folder: Path, ours: Pipeline, drop_t5: bool = False) -> np.ndarray:
    import torch
    from diffusers import StableDiffusion3Pipeline

    extra = {"text_encoder_3": None, "tokenizer_3": None} if drop_t5 else {}
    pipe = StableDiffusion3Pipeline.from_pretrained(folder, **extra)
    h, w = ours.image_size
    out = pipe(OPTS.prompt, negative_prompt=OPTS.negative_prompt, num_inference_steps=OPTS.steps,
               guidance_scale=OPTS.guidance, height=h, width=w, latents=torch.from_numpy(ours.noise(OPTS.seed)),
               max_sequence_length=77, output_type="np").images[0]
    return (out * 255).round().astype(np.uint8)


def test_every_component_exports_and_matches_pytorch(tiny_sd3):
    out = tiny_sd3.out
    got = {c.component: c for c in tiny_sd3.components}
    assert list(got) == ["text_encoder", "text_encoder_2", "text_encoder_3", "vae_encoder", "vae_decoder",
                         "transformer"]
    for c in got.values():
        assert c.check["max_rel_error"] < 1e-5, (c.component, c.check)  # measured: at most 2.4e-6
    export = json.loads((out / "transformer" / "export.json").read_text())
    assert export["module_class"] == "SD3Transformer2DModel"
    assert [(i["name"], i["shape"]) for i in export["inputs"]] == [
        ("hidden_states", [2, 16, 32, 32]), ("timestep", [2]), ("encoder_hidden_states", [2, 154, 128]),
        ("pooled_projections", [2, 96])]
    assert json.loads((out / "vae_decoder" / "export.json").read_text())["inputs"][0]["shape"] == [1, 16, 32, 32]
    t5 = json.loads((out / "text_encoder_3" / "export.json").read_text())
    assert t5["module_class"] == "T5EncoderModel" and t5["outputs"] == ["last_hidden_state"]
    # both CLIP encoders have the projection: each keeps its pooled text_embeds and penultimate hidden states
    for name in ("text_encoder", "text_encoder_2"):
        report = json.loads((out / name / "dd" / "report.json").read_text())
        assert list(report["outputs"]) == ["text_embeds", "hidden_states.1"], name
    for name in ("tokenizer", "tokenizer_2", "tokenizer_3", "scheduler"):
        assert (out / name).is_dir()


def test_the_t5_tokenizer_stand_in_has_t5s_form(tiny_sd3):
    """The presets' tokenizer_3: T5's special ids and vocabulary size, words as whole pieces, ``</s>`` then
    padding, and it reads back what it was given."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_sd3.out / "tokenizer_3")
    assert type(tok).__name__ == "T5TokenizerFast" and len(tok) == 32_100
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    ids = tok("a photo of an astronaut riding a horse", padding="max_length", max_length=77).input_ids
    assert tok.convert_ids_to_tokens(ids[:9]) == ["▁a", "▁photo", "▁of", "▁an", "▁astronaut", "▁riding", "▁a",
                                                 "▁horse", "</s>"]
    assert ids[9:] == [0] * 68
    assert tok.decode(tok("Mars, 4k!").input_ids, skip_special_tokens=True) == "Mars, 4k!"


def test_generate_draws_what_diffusers_draws(tiny_sd3, tiny_sd3_folder):
    """`sdnpu generate --reference` on tiny-sd3 draws what diffusers' StableDiffusion3Pipeline draws from the
    same weights, seed and starting latents (77 T5 tokens both); the dispatch models stay close."""
    ours = Pipeline(tiny_sd3.out, reference=True)
    assert type(ours).__name__ == "SD3Pipeline" and ours.encoders == ("text_encoder", "text_encoder_2",
                                                                       "text_encoder_3")
    image = ours(OPTS)
    assert image.shape == (256, 256, 3) and image.std() > 10
    diff = np.abs(_diffusers_image(tiny_sd3_folder, ours).astype(int) - image.astype(int))
    # measured: 1 level at most, on 0.006% of the values (rounding)
    assert diff.max() <= 1 and np.mean(diff > 0) < 1e-3, (diff.max(), np.mean(diff > 0))
    dispatch = Pipeline(tiny_sd3.out)(OPTS)
    psnr = 10 * np.log10(255**2 / np.mean((dispatch.astype(float) - image) ** 2))
    assert psnr > 40, psnr  # measured: 45.0 dB


def test_without_t5_the_prompt_is_clips_alone(tiny_sd3, tiny_sd3_folder, tmp_path, capsys):
    """A folder converted without text_encoder_3 runs as diffusers runs without T5 (its tokens are zeros), and
    `sdnpu generate` says which encoders ran."""
    from sdnpu.cli import main

    folder = tmp_path / "no-t5"
    shutil.copytree(tiny_sd3.out, folder, ignore=shutil.ignore_patterns("text_encoder_3", "tokenizer_3"))
    ours = Pipeline(folder, reference=True)
    assert ours.encoders == ("text_encoder", "text_encoder_2")
    image = ours(OPTS)
    diff = np.abs(_diffusers_image(tiny_sd3_folder, ours, drop_t5=True).astype(int) - image.astype(int))
    assert diff.max() <= 1 and np.mean(diff > 0) < 1e-3, (diff.max(), np.mean(diff > 0))
    png = tmp_path / "x.png"
    assert main(["generate", "--models", str(folder), "--prompt", "a cat", "--steps", "1", "--out", str(png),
                 "--reference"]) == 0
    out = capsys.readouterr().out
    assert "text encoders text_encoder, text_encoder_2 (no text_encoder_3 converted" in out and png.is_file()


def test_a_local_sd3_folder_converts_like_the_preset(tiny_sd3, tiny_sd3_folder, tmp_path):
    """A diffusers folder (save_pretrained) converts as the preset does: the same graphs' outputs."""
    from sdnpu.convert import convert
    from sdnpu.convert.compile import run_onnx
    from sdnpu.reports.fidelity import generic_inputs

    result = convert(tiny_sd3_folder, "text_encoder_3,transformer", out=tmp_path / "local", compile=False)
    assert [c.component for c in result.components] == ["text_encoder_3", "transformer"]
    for comp in ("text_encoder_3", "transformer"):
        feeds = generic_inputs(tiny_sd3.out / comp / "model.onnx", seed=1)
        a = run_onnx(tiny_sd3.out / comp / "model.onnx", feeds)
        b = run_onnx(result.out / comp / "model.onnx", feeds)
        assert all(np.allclose(a[k], b[k], rtol=0, atol=1e-5 * np.abs(a[k]).max()) for k in a), comp


def test_sd3_refuses_what_it_does_not_run(tiny_sd3, tmp_path):
    from sdnpu.convert import convert
    from sdnpu.errors import SdnpuError
    from sdnpu.runtime import RuntimeOptions

    with pytest.raises(SdnpuError, match="SD3 pipeline: sdnpu runs it text-to-image only"):
        Pipeline(tiny_sd3.out, reference=True)(GenerateOptions("a cat", image=tmp_path / "x.png"))
    with pytest.raises(SdnpuError, match="SD3 pipeline: sdnpu applies LoRAs to SDXL, SD 1.x and Flux.1 folders only"):
        Pipeline(tiny_sd3.out, reference=True, runtime=RuntimeOptions(loras=("x.safetensors",)))(
            GenerateOptions("a cat"))
    from sdnpu.lora import overlay
    from sdnpu.lora.adapters import LoraSpec

    with pytest.raises(SdnpuError, match="SD3 pipeline: sdnpu applies LoRAs to SDXL, SD 1.x and Flux.1 folders only"):
        overlay.apply(tiny_sd3.out, [LoraSpec.parse("x.safetensors")])
    with pytest.raises(SdnpuError, match="SD3 pipeline: sdnpu fuses LoRAs into UNets"):
        convert("tiny-sd3", "transformer", out=tmp_path / "o", loras=("x.safetensors",))
    assert not (tmp_path / "o").exists()


def test_the_transformer_is_offloaded_but_for_its_boundary(tiny_sd3):
    """On diffusers' own SD3 graph (tiny, 2 blocks, dual attention in the first): every attention is SDMHA (the
    joint ones split by query part), every norm and projection a dispatch op, every MAC on the NPU; what stays
    on the CPU is the graph's edge: the inputs' casts and `hidden_states`' Transpose, the timestep sinusoid in
    fp32, and the unpatchify (a Transpose between Reshapes) with the output's cast."""
    report = json.loads((tiny_sd3.out / "transformer" / "dd" / "report.json").read_text())
    summary = report["summary"]
    assert summary["macs_offloaded_share"] == 1.0 and summary["npu_regions"] == 1
    ops = report["offloaded_by_type"]
    # block 0: joint attention (image and text queries) and the image's own (dual) attention; block 1 keeps
    # the image tokens only (context_pre_only): one query part
    assert ops["SDMHA"] + ops.get("SDFlatMHA", 0) == 4 and ops["SDRMSNorm"] == 9 and ops["SDConv"] == 1
    cpu = sorted(n["op_type"] for n in report["cpu_nodes"])
    # the unpatchify's Einsum is the Transpose it is (canonical.movement.lower_einsum)
    assert cpu == sorted(["CastAvx"] * 5 + ["Transpose", "Mul", "Add", "Sin"] + ["Reshape"] * 3 + ["Transpose"]), cpu
    # measured: 90.37% on main 9f04e2d (122 dispatch ops, 13 CPU nodes; the AdaLayerNorms' `1 +` folded into their SDGemm
    # biases); more since the `1 +` is an SDAdd after the layer where the bf16 bias cannot hold it (passes/rules/gemm.py)
    assert summary["offload_rate"] > 0.90
    assert set(report["assumed_capabilities"]) == {"SDRMSNorm: registry", "SDGelu: tanh GELU"}


def test_t5s_feed_forward_is_on_the_npu_and_its_attention_says_why_not(tiny_sd3):
    """T5's gated tanh-GELU (transformers' gelu_new, written out as Pow/Tanh/Mul/Add) becomes SDGelu beside
    the gate's SDMul; its attention adds a relative-position bias per head and query, which SDMHA's one-row
    mask cannot carry, so the attention stays on the CPU, one node, and the report says that (not a causal-mask
    miss)."""
    report = json.loads((tiny_sd3.out / "text_encoder_3" / "dd" / "report.json").read_text())
    layers = json.loads((tiny_sd3.out / "text_encoder_3" / "config.json").read_text())["num_layers"]
    ops = report["offloaded_by_type"]
    assert ops["SDGelu"] == layers and ops["SDRMSNorm"] == 2 * layers + 1 and ops["SDGemm"] == 7 * layers
    cpu = report["cpu_nodes"]
    assert not {"Pow", "Tanh"} & {n["op_type"] for n in cpu}
    # each attention is one onnxruntime MultiHeadAttention on the CPU (its bias its attention_bias)
    mha = [n for n in cpu if n["op_type"] == "MultiHeadAttention" and "relative-position bias" in n["reason"]]
    assert len(mha) == layers and not {"MatMul", "Softmax"} & {n["op_type"] for n in cpu}, cpu
    assert report["summary"]["macs_offloaded_share"] > 0.9  # the attention's two products stay on the CPU


def test_sd3_takes_more_sizes(tiny_sd3, tmp_path, caplog):
    """`--res ... --add` for the transformer: its position-embedding crop is cut for its size, so the second
    size is compiled in full (said once in the log) rather than re-derived from the first's dispatch model,
    and the pipeline runs at it."""
    import logging

    from sdnpu.convert import convert
    from sdnpu.imagesize import Size

    folder = tmp_path / "tiny-sd3"
    shutil.copytree(tiny_sd3.out, folder)
    with caplog.at_level(logging.WARNING):
        result = convert("tiny-sd3", "transformer,vae_decoder", out=folder, res="320x256", add=True)
    assert [(c.component, c.size) for c in result.components] == [("vae_decoder", "320x256"),
                                                                   ("transformer", "320x256")]
    assert "were cut for the primary's size (SD3's position-embedding crop)" in caplog.text
    report = json.loads((folder / "transformer" / "dd" / "report.320x256.json").read_text())
    assert report["fidelity"]["min_cosine"] > 0.9999 and report["summary"]["cpu_nodes"] == 13
    image = Pipeline(folder, reference=True, size=Size(256, 320))(GenerateOptions("a cat", steps=2))
    assert image.shape == (256, 320, 3)


def test_a_module_too_large_for_the_machine_is_refused_before_any_export(tmp_path, monkeypatch):
    """A module whose fp32 weights do not fit the machine's memory, and that has no block-by-block conversion,
    is refused in one line naming the size and the way around it, before anything is exported or written
    (T5, larger here, would convert block by block: tests/test_blockwise.py)."""
    from sdnpu.convert import budget, driver
    from sdnpu.errors import SdnpuError

    monkeypatch.setattr(budget, "available_bytes", lambda: 8_000_000)  # 8 MB: tiny-sd3's CLIP-G has 12.95 MB
    out = tmp_path / "out"
    with pytest.raises(SdnpuError, match=r"text_encoder_2 cannot be converted here: the text_encoder_2 module's "
                                         r"fp32 weights alone are 12\.95 MB and this machine has 8\.00 MB") as e:
        driver.convert("tiny-sd3", "text_encoder_3,text_encoder_2,transformer", out=out)
    assert "--model text_encoder_3,transformer" in e.value.hint
    assert not any(out.rglob("*.onnx"))
