"""Many image sizes over one copy of the weights (issue 13): --res lists and sdxl-buckets, the shared data
files, adding a size, choosing one at run time, the per-size reports, the LoRA overlay on every size."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from PIL import Image

from sdnpu.cli import main
from sdnpu.convert import convert
from sdnpu.convert import shared
from sdnpu.errors import SdnpuError
from sdnpu.imagesize import SDXL_BUCKETS, Size, parse_sizes
from sdnpu.runtime import GenerateOptions, Pipeline, RuntimeOptions, open_component
from sdnpu.runtime.session import SharedWeights
from sdnpu.formats.sizes import read_manifest, sizes_of
from tests.conftest import _arrays, _tree

WIDE = Size(256, 320)  # 320x256


def test_res_takes_lists_and_the_sdxl_buckets():
    assert parse_sizes("1024x1024, 1152x896,1024") == [Size(1024, 1024), Size(896, 1152)]
    buckets = parse_sizes("sdxl-buckets")
    assert [str(s) for s in buckets] == list(SDXL_BUCKETS) and len(buckets) == 9
    assert all(s.width % 64 == 0 and s.height % 64 == 0 for s in buckets)
    assert parse_sizes("sdxl-buckets,1024x576")[-1] == Size(576, 1024)
    assert parse_sizes(256) == [Size(256, 256)] and parse_sizes(["256", Size(256, 320)]) == [Size(256, 256), WIDE]
    with pytest.raises(SdnpuError, match="is a list of sizes; one size is taken here"):
        Size.parse("256,320")


def test_sizes_share_one_copy_of_the_weights(two_sizes):
    for comp in ("unet", "vae_decoder"):
        comp_dir = two_sizes / comp
        sizes = sizes_of(comp_dir)
        assert [(str(f.size), f.primary) for f in sizes] == [("256x256", True), ("320x256", False)]
        manifest = read_manifest(comp_dir)
        stats = manifest["sizes"][1]["shared"]
        for kind, graph, data in (("model", "model.320x256.onnx", "model.onnx.data"),
                                  ("dispatch", "dd/replaced.320x256.onnx", "replaced.onnx.data")):
            # what only this size has (an attention mask as long as its sequence): its own small file
            assert stats[kind]["shared"] > 0 and stats[kind]["own_bytes"] < 0.01 * stats[kind]["shared_bytes"], stats
            own = Path(graph).name + ".data"
            assert (comp_dir / (graph + ".data")).is_file() == (stats[kind]["own"] > 0)
            proto = onnx.load(str(comp_dir / graph), load_external_data=False)
            places = [{e.key: e.value for e in t.external_data}["location"] for t in proto.graph.initializer
                      if t.data_location == onnx.TensorProto.EXTERNAL]
            assert places.count(data) == stats[kind]["shared"] and places.count(own) == stats[kind]["own"]
            assert len(places) == stats[kind]["shared"] + stats[kind]["own"]
            onnx.checker.check_model(str(comp_dir / graph), full_check=True)
            assert (comp_dir / graph).stat().st_size < 2e6  # the graph alone: the weights are not in it
        # each size fused for its own static shapes
        report = json.loads((comp_dir / "dd" / "report.320x256.json").read_text())
        assert report["size"] == {"height": 256, "width": 320}
        assert report["inputs"]["sample" if comp == "unet" else "latent_sample"][-2:] == [32, 40]
        primary = json.loads((comp_dir / "dd" / "report.json").read_text())
        assert report["summary"]["offload_rate"] == primary["summary"]["offload_rate"]
        assert report["fidelity"]["min_cosine"] > 0.999
        assert json.loads((comp_dir / "export.320x256.json").read_text())["size"] == report["size"]


def test_the_dispatch_model_of_another_size_runs_and_agrees_with_its_fp32_graph(two_sizes):
    unet = open_component(two_sizes, "unet", options=RuntimeOptions(optimize=False), size=WIDE)
    ref = open_component(two_sizes, "unet", reference=True, options=RuntimeOptions(optimize=False), size=WIDE)
    assert unet.path.name == "replaced.320x256.onnx" and unet.inputs["sample"] == [2, 4, 32, 40]
    rng = np.random.default_rng(1)
    feeds = {k: rng.standard_normal(v).astype(np.float32) for k, v in unet.inputs.items() if k != "timestep"}
    feeds["timestep"] = np.asarray(600.0, np.float32)
    a, b = unet.run(feeds)["out_sample"], ref.run(feeds)["out_sample"]
    cos = float(np.dot(a.ravel(), b.ravel()) / np.linalg.norm(a) / np.linalg.norm(b))
    assert cos > 0.999, cos


def test_sessions_of_two_sizes_share_the_weights_in_memory(two_sizes):
    weights = SharedWeights()
    rng = np.random.default_rng(2)
    for size in (Size(256, 256), WIDE):
        both = open_component(two_sizes, "unet", options=RuntimeOptions(optimize=False), size=size, shared=weights)
        alone = open_component(two_sizes, "unet", options=RuntimeOptions(optimize=False), size=size)
        feeds = {k: rng.standard_normal(v).astype(np.float32) for k, v in both.inputs.items() if k != "timestep"}
        feeds["timestep"] = np.asarray(300.0, np.float32)
        np.testing.assert_array_equal(both.run(feeds)["out_sample"], alone.run(feeds)["out_sample"])
        if size == Size(256, 256):
            first = weights.tensors
    assert first > 100 and weights.tensors == first  # the second size added no tensor of its own


def test_reports_have_a_line_per_size_and_a_total(two_sizes, capsys):
    text = (two_sizes / "unet" / "dd" / "onnx_report.txt").read_text()
    assert "Sizes (2; one copy of the weights, replaced.onnx.data" in text
    lines = text.split("Sizes (2", 1)[1].splitlines()
    assert any(line.split()[:1] == ["256x256"] for line in lines)
    assert any(line.split()[:1] == ["320x256"] for line in lines)
    assert any(line.split()[:1] == ["total"] for line in lines)
    assert main(["report", str(two_sizes)]) == 0
    out = capsys.readouterr().out
    for line in ("unet 256x256", "unet 320x256", "vae_decoder 320x256", "text_encoder "):
        assert line in out
    unet = two_sizes / "unet" / "dd"
    assert main(["report", "diff", str(unet / "report.json"), str(unet / "report.320x256.json")]) == 0
    assert "unet: offload" in capsys.readouterr().out
    assert main(["report", str(unet / "replaced.320x256.onnx")]) == 0
    assert "input       sample [2, 4, 32, 40]" in capsys.readouterr().out


def test_generate_picks_the_size_and_refuses_one_not_converted(two_sizes, tmp_path, capsys):
    out = tmp_path / "wide.png"
    argv = ["generate", "--models", str(two_sizes), "--prompt", "a cat", "--steps", "2"]
    assert main([*argv, "--width", "320", "--height", "256", "--out", str(out)]) == 0
    assert Image.open(out).size == (320, 256)
    assert main([*argv, "--width", "320", "--height", "320", "--out", str(tmp_path / "no.png")]) == 2
    err = capsys.readouterr().err
    assert "is not converted at 320x320 (converted: 256x256, 320x256)" in err and "--add" in err
    assert not (tmp_path / "no.png").exists()
    pipe = Pipeline(two_sizes, size=WIDE)
    assert pipe.image_size == (256, 320)
    image = pipe(GenerateOptions("a cat", steps=2, seed=3))
    reference = Pipeline(two_sizes, reference=True, size=WIDE)(GenerateOptions("a cat", steps=2, seed=3))
    psnr = 10 * np.log10(255**2 / np.mean((image.astype(float) - reference) ** 2))
    assert image.shape == (256, 320, 3) and psnr > 35, psnr


def test_adding_a_size_writes_only_its_files(two_sizes, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(two_sizes, folder)
    before = _tree(folder)
    convert("tiny-sdxl", "vae_decoder", out=folder, res="256x256,256x320", add=True, check=False)
    after = _tree(folder)
    assert {k for k in before if before[k] != after[k]} == {
        "vae_decoder/sizes.json", "vae_decoder/dd/report.json", "vae_decoder/dd/onnx_report.txt"}
    added = {k for k in after if k not in before}
    own = ["dd/replaced.256x320.onnx.data"] if (folder / "vae_decoder/dd/replaced.256x320.onnx.data").exists() else []
    assert added == {f"vae_decoder/{f}" for f in (
        "model.256x320.onnx", "export.256x320.json", "parameters.256x320.json", "dd/replaced.256x320.onnx",
        "dd/report.256x320.json", "dd/onnx_report.256x320.txt", "dd/weights.256x320.json", *own)}
    assert [str(f.size) for f in sizes_of(folder / "vae_decoder")] == ["256x256", "320x256", "256x320"]
    # a size it has already: nothing to do, nothing written
    result = convert("tiny-sdxl", "unet,vae_decoder", out=folder, res="320x256", add=True)
    assert result.components == [] and _tree(folder) == after


def test_an_add_that_fails_leaves_the_folder_as_it_was(two_sizes, tmp_path, monkeypatch):
    folder = tmp_path / "m"
    shutil.copytree(two_sizes, folder)
    before = _tree(folder)
    real = shared._write

    def dies_on_the_dispatch_model(proto, dest, *a):
        if dest.name.startswith("replaced"):
            raise OSError(28, "No space left on device", str(dest))
        return real(proto, dest, *a)

    monkeypatch.setattr(shared, "_write", dies_on_the_dispatch_model)
    with pytest.raises(OSError, match="No space left"):
        convert("tiny-sdxl", "vae_decoder", out=folder, res="288x256", add=True, check=False)
    after = _tree(folder)
    # the size is not listed, nothing that was there changed, no scratch folder is left; the fp32 graph
    # written before the failure is an orphan the next add of that size replaces
    assert {k: v for k, v in after.items() if k in before} == before
    assert set(after) - set(before) <= {"vae_decoder/model.288x256.onnx"}
    assert not list((folder / "vae_decoder").glob(".size-*"))
    assert [str(f.size) for f in sizes_of(folder / "vae_decoder")] == ["256x256", "320x256"]


@pytest.mark.parametrize("change, message", [
    ({"precision": "bfp16"}, "was converted with precision bf16, this run has bfp16"),
    ({"exporter": "torchscript"}, "was converted with exporter dynamo, this run has torchscript"),
])
def test_add_refuses_other_settings(two_sizes, change, message):
    before = _tree(two_sizes)
    with pytest.raises(SdnpuError, match=message):
        convert("tiny-sdxl", "unet", out=two_sizes, res="288x256", add=True, **change)
    assert _tree(two_sizes) == before


def test_add_refuses_a_folder_without_a_conversion(tmp_path, capsys):
    argv = ["convert", "--source", "tiny-sdxl", "--model", "unet", "--res", "288x256", "--add"]
    assert main([*argv, "--out", str(tmp_path / "none")]) == 2
    assert "holds no conversion to add sizes to" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([*argv, "--out", str(tmp_path / "empty")]) == 2
    assert "holds no converted unet" in capsys.readouterr().err
    assert not any((tmp_path / "empty").iterdir())


def test_a_list_converts_every_size_in_one_run(tmp_path, capsys):
    assert main(["-q", "convert", "--source", "tiny-sdxl", "--model", "vae_decoder", "--res", "320x256,256x256",
                 "--out", str(tmp_path), "--no-check"]) == 0
    out = capsys.readouterr().out
    assert "(320x256, 256x256 px)" in out and "vae_decoder        256x256" in out
    comp_dir = tmp_path / "vae_decoder"
    assert [str(f.size) for f in sizes_of(comp_dir)] == ["320x256", "256x256"]
    # a non-square primary: its records name the size (resolution is a square's side only)
    export = json.loads((comp_dir / "export.json").read_text())
    assert export["resolution"] is None and export["size"] == {"height": 256, "width": 320}
    assert json.loads((comp_dir / "dd" / "report.json").read_text())["size"] == export["size"]
    assert json.loads((comp_dir / "dd" / "report.256x256.json").read_text())["specialized_from"] == "320x256"
    assert (comp_dir / "dd" / "replaced.onnx.data").is_file() and not list(tmp_path.glob(".*"))
    assert not list(comp_dir.glob(".size-*"))


def test_the_lora_overlay_applies_to_every_size(two_sizes, tmp_path):
    """`sdnpu lora apply` writes one overlay; each size's session reads it in place (its own names for the
    same tensors) and runs what the LoRA computed at session open runs."""
    from sdnpu.lora import LoraSpec, overlay
    from sdnpu.lora.seeded import write_seeded_lora

    folder = tmp_path / "m"
    shutil.copytree(two_sizes, folder)
    lora = tmp_path / "style.safetensors"
    write_seeded_lora(folder, lora, rank=4)
    overlay.apply(folder, [LoraSpec.parse(f"{lora}:0.8")])
    rng = np.random.default_rng(5)
    base = open_component(two_sizes, "unet", options=RuntimeOptions(optimize=False), size=WIDE)
    feeds = {k: rng.standard_normal(v).astype(np.float32) for k, v in base.inputs.items() if k != "timestep"}
    feeds["timestep"] = np.asarray(800.0, np.float32)
    applied = open_component(folder, "unet", options=RuntimeOptions(optimize=False), size=WIDE)
    at_open = open_component(two_sizes, "unet", size=WIDE,
                             options=RuntimeOptions(optimize=False, loras=(LoraSpec.parse(f"{lora}:0.8"),)))
    assert applied.lora and at_open.lora
    a, b, c = (x.run(feeds)["out_sample"] for x in (base, applied, at_open))
    assert not np.allclose(a, b)
    np.testing.assert_array_equal(b, c)


def test_compile_refuses_to_replace_the_dispatch_models_of_several_sizes(two_sizes, tmp_path, capsys):
    before = _tree(two_sizes / "unet")
    graph = two_sizes / "unet" / "model.320x256.onnx"
    assert main(["compile", str(graph)]) == 2
    assert "holds the dispatch models of 2 sizes (256x256, 320x256)" in capsys.readouterr().err
    assert _tree(two_sizes / "unet") == before
    # elsewhere, a size's fp32 graph (its weights in the primary's data file) compiles like any other
    assert main(["-q", "compile", str(graph), "--out", str(tmp_path / "dd"), "--no-verify"]) == 0
    report = json.loads((tmp_path / "dd" / "report.json").read_text())
    assert report["inputs"]["sample"] == [2, 4, 32, 40]
    assert report["summary"]["offload_rate"] == json.loads(
        (two_sizes / "unet" / "dd" / "report.320x256.json").read_text())["summary"]["offload_rate"]


def _graph_parts(path: Path) -> dict[str, object]:
    """Everything in a dispatch model but where its tensors' bytes lie: nodes (attributes, metadata), value
    shapes, inputs and outputs, and every initializer's name, type and values."""
    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    return {"nodes": [n.SerializeToString() for n in g.node],
            "value_info": sorted(v.SerializeToString() for v in g.value_info),
            "io": [v.SerializeToString() for v in [*g.input, *g.output]],
            "initializers": {k: (v.dtype, v.shape, v.tobytes()) for k, v in _arrays(path).items()}}


