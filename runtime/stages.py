"""What the text-to-image loops of every pipeline share (``sdnpu.runtime.text2image`` for SDXL and SD 1.x,
``sdnpu.runtime.sd3``): a converted folder's ``model_index.json``, its scheduler, sessions opened per stage, and
how several images go through the denoiser's converted batches (``plan_calls``)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from sdnpu.errors import SdnpuError
from sdnpu.imagesize import Size
from sdnpu.progress import release_memory
from sdnpu.runtime.session import Component, RuntimeOptions, open_component
from sdnpu.signatures import CFG_BATCH, batched


class Stages:
    """Sessions opened per stage of a pipeline (``folder``, ``reference``, ``runtime``, ``size``, ``keep``:
    set by the pipeline), dropped after it unless kept."""

    folder: Path
    reference: bool
    keep: bool | frozenset[str]  # True: every session; a set: those components' (the rest per stage)
    runtime: RuntimeOptions
    size: Size | None
    parts: dict[tuple[str, int | None], Component]  # kept sessions, by component and batch

    def generate(self, opts: Any, progress: Callable[[int, int], None] | None = None) -> list[np.ndarray]:
        raise NotImplementedError

    def __call__(self, opts: Any, progress: Callable[[int, int], None] | None = None) -> np.ndarray:
        """The image, [H, W, 3] uint8 (``opts``: ``GenerateOptions`` with one image)."""
        if opts.num_images != 1:
            raise SdnpuError(f"a pipeline call draws one image, not {opts.num_images}",
                             hint=f"{type(self).__name__}.generate(opts) draws num_images")
        return self.generate(opts, progress)[0]

    @contextlib.contextmanager
    def _using(self, *names: str, runtime: RuntimeOptions | None = None,
               batch: int | None = None) -> Iterator[dict[str, Component]]:
        """Sessions for ``names`` for the length of a stage (kept when ``keep_sessions``, by name and batch);
        ``runtime``: how to make them, where not as the pipeline's; ``batch``: the denoisers' (None: their first
        at the size)."""
        runtime = runtime or self.runtime
        key = {n: (n, batch if batched(n) else None) for n in names}
        parts = {n: self.parts.get(key[n]) or open_component(self.folder, n, self.reference, runtime, self.size,
                                                               batch=batch if batched(n) else None)
                 for n in names}
        kept = [n for n in names if self.keep is True or (self.keep and n in self.keep)]
        self.parts.update({key[n]: parts[n] for n in kept})
        try:
            yield parts
        finally:
            parts.clear()
            if len(kept) < len(names):
                release_memory()


def check_generate(opts: Any) -> None:
    """Refuse, before any work, options no pipeline can run."""
    if opts.steps < 1:
        raise SdnpuError(f"steps must be at least 1, not {opts.steps}")
    if opts.num_images < 1:
        raise SdnpuError(f"--num-images must be at least 1, not {opts.num_images}")
    if opts.guidance < 0:
        raise SdnpuError(f"guidance must be at least 0, not {opts.guidance:g}",
                         hint="0 or 1: no guidance (Turbo, LCM); above 1: classifier-free guidance")
    if opts.strength is not None and not 0 < opts.strength <= 1:
        raise SdnpuError(f"strength must be in (0, 1], not {opts.strength:g}")
    if getattr(opts, "mask", None) is not None and opts.image is None:
        raise SdnpuError("--mask needs the picture it masks", hint="give --image in.png with --mask mask.png")


def plan_calls(images: int, cfg: bool, batches: list[int], add: Callable[[int], str]) -> list[tuple[int, int]]:
    """The denoiser calls that draw ``images``: (batch, images in it) each, as few as the converted ``batches``
    allow (the largest that fits first). With guidance (``cfg``) an image takes two rows of a batch
    (unconditional, conditional), without one. A rest no batch fits is refused, naming the ``--add`` (``add``:
    batch -> command) that fixes it."""
    rows = 2 if cfg else 1
    per_call = sorted({b // rows for b in batches if b % rows == 0 and b >= rows}, reverse=True)
    calls: list[tuple[int, int]] = []
    left = images
    while left:
        k = next((n for n in per_call if n <= left), None)
        if k is None:
            want = rows  # one image a call: always fits
            mode = "guidance above 1 (two rows an image)" if cfg else "guidance at most 1 (one row an image)"
            raise SdnpuError(
                f"the denoiser is converted at batch {', '.join(map(str, batches))}: none draws "
                f"{'the' if left == images else 'the last'} {left} image{'s' if left > 1 else ''} at {mode}",
                hint=f"add batch {want}: {add(want)}"
                + ("; or generate with --guidance above 1" if not cfg and CFG_BATCH in batches else ""))
        calls.append((rows * k, k))
        left -= k
    return calls


def halves(neg: np.ndarray | None, pos: np.ndarray | None, k: int) -> np.ndarray:
    """A denoiser input for ``k`` images: the unconditional rows then the conditional ones (diffusers' order),
    or only the conditional ones where there is no guidance (``neg`` empty)."""
    parts = ([neg] * k if neg is not None and len(neg) else []) + [pos] * k  # type: ignore[list-item]
    return np.concatenate(parts).astype(np.float32)


def load_scheduler(folder: Path, name: str | None) -> Any:
    """The folder's scheduler (``scheduler/scheduler_config.json``), or diffusers' scheduler class ``name``
    made from that config."""
    import diffusers

    config = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    cls_name = name or config["_class_name"]
    cls = getattr(diffusers, cls_name, None)
    if cls is None or not hasattr(cls, "from_config"):
        raise SdnpuError(f"unknown scheduler {cls_name!r}",
                         hint="a diffusers scheduler class, e.g. EulerDiscreteScheduler, DDIMScheduler "
                         "(FlowMatchEulerDiscreteScheduler for SD3)")
    return cls.from_config(config)




def read_index(folder: Path) -> dict[str, Any]:
    """A converted folder's ``model_index.json``, or the error that says it is not one."""
    path = folder / "model_index.json"
    if not path.is_file():
        raise SdnpuError(f"{folder} is not a converted pipeline folder (no model_index.json)",
                         hint="make convert MODEL=all writes one: models/<source name>/")
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SdnpuError(f"cannot read {path}: {e}", hint="convert the pipeline again") from e
    if not isinstance(index, dict):
        raise SdnpuError(f"{path} does not hold a JSON object", hint="convert the pipeline again")
    return index
