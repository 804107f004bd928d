"""LoRAs on a tiny-sdxl conversion: the overlay against diffusers' fuse_lora, both namings, stacking, swapping,
removal byte for byte, the runtime's --lora, and every bad input with its one line."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from sdnpu.cli import main
from sdnpu.errors import SdnpuError
from sdnpu.formats.overlay import overlay_initializers, read_manifest
from sdnpu.lora import LoraSpec, overlay
from sdnpu.lora.seeded import write_seeded_lora, write_summed_lora
from tests.conftest import once

LORA_COMPONENTS = ("unet", "text_encoder", "text_encoder_2")
PRESETS = Path(__file__).resolve().parents[1] / "convert" / "presets"


@pytest.fixture(scope="module")
def loras(tmp_path_factory, tiny_conversion) -> dict[str, Path]:
    """Seeded rank-4 LoRAs over every attention and feed-forward projection and the resnets' convolutions
    (3x3 LoRAs) of tiny-sdxl: one in diffusers naming, the same in kohya naming, and two more seeds."""
    def make(d: Path) -> dict[str, Path]:
        files = {"diffusers": d / "a.safetensors", "kohya": d / "a-kohya.safetensors", "b": d / "b.safetensors",
                 "c": d / "c.safetensors"}
        write_seeded_lora(tiny_conversion.out, files["diffusers"], rank=4, convs=True)
        write_seeded_lora(tiny_conversion.out, files["kohya"], rank=4, naming="kohya", convs=True)
        write_seeded_lora(tiny_conversion.out, files["b"], rank=4, seed=1, convs=True)
        write_seeded_lora(tiny_conversion.out, files["c"], rank=4, seed=2, convs=True)
        return files

    return once(tmp_path_factory, "loras", make)


@pytest.fixture
def folder(tmp_path, tiny_conversion) -> Path:
    """A private copy of the tiny conversion (LoRAs change the folder)."""
    out = tmp_path / "tiny"
    shutil.copytree(tiny_conversion.out, out)
    return out


@pytest.fixture(scope="module")
def fused(tmp_path_factory, loras) -> Path:
    """tiny-sdxl converted with the diffusers LoRA fused at 0.7 by diffusers' fuse_lora (sdnpu convert --lora)."""
    from sdnpu.convert import convert

    return once(tmp_path_factory, "fused",
                lambda out: convert("tiny-sdxl", "all", out=out, loras=(f"{loras['diffusers']}:0.7",)).out)


def _initializers(model: Path) -> dict[str, bytes]:
    return {t.name: numpy_helper.to_array(t).tobytes() for t in onnx.load(str(model)).graph.initializer}


def _adapted(comp_dir: Path) -> dict[str, bytes]:
    """The dispatch model's weights with the folder's overlay over them."""
    weights = _initializers(comp_dir / "dd" / "replaced.onnx")
    arrays, _ = overlay_initializers(comp_dir / "dd")
    weights.update({name: np.asarray(a).tobytes() for name, a in arrays.items()})
    return weights


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_overlay_is_what_diffusers_fuse_lora_converts_to(folder, loras, fused):
    """Applied to the compiled folder, the LoRA gives every weight of every dispatch model byte for byte as
    converting the PyTorch modules after diffusers' fuse_lora does; the graphs and offload are unchanged."""
    results = overlay.apply(folder, [LoraSpec(loras["diffusers"], 0.7)])
    assert {r.component for r in results} == set(LORA_COMPONENTS)
    for comp in LORA_COMPONENTS:
        adapted, want = _adapted(folder / comp), _initializers(fused / comp / "dd" / "replaced.onnx")
        assert adapted.keys() == want.keys()
        differ = [n for n in want if adapted[n] != want[n]]
        assert not differ, f"{comp}: {len(differ)} weights differ from the fused conversion, e.g. {differ[:3]}"
        base = _initializers(folder / comp / "dd" / "replaced.onnx")
        changed = sum(base[n] != want[n] for n in want)
        assert changed == len(read_manifest(folder / comp / "dd")["tensors"]) > 0
        report = json.loads((folder / comp / "dd" / "report.json").read_text())
        fused_report = json.loads((fused / comp / "dd" / "report.json").read_text())
        assert report["summary"] == fused_report["summary"]  # offload rate and op counts
        assert report["lora"]["applied"][0]["scale"] == 0.7
        assert "LoRA" in (folder / comp / "dd" / "onnx_report.txt").read_text()
        assert fused_report["lora_fused"]["fused"][0]["name"] == loras["diffusers"].name