@pytest.mark.parametrize("comp", ["unet", "vae_decoder"])
def test_an_added_size_is_what_a_full_compile_of_it_writes(two_sizes, tmp_path, comp):
    """The added size's dispatch model was re-derived from the primary's (passes/specialize.py), not compiled:
    compiling its exported graph in full gives the same graph, tensor for tensor."""
    from sdnpu.convert.compile import compile_file

    report = json.loads((two_sizes / comp / "dd" / "report.320x256.json").read_text())
    assert report["specialized_from"] == "256x256" and report["passes"][0]["name"] == "specialize"
    compile_file(two_sizes / comp / "model.320x256.onnx", tmp_path / comp, verify=False)
    full = _graph_parts(tmp_path / comp / "replaced.onnx")
    specialized = _graph_parts(two_sizes / comp / "dd" / "replaced.320x256.onnx")
    for part in full:
        assert specialized[part] == full[part], part
    ours = json.loads((tmp_path / comp / "report.json").read_text())["summary"]
    assert {k: report["summary"][k] for k in ("offloaded_nodes", "cpu_nodes", "offload_rate", "npu_regions",
                                              "transitions", "macs_total")} == \
        {k: ours[k] for k in ("offloaded_nodes", "cpu_nodes", "offload_rate", "npu_regions", "transitions",
                              "macs_total")}


