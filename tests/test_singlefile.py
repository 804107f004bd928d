"""Single-file checkpoints (``sdnpu.convert.singlefile``): the tiny presets written in their original layouts
(``tests/original_layout.py``) read back bit for bit and convert to the preset's graphs byte for byte; the
full-size layouts (shapes alone, on the meta device) find their presets; Flux.1's reader is diffusers' at
FLUX.1's width; and every file sdnpu cannot read is one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from sdnpu.convert import convert, parse_components, resolve_source
from sdnpu.convert.sources import match_preset
from sdnpu.errors import SdnpuError
from tests.original_layout import FILES, original, shapes, single_file

# (preset, layout): every layout the tests write
CASES = [("tiny-sdxl", "sdxl"), ("tiny-sd15", "sd1"), ("tiny-sd21", "sd2"), ("tiny-sd3", "sd3"),
         ("tiny-flux", "flux"), ("tiny-flux", "flux-comfy")]
# what a conversion writes that names its source or its times: the rest is compared byte for byte
RECORDS = {"export.json", "dd/report.json", "dd/onnx_report.txt"}


@pytest.mark.parametrize(("preset", "layout"), CASES, ids=[c[1] for c in CASES])
def test_each_module_reads_back_bit_for_bit(preset, layout, tmp_path):
    path = single_file(preset, layout, tmp_path / f"my-{layout}.safetensors")
    src = resolve_source(path)
    assert (src.kind, src.name, src.root, src.single.preset.name) == ("single-file", f"my-{layout}", path, preset)
    assert list(src.modules) == list(FILES[layout])
    ref = resolve_source(preset)
    for key in src.modules:
        ours, theirs = src.load_module(key).state_dict(), ref.load_module(key).state_dict()
        assert ours.keys() == theirs.keys(), key
        if layout == "sd3" and key == "text_encoder":  # SD3's CLIP-L is read unprojected, as diffusers reads it
            assert torch.equal(ours.pop("text_projection.weight"), torch.eye(32))
            theirs.pop("text_projection.weight")
        assert all(ours[k].dtype == torch.float32 and torch.equal(ours[k], theirs[k]) for k in theirs), key


# (preset, layout, modules): full-size layouts, as the models' releases hold them
FULL = [("sdxl-base", "sdxl", None), ("sdxl-inpaint", "sdxl", ["unet"]), ("sd15", "sd1", None),
        ("sd-turbo", "sd2", None), ("sd35-medium", "sd3", None), ("flux-dev", "flux", None),
        ("flux-schnell", "flux", None)]


@pytest.mark.parametrize(("preset", "layout", "modules"), FULL, ids=[f[0] for f in FULL])
def test_a_full_size_file_finds_its_preset_by_its_shapes(preset, layout, modules):
    held = shapes(preset, layout, modules)  # the meta device: no weights drawn
    found, prefixes, match = match_preset(held, f"{preset}.safetensors")
    assert (found.family, match.name, list(prefixes)) == (match.family, preset, modules or list(FILES[layout]))


def test_what_real_files_hold_beside_the_modules_is_ignored():
    """The tensors a release holds that no module reads: SD 2.x's last OpenCLIP layer (its pipeline reads the
    penultimate) and projection, CLIP's saved position ids, the DDPM schedule and the EMA copy."""
    held = shapes("sd-turbo", "sd2")
    layer = "cond_stage_model.model.transformer.resblocks"
    held.update({k.replace(".resblocks.22.", ".resblocks.23."): v for k, v in held.items() if ".resblocks.22." in k})
    held.update({"cond_stage_model.model.text_projection": (1024, 1024), "cond_stage_model.model.logit_scale": (),
                 "alphas_cumprod": (1000,), "model_ema.decay": (), "model_ema.num_updates": ()})
    assert f"{layer}.23.attn.in_proj_weight" in held
    assert match_preset(held, "v2-1_512-ema-pruned.safetensors")[2].name == "sd-turbo"
    held = shapes("sdxl-base", "sdxl")
    held["conditioner.embedders.0.transformer.text_model.embeddings.position_ids"] = (1, 77)
    assert match_preset(held, "sd_xl_base_1.0.safetensors")[2].name == "sdxl-base"


