"""Flux.1 (dev and schnell): the presets, the export of every component (CLIP-L's pooled output, T5 as
``text_encoder_2``, the packed-latent transformer with its ids and guidance), the transformer's offload, and the
pipeline against diffusers' own ``FluxPipeline`` (PyTorch, the same weights)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sdnpu.runtime import GenerateOptions, Pipeline
from tests.conftest import once
from tests.images import psnr
from tests.test_lora import _adapted, _initializers  # the dispatch weights, with a folder's overlay

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


def test_the_transformer_is_offloaded_but_for_its_tables(tiny_flux):
    """Every attention, norm, projection and modulation of diffusers' own Flux graph is a dispatch op and every
    MAC is on the NPU, in one region; what stays on the CPU is the graph's edge: the inputs' casts, the timestep's
    and the guidance's sinusoids in fp32. The rotary tables computed from the ids (a Gather of the ids' Concat,
    its Cos and Sin, their casts and the tables' Splits) are the prologue, computed once a generation."""
    report = json.loads((tiny_flux.out / "transformer" / "dd" / "report.json").read_text())
    summary = report["summary"]
    assert summary["macs_offloaded_share"] == 1.0 and summary["npu_regions"] == 1
    assert summary["cpu_islands"]["avoidable"] == 0
    assert report["offloaded_by_type"]["SDMHA"] + report["offloaded_by_type"].get("SDFlatMHA", 0) == 5
    cpu = sorted(n["op_type"] for n in report["cpu_nodes"])
    assert cpu == sorted(["CastAvx"] * 6 + ["Mul", "Add", "Sin"] * 2), cpu
    tables = sorted(n["op_type"] for n in report["prologue"]["cpu_nodes"])
    assert tables == sorted(["Concat", "Gather", "Mul", "Cos", "Sin"] + ["CastAvx", "Split"] * 2), tables
    assert report["prologue"]["inputs"] == ["img_ids", "txt_ids"]
    assert report["fidelity"]["min_cosine"] > 0.9999  # measured: 0.999982


def test_another_size_draws_what_diffusers_draws(tiny_flux, tiny_flux_folder, tmp_path, caplog):
    """320x256 added to a copy of the folder (`convert --res 320x256 --add`): the transformer's second dispatch
    model compiled in full with its own prologue (its rotary tables are cut at the text length, a constant of
    the first size's prologue, so the specializer declines with that reason); it draws what diffusers draws at
    that size (the fp32 graphs), the dispatch models close to it."""
    import logging

    import shutil

    from sdnpu.convert import convert
    from sdnpu.formats.sizes import sizes_of
    from sdnpu.imagesize import Size

    folder = tmp_path / "flux"
    shutil.copytree(tiny_flux.out, folder)
    with caplog.at_level(logging.WARNING):
        convert("tiny-flux", "transformer,vae_decoder", out=folder, res="320x256", add=True)
    assert "its prologue does not run at this size" in caplog.text and "a bug" not in caplog.text
    variants = sizes_of(folder / "transformer")
    assert [str(v.size) for v in variants] == ["256x256", "320x256"]
    dd = folder / "transformer" / "dd"
    assert sorted(p.name for p in dd.glob("prologue*.onnx")) == ["prologue.320x256.onnx", "prologue.onnx"]
    size = Size.of("320x256")
    ours = Pipeline(folder, reference=True, size=size)
    image = ours(OPTS)
    assert image.shape == (256, 320, 3)
    worst, share = _close(_diffusers_images(tiny_flux_folder, ours)[0], image)
    assert worst <= 1 and share < 1e-3, (worst, share)
    assert psnr(Pipeline(folder, size=size)(OPTS), image) > 40


