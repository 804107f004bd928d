"""Resolving SOURCE and MODEL: presets, folders, and the errors for everything else."""

import json

import pytest

from sdnpu.convert import COMPONENTS, parse_components, preset_names, resolve_source
from sdnpu.errors import SdnpuError


FIVE = ["text_encoder", "text_encoder_2", "vae_encoder", "vae_decoder", "unet"]


def test_presets_provide_all_five_components():
    assert {"sdxl-base", "tiny-sdxl", "controlnet-sdxl", "tiny-controlnet-sd15"} <= set(preset_names())
    for name in ("sdxl-base", "tiny-sdxl"):
        src = resolve_source(name)
        assert src.kind == "preset" and src.components == FIVE
    assert COMPONENTS == ("text_encoder", "text_encoder_2", "text_encoder_3", "vae_encoder", "vae_decoder", "unet",
                          "unet_controlnet", "controlnet", "transformer")
    for name in ("tiny-sd3", "sd35-medium"):  # SD3: three text encoders, the MMDiT, the 16-channel VAE
        src = resolve_source(name)
        assert src.components == ["text_encoder", "text_encoder_2", "text_encoder_3", "vae_encoder", "vae_decoder",
                                  "transformer"]
    assert resolve_source("controlnet-sdxl").components == ["controlnet"]


def test_fingerprint_depends_on_config(tmp_path):
    assert resolve_source("tiny-sdxl").fingerprint() == resolve_source("tiny-sdxl").fingerprint()
    assert resolve_source("tiny-sdxl").fingerprint() != resolve_source("sdxl-base").fingerprint()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "nope", "neither a preset nor an existing folder"),
        (lambda p: (p / "f.onnx").write_bytes(b"x") and p / "f.onnx", "is a file, not a diffusers folder"),
        (lambda p: p, "not a diffusers folder: it has neither model_index.json nor config.json"),
    ],
)
def test_bad_sources_say_what_is_expected(tmp_path, make, message):
    with pytest.raises(SdnpuError, match=message) as err:
        resolve_source(make(tmp_path))
    assert err.value.hint  # every one of these says how to fix it


def test_pipeline_listing_a_missing_module(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"unet": ["diffusers", "UNet2DConditionModel"]}))
    with pytest.raises(SdnpuError, match=r"lists 'unet' .*/config.json is missing"):
        resolve_source(tmp_path)


def test_pipeline_without_a_component(tmp_path):
    (tmp_path / "unet").mkdir()
    (tmp_path / "unet" / "config.json").write_text("{}")
    (tmp_path / "model_index.json").write_text(json.dumps({"unet": ["diffusers", "UNet2DConditionModel"]}))
    src = resolve_source(tmp_path)
    assert src.components == ["unet"]
    with pytest.raises(SdnpuError, match="has no 'vae' module, needed for component 'vae_decoder'"):
        parse_components("vae_decoder", src)


def test_unsupported_module_class(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "UNet3DConditionModel"}))
    with pytest.raises(SdnpuError, match="UNet3DConditionModel module, which sdnpu cannot export"):
        resolve_source(tmp_path)


def test_corrupt_json_is_named(tmp_path):
    (tmp_path / "model_index.json").write_text("{not json")
    with pytest.raises(SdnpuError, match="model_index.json"):
        resolve_source(tmp_path)


def test_component_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    src = resolve_source(tmp_path)
    assert src.kind == "component" and src.components == ["vae_encoder", "vae_decoder"]
    with pytest.raises(SdnpuError, match="no weights in"):
        src.load_module("vae")


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("all", FIVE), ("unet", ["unet"]), ("vae_decoder, unet", ["vae_decoder", "unet"]),
     (["text_encoder_2", "text_encoder"], ["text_encoder", "text_encoder_2"])],
)
def test_parse_components(spec, expected):
    assert parse_components(spec, resolve_source("tiny-sdxl")) == expected


def test_unknown_component_lists_the_valid_ones():
    with pytest.raises(SdnpuError, match="unknown component 'unte'") as err:
        parse_components("unte", resolve_source("tiny-sdxl"))
    assert all(c in err.value.hint for c in COMPONENTS) and "all" in err.value.hint


def test_preset_with_an_unknown_block_type(tmp_path, monkeypatch):
    import shutil

    from sdnpu.convert import sources

    shutil.copytree(sources.PRESETS_DIR / "tiny-sdxl", tmp_path / "broken")
    cfg = tmp_path / "broken" / "unet" / "config.json"
    cfg.write_text(cfg.read_text().replace('"CrossAttnDownBlock2D"', '"WarpDownBlock2D"'))
    monkeypatch.setattr(sources, "PRESETS_DIR", tmp_path)
    with pytest.raises(SdnpuError, match="cannot build UNet2DConditionModel .*WarpDownBlock2D"):
        resolve_source("broken").load_module("unet")
