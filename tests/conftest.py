"""Shared fixtures: one tiny-sdxl and one tiny-sd3 conversion per test session (reused by the tests that read
them), and the local folders made from their presets.

The session's expensive fixtures (and the test modules' own) are made once per run however many pytest-xdist
workers ask for them (``once``): the first worker makes it under a lock in the run's shared temporary folder,
the others wait and read what it made. They are read-only: a test that changes one copies it first."""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

T = TypeVar("T")


def _share_the_cores() -> None:
    """Under pytest-xdist the workers share the machine's cores: each worker's torch, its subprocesses' OpenMP
    and each onnxruntime session it opens (where the test sets no thread count) take cores / workers threads,
    and onnxruntime's pool does not spin waiting for work. Left to their defaults, two workers' pools as wide as
    the machine, spinning, took 201 s for test_zoo.py and test_node_tests.py where this took 183 s (2 cores, 2
    workers, one run each, the same run)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers < 2:
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import onnxruntime as ort
    import torch

    torch.set_num_threads(threads)
    init = ort.InferenceSession.__init__

    def shared(self, path_or_bytes, sess_options=None, providers=None, provider_options=None, **kwargs):
        options = sess_options if sess_options is not None else ort.SessionOptions()
        if options.intra_op_num_threads == 0:
            options.intra_op_num_threads = threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        init(self, path_or_bytes, options, providers, provider_options, **kwargs)

    ort.InferenceSession.__init__ = shared  # type: ignore[method-assign]


_share_the_cores()


def once(factory: pytest.TempPathFactory, key: str, make: Callable[[Path], T]) -> T:
    """``make(folder)`` (``folder``: a new empty folder) run once per test run, its value shared by every xdist
    worker that asks for ``key`` (pickled beside it); without xdist, simply run."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return make(factory.mktemp(key))
    from filelock import FileLock

    root = factory.getbasetemp().parent / "shared"
    root.mkdir(exist_ok=True)
    with FileLock(str(root / f"{key}.lock")):
        record = root / f"{key}.pickle"
        if record.is_file():
            return pickle.loads(record.read_bytes())
        folder = root / key
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        value = make(folder)
        record.write_bytes(pickle.dumps(value))
        return value


@pytest.fixture(scope="session")
def tiny_conversion(tmp_path_factory: pytest.TempPathFactory):
    from sdnpu.convert import convert

    return once(tmp_path_factory, "tiny-sdxl", lambda out: convert("tiny-sdxl", "all", out=out))


@pytest.fixture(scope="session")
def tiny_sd15_conversion(tmp_path_factory: pytest.TempPathFactory):
    """tiny-sd15 converted whole (SD 1.5's architecture: one text encoder, no added conditioning)."""
    from sdnpu.convert import convert

    return once(tmp_path_factory, "tiny-sd15", lambda out: convert("tiny-sd15", "all", out=out))


@pytest.fixture(scope="session")
def tiny_pipeline_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-sdxl written by diffusers' own save_pretrained: a local folder as users have them."""
    return once(tmp_path_factory, "my-sdxl", _sdxl_folder)