def test_flux_refuses_what_it_does_not_run(tiny_flux, tmp_path):
    from sdnpu.errors import SdnpuError
    from sdnpu.runtime import RuntimeOptions

    with pytest.raises(SdnpuError, match="Flux.1 pipeline: sdnpu runs it text-to-image only"):
        Pipeline(tiny_flux.out, reference=True)(GenerateOptions("a cat", image=tmp_path / "x.png"))
    with pytest.raises(SdnpuError, match="LoRA file x.safetensors not found"):
        Pipeline(tiny_flux.out, reference=True, runtime=RuntimeOptions(loras=("x.safetensors",)))(
            GenerateOptions("a cat"))
    with pytest.raises(SdnpuError, match="takes no sigmas"):
        Pipeline(tiny_flux.out, reference=True)(GenerateOptions("a cat", steps=1, scheduler="DDIMScheduler"))


@pytest.fixture(scope="module")
def flux_loras(tmp_path_factory, tiny_flux) -> dict[str, Path]:
    """Seeded rank-4 LoRAs of tiny-flux's transformer (both streams' attention and feed-forward projections,
    the single blocks', the modulations) and CLIP-L: one in diffusers naming, one in kohya's (Flux's original
    block names, q, k and v one fused projection)."""
    from sdnpu.lora.seeded import write_seeded_lora

    def make(d: Path) -> dict[str, Path]:
        files = {"diffusers": d / "a.safetensors", "kohya": d / "a-kohya.safetensors"}
        assert write_seeded_lora(tiny_flux.out, files["diffusers"], rank=4) == {"text_encoder": 12,
                                                                               "transformer": 26}
        # below Flux's own widths diffusers cannot split a single block's linear1: those 8 modules are left out
        assert write_seeded_lora(tiny_flux.out, files["kohya"], rank=4, naming="kohya") == {"text_encoder": 12,
                                                                                           "transformer": 18}
        return files

    return once(tmp_path_factory, "flux-loras", make)


def test_a_lora_overlay_is_what_diffusers_fuse_lora_converts_to(tiny_flux, flux_loras, tmp_path):
    """`sdnpu lora apply` on the converted folder (a LoRA in each naming, stacked) gives every weight of the
    transformer's and CLIP-L's dispatch models byte for byte as converting them after diffusers' fuse_lora
    (`sdnpu convert --lora`) does; T5 takes no LoRA (as in diffusers), and the graphs and offload are
    unchanged."""
    import shutil

    from sdnpu.convert import convert
    from sdnpu.lora import LoraSpec, overlay

    folder = tmp_path / "flux"
    shutil.copytree(tiny_flux.out, folder)
    specs = (f"{flux_loras['diffusers']}:0.7", f"{flux_loras['kohya']}:0.4")
    fused = convert("tiny-flux", "text_encoder,transformer", out=tmp_path / "fused", loras=specs).out
    results = overlay.apply(folder, [LoraSpec.parse(s) for s in specs])
    assert {r.component for r in results} == {"text_encoder", "transformer"}
    for comp in ("text_encoder", "transformer"):
        adapted, want = _adapted(folder / comp), _initializers(fused / comp / "dd" / "replaced.onnx")
        assert adapted.keys() == want.keys()
        differ = [n for n in want if adapted[n] != want[n]]
        assert not differ, f"{comp}: {len(differ)} weights differ from the fused conversion, e.g. {differ[:3]}"
        report = json.loads((folder / comp / "dd" / "report.json").read_text())
        assert report["summary"] == json.loads((fused / comp / "dd" / "report.json").read_text())["summary"]
    assert [x["format"] for x in overlay.status(folder)["transformer"]["loras"]] == ["diffusers", "kohya"]
    assert overlay.remove(folder) == ["text_encoder", "transformer"]