def test_specializing_refuses_what_it_cannot_rederive(two_sizes):
    from sdnpu.convert import shared as sh
    from sdnpu.ops.target import get_target
    from sdnpu.passes.specialize import CannotSpecialize, regroup, specialize

    # views: merged dims multiply, a split takes its parts from the other operand, or is refused
    assert regroup([2, 64, 64, 640], [2, 4096, 640], [2, 56, 72, 640]) == [2, 4032, 640]
    assert regroup([2, 4096, 640], [2, 64, 64, 640], [2, 4032, 640], hint=[2, 56, 72, 640]) == [2, 56, 72, 640]
    assert regroup([2, 1280], [2, 1, 1280], [2, 1280]) == [2, 1, 1280]
    with pytest.raises(CannotSpecialize, match="nothing says how"):
        regroup([2, 4096, 640], [2, 64, 64, 640], [2, 4032, 640])
    # a size whose attention takes another AMD variant (Q length 16 < 256: SDFlatMHA) is compiled in full
    path = two_sizes / "unet" / "dd" / "replaced.onnx"
    model = onnx.load(str(path), load_external_data=False)
    inputs = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.input}
    inputs["sample"] = [*inputs["sample"][:2], 8, 8]
    handles: dict = {}
    with pytest.raises(CannotSpecialize, match="take SDFlatMHA, not SDMHA"):
        specialize(model, get_target(), inputs, lambda t: sh.tensor_bytes(path.parent, t, handles))
    inputs["sample"] = [*inputs["sample"][:2], 32, 1]  # a dimension of 1 where the primary has more
    with pytest.raises(CannotSpecialize):
        specialize(model, get_target(), inputs, lambda t: sh.tensor_bytes(path.parent, t, handles))
    for f in handles.values():
        f.close()


