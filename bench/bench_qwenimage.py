"""`sdnpu generate` on converted tiny-qwen-image folders against diffusers' own QwenImagePipeline (PyTorch, the
same seeded weights, seed and starting latents): the fp32 graphs and the dispatch models, with true CFG (a
negative prompt, guidance 4) and without (guidance 1, where the folder has a batch the image fits).

    python bench/bench_qwenimage.py models/tiny-qwen-image [more folders]

Prints one row per folder and mode: the levels apart (of 255) at most, the share of values that differ at all
and of those more than 1 level apart, the PSNR, for the fp32 graphs and for the dispatch models, against
diffusers' image, and each run's seconds.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from sdnpu.errors import SdnpuError  # noqa: E402
from sdnpu.runtime import GenerateOptions, Pipeline  # noqa: E402
from sdnpu.runtime.flux import pack  # noqa: E402
from tests.images import psnr  # noqa: E402
from tests.test_qwenimage import _diffusers_pipeline  # noqa: E402

MODES = {"true CFG 4": GenerateOptions("a photo of a cat", negative_prompt="blurry, low quality", steps=3,
                                       guidance=4.0, seed=4),
         "no guidance": GenerateOptions("a red bicycle", steps=3, guidance=1.0, seed=7)}


def _apart(a: np.ndarray, b: np.ndarray) -> str:
    """The largest difference in levels, the share of values that differ, the share more than 1 level apart,
    the PSNR."""
    diff = np.abs(a.astype(int) - b.astype(int))
    return f"{diff.max()}, {np.mean(diff > 0):.4%}, {np.mean(diff > 1):.4%}, {psnr(a, b):.1f} dB"


def main(folders: list[str]) -> None:
    print("| folder | size | mode | fp32: max levels, share differing, share > 1, PSNR | dispatch: the same "
          "| diffusers s | fp32 s | dispatch s |")
    print("|---|---|---|---|---|---|---|---|")
    for folder in map(Path, folders):
        pipe = _diffusers_pipeline(folder)
        for mode, opts in MODES.items():
            ours = Pipeline(folder, reference=True)
            try:
                t = time.perf_counter()
                image = ours(opts)
                fp32_s = time.perf_counter() - t
            except SdnpuError as e:  # no batch the mode fits
                print(f"| {folder.name} | | {mode} | {str(e).splitlines()[0]} | | | | |")
                continue
            h, w = ours.image_size
            kw = {"negative_prompt": opts.negative_prompt} if opts.guidance > 1 else {}
            t = time.perf_counter()
            want = pipe(opts.prompt, num_inference_steps=opts.steps, true_cfg_scale=opts.guidance, height=h, width=w,
                        latents=torch.from_numpy(pack(ours.noise(opts.seed))), max_sequence_length=ours.text_len,
                        output_type="np", **kw).images[0]
            torch_s = time.perf_counter() - t
            want = (want * 255).round().astype(np.uint8)
            t = time.perf_counter()
            dispatch = Pipeline(folder)(opts)
            dd_s = time.perf_counter() - t
            print(f"| {folder.name} | {w}x{h} | {mode} | {_apart(want, image)} | {_apart(want, dispatch)} "
                  f"| {torch_s:.1f} | {fp32_s:.1f} | {dd_s:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