def test_the_merged_weights_are_diffusers_pipeline_fuse_lora(tiny_flux_folder, flux_loras):
    """Both LoRAs through diffusers' own FluxPipeline API (load_lora_weights, set_adapters with weights,
    fuse_lora of both components, unload_lora_weights) give every changed weight of the transformer and CLIP-L
    bit for bit as
    sdnpu's merge over a weightless skeleton and its convert-time fusion (``fuse_into``)."""
    import torch
    from diffusers import FluxPipeline

    from sdnpu.lora import LoraSpec
    from sdnpu.lora.adapters import Adapters, fuse_into, read_lora

    pipe = FluxPipeline.from_pretrained(tiny_flux_folder)
    comps = ("text_encoder", "transformer")
    base = {c: {n: p.detach().clone() for n, p in getattr(pipe, c).named_parameters()} for c in comps}
    specs = [LoraSpec(flux_loras["diffusers"], 0.5), LoraSpec(flux_loras["kohya"], 1.25)]
    for i, spec in enumerate(specs):
        pipe.load_lora_weights(str(spec.path.parent), weight_name=spec.path.name, adapter_name=f"l{i}")
    pipe.set_adapters(["l0", "l1"], adapter_weights=[s.scale for s in specs])
    # FluxPipeline.fuse_lora fuses the transformer alone unless told; a LoRA's CLIP-L part is in force when the
    # pipeline runs it unfused, so sdnpu applies both parts: fused here as such
    pipe.fuse_lora(components=["transformer", "text_encoder"], adapter_names=["l0", "l1"])
    pipe.unload_lora_weights()
    files = [read_lora(s, "flux", None) for s in specs]
    for comp in comps:
        fused = dict(getattr(pipe, comp).named_parameters())
        adapters = Adapters(tiny_flux_folder, comp, files, "flux")
        for module in adapters.modules:
            w = f"{module}.weight"
            assert torch.equal(adapters.merged(module, base[comp][w]), fused[w].detach()), f"{comp}.{module}"
        own = getattr(FluxPipeline.from_pretrained(tiny_flux_folder), comp)
        fuse_into(own, comp, files, "flux")
        for name, p in own.named_parameters():
            assert torch.equal(p.detach(), fused[name].detach()), f"{comp}.{name}"
        changed = [n for n in base[comp] if not torch.equal(base[comp][n], fused[n].detach())]
        assert len(changed) == len(adapters.modules) > 0


def test_generate_with_a_lora_draws_what_the_overlay_draws(tiny_flux, flux_loras, tmp_path):
    """`generate --lora` (the weights computed at session open) draws what the folder with the same LoRA
    applied (`sdnpu lora apply`) draws, bit for bit, and not what the base weights draw."""
    import shutil

    from sdnpu.lora import LoraSpec, overlay
    from sdnpu.runtime import RuntimeOptions

    opts = GenerateOptions("a cat", steps=2, seed=1)
    folder = tmp_path / "flux"
    shutil.copytree(tiny_flux.out, folder)
    spec = LoraSpec(flux_loras["diffusers"], 0.8)
    at_open = Pipeline(folder, runtime=RuntimeOptions(loras=(spec,)))(opts)
    overlay.apply(folder, [spec])
    assert np.array_equal(Pipeline(folder)(opts), at_open)
    overlay.remove(folder)
    assert not np.array_equal(Pipeline(folder)(opts), at_open)