def test_the_merged_weights_are_diffusers_pipeline_fuse_lora(tiny_pipeline_folder, loras):
    """Three LoRAs (one in kohya naming) through diffusers' own pipeline API (load_lora_weights, set_adapters
    with weights, fuse_lora, unload_lora_weights) give every changed module weight bit for bit as sdnpu's
    merge (over a weightless skeleton) and its convert-time fusion (``fuse_into``)."""
    from diffusers import StableDiffusionXLPipeline

    from sdnpu.lora.adapters import Adapters, fuse_into, read_lora

    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_pipeline_folder)
    base = {c: {n: p.detach().clone() for n, p in getattr(pipe, c).named_parameters()} for c in LORA_COMPONENTS}
    specs = [LoraSpec(loras["diffusers"], 0.5), LoraSpec(loras["kohya"], 0.25), LoraSpec(loras["c"], 1.5)]
    for i, spec in enumerate(specs):
        pipe.load_lora_weights(str(spec.path.parent), weight_name=spec.path.name, adapter_name=f"l{i}")
    pipe.set_adapters([f"l{i}" for i in range(3)], adapter_weights=[s.scale for s in specs])
    pipe.fuse_lora(adapter_names=[f"l{i}" for i in range(3)])
    pipe.unload_lora_weights()
    files = [read_lora(s, True, dict(pipe.unet.config)) for s in specs]
    for comp in LORA_COMPONENTS:
        fused = dict(getattr(pipe, comp).named_parameters())
        adapters = Adapters(tiny_pipeline_folder, comp, files, True)
        assert adapters.modules
        for module in adapters.modules:
            w = f"{module}.weight"
            assert torch_equal(adapters.merged(module, base[comp][w]), fused[w]), f"{comp}.{module}"
        own = getattr(StableDiffusionXLPipeline.from_pretrained(tiny_pipeline_folder), comp)
        fuse_into(own, comp, files, True)
        for name, p in own.named_parameters():
            assert torch_equal(p, fused[name]), f"{comp}.{name}"
        changed = [n for n in base[comp] if not torch_equal(base[comp][n], fused[n])]
        assert len(changed) == len(adapters.modules)


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a.detach(), b.detach()))


def test_kohya_naming_gives_the_same_overlay(folder, loras):
    """The same LoRA in kohya naming (SGM block names, alpha = rank / 2) is the same change."""
    overlay.apply(folder, [LoraSpec(loras["diffusers"])])
    first = {c: _adapted(folder / c) for c in LORA_COMPONENTS}
    overlay.apply(folder, [LoraSpec(loras["kohya"])])
    for comp in LORA_COMPONENTS:
        assert _adapted(folder / comp) == first[comp], comp
    assert overlay.status(folder)["unet"]["loras"][0]["format"] == "kohya"


def test_three_stacked_loras_match_their_sum(folder, loras, tmp_path):
    """a:0.5 + b:0.25 + c:1.0 stacked equals one LoRA holding their sum, to within fp32 summation order
    (bf16 weights within one bf16 step, in a handful of values)."""
    specs = [LoraSpec(loras["diffusers"], 0.5), LoraSpec(loras["b"], 0.25), LoraSpec(loras["c"], 1.0)]
    overlay.apply(folder, specs)
    stacked = {c: overlay_initializers(folder / c / "dd")[0] for c in LORA_COMPONENTS}
    stacked = {c: {n: np.asarray(a).astype(np.float32) for n, a in a_.items()} for c, a_ in stacked.items()}
    total = tmp_path / "sum.safetensors"
    write_summed_lora([loras["diffusers"], loras["b"], loras["c"]], [0.5, 0.25, 1.0], total)
    overlay.apply(folder, [LoraSpec(total)])
    for comp in LORA_COMPONENTS:
        arrays = overlay_initializers(folder / comp / "dd")[0]
        summed = {n: np.asarray(a).astype(np.float32) for n, a in arrays.items()}
        assert summed.keys() == stacked[comp].keys()
        values = differing = 0
        for name, want in summed.items():
            got = stacked[comp][name]
            # one bf16 step at the larger value, plus fp32's summation noise at the weight's scale (a value
            # near zero can round across it)
            step = np.maximum(np.abs(want), np.abs(got)) * 2.0 ** -7 + 1e-6 * np.abs(want).max()
            assert np.all(np.abs(got - want) <= step), f"{comp} {name}"
            values += want.size
            differing += int(np.count_nonzero(got != want))
        assert differing <= 0.01 * values, (comp, differing, values)
        fp32_stacked = dict(overlay.compute_in_memory(folder / comp, specs, reference=True)[0])
        fp32_sum = dict(overlay.compute_in_memory(folder / comp, [LoraSpec(total)], reference=True)[0])
        for name, want in fp32_sum.items():
            np.testing.assert_allclose(fp32_stacked[name], want, rtol=1e-5, atol=1e-6)


