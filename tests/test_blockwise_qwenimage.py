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
            outs = [o.numpy() for o in (got if isinstance(got, tuple) else (got,))]
            values = link_values(values, piece.outputs, outs)
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
    regions and MACs; the one op more is the SiLU of the timestep embedding, which the whole graph computes once
    for every block and the pieces after the first compute again (once for all of them: they read temb through
    their seam's view, and the stitch keeps their repeats once; measured so at 3 and 4 blocks too). Every weight
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
    assert report["blockwise"]["pieces"] == 2
    want = dict(ref["offloaded_by_type"], SDSilu=ref["offloaded_by_type"]["SDSilu"] + 1)
    assert report["offloaded_by_type"] == want
    record = provenance.read_record(out / "dd" / provenance.FILE)
    counts, problems = provenance.check_replay(record["weights"], ir.load(out / "dd" / "replaced.onnx").graph,
                                               provenance.constant_reader(ir.load(out / "model.onnx")))
    assert not problems and counts["replayed"] > 0, problems[:5]
    params = {e["param"] for e in json.loads((out / "parameters.json").read_text())["initializers"].values()
              if e.get("param")}
    assert {"img_in.weight", "transformer_blocks.1.attn.to_q.weight", "proj_out.bias"} <= params


@pytest.fixture(scope="module")
def dispatch_only(tmp_path_factory, qwen_conversions):
    """The folder's transformer converted block by block with --dispatch-only, beside the run that keeps the
    fp32 graph."""
    from sdnpu.convert import ConvertOptions, convert

    blocks, _ = qwen_conversions
    options = ConvertOptions(res=RES, blockwise=True, dispatch_only=True)
    return once(tmp_path_factory, "qwen-dispatch-only",
                lambda out: convert(blocks.source.root, "transformer", out=out, options=options)), blocks


def _walk(*expr):
    for e in expr:
        if isinstance(e, dict):
            if "init" in e:
                yield e["init"]
            yield from _walk(*e.values())
        elif isinstance(e, list):
            yield from _walk(*e)


def test_dispatch_only_keeps_the_same_dispatch_model_and_no_fp32_graph(dispatch_only):
    """--dispatch-only writes the dispatch model the run that keeps the fp32 graph writes, byte for byte (its
    checks measured the same way: the pieces' fp32 graphs against PyTorch before they went), and no model.onnx;
    export.json and both reports say so; parameters.json maps the same parameters, and the dispatch model's
    weight records name their constants."""
    from sdnpu.formats import reference
    from sdnpu.formats import weights as provenance

    small, full = dispatch_only
    out, ref = small.out / "transformer", full.out / "transformer"
    assert not any(out.glob("model.onnx*")) and (ref / "model.onnx").is_file()
    for f in ("dd/replaced.onnx", "dd/replaced.onnx.data"):
        assert (out / f).read_bytes() == (ref / f).read_bytes(), f
    export, export_full = (json.loads((d / "export.json").read_text()) for d in (out, ref))
    assert export[reference.KEY] is True and reference.KEY not in export_full and reference.dispatch_only(out)
    assert export["check"]["max_rel_error"] == export_full["check"]["max_rel_error"]
    report = json.loads((out / "dd" / "report.json").read_text())
    assert report["blockwise"] == {"pieces": 2, reference.KEY: True}
    assert report["summary"]["weight_bytes_before"] is None and report["fidelity"]["min_cosine"] > 0.9999
    assert "none kept (--dispatch-only)" in (out / "dd" / "onnx_report.txt").read_text()
    names = set(_walk(provenance.read_record(out / "dd" / provenance.FILE)["weights"]))
    mapped = [json.loads((d / "parameters.json").read_text())["initializers"] for d in (out, ref)]
    params = [{e["param"] for e in m.values() if e.get("param")} for m in mapped]
    # the same, and those whose constant the fp32 stitch keeps once under an earlier piece's name (equal norm
    # weights: the RMS norms' ones) besides
    assert params[1] <= params[0] and "transformer_blocks.1.img_mlp.net.2.weight" in params[1]
    by_param = {n for n, e in mapped[0].items() if e.get("param")}
    assert len(names & by_param) > len(params[0]) // 2  # the dispatch weights name the parameters' constants


def test_what_needs_the_fp32_graph_refuses_a_dispatch_only_folder_in_one_line(dispatch_only, tmp_path):
    """generate --reference (the runtime's component_path), convert --add and a LoRA's replay each fail with one
    line naming --dispatch-only; the dispatch model opens as ever. A folder whose fp32 graph is merely missing
    keeps the old error."""
    from sdnpu.convert import ConvertOptions, convert
    from sdnpu.errors import SdnpuError
    from sdnpu.lora import overlay
    from sdnpu.runtime.session import component_path

    small, full = dispatch_only
    assert component_path(small.out, "transformer") == small.out / "transformer" / "dd" / "replaced.onnx"
    with pytest.raises(SdnpuError, match="converted with --dispatch-only: it has no fp32 graph") as e:
        component_path(small.out, "transformer", reference=True)
    assert "\n" not in e.value.message and "without --dispatch-only" in (e.value.hint or "")
    with pytest.raises(SdnpuError, match="--dispatch-only.*derive the added sizes"):
        convert(small.source.root, "transformer", out=small.out, options=ConvertOptions(res=96, add=True))
    with pytest.raises(SdnpuError, match="--dispatch-only.*a LoRA's changes"):
        overlay._sources(small.out / "transformer")
    copy = tmp_path / "copy"
    shutil.copytree(full.out / "transformer", copy / "transformer")
    (copy / "transformer" / "model.onnx").unlink()
    with pytest.raises(SdnpuError, match="not found"):
        component_path(copy, "transformer", reference=True)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"compile": False}, "needs the compile"), ({"target": "qnn-htp"}, "compiles from the fp32 graph"),
    ({"add": True}, "adds no sizes")])
def test_dispatch_only_is_refused_where_it_cannot_apply(kwargs, message):
    from sdnpu.convert import ConvertOptions
    from sdnpu.errors import SdnpuError

    with pytest.raises(SdnpuError, match=message):
        ConvertOptions(dispatch_only=True, **kwargs)


def test_the_disk_check_counts_what_dispatch_only_writes_and_names_it(tmp_path, monkeypatch):
    """Block by block a module's folder takes 1.5x its fp32 weights (fp32 graph and dispatch model), with
    --dispatch-only 0.75x (the dispatch model and one piece at a time): a disk with room for the one and not the
    other is refused with a hint that names --dispatch-only, and taken with it."""
    from collections import namedtuple

    from sdnpu.convert import budget
    from sdnpu.errors import SdnpuError

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _where: usage(0, 0, 75_000_000_000))  # this machine, later
    weights = {"transformer": 81_700_000_000}  # Qwen-Image's transformer in fp32
    with pytest.raises(SdnpuError, match=r"need about 122.55 GB on disk") as e:
        budget.check_disk(budget.Budget(weights, by_block={"transformer"}), ["transformer"], tmp_path)
    assert "--dispatch-only keeps transformer without the fp32 graph" in (e.value.hint or "")
    budget.check_disk(budget.Budget(weights, by_block={"transformer"}, dispatch_only=True), ["transformer"], tmp_path)
    with pytest.raises(SdnpuError) as e:  # a module converted whole keeps its fp32 graph: no such hint
        budget.check_disk(budget.Budget(weights, dispatch_only=True), ["transformer"], tmp_path)
    assert "--dispatch-only" not in (e.value.hint or "")