@pytest.mark.parametrize("naming, message", [
    ("diffusers", "changes text_encoder_2, unet, which a FluxPipeline has not"),
    ("kohya", "diffusers cannot read the LoRA"),  # SDXL's block names are no Flux block
])
def test_an_sdxl_lora_on_flux_gets_one_line_and_changes_nothing(naming, message, tiny_flux, tmp_path, capsys):
    import hashlib
    import shutil

    from sdnpu.cli import main
    from sdnpu.lora.seeded import write_seeded_lora

    folder = tmp_path / "flux"
    shutil.copytree(tiny_flux.out, folder)
    lora = tmp_path / "sdxl.safetensors"
    write_seeded_lora(Path(__file__).resolve().parents[1] / "convert" / "presets" / "tiny-sdxl", lora, rank=2,
                      naming=naming)

    def digest() -> dict[str, str]:
        return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}

    before = digest()
    capsys.readouterr()
    assert main(["lora", "apply", str(folder), "--lora", str(lora)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) <= 2 and len(err) < 600, err  # the error and its hint
    assert digest() == before


@pytest.fixture(scope="module")
def blockwise_flux(tiny_flux_blockwise, tiny_flux):
    """tiny-flux's transformer from its local folder converted block by block (``tiny_flux_blockwise``), beside
    the preset converted whole (``tiny_flux``): the same weights."""
    return tiny_flux_blockwise, tiny_flux


def test_the_transformer_converts_block_by_block_as_it_converts_whole(blockwise_flux):
    """A local FluxPipeline folder (save_pretrained), its transformer read tensor by tensor and converted piece by
    piece (the embeddings and the first block, each block, the last block and the output layers),
    stitched: the fp32 graph computes what the module computes, the dispatch model what the whole graph's
    does, with the same CPU nodes and one NPU region (the shared timestep embedding and rotary tables written
    once; the casts and the repeated casts and Splits of them between the pieces gone), and every weight replays
    from the stitched graph's constants."""
    import onnx
    import onnx_ir as ir

    from sdnpu.convert.compile import run_onnx
    from sdnpu.formats import weights as provenance
    from sdnpu.reports.fidelity import generic_inputs

    blocks, whole = blockwise_flux
    out, ref_dir = blocks.out / "transformer", whole.out / "transformer"
    export = json.loads((out / "export.json").read_text())
    # each piece's fp32 graph against PyTorch on its inputs: the output layers within 1e-5 as the whole graph's
    # export; the worst piece is the first, whose temb is fp32 sinusoids of timestep x 1000 (measured 2.1e-05)
    assert export["blockwise"] and export["check"]["outputs"]["out_sample"]["max_rel"] < 1e-5
    assert export["check"]["max_rel_error"] <= export["check"]["rel_tolerance"]
    feeds = {**generic_inputs(ref_dir / "model.onnx", seed=2),
             **blocks.source.pipeline_config().spec("transformer").sample_inputs(256, seed=2, batch=1)}
    a, b = (run_onnx(d / "model.onnx", feeds)["out_sample"] for d in (ref_dir, out))
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * np.abs(a).max())
    da, db = (run_onnx(d / "dd" / "replaced.onnx", feeds)["out_sample"] for d in (ref_dir, out))
    cos = float(db.ravel() @ a.ravel() / np.linalg.norm(db) / np.linalg.norm(a))
    assert cos > 0.9999 and np.abs(db - da).max() < 0.05 * np.abs(da).max(), cos
    for graph in (out / "model.onnx", out / "dd" / "replaced.onnx"):
        onnx.checker.check_model(str(graph), full_check=True)
    report, ref = (json.loads((d / "dd" / "report.json").read_text())["summary"] for d in (out, ref_dir))
    assert (report["cpu_nodes"], report["npu_regions"], report["cpu_islands"]) == (
        ref["cpu_nodes"], ref["npu_regions"], ref["cpu_islands"])
    assert report["macs_offloaded_share"] == 1.0
    # the rotary tables are the stitched model's prologue, as the whole graph's: the same CPU work
    tables = [sorted(n["op_type"] for n in json.loads((d / "dd" / "report.json").read_text())["prologue"]["cpu_nodes"])
              for d in (out, ref_dir)]
    assert tables[0] == tables[1] and len(tables[0]) == 9, tables
    record = provenance.read_record(out / "dd" / provenance.FILE)
    counts, problems = provenance.check_replay(record["weights"], ir.load(out / "dd" / "replaced.onnx").graph,
                                               provenance.constant_reader(ir.load(out / "model.onnx")))
    assert not problems and counts["replayed"] > 0, problems[:5]