def test_swapping_never_blends_and_remove_restores_every_byte(folder, loras):
    before = _digest(folder)
    overlay.apply(folder, [LoraSpec(loras["b"])])
    only_b = {c: _adapted(folder / c) for c in LORA_COMPONENTS}
    overlay.apply(folder, [LoraSpec(loras["diffusers"])])
    overlay.apply(folder, [LoraSpec(loras["b"])])  # a swap: computed from the base, not on top
    assert {c: _adapted(folder / c) for c in LORA_COMPONENTS} == only_b
    assert sorted(overlay.remove(folder)) == sorted(LORA_COMPONENTS)
    assert _digest(folder) == before
    assert overlay.remove(folder) == []


def test_a_lora_for_fewer_components_drops_the_others_overlays(folder, loras, tmp_path):
    overlay.apply(folder, [LoraSpec(loras["diffusers"])])
    unet_only = tmp_path / "unet-only.safetensors"
    write_seeded_lora(folder, unet_only, rank=2, components=("unet",))
    overlay.apply(folder, [LoraSpec(unet_only)])
    status = overlay.status(folder)
    assert status["unet"] is not None and status["text_encoder"] is None and status["text_encoder_2"] is None
    assert "lora" not in json.loads((folder / "text_encoder" / "dd" / "report.json").read_text())


def test_runtime_lora_overlay_and_fused_conversion_draw_the_same_image(folder, loras, fused):
    from sdnpu.runtime import GenerateOptions, Pipeline, RuntimeOptions

    opts = GenerateOptions("a cat", steps=2, seed=3)
    spec = LoraSpec(loras["diffusers"], 0.7)
    at_open = Pipeline(folder, runtime=RuntimeOptions(loras=(spec,)))(opts)
    base = Pipeline(folder)(opts)
    overlay.apply(folder, [spec])
    with_overlay = Pipeline(folder)(opts)
    converted = Pipeline(fused)(opts)
    np.testing.assert_array_equal(at_open, converted)
    np.testing.assert_array_equal(with_overlay, converted)
    assert np.abs(base.astype(int) - converted.astype(int)).max() > 2  # the LoRA matters
    # the fp32 graphs carry the overlay's LoRAs too (recomputed from its files)
    np.testing.assert_array_equal(Pipeline(folder, reference=True)(opts), Pipeline(fused, reference=True)(opts))


