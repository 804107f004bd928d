"""Shared fixtures: one tiny-sdxl conversion per test session (about 20 s), reused by the tests that read it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_conversion(tmp_path_factory: pytest.TempPathFactory):
    from sdnpu.convert import convert

    out = tmp_path_factory.mktemp("tiny-sdxl")
    return convert("tiny-sdxl", "all", out=out)


@pytest.fixture(scope="session")
def tiny_pipeline_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-sdxl written by diffusers' own save_pretrained: a local folder as users have them."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline
    from transformers import CLIPTokenizer

    from sdnpu.convert import resolve_source

    src = resolve_source("tiny-sdxl")
    tok_dir = tmp_path_factory.mktemp("tok")
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
    folder = tmp_path_factory.mktemp("local") / "my-sdxl"
    pipe.save_pretrained(folder)
    return folder