def test_a_size_that_cannot_be_specialized_is_compiled_in_full(two_sizes, tmp_path, monkeypatch, caplog):
    import sdnpu.convert.specialized as compile_module
    from sdnpu.passes.specialize import CannotSpecialize

    folder = tmp_path / "m"
    shutil.copytree(two_sizes, folder)

    def refuses(*a):
        raise CannotSpecialize("a test says no")

    monkeypatch.setattr(compile_module, "plan_specialization", refuses)
    with caplog.at_level("WARNING"):
        convert("tiny-sdxl", "vae_decoder", out=folder, res="288x256", add=True, check=False)
    assert "cannot be re-derived for it (a test says no); compiling it in full" in caplog.text
    report = json.loads((folder / "vae_decoder" / "dd" / "report.288x256.json").read_text())
    assert "specialized_from" not in report and report["passes"][0]["name"] == "canonical/opset"
    assert [str(f.size) for f in sizes_of(folder / "vae_decoder")] == ["256x256", "320x256", "288x256"]


def test_verify_at_another_size(two_sizes, tmp_path, capsys):
    folder = tmp_path / "m"
    shutil.copytree(two_sizes, folder)
    before = {c: (folder / c / "dd" / "report.json").read_text() for c in ("unet", "vae_decoder")}
    assert main(["-q", "verify", str(folder), "--steps", "1", "--width", "320", "--height", "256"]) == 0
    out = capsys.readouterr().out
    assert "pipeline (1 steps, seed 0): image PSNR" in out and "report.320x256.json" in out
    summary = json.loads((folder / "verify.320x256.json").read_text())
    assert summary["size"] == "320x256" and set(summary["components"]) == {"unet", "vae_decoder"}
    assert summary["pipeline"]["psnr_db"] > 35
    for comp in ("unet", "vae_decoder"):
        report = json.loads((folder / comp / "dd" / "report.320x256.json").read_text())
        assert report["fidelity"]["min_cosine"] > 0.99 and report["fidelity_pessimistic"]["min_cosine"] > 0.99
        assert "(sdnpu verify)" in report["fidelity"]["inputs"]
        assert (folder / comp / "dd" / "report.json").read_text() == before[comp]  # the primary's untouched
    assert main(["verify", str(folder), "--width", "384", "--height", "256"]) == 2
    assert "is not converted at 384x256 (converted: 256x256, 320x256)" in capsys.readouterr().err