def test_both_replacement_paths_on_a_model_with_external_data(folder, loras):
    """Full-size dispatch models keep their weights in replaced.onnx.data. The folder's overlay is read in
    place (each replaced tensor's external-data entry pointed at dd/lora/weights.data); `--lora` goes through
    onnxruntime's external-initializer API. Both give what the inline tiny model gives."""
    from sdnpu.runtime import open_component
    from sdnpu.runtime.session import RuntimeOptions

    spec = LoraSpec(loras["diffusers"], 0.7)
    overlay.apply(folder, [spec])
    dd = folder / "unet" / "dd"
    inline = open_component(folder, "unet", options=RuntimeOptions(optimize=False))  # its tensors made external
    model = onnx.load(str(dd / "replaced.onnx"))
    onnx.save_model(model, str(dd / "replaced.onnx"), save_as_external_data=True, location="replaced.onnx.data",
                    size_threshold=1024)
    graph = onnx.load(str(dd / "replaced.onnx"), load_external_data=False).graph
    kinds = {t.name: t.data_location for t in graph.initializer}
    replaced = read_manifest(dd)["tensors"]
    assert any(kinds[n] == onnx.TensorProto.EXTERNAL for n in replaced)
    in_place = open_component(folder, "unet", options=RuntimeOptions(optimize=False))
    at_open = open_component(folder, "unet", options=RuntimeOptions(optimize=False, loras=(spec,)))
    assert not in_place.replaced and len(at_open.replaced) == len(replaced)
    rng = np.random.default_rng(0)
    feeds = {}
    for i in inline.session.get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in i.shape]
        feeds[i.name] = (rng.standard_normal(shape) if "float" in i.type else np.ones(shape)).astype(
            np.float32 if "float" in i.type else np.int64)
    want = inline.run(feeds)["out_sample"]
    np.testing.assert_array_equal(in_place.run(feeds)["out_sample"], want)
    np.testing.assert_array_equal(at_open.run(feeds)["out_sample"], want)
    assert in_place.lora and in_place.lora[0]["scale"] == 0.7


def test_an_interrupted_apply_leaves_the_previous_overlay(folder, loras, monkeypatch):
    overlay.apply(folder, [LoraSpec(loras["b"])])
    before = _digest(folder)
    real = overlay._write_overlay

    def fail_on_text_encoder_2(staging, comp_dir, adapters):
        if comp_dir.name == "text_encoder_2":
            raise KeyboardInterrupt
        return real(staging, comp_dir, adapters)

    monkeypatch.setattr(overlay, "_write_overlay", fail_on_text_encoder_2)
    with pytest.raises(KeyboardInterrupt):
        overlay.apply(folder, [LoraSpec(loras["diffusers"])])
    assert _digest(folder) == before  # no half-written overlay, no staging folder left


