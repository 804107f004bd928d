"""Qwen-Image's transformer converted block by block (``sdnpu.convert.blockwise.qwenimage``): what the full-size
model (20.4 B parameters, 81.7 GB of fp32 weights) needs on this machine. At tiny size: the pieces chained in
PyTorch are the whole module, and the stitched graphs compute and compile to what the whole conversion's do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from sdnpu.convert.sources import PRESETS_DIR
from tests.conftest import once

RES = 64  # 32 x 32 latents: 256 image tokens; the preset's 64 prompt tokens


def _chain(src, config: dict | None = None, monkeypatch=None):
    """The preset's pieces chained in PyTorch on the transformer's seeded inputs, and the whole module (from
    ``whole_module``: the same weights) on them; ``config``: the transformer's config in place of the preset's."""
    from sdnpu.convert.blockwise import driver, qwenimage
    from sdnpu.convert.blockwise.piece import link_values
    from sdnpu.convert.wrappers import build_wrapper

    if config is not None:
        monkeypatch.setattr(qwenimage, "_config", lambda _src, _key: config)
    spec = src.pipeline_config().spec("transformer")
    sig = spec.signature(RES, 2)
    feeds = spec.sample_inputs(RES, batch=2)
    latent = (RES // spec.vae_factor, RES // spec.vae_factor)
    values, n = dict(feeds), 0
    with torch.no_grad():
        for piece in driver.pieces(src, "transformer", sig, latent=latent):
            got = piece.module(*(torch.from_numpy(values[k]) for k in piece.inputs))
            values = link_values(values, piece.outputs, [o.numpy() for o in (got if isinstance(got, tuple) else (got,))])
            n += 1
        module = qwenimage.QwenImageTransformer2DModel.from_config(config) if config else None
        whole = driver.whole_module(src, "transformer") if module is None else qwenimage.whole_module(
            src, "transformer", driver.Weights(src, "transformer"))
        ref = build_wrapper("transformer", whole, spec.config, latent=latent)(
            *(torch.from_numpy(feeds[s.name]) for s in sig.inputs))[0].numpy()
    return values["out_sample"], ref, n, feeds


@pytest.mark.parametrize("layers", [2, 3], ids=["preset", "three-blocks"])
def test_the_pieces_chained_in_pytorch_are_the_whole_module(layers, monkeypatch):
    """The embeddings with block 0, each block (the three-block config has a middle piece), the last block with
    the output layers: chained, they compute what QwenImageTransformer2DModel computes with the same weights
    (the same ops in the same order: equal to float32's last bit in practice, held to 1e-6 of the range), and
    the caption's padding matters (a mask of all ones gives another output)."""
    from sdnpu.convert import resolve_source

    src = resolve_source("tiny-qwen-image")
    config = json.loads((PRESETS_DIR / "tiny-qwen-image" / "transformer" / "config.json").read_text())
    config["num_layers"] = layers
    got, ref, n, feeds = _chain(src, config, monkeypatch)
    assert n == layers and got.shape == ref.shape == feeds["hidden_states"].shape[:2] + (16,)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6 * np.abs(ref).max())
    assert 0 < feeds["encoder_hidden_states_mask"].sum() < feeds["encoder_hidden_states_mask"].size


def test_the_edit_and_layered_models_are_declined_with_their_option(monkeypatch):
    from sdnpu.convert import resolve_source
    from sdnpu.errors import SdnpuError

    src = resolve_source("tiny-qwen-image")
    config = json.loads((PRESETS_DIR / "tiny-qwen-image" / "transformer" / "config.json").read_text())
    for key in ("zero_cond_t", "use_layer3d_rope"):
        with pytest.raises(SdnpuError, match=key):
            _chain(src, {**config, key: True}, monkeypatch)
    with pytest.raises(SdnpuError, match="of 1 block converts whole"):
        _chain(src, {**config, "num_layers": 1}, monkeypatch)


