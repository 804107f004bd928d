import json

import pytest

from sdnpu.convert.sources import PRESETS_DIR
from sdnpu.errors import SdnpuError
from sdnpu.signatures import sample_inputs, signature, vae_scale_factor
from sdnpu.specs import default_resolution, resolution_step


def _config(preset: str, module: str) -> dict:
    return json.loads((PRESETS_DIR / preset / module / "config.json").read_text())


def _shapes(sig):
    return {s.name: s.shape for s in sig.inputs}


def test_sdxl_base_signatures_at_1024():
    vae = _config("sdxl-base", "vae")
    f = vae_scale_factor(vae)
    assert f == 8
    unet = signature("unet", _config("sdxl-base", "unet"), 1024, f)
    assert _shapes(unet) == {
        "sample": (2, 4, 128, 128),
        "timestep": (),
        "encoder_hidden_states": (2, 77, 2048),
        "text_embeds": (2, 1280),
        "time_ids": (2, 6),
    }
    assert unet.outputs == ("out_sample",)
    assert _shapes(signature("vae_decoder", vae, 1024, f)) == {"latent_sample": (1, 4, 128, 128)}
    assert _shapes(signature("vae_encoder", vae, 1024, f)) == {"sample": (1, 3, 1024, 1024)}
    te = signature("text_encoder", _config("sdxl-base", "text_encoder"), 1024, f)
    assert te.outputs[:2] == ("last_hidden_state", "pooler_output") and len(te.outputs) == 2 + 13
    te2 = signature("text_encoder_2", _config("sdxl-base", "text_encoder_2"), 1024, f)
    assert te2.outputs[:2] == ("text_embeds", "last_hidden_state") and te2.outputs[-1] == "hidden_states.32"
    assert resolution_step("unet", _config("sdxl-base", "unet"), f) == 32


def test_sd15_style_unet_has_three_inputs():
    config = _config("sdxl-base", "unet") | {"addition_embed_type": None, "cross_attention_dim": 768}
    assert list(_shapes(signature("unet", config, 512))) == ["sample", "timestep", "encoder_hidden_states"]


def test_unsupported_added_conditioning_is_refused():
    config = _config("sdxl-base", "unet") | {"addition_embed_type": "image"}
    with pytest.raises(SdnpuError, match="addition_embed_type='image'"):
        signature("unet", config, 1024)


def test_sample_inputs_are_seeded_and_realistic():
    config = _config("tiny-sdxl", "unet")
    sig = signature("unet", config, 256)
    a, b = sample_inputs(sig, config, 256), sample_inputs(sig, config, 256)
    assert all((a[k] == b[k]).all() for k in a)
    assert a["time_ids"].tolist() == [[256, 256, 0, 0, 256, 256]] * 2
    te = _config("tiny-sdxl", "text_encoder")
    ids = sample_inputs(signature("text_encoder", te, 256), te, 256)["input_ids"]
    assert ids[0, 0] == 49406 and ids[0, -1] == 49407 and ids.dtype.name == "int64"


def test_compile_binds_dynamic_axes_by_the_same_resolution_rule(tmp_path):
    """``sdnpu compile`` on an optimum-style folder (dynamic axes, config.json beside each graph) binds the
    shapes convert would write, latents included, for a VAE that downsamples by 2 rather than 8."""
    import onnx
    from onnx import TensorProto, helper

    from sdnpu.convert.compile import static_shapes

    unet = _config("tiny-sdxl", "unet")
    vae = dict(_config("tiny-sdxl", "vae"), block_out_channels=[32, 64])
    assert vae_scale_factor(vae) == 2 and default_resolution(unet, vae) == unet["sample_size"] * 2
    for name, config in (("unet", unet), ("vae_decoder", vae)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    inputs = [helper.make_tensor_value_info(spec.name, TensorProto.FLOAT, [f"d{i}" for i in range(len(spec.shape))])
              for spec in signature("unet", unet, 64, 2).inputs]
    graph = helper.make_graph([helper.make_node("Identity", ["sample"], ["out_sample"])], "g", inputs,
                              [helper.make_tensor_value_info("out_sample", TensorProto.FLOAT, None)])
    onnx.save(helper.make_model(graph), tmp_path / "unet" / "model.onnx")
    for res, side in ((None, unet["sample_size"]), (256, 128)):
        shapes = static_shapes(tmp_path / "unet" / "model.onnx", res=res)
        assert shapes["sample"] == [2, unet["in_channels"], side, side]
        assert shapes == {s.name: list(s.shape) for s in signature("unet", unet, side * 2, 2).inputs if s.shape}