# (preset, sized components, primary,other, the components re-derived): height and width swapped; one side
# equal and neither a multiple of 64; swapped again on SD3's VAEs (its transformer is compiled per size).
# SD 1.5's UNet is refused: its 1x1 proj_in/proj_out convolutions read the [B, H*W, C] tokens as NHWC, and
# no operand says how 780 tokens split into rows and columns
# `make test` runs the first of each list; `make sweep` (pytest -m sweep) the others too.
_SWEEP = pytest.mark.sweep
SWEEP = [pytest.param("tiny-sdxl", "unet,vae_decoder,vae_encoder", "256x192,192x256", "unet,vae_decoder,vae_encoder",
                      id="tiny-sdxl"),
         pytest.param("tiny-sd15", "unet,vae_decoder,vae_encoder", "240x176,240x208", "vae_decoder,vae_encoder",
                      marks=_SWEEP, id="tiny-sd15"),
         pytest.param("tiny-sd3", "vae_decoder,vae_encoder", "224x160,160x224", "vae_decoder,vae_encoder",
                      marks=_SWEEP, id="tiny-sd3")]


@pytest.mark.slow
@pytest.mark.parametrize(("preset", "comps", "res", "expected"), SWEEP)
def test_every_size_pair_is_rederived_as_a_full_compile_writes_it_or_compiled_in_full(preset, comps, res, expected,
                                                                                        tmp_path, caplog):
    """The specializer never crashes (issue 27): each second size is re-derived from the primary's dispatch
    model, tensor for tensor what a full compile of its exported graph writes, or refused with its reason
    and compiled in full."""
    from sdnpu.convert.compile import compile_file

    first, second = res.split(",")
    with caplog.at_level("WARNING"):
        convert(preset, comps, out=tmp_path / "m", res=res, check=False)
    assert "bug in sdnpu's size specializer" not in caplog.text
    derived = []
    for comp in comps.split(","):
        report = json.loads((tmp_path / "m" / comp / "dd" / f"report.{second}.json").read_text())
        if report.get("specialized_from") == first:
            derived.append(comp)
        else:
            assert f"[{comp}] {second}" in caplog.text and "cannot be re-derived" in caplog.text
        compile_file(tmp_path / "m" / comp / f"model.{second}.onnx", tmp_path / "full" / comp, verify=False)
        full = _graph_parts(tmp_path / "full" / comp / "replaced.onnx")
        ours = _graph_parts(tmp_path / "m" / comp / "dd" / f"replaced.{second}.onnx")
        assert all(ours[part] == full[part] for part in full), comp
    assert derived == expected.split(","), caplog.text


