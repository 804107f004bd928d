"""End to end on tiny-sdxl: the five components, local folders, determinism and failure safety."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest

from sdnpu.convert import COMPONENTS, convert, resolve_source
from sdnpu.convert import budget, stages, torch_stage
from sdnpu.convert.wrappers import build_wrapper
from sdnpu.signatures import sample_inputs, signature
from sdnpu.convert.compile import run_onnx
from sdnpu.convert.export import torch_outputs
from sdnpu.reports.fidelity import fidelity
from sdnpu.errors import SdnpuError

# ONNX vs PyTorch, fp32, as a fraction of the output's largest magnitude. Measured on tiny-sdxl with both
# exporters: 4e-7 (text encoders) to 2.7e-6 (VAE decoder); the bound leaves a margin for other CPUs.
FP32_REL_TOL = 2e-5

_DIMS = {"float32": onnx.TensorProto.FLOAT, "int64": onnx.TensorProto.INT64}


def _io(model: onnx.ModelProto, which: str) -> dict[str, tuple[int, list[int]]]:
    return {v.name: (v.type.tensor_type.elem_type, [d.dim_value if d.HasField("dim_value") else d.dim_param
                                                    for d in v.type.tensor_type.shape.dim])
            for v in getattr(model.graph, which)}


def test_all_five_components_export_and_match_pytorch(tiny_conversion):
    src = resolve_source("tiny-sdxl")
    assert [c.component for c in tiny_conversion.components] == [c for c in COMPONENTS if c in (
        "text_encoder", "text_encoder_2", "vae_encoder", "vae_decoder", "unet")]  # no ControlNet, no SD3 module
    assert tiny_conversion.resolution == (256, 256) and str(tiny_conversion.resolution) == "256x256"
    for result in tiny_conversion.components:
        path = result.path
        onnx.checker.check_model(str(path), full_check=True)
        model = onnx.load(str(path))
        assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 17
        sig = signature(result.component, src.module_config(result.component), 256)
        inputs = _io(model, "input")
        assert list(inputs) == [s.name for s in sig.inputs]
        for spec in sig.inputs:  # static shapes, the dtypes of the ecosystem
            assert inputs[spec.name] == (_DIMS[spec.dtype], list(spec.shape))
        outputs = _io(model, "output")
        assert list(outputs) == list(sig.outputs)
        assert all(all(isinstance(d, int) and d > 0 for d in shape) for _, shape in outputs.values())
        info = json.loads((path.parent / "export.json").read_text())
        assert info["check"]["max_rel_error"] <= FP32_REL_TOL
        assert info["exporter"] == "dynamo" and info["source"]["name"] == "tiny-sdxl"
        assert (path.parent / "config.json").is_file()
    out = tiny_conversion.out
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == "StableDiffusionXLPipeline"
    for name in ("scheduler/scheduler_config.json", "tokenizer/vocab.json", "tokenizer_2/merges.txt"):
        assert (out / name).is_file()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no staging leftovers


def test_unet_output_names_and_shapes(tiny_conversion):
    model = onnx.load(str(tiny_conversion.out / "unet" / "model.onnx"), load_external_data=False)
    assert _io(model, "output") == {"out_sample": (onnx.TensorProto.FLOAT, [2, 4, 32, 32])}
    vae = onnx.load(str(tiny_conversion.out / "vae_encoder" / "model.onnx"), load_external_data=False)
    assert _io(vae, "output") == {"latent_parameters": (onnx.TensorProto.FLOAT, [1, 8, 32, 32])}


@pytest.mark.parametrize("component", ["unet", "text_encoder_2", "vae_decoder"])
def test_graph_matches_pytorch_on_fresh_inputs(tiny_conversion, component):
    """Independent of the check inside convert: other seeds, a module built anew."""
    src = resolve_source("tiny-sdxl")
    key = {"vae_decoder": "vae"}.get(component, component)
    config = src.module_config(component)
    sig = signature(component, config, 256)
    wrapper = build_wrapper(component, src.load_module(key), config)
    for seed in (1, 2):
        feeds = sample_inputs(sig, config, 256, seed=seed)
        expected = torch_outputs(wrapper, feeds)
        actual = run_onnx(tiny_conversion.out / component / "model.onnx", feeds)
        for err in fidelity(dict(zip(sig.outputs, expected, strict=True)), actual)["outputs"].values():
            assert err["max_rel"] <= FP32_REL_TOL and err["cosine"] > 0.999999


def test_local_pipeline_folder_converts_exactly_like_the_preset(tiny_pipeline_folder, tiny_conversion, tmp_path,
                                                                monkeypatch):
    monkeypatch.chdir(tmp_path)
    # default OUT: models/<name>; the export is what this compares (the compile of the same graph is tested
    # elsewhere)
    result = convert(tiny_pipeline_folder, "text_encoder,vae_decoder,unet", compile=False, check=False)
    assert result.out == Path("models") / "my-sdxl"
    for comp in ("text_encoder", "vae_decoder", "unet"):
        ours = (tmp_path / "models" / "my-sdxl" / comp / "model.onnx").read_bytes()
        assert ours == (tiny_conversion.out / comp / "model.onnx").read_bytes(), comp
    for name in ("model_index.json", "scheduler", "tokenizer", "tokenizer_2"):
        assert (tmp_path / "models" / "my-sdxl" / name).exists()
    info = json.loads((tmp_path / "models" / "my-sdxl" / "unet" / "export.json").read_text())
    assert info["source"]["kind"] == "pipeline"


def test_fp16_variant_component_folder(tmp_path):
    import torch

    unet = resolve_source("tiny-sdxl").load_module("unet").to(torch.float16)
    unet.save_pretrained(tmp_path / "unet", variant="fp16")
    assert [p.name for p in (tmp_path / "unet").glob("*.safetensors")] == [
        "diffusion_pytorch_model.fp16.safetensors"]
    result = convert(tmp_path / "unet", "all", out=tmp_path / "out", compile=False)  # the export is the point
    assert [c.component for c in result.components] == ["unet"]
    assert result.components[0].check["max_rel_error"] <= FP32_REL_TOL
    assert not (tmp_path / "out" / "model_index.json").exists()  # a lone module is not a pipeline


def test_two_runs_are_byte_identical(tmp_path, tiny_conversion):
    a = convert("tiny-sdxl", "vae_decoder", out=tmp_path / "a", check=False)
    b = convert("tiny-sdxl", "vae_decoder", out=tmp_path / "b", check=False)
    data = a.components[0].path.read_bytes()
    assert data == b.components[0].path.read_bytes()
    assert data == (tiny_conversion.out / "vae_decoder" / "model.onnx").read_bytes()


def test_large_modules_export_in_a_worker_process(tmp_path, tiny_conversion, monkeypatch):
    """Above ISOLATE_BYTES the torch side runs in a spawned process (torch's exporter holds on to tensors);
    the result is the same graph, byte for byte."""
    monkeypatch.setattr(budget, "ISOLATE_BYTES", 0)
    result = convert("tiny-sdxl", "vae_decoder", out=tmp_path, compile=False)
    assert result.components[0].check["max_rel_error"] <= FP32_REL_TOL
    assert result.components[0].path.read_bytes() == (tiny_conversion.out / "vae_decoder" / "model.onnx").read_bytes()


def test_worker_errors_come_back_as_clear_errors(tmp_path, monkeypatch):
    import shutil

    from sdnpu.convert.sources import PRESETS_DIR

    monkeypatch.setattr(budget, "ISOLATE_BYTES", 0)
    vae = tmp_path / "vae"
    shutil.copytree(PRESETS_DIR / "tiny-sdxl" / "vae", vae)
    (vae / "diffusion_pytorch_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(SdnpuError, match=f"cannot load AutoencoderKL weights from {vae}"):
        convert(vae, "vae_decoder", out=tmp_path / "out")
    assert not any((tmp_path / "out").iterdir())


def test_unknown_exporter_is_refused_before_any_work(tmp_path):
    with pytest.raises(SdnpuError, match="unknown exporter 'tracer'"):
        convert("tiny-sdxl", "vae_decoder", out=tmp_path / "out", exporter="tracer")
    assert not (tmp_path / "out").exists()


def test_torchscript_exporter_also_works(tmp_path):
    result = convert("tiny-sdxl", "unet", out=tmp_path, exporter="torchscript", compile=False)
    info = json.loads((tmp_path / "unet" / "export.json").read_text())
    assert info["exporter"] == "torchscript"
    assert result.components[0].check["max_rel_error"] <= FP32_REL_TOL


def _seed_previous_output(tiny_conversion, out: Path) -> bytes:
    import shutil

    shutil.copytree(tiny_conversion.out / "vae_decoder", out / "vae_decoder")
    return (out / "vae_decoder" / "model.onnx").read_bytes()


def test_failed_export_keeps_previous_output(tmp_path, tiny_conversion, monkeypatch):
    before = _seed_previous_output(tiny_conversion, tmp_path)

    def broken_export(wrapper, args, input_names, output_names, path, **kw):
        path.write_bytes(b"half a model")
        raise RuntimeError("simulated exporter crash")

    monkeypatch.setattr(torch_stage, "export_module", broken_export)
    with pytest.raises(SdnpuError, match="dynamo exporter failed on vae_decoder: RuntimeError"):
        convert("tiny-sdxl", "vae_decoder", out=tmp_path)
    assert (tmp_path / "vae_decoder" / "model.onnx").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["vae_decoder"]


def test_mismatch_with_pytorch_fails_and_keeps_previous_output(tmp_path, tiny_conversion, monkeypatch):
    before = _seed_previous_output(tiny_conversion, tmp_path)
    real = stages.run_onnx
    monkeypatch.setattr(stages, "run_onnx", lambda *a, **k: {n: o + 0.5 for n, o in real(*a, **k).items()})
    with pytest.raises(SdnpuError, match="does not match PyTorch: output 'sample'"):
        convert("tiny-sdxl", "vae_decoder", out=tmp_path)
    assert (tmp_path / "vae_decoder" / "model.onnx").read_bytes() == before


def test_sigkill_during_export_keeps_previous_output(tmp_path, tiny_conversion):
    before = _seed_previous_output(tiny_conversion, tmp_path)
    cmd = [sys.executable, "-m", "sdnpu", "-q", "convert", "--source", "tiny-sdxl", "--model", "vae_decoder",
           "--out", str(tmp_path)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    staging = tmp_path / f".vae_decoder.staging-{proc.pid}"
    deadline = time.monotonic() + 120
    while not staging.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert staging.exists(), "the run never started staging"
    time.sleep(0.5)  # inside the export
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (tmp_path / "vae_decoder" / "model.onnx").read_bytes() == before
    result = convert("tiny-sdxl", "vae_decoder", out=tmp_path, check=False)  # the next run succeeds ...
    assert not staging.exists()  # ... sweeps the dead run's staging ...
    assert result.components[0].path.read_bytes() == before  # ... and writes the same bytes


def test_resolution_must_fit_the_unet(tmp_path):
    with pytest.raises(SdnpuError, match="each side must be a multiple of 32") as e:
        convert("tiny-sdxl", "unet", out=tmp_path, res=200)
    assert e.value.hint == "the nearest that fit: 192x192, 192x224, 224x192, 224x224"
    with pytest.raises(SdnpuError, match="size 300x256 does not fit the unet") as e:
        convert("tiny-sdxl", "unet", out=tmp_path, res="300x256")
    assert e.value.hint == "the nearest that fit: 288x256, 320x256"
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("text, size", [("1152x896", (896, 1152)), ("1024", (1024, 1024)),
                                        (" 640 X 1536 ", (1536, 640))])
def test_sizes_are_written_width_by_height(text, size):
    from sdnpu.imagesize import Size

    assert Size.parse(text) == size and Size.of(size) == size


@pytest.mark.parametrize("text, message", [("1152x", "cannot read the size"), ("wide", "cannot read the size"),
                                           ("256x256,1152x", "cannot read the size '1152x'"),
                                           (",", "names no size"),
                                           ("256x256,250x256", "size 250x256 does not fit the unet"),
                                           ("0x1024", "not a positive number of pixels")])
def test_bad_sizes_get_one_line(text, message, tmp_path, capsys):
    from sdnpu.cli import main

    assert main(["convert", "--source", "tiny-sdxl", "--model", "unet", "--res", text, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_a_run_that_cannot_fit_says_so_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """A conversion whose onnxruntime run cannot fit (here: 1 MB available) stops before the run with one line
    naming the largest tensor and the fix; the output folder keeps what it had. (It used to be killed: an SD
    1.5-style UNet at 128 x 128 latents reached 20.5 GB in its attention.)"""
    from sdnpu import memory
    from sdnpu.cli import main

    out = tmp_path / "out"
    assert main(["-q", "convert", "--source", "tiny-sdxl", "--model", "vae_decoder", "--out", str(out)]) == 0
    before = (out / "vae_decoder" / "model.onnx").read_bytes()
    monkeypatch.setattr(memory, "available_bytes", lambda: 1_000_000)
    assert main(["-q", "convert", "--source", "tiny-sdxl", "--model", "vae_decoder", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "running the exported graph in onnxruntime (the check against PyTorch) needs at least" in err
    import re

    assert re.search(r"and 2 x [0-9.]+ GB for \S+ \[1, 32, 256, 256\]\); 0.0 GB is available", err), err
    lines = err.splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("sdnpu: error:")]
    assert len(errors) == 1 and lines[errors[0] + 1].startswith("  hint: --no-check skips the check")
    assert (out / "vae_decoder" / "model.onnx").read_bytes() == before
    assert main(["-q", "compile", str(out / "vae_decoder" / "model.onnx"), "--out", str(tmp_path / "dd")]) == 2
    assert "--no-verify skips the fidelity run" in capsys.readouterr().err
    assert not (tmp_path / "dd").exists()


def test_a_compile_writes_the_same_bytes_in_any_process(tiny_conversion, tmp_path):
    """Two processes with other hash seeds (set and dict orders that depend on them differ) compile one graph
    into the same dispatch model, byte for byte: the reference functions went in a set's order once."""
    source = tiny_conversion.out / "unet" / "model.onnx"
    code = ("import sys; from pathlib import Path; from sdnpu.convert.compile import compile_file; "
            "compile_file(Path(sys.argv[1]), Path(sys.argv[2]), verify=False)")
    outs = []
    for seed in ("1", "2"):
        out = tmp_path / seed
        subprocess.run([sys.executable, "-c", code, str(source), str(out)], check=True, capture_output=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}, timeout=600)
        outs.append(out)
    for name in ("replaced.onnx", "replaced.onnx.data"):
        a, b = (o / name for o in outs)
        assert a.is_file() == b.is_file()
        if a.is_file():
            assert a.read_bytes() == b.read_bytes(), name