def _sdxl_folder(root: Path) -> Path:
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline
    from transformers import CLIPTokenizer

    from sdnpu.convert import resolve_source

    src = resolve_source("tiny-sdxl")
    tok_dir = root / "tok"
    tok_dir.mkdir()
    src.write_pipeline_files(tok_dir)
    pipe = StableDiffusionXLPipeline(
        vae=src.load_module("vae"),
        text_encoder=src.load_module("text_encoder"),
        text_encoder_2=src.load_module("text_encoder_2"),
        tokenizer=CLIPTokenizer.from_pretrained(tok_dir / "tokenizer"),
        tokenizer_2=CLIPTokenizer.from_pretrained(tok_dir / "tokenizer_2"),
        unet=src.load_module("unet"),
        scheduler=EulerDiscreteScheduler.from_pretrained(tok_dir / "scheduler"),
    )
    folder = root / "local" / "my-sdxl"
    pipe.save_pretrained(folder)
    return folder


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): _digest(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def _arrays(path: Path) -> dict[str, np.ndarray]:
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.fixture(scope="session")
def two_sizes(tiny_conversion, tmp_path_factory) -> Path:
    """The session's tiny-sdxl conversion (256x256) copied, and 320x256 added to its UNet and VAE decoder
    (their dispatch models re-derived from the primary's: sdnpu.passes.specialize). Read-only: copy it first."""
    return once(tmp_path_factory, "two-sizes", lambda root: _two_sizes(tiny_conversion, root))


def _two_sizes(tiny_conversion, root: Path) -> Path:
    from sdnpu.convert import convert

    folder = root / "tiny-sdxl"
    shutil.copytree(tiny_conversion.out, folder)
    before = _tree(folder)
    result = convert("tiny-sdxl", "unet,vae_decoder", out=folder, res="320x256", add=True)
    assert [(c.component, c.size) for c in result.components] == [("vae_decoder", "320x256"), ("unet", "320x256")]
    after = _tree(folder)
    changed = {k for k in before if before[k] != after.get(k)}
    # tiny-sdxl keeps its weights inside the graph: the first added size moves them, once, into the data files
    # that the sizes then share; nothing else that was there changes but the reports' sizes tables
    assert changed <= {f"{c}/{f}" for c in ("unet", "vae_decoder")
                       for f in ("model.onnx", "dd/replaced.onnx", "dd/report.json", "dd/onnx_report.txt",
                                 "sizes.json")}
    for comp in ("unet", "vae_decoder"):
        for graph in ("model.onnx", "dd/replaced.onnx"):  # the same tensors, now in the data file
            a, b = _arrays(tiny_conversion.out / comp / graph), _arrays(folder / comp / graph)
            assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    return folder


@pytest.fixture(scope="session")
def tiny_sd3(tmp_path_factory: pytest.TempPathFactory):
    """tiny-sd3 converted whole: three text encoders, the transformer, the 16-channel VAE."""
    from sdnpu.convert import convert

    return once(tmp_path_factory, "tiny-sd3", lambda out: convert("tiny-sd3", "all", out=out))


@pytest.fixture(scope="session")
def tiny_sd3_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-sd3 written by diffusers' own save_pretrained: a local folder as users have them."""
    return once(tmp_path_factory, "my-sd3", _sd3_folder)


def _sd3_folder(root: Path) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from transformers import CLIPTokenizer, T5TokenizerFast

    from sdnpu.convert import resolve_source

    src = resolve_source("tiny-sd3")
    files = root / "sd3-files"
    files.mkdir()
    src.write_pipeline_files(files)
    pipe = StableDiffusion3Pipeline(
        transformer=src.load_module("transformer"), vae=src.load_module("vae"),
        text_encoder=src.load_module("text_encoder"), text_encoder_2=src.load_module("text_encoder_2"),
        text_encoder_3=src.load_module("text_encoder_3"),
        tokenizer=CLIPTokenizer.from_pretrained(files / "tokenizer"),
        tokenizer_2=CLIPTokenizer.from_pretrained(files / "tokenizer_2"),
        tokenizer_3=T5TokenizerFast.from_pretrained(files / "tokenizer_3"),
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(files / "scheduler"))
    folder = root / "local" / "my-sd3"
    pipe.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_flux(tmp_path_factory: pytest.TempPathFactory):
    """tiny-flux converted whole: CLIP-L, T5, the 16-channel VAE, the transformer (dev: guidance embedded)."""
    from sdnpu.convert import convert

    return once(tmp_path_factory, "tiny-flux", lambda out: convert("tiny-flux", "all", out=out))


@pytest.fixture(scope="session")
def tiny_qwen_image(tmp_path_factory: pytest.TempPathFactory):
    """tiny-qwen-image converted whole at 64 px (32 x 32 latents: 256 image tokens; 64 prompt tokens): its
    Qwen2.5-VL text encoder, the one-frame VAE and the transformer at batch 2 (true CFG)."""
    from sdnpu.convert import convert

    return once(tmp_path_factory, "tiny-qwen-image", lambda out: convert("tiny-qwen-image", "all", out=out, res=64))


@pytest.fixture(scope="session")
def tiny_flux_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-flux written by diffusers' own save_pretrained (``FluxPipeline``): a local folder as users have
    them, with the preset's generation.json beside it."""
    return once(tmp_path_factory, "my-flux", _flux_folder)


def _flux_folder(root: Path) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
    from transformers import CLIPTokenizer, T5TokenizerFast

    from sdnpu.convert import resolve_source

    src = resolve_source("tiny-flux")
    files = root / "flux-files"
    files.mkdir()
    src.write_pipeline_files(files)
    pipe = FluxPipeline(
        transformer=src.load_module("transformer"), vae=src.load_module("vae"),
        text_encoder=src.load_module("text_encoder"), text_encoder_2=src.load_module("text_encoder_2"),
        tokenizer=CLIPTokenizer.from_pretrained(files / "tokenizer"),
        tokenizer_2=T5TokenizerFast.from_pretrained(files / "tokenizer_2"),
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(files / "scheduler"))
    folder = root / "local" / "my-flux"
    pipe.save_pretrained(folder)
    shutil.copy(files / "generation.json", folder / "generation.json")
    return folder


@pytest.fixture(scope="session")
def tiny_flux_blockwise(tmp_path_factory: pytest.TempPathFactory, tiny_flux_folder: Path):
    """tiny-flux's transformer from its local folder (safetensors, the preset's weights) converted block by
    block (``--blockwise``: what flux-dev's 47.6 GB of fp32 weights need here)."""
    from sdnpu.convert import convert

    return once(tmp_path_factory, "flux-blocks",
                lambda out: convert(tiny_flux_folder, "transformer", out=out, blockwise=True))