def _folder(root: Path) -> Path:
    """tiny-qwen-image as a local folder whose transformer holds the pieces' seeded weights (save_pretrained:
    safetensors, read tensor by tensor block by block); the other modules as the preset has them."""
    from sdnpu.convert import resolve_source
    from sdnpu.convert.blockwise import whole_module

    folder = root / "my-qwen-image"
    shutil.copytree(PRESETS_DIR / "tiny-qwen-image", folder)
    whole_module(resolve_source("tiny-qwen-image"), "transformer").save_pretrained(folder / "transformer")
    return folder


@pytest.fixture(scope="module")
def qwen_conversions(tmp_path_factory):
    """The folder's transformer converted block by block and whole (the same weights)."""
    from sdnpu.convert import convert

    folder = once(tmp_path_factory, "qwen-folder", _folder)
    blocks = once(tmp_path_factory, "qwen-blocks",
                  lambda out: convert(folder, "transformer", out=out, res=RES, blockwise=True))
    whole = once(tmp_path_factory, "qwen-whole", lambda out: convert(folder, "transformer", out=out, res=RES))
    return blocks, whole


def test_the_transformer_converts_block_by_block_as_it_converts_whole(qwen_conversions):
    """Stitched from its two pieces, the fp32 graph computes what the whole graph computes (the rotary tables
    constants in both), the dispatch model what the whole dispatch model does, with the same CPU nodes, NPU
    regions and MACs; the one op more is the SiLU of the timestep embedding that the second piece computes again
    (the whole graph computes it once for every block: a piece reads temb through its seam's view). Every weight
    replays from the stitched graph's constants, named as the whole module names them."""
    import onnx
    import onnx_ir as ir

    from sdnpu.convert.compile import run_onnx
    from sdnpu.formats import weights as provenance

    blocks, whole = qwen_conversions
    out, ref_dir = blocks.out / "transformer", whole.out / "transformer"
    export = json.loads((out / "export.json").read_text())
    assert export["blockwise"] and export["check"]["max_rel_error"] < 1e-5  # measured 5.4e-06 (the first piece)
    feeds = blocks.source.pipeline_config().spec("transformer").sample_inputs(RES, seed=2, batch=2)
    a, b = (run_onnx(d / "model.onnx", feeds)["out_sample"] for d in (ref_dir, out))
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * np.abs(a).max())
    da, db = (run_onnx(d / "dd" / "replaced.onnx", feeds)["out_sample"] for d in (ref_dir, out))
    cos = float(db.ravel() @ a.ravel() / np.linalg.norm(db) / np.linalg.norm(a))
    assert cos > 0.9999 and np.abs(db - da).max() < 0.05 * np.abs(da).max(), cos  # measured 0.99998
    for graph in (out / "model.onnx", out / "dd" / "replaced.onnx"):
        onnx.checker.check_model(str(graph), full_check=True)
    report, ref = (json.loads((d / "dd" / "report.json").read_text()) for d in (out, ref_dir))
    for key in ("cpu_nodes", "npu_regions", "transitions", "cpu_islands", "macs_total"):
        assert report["summary"][key] == ref["summary"][key], key
    assert report["summary"]["macs_offloaded_share"] == 1.0
    assert sorted(n["op_type"] for n in report["cpu_nodes"]) == sorted(n["op_type"] for n in ref["cpu_nodes"])
    pieces = report["blockwise"]["pieces"]
    assert pieces == 2
    want = dict(ref["offloaded_by_type"], SDSilu=ref["offloaded_by_type"]["SDSilu"] + pieces - 1)
    assert report["offloaded_by_type"] == want
    record = provenance.read_record(out / "dd" / provenance.FILE)
    counts, problems = provenance.check_replay(record["weights"], ir.load(out / "dd" / "replaced.onnx").graph,
                                               provenance.constant_reader(ir.load(out / "model.onnx")))
    assert not problems and counts["replayed"] > 0, problems[:5]
    params = {e["param"] for e in json.loads((out / "parameters.json").read_text())["initializers"].values()
              if e.get("param")}
    assert {"img_in.weight", "transformer_blocks.1.attn.to_q.weight", "proj_out.bias"} <= params