def _bad_lora(kind: str, tmp_path: Path, folder: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    path = tmp_path / f"{kind}.safetensors"
    if kind == "corrupt":
        good = tmp_path / "good.safetensors"
        write_seeded_lora(folder, good, rank=2, components=("unet",))
        path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    elif kind == "not-a-lora":
        save_file({"model.weight": torch.zeros(4, 4)}, str(path))
    elif kind == "no-module":
        save_file({"unet.down_blocks.7.attentions.0.proj_in.lora_A.weight": torch.zeros(2, 32),
                   "unet.down_blocks.7.attentions.0.proj_in.lora_B.weight": torch.zeros(32, 2)}, str(path))
    elif kind == "shape":
        name = "unet.mid_block.attentions.0.transformer_blocks.0.attn1.to_q"
        save_file({f"{name}.lora_A.weight": torch.zeros(2, 100), f"{name}.lora_B.weight": torch.zeros(128, 2)},
                  str(path))
    elif kind == "sd15":  # a LoRA for SD 1.5's UNet and text encoder, on SDXL
        write_seeded_lora(PRESETS / "tiny-sd15", path, rank=2)
    return path


@pytest.mark.parametrize("kind, message", [
    ("missing", "not found"),
    ("corrupt", "is not a readable safetensors file"),
    ("not-a-lora", "is not a LoRA"),
    ("no-module", "matches no module of the unet"),
    ("shape", "the module takes"),
    ("sd15", "another base model"),
])
def test_bad_loras_get_one_line_and_change_nothing(kind, message, folder, loras, tmp_path, capsys):
    overlay.apply(folder, [LoraSpec(loras["b"])])
    before = _digest(folder)
    path = tmp_path / "missing.safetensors" if kind == "missing" else _bad_lora(kind, tmp_path, folder)
    capsys.readouterr()
    assert main(["lora", "apply", str(folder), "--lora", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) <= 2, err  # the error and its hint
    assert _digest(folder) == before


@pytest.mark.parametrize("argv, message", [
    (["lora", "apply", "{folder}"], "no LoRA given"),
    (["lora", "apply", "{folder}", "--lora", "{lora}:strong"], "cannot read the LoRA scale"),
    (["lora", "apply", "{tmp}", "--lora", "{lora}"], "is not a converted pipeline folder"),
    (["lora", "remove", "{folder}", "--lora", "{lora}"], "takes no --lora"),
])
def test_bad_lora_commands(argv, message, folder, loras, tmp_path, capsys):
    subs = {"folder": str(folder), "lora": str(loras["b"]), "tmp": str(tmp_path)}
    assert main([a.format(**subs) for a in argv]) == 2
    assert message in capsys.readouterr().err


def test_a_stale_or_truncated_overlay_is_refused_at_session_open(folder, loras):
    from sdnpu.runtime import open_component

    overlay.apply(folder, [LoraSpec(loras["b"])])
    data = folder / "unet" / "dd" / "lora" / "weights.data"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(SdnpuError, match="missing or truncated"):
        open_component(folder, "unet")
    overlay.apply(folder, [LoraSpec(loras["b"])])
    record = folder / "unet" / "dd" / "weights.json"
    record.write_text(record.read_text().replace('"version": 1', '"version": 1 '))
    with pytest.raises(SdnpuError, match="another compilation"):
        open_component(folder, "unet")


def test_lora_cli_apply_show_remove(folder, loras, capsys):
    assert main(["lora", "apply", str(folder), "--lora", f"{loras['diffusers']}:0.8", "--lora",
                 str(loras["kohya"])]) == 0
    out = capsys.readouterr().out
    assert "unet" in out and "dispatch-model weights" in out
    assert main(["lora", "show", str(folder / "unet")]) == 0
    out = capsys.readouterr().out
    assert "a.safetensors:0.8 (diffusers), a-kohya.safetensors:1 (kohya)" in out
    assert main(["report", str(folder / "unet")]) == 0  # the report with its LoRA entry follows the schema
    assert "a-kohya.safetensors" in capsys.readouterr().out
    assert main(["lora", "remove", str(folder)]) == 0
    assert main(["lora", "show", str(folder)]) == 0
    assert capsys.readouterr().out.count("base weights") == 3


def test_verify_measures_the_adapted_model_against_the_fp32_graph_with_the_same_lora(folder, loras):
    """sdnpu verify with an overlay: both models carry the LoRA; the result goes to the report's lora entry
    (which remove drops), the base fidelity stays."""
    from sdnpu.runtime import verify

    for comp in ("text_encoder", "text_encoder_2", "vae_encoder", "vae_decoder"):
        shutil.rmtree(folder / comp)  # the UNet alone: no pipeline run
    report = json.loads((folder / "unet" / "dd" / "report.json").read_text())
    base_fidelity = report["fidelity"]
    spec = LoraSpec(loras["diffusers"], 0.7)
    overlay.apply(folder, [spec])
    results = verify(folder, runs=((0, 999.0),))
    assert results["lora"] == {"unet": [f"{loras['diffusers'].name}:0.7"]}
    report = json.loads((folder / "unet" / "dd" / "report.json").read_text())
    assert report["fidelity"] == base_fidelity
    fid = report["lora"]["fidelity"]
    assert fid["min_cosine"] > 0.999
    assert "against the fp32 graph with the same LoRAs" in (folder / "unet" / "dd" / "onnx_report.txt").read_text()
    overlay.remove(folder)
    assert "lora" not in json.loads((folder / "unet" / "dd" / "report.json").read_text())


def test_few_step_generation_with_lcm_is_seeded(folder, loras):
    """``--scheduler LCMScheduler --steps 4`` with a LoRA at guidance 1 (as an LCM LoRA runs: no unconditional
    half) on the UNet's batch 1, added beside its batch 2: LCM draws noise as it steps, from the seed."""
    from sdnpu.convert import convert
    from sdnpu.runtime import GenerateOptions, Pipeline, RuntimeOptions

    convert("tiny-sdxl", "unet", out=folder, batch=1, add=True, check=False)
    pipe = Pipeline(folder, runtime=RuntimeOptions(loras=(LoraSpec(loras["diffusers"]),)))
    opts = GenerateOptions("a cat", steps=4, guidance=1.0, seed=5, scheduler="LCMScheduler")
    first, again = pipe(opts), pipe(opts)
    np.testing.assert_array_equal(first, again)
    other = pipe(GenerateOptions("a cat", steps=4, guidance=1.0, seed=6, scheduler="LCMScheduler"))
    assert np.abs(first.astype(int) - other.astype(int)).max() > 0