def test_flux_reader_is_diffusers_at_flux1s_width():
    """diffusers' converter splits a single-stream block's fused projection at FLUX.1's width (3072) whatever the
    file's; sdnpu's reads it from the config. At FLUX.1's width the two agree on every row of every tensor
    (each row a number of its own: the converters only split, join and swap along the rows)."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    from sdnpu.convert import singlefile

    held = {k: v for k, v in shapes("flux-dev", "flux").items()
            if not k.startswith(("double_blocks.", "single_blocks.")) or k.split(".")[1] in ("0", "1")}
    probe, start = {}, 0
    for k, shape in held.items():
        rows = shape[0]
        probe[k] = torch.arange(start, start + rows, dtype=torch.float64)[:, None]
        start += rows
    config = json.loads((resolve_source("flux-dev").modules["transformer"] / "config.json").read_text())
    ours = singlefile.CONVERTERS["bfl"](dict(probe), "", config, None)
    theirs = convert_flux_transformer_checkpoint_to_diffusers(dict(probe))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert {k.split(".")[0] for k in ours} >= {"transformer_blocks", "single_transformer_blocks", "norm_out"}


def test_an_fp16_file_of_the_unet_alone(tmp_path):
    """Most shared files are fp16, and some hold the UNet alone: it is read to fp32, the pipeline the preset's."""
    from safetensors.torch import save_file

    state = {k: v.half() for k, v in original("tiny-sdxl", "sdxl", ["unet"]).items()}
    save_file(state, str(tmp_path / "unet-only.safetensors"))
    src = resolve_source(tmp_path / "unet-only.safetensors")
    assert src.components == ["unet"] and src.family == "sdxl"
    ours = src.load_module("unet").state_dict()
    theirs = resolve_source("tiny-sdxl").load_module("unet").state_dict()
    assert all(ours[k].dtype == torch.float32 and torch.equal(ours[k], theirs[k].half().float()) for k in theirs)
    with pytest.raises(SdnpuError, match=r"unet-only.safetensors holds no vae .*the file holds unet") as e:
        parse_components("vae_decoder", src)
    assert "diffusers folder" in e.value.hint


def _misfit(tmp_path: Path, name: str, change) -> Path:
    from safetensors.torch import save_file

    state = original("tiny-sdxl", "sdxl")
    change(state)
    save_file(state, str(tmp_path / name))
    return tmp_path / name