def test_a_lora_reaches_the_stitched_transformer(blockwise_flux, flux_loras, tmp_path):
    """The stitched graph's constants are named by the whole module's parameters, so a LoRA applied to the
    block-by-block conversion changes what it changes in the whole one: the adapted dispatch models agree.
    `convert --lora` refuses a transformer it converts block by block, naming `lora apply`."""
    import shutil

    from sdnpu.convert import convert
    from sdnpu.convert.compile import run_onnx
    from sdnpu.errors import SdnpuError
    from sdnpu.lora import LoraSpec, overlay
    from sdnpu.runtime import RuntimeOptions
    from sdnpu.runtime.session import open_component

    blocks, whole = blockwise_flux
    spec = LoraSpec(flux_loras["diffusers"], 1.0)
    outs = []
    for result in (blocks, whole):
        folder = tmp_path / result.out.name
        shutil.copytree(result.out, folder)
        if not (folder / "model_index.json").is_file():
            (folder / "model_index.json").write_text((result.source.root / "model_index.json").read_text())
        applied = overlay.apply(folder, [spec])
        assert ("transformer", 26) in [(r.component, r.modules) for r in applied]
        feeds = result.source.pipeline_config().spec("transformer").sample_inputs(256, seed=3, batch=1)
        adapted = open_component(folder, "transformer", False, RuntimeOptions())  # reads the overlay in place
        assert adapted.lora
        outs.append(adapted.run(feeds, ["out_sample"])["out_sample"])
        base = run_onnx(folder / "transformer" / "dd" / "replaced.onnx", feeds)["out_sample"]
        assert np.abs(outs[-1] - base).max() > 0.01 * np.abs(base).max()  # the LoRA changes the output
    cos = float(outs[0].ravel() @ outs[1].ravel() / np.linalg.norm(outs[0]) / np.linalg.norm(outs[1]))
    assert cos > 0.9999, cos
    with pytest.raises(SdnpuError, match="converts block by block, where sdnpu does not fuse LoRAs"):
        convert(blocks.source.root, "transformer", out=tmp_path / "x", blockwise=True, loras=(str(spec),))
    assert not (tmp_path / "x").exists()


def test_a_flux_folder_without_generation_json_gets_flux_pipelines_defaults(tiny_flux_folder, tmp_path):
    """A FluxPipeline folder as diffusers saves it has no generation.json: it is drawn as FluxPipeline draws by
    default (28 steps, guidance 3.5 embedded, 512 T5 tokens, the transformer at batch 1), and the converted folder
    says so in its own generation.json, which every reader of it (generate, serve, verify) takes."""
    import shutil

    from sdnpu.convert import resolve_source
    from sdnpu.formats import generation

    folder = tmp_path / "plain"
    shutil.copytree(tiny_flux_folder, folder, ignore=shutil.ignore_patterns("generation.json"))
    src = resolve_source(folder)
    assert src.generation() == generation.Generation(28, 3.5, embedded_guidance=True) and src.generation().batch == 1
    assert src.pipeline_config().spec("transformer").signature(256, 1).inputs[2].shape == (1, 512, 128)
    out = tmp_path / "out"
    out.mkdir()
    assert "generation.json" in src.write_pipeline_files(out)
    assert generation.read(out) == src.generation()


def test_verify_feeds_the_transformer_flux_inputs(tiny_flux):
    """`sdnpu verify` on a Flux folder feeds the transformer diffusers' timesteps 999, 500, 1 as it takes them
    (a thousandth), its position ids a grid, its guidance FluxPipeline's (its pipeline comparison is
    `generate`'s, tested above)."""
    from sdnpu.reports.fidelity import range_inputs
    from sdnpu.runtime.verify import _component

    feeds = range_inputs(tiny_flux.out / "transformer" / "model.onnx", 0, 999.0, 1e-3)
    assert np.allclose(feeds["timestep"], 0.999) and np.all(feeds["guidance"] == 3.5)
    assert np.array_equal(feeds["img_ids"][:, 1:], np.stack(np.divmod(np.arange(256), 16), axis=1))
    assert not feeds["txt_ids"].any()
    result = _component(tiny_flux.out, "transformer", ((0, 999.0),))
    assert result["optimistic"]["min_cosine"] > 0.9999 and "timestep 999" in result["optimistic"]["inputs"]