# (preset, denoiser, primary batch, other batch, why it is refused): 1 <-> 2, a dimension of 1 against one of
# more (the passes may decide differently there); 2 -> 4, the timestep's sinusoid frequencies broadcast to the
# batch offline (``canonical.movement.fold_expands_into_constants``) are a constant of the primary's batch; SD3's
# transformer, its position embedding cut for the primary (sized components it is compiled per size). All compile
# in full.
BATCHES = [pytest.param("tiny-sdxl-turbo", "unet", 1, 2, "a dimension of 1", id="tiny-sdxl-turbo-1-2"),
           pytest.param("tiny-sdxl", "unet", 2, 4, "the table's shape rule refuses", marks=_SWEEP,
                        id="tiny-sdxl-2-4"),
           pytest.param("tiny-sd15", "unet", 2, 1, "a dimension of 1", marks=_SWEEP, id="tiny-sd15-2-1"),
           pytest.param("tiny-sd3", "transformer", 2, 1, "position-embedding crop", marks=_SWEEP,
                        id="tiny-sd3-2-1")]


@pytest.mark.slow
@pytest.mark.parametrize(("preset", "comp", "first", "second", "why"), BATCHES)
def test_every_batch_is_rederived_as_a_full_compile_writes_it_or_compiled_in_full(preset, comp, first, second, why,
                                                                                  tmp_path, caplog):
    """A denoiser's second batch, as its second size: re-derived tensor for tensor as a full compile of its
    exported graph writes it, or refused with the reason and compiled in full; its files carry the batch."""
    from sdnpu.convert.compile import compile_file

    with caplog.at_level("WARNING"):
        convert(preset, comp, out=tmp_path / "m", batch=(first, second), check=False)
    assert "bug in sdnpu's size specializer" not in caplog.text
    comp_dir = tmp_path / "m" / comp
    tag = f"256x256.b{second}"
    report = json.loads((comp_dir / "dd" / f"report.{tag}.json").read_text())
    assert report["batch"] == second and json.loads((comp_dir / "dd" / "report.json").read_text())["batch"] == first
    assert (report.get("specialized_from") == "256x256") == (why is None), caplog.text
    if why is not None:
        assert f"at batch {second}: the dispatch model" in caplog.text and why in caplog.text
    compile_file(comp_dir / f"model.{tag}.onnx", tmp_path / "full" / comp, verify=False)
    full = _graph_parts(tmp_path / "full" / comp / "replaced.onnx")
    ours = _graph_parts(comp_dir / "dd" / f"replaced.{tag}.onnx")
    assert all(ours[part] == full[part] for part in full)
    assert [(f.batch, f.model) for f in sizes_of(comp_dir)] == [(first, "model.onnx"), (second, f"model.{tag}.onnx")]