def test_bad_files_are_one_line(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "model.ckpt").write_bytes(b"\x80\x04not read")
    with pytest.raises(SdnpuError, match="model.ckpt is a pickle checkpoint: .* loading a pickle runs code") as e:
        resolve_source(tmp_path / "model.ckpt")
    assert "weights_only=True" in e.value.hint and "safetensors" in e.value.hint
    (tmp_path / "cut.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(SdnpuError, match="cut.safetensors is not a readable safetensors file"):
        resolve_source(tmp_path / "cut.safetensors")
    save_file({"lm_head.weight": torch.zeros(2), "cond_stage_model.model.ln_final.weight": torch.zeros(2),
               "first_stage_model.decoder.conv_in.weight": torch.zeros(2)}, str(tmp_path / "llm.safetensors"))
    with pytest.raises(SdnpuError, match=r"llm.safetensors holds no model sdnpu reads: cond_stage_model.model. "
                       r"\(1 tensor\), first_stage_model. \(1 tensor\), lm_head. \(1 tensor\)") as e:
        resolve_source(tmp_path / "llm.safetensors")
    assert "SDXL, SD 1.x/2.x, SD3/3.5 and Flux.1" in e.value.hint


def test_a_file_whose_shapes_match_no_preset(tmp_path):
    def widen(state):
        w = state["model.diffusion_model.input_blocks.0.0.weight"]
        state["model.diffusion_model.input_blocks.0.0.weight"] = torch.cat([w, w[:, :1]], dim=1)

    with pytest.raises(SdnpuError, match=r"wide.safetensors is an SDXL checkpoint whose shapes match no SDXL preset "
                       r"\(closest, tiny-sdxl: its unet conv_in.weight is \[32, 5, 3, 3\] in the file and "
                       r"\[32, 4, 3, 3\] in the config\)") as e:
        resolve_source(_misfit(tmp_path, "wide.safetensors", widen))
    assert "sdxl-base" in e.value.hint and "diffusers folder" in e.value.hint
    with pytest.raises(SdnpuError, match=r"short.safetensors is an SDXL checkpoint whose shapes match no SDXL preset "
                       r"\(closest, tiny-sdxl: its vae lacks 1 of its tensors \(encoder.conv_out.bias\)\)"):
        resolve_source(_misfit(tmp_path, "short.safetensors",
                               lambda s: s.pop("first_stage_model.encoder.conv_out.bias")))


def test_cli_refuses_a_pickle_in_one_line(tmp_path, capsys):
    from sdnpu.cli import main

    (tmp_path / "model.ckpt").write_bytes(b"\x80\x04")
    assert main(["convert", "--source", str(tmp_path / "model.ckpt"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "pickle checkpoint" in err and "hint:" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


# -- conversions: the single file against the preset's, byte for byte ----------------------------------------

def _same_graphs(ours: Path, theirs: Path, components: list[str], pipeline: bool = True,
                 skip: frozenset[str] = frozenset()) -> None:
    """Every file of each component folder but its records (``RECORDS``) byte for byte the same: the fp32
    graph, the dispatch model, their data files, weights.json, parameters.json, config.json, sizes.json; and
    (``pipeline``) the pipeline's files (model_index.json, scheduler, tokenizers)."""
    for comp in components:
        a = {p.relative_to(theirs / comp).as_posix(): p for p in (theirs / comp).rglob("*") if p.is_file()}
        b = {p.relative_to(ours / comp).as_posix(): p for p in (ours / comp).rglob("*") if p.is_file()}
        assert a.keys() == b.keys(), comp
        assert {"model.onnx", "dd/replaced.onnx"} <= a.keys()
        for name in sorted(a.keys() - RECORDS - skip):
            assert a[name].read_bytes() == b[name].read_bytes(), f"{comp}/{name}"
        info = json.loads((ours / comp / "export.json").read_text())
        assert info["source"]["kind"] == "single-file"
    files = [p.name for p in theirs.iterdir() if pipeline and not (p / "model.onnx").exists()]
    assert files or not pipeline
    for name in files:
        if (theirs / name).is_file():
            assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
        else:
            assert {p.name: p.read_bytes() for p in (ours / name).iterdir()} == \
                {p.name: p.read_bytes() for p in (theirs / name).iterdir()}, name


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """One conversion per layout, of the tiny preset's modules written as one file: layout -> its folder."""
    made: dict[str, Path] = {}

    def make(preset: str, layout: str) -> Path:
        if layout not in made:
            root = tmp_path_factory.mktemp(f"single-{layout}")
            path = single_file(preset, layout, root / f"my-{layout}.safetensors")
            made[layout] = convert(path, "all", out=root / "out").out
        return made[layout]
    return make


def test_sdxl_file_converts_as_the_preset(converted, tiny_conversion):
    _same_graphs(converted("tiny-sdxl", "sdxl"), tiny_conversion.out,
                 ["text_encoder", "text_encoder_2", "vae_encoder", "vae_decoder", "unet"])


def test_sd15_file_converts_as_the_preset(converted, tiny_sd15_conversion):
    _same_graphs(converted("tiny-sd15", "sd1"), tiny_sd15_conversion.out,
                 ["text_encoder", "vae_encoder", "vae_decoder", "unet"])


def test_sd3_file_converts_as_the_preset(converted, tiny_sd3, tiny_sd3_folder, tmp_path):
    """Every component as the preset's but CLIP-L, which the file holds unprojected: as a folder whose CLIP-L
    projection is the identity converts it."""
    from safetensors.torch import load_file, save_file

    ours = converted("tiny-sd3", "sd3")
    _same_graphs(ours, tiny_sd3.out, ["text_encoder_2", "text_encoder_3", "vae_encoder", "vae_decoder",
                                      "transformer"])
    folder = tmp_path / "my-sd3"
    shutil.copytree(tiny_sd3_folder, folder)
    weights = folder / "text_encoder" / "model.safetensors"
    state = load_file(str(weights))
    state["text_projection.weight"] = torch.eye(32)
    save_file(state, str(weights), metadata={"format": "pt"})
    unprojected = convert(folder, "text_encoder", out=tmp_path / "out").out
    # the folder's config.json is transformers' save_pretrained's (its own fields), the graphs are the point
    _same_graphs(ours, unprojected, ["text_encoder"], pipeline=False, skip=frozenset({"config.json"}))


def test_flux_file_converts_as_the_preset(converted, tiny_flux):
    """ComfyUI's whole checkpoint (the transformer under model.diffusion_model., the VAE under vae., CLIP-L and
    T5 under text_encoders.)."""
    _same_graphs(converted("tiny-flux", "flux-comfy"), tiny_flux.out,
                 ["text_encoder", "text_encoder_2", "vae_encoder", "vae_decoder", "transformer"])


def test_a_transformer_alone_says_what_it_lacks(tmp_path, caplog):
    """Black Forest Labs' release holds the transformer alone: that is what converts, and the log says so; the
    pipeline's files are the preset's."""
    path = single_file("tiny-flux", "flux", tmp_path / "flux1-dev.safetensors")
    with caplog.at_level("INFO", logger="sdnpu.convert.sources"):
        src = resolve_source(path)
    preset = resolve_source("tiny-flux")
    assert src.components == ["transformer"] and src.generation() == preset.generation()
    # the pipeline it joins is the preset's: its resolution from the preset's VAE, which the file lacks
    assert src.pipeline_config().default_resolution() == preset.pipeline_config().default_resolution() == 256
    assert "a Flux.1 checkpoint holding transformer; its configs, tokenizers and scheduler are preset " \
        "tiny-flux's; it holds no vae, text_encoder, text_encoder_2" in caplog.text
    assert parse_components("all", src) == ["transformer"]


# -- block by block: what flux-dev's 47.6 GB of fp32 weights and T5-XXL need here -----------------------------

@pytest.mark.parametrize(("preset", "layout", "key", "folder"), [
    ("tiny-flux", "flux-comfy", "transformer", "tiny_flux_folder"),
    ("tiny-sd3", "sd3", "text_encoder_3", "tiny_sd3_folder")], ids=["flux", "t5"])
def test_pieces_read_from_a_file_as_from_the_folder(preset, layout, key, folder, tmp_path, request):
    """Each piece's tensors (a block, or the embeddings and output layers) read a group at a time from the file
    are the folder's, bit for bit."""
    from sdnpu.convert.blockwise.piece import Weights

    ours = Weights(resolve_source(single_file(preset, layout, tmp_path / "my.safetensors")), key)
    theirs = Weights(resolve_source(request.getfixturevalue(folder)), key)
    assert ours.where.keys() >= {n for n in theirs.where if n != "encoder.embed_tokens.weight"}
    if key == "transformer":
        prefixes = ["x_embedder.", "time_text_embed.", "context_embedder.", "norm_out.", "proj_out.",
                    "transformer_blocks.0.", "single_transformer_blocks.0.", "single_transformer_blocks.1."]
    else:
        prefixes = ["encoder.block.0.", "encoder.block.1.", "encoder.final_layer_norm.", "shared."]
    for prefix in prefixes:
        a, b = ours.tensors(prefix), theirs.tensors(prefix)
        assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b), prefix
    if key == "text_encoder_3":
        assert torch.equal(ours.tensor("shared.weight"), theirs.tensor("shared.weight"))


def test_a_flux_file_converts_block_by_block_as_its_folder(tiny_flux_blockwise, tmp_path):
    """BFL's transformer-only file, block by block: byte for byte the graphs the folder's block-by-block
    conversion writes (the folder's config.json is diffusers' save_pretrained's)."""
    path = single_file("tiny-flux", "flux", tmp_path / "flux1-dev.safetensors")
    out = convert(path, "transformer", out=tmp_path / "out", blockwise=True).out
    assert json.loads((out / "transformer" / "export.json").read_text())["blockwise"]
    _same_graphs(out, tiny_flux_blockwise.out, ["transformer"], pipeline=False, skip=frozenset({"config.json"}))


def test_a_large_module_of_a_file_exports_in_a_worker(tiny_conversion, tmp_path, monkeypatch):
    """Above 1 GiB a module's torch side runs in a worker process, which resolves the file again: the same
    graph, byte for byte."""
    from sdnpu.convert import budget

    monkeypatch.setattr(budget, "ISOLATE_BYTES", 0)
    path = single_file("tiny-sdxl", "sdxl", tmp_path / "my-sdxl.safetensors", ["unet", "vae"])
    result = convert(path, "vae_decoder", out=tmp_path / "out", compile=False, check=False)
    ours = (result.out / "vae_decoder" / "model.onnx").read_bytes()
    assert ours == (tiny_conversion.out / "vae_decoder" / "model.onnx").read_bytes()
