"""What the text-to-image loops of every pipeline share (``sdnpu.runtime.text2image`` for SDXL and SD 1.x,
``sdnpu.runtime.sd3``, ``sdnpu.runtime.flux``): a converted folder's ``model_index.json``, its scheduler, sessions
opened per stage, how several images go through the denoiser's converted batches (``plan_calls``), and the
set-up, decode and noise of the transformer families' loops (``TransformerStages``)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from sdnpu.errors import SdnpuError
from sdnpu.families import Family
from sdnpu.formats import generation
from sdnpu.imagesize import Size
from sdnpu.progress import release_memory
from sdnpu.runtime.session import Component, RuntimeOptions, batches_at, component_path, open_component
from sdnpu.signatures import CFG_BATCH, batched, vae_scale_factor


class Stages:
    """Sessions opened per stage of a pipeline (``folder``, ``reference``, ``runtime``, ``size``, ``keep``:
    set by the pipeline), dropped after it unless kept."""

    folder: Path
    reference: bool
    keep: bool | frozenset[str]  # True: every session; a set: those components' (the rest per stage)
    runtime: RuntimeOptions
    size: Size | None
    index: dict[str, Any]  # the folder's model_index.json
    parts: dict[tuple[str, int | None], Component]  # kept sessions, by component and batch

    def _open(self, folder: str | Path, reference: bool, keep_sessions: bool | frozenset[str],
              runtime: RuntimeOptions | None, size: Any) -> None:
        """What every loop's set-up begins with: the folder and its ``model_index.json`` (refused where it is not
        a converted folder), how sessions are made and kept, the size to draw at (None: the folder's primary)."""
        self.folder = Path(folder)
        self.reference, self.keep, self.runtime = reference, keep_sessions, runtime or RuntimeOptions()
        self.index = read_index(self.folder)
        self.size = Size.of(size) if size is not None else None
        self.parts = {}

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


class TransformerStages(Stages):
    """The loops of the transformer families (SD3's ``SD3Pipeline``, Flux.1's ``FluxPipeline``): their set-up,
    the same to the letter, then the family's own (``_set_up``); the VAE decode and the starting noise they
    share. Sessions are opened per stage and dropped after it unless ``keep_sessions``."""

    family: Family  # the family whose loop it is (``sdnpu.families``): its generation defaults
    required: tuple[str, ...]  # the text encoders the folder must hold (the others are optional)
    tokenizers: dict[str, Any]  # by text encoder: the loop's own (a cached property)
    latent_shape: tuple[int, ...]  # (1, C, H/f, W/f): set by ``_set_up``

    def __init__(self, folder: str | Path, reference: bool = False, keep_sessions: bool | frozenset[str] = False,
                 runtime: RuntimeOptions | None = None, size: Any = None) -> None:
        self._open(folder, reference, keep_sessions, runtime, size)
        for name in (*self.required, "transformer", "vae_decoder"):
            component_path(self.folder, name, reference, self.size)  # refused, with the fix, if absent
        self.vae_config = json.loads((self.folder / "vae_decoder" / "config.json").read_text())
        self.transformer_config = json.loads((self.folder / "transformer" / "config.json").read_text())
        # the transformer's inputs and their dims, at the size (its graph read without its weights)
        self.inputs = graph_inputs(component_path(self.folder, "transformer", reference, self.size))
        self.batches = batches_at(self.folder, "transformer", self.size) or [self.inputs["hidden_states"][0]]
        self.generation = generation.read(self.folder, self.family.name)
        self._set_up()

    def _set_up(self) -> None:
        """The family's own set-up after the shared one: its latent shape, image size and text length."""
        raise NotImplementedError

    def _packed_latents(self, channels: int) -> None:
        """``latent_shape`` and ``image_size`` of a transformer that takes its latents packed 2 x 2 into tokens
        (Flux.1's, Qwen-Image's): at the folder's size, or the primary one read from the VAE decoder beside it
        (its last two dims; the tokens alone do not say the aspect); refused where the two disagree."""
        tokens, factor = self.inputs["hidden_states"][1], vae_scale_factor(self.vae_config)
        if self.size is None:
            decoder = graph_inputs(component_path(self.folder, "vae_decoder", self.reference))
            lh, lw = next(iter(decoder.values()))[-2:]
        else:
            lh, lw = self.size.height // factor, self.size.width // factor
        if (lh // 2) * (lw // 2) != tokens:
            raise SdnpuError(f"the transformer takes {tokens} image tokens, latents of {lh}x{lw} make "
                             f"{(lh // 2) * (lw // 2)}", hint="convert the transformer and the VAE at one size")
        self.latent_shape = (1, channels, lh, lw)
        self.image_size = (factor * lh, factor * lw)  # (height, width) in pixels

    def _ids(self, name: str, text: str, length: int) -> np.ndarray:
        """``text`` as text encoder ``name``'s token ids, padded or cut to ``length``: [1, length] int64."""
        ids = self.tokenizers[name](text, padding="max_length", max_length=length, truncation=True).input_ids
        return np.asarray(ids, dtype=np.int64)[None]

    def _decode(self, latents: np.ndarray) -> list[np.ndarray]:
        """Denoised latents [k, C, h, w] (float32) -> k images [H, W, 3] uint8: / scaling_factor + shift_factor,
        then the VAE decoder one image at a time."""
        z = latents / float(self.vae_config["scaling_factor"]) + float(self.vae_config.get("shift_factor") or 0.0)
        images = []
        with self._using("vae_decoder") as parts:
            for j in range(len(z)):
                image = parts["vae_decoder"].run({"latent_sample": z[j : j + 1]}, ["sample"])["sample"][0]
                images.append((np.clip(image.transpose(1, 2, 0) / 2 + 0.5, 0, 1) * 255).round().astype(np.uint8))
        return images

    def noise(self, seed: int) -> np.ndarray:
        """The starting latents for ``seed``, [1, C, H/f, W/f] (flow matching starts from plain Gaussian noise)."""
        return np.random.default_rng(seed).standard_normal(self.latent_shape).astype(np.float32)


def graph_inputs(path: Path) -> dict[str, list[int]]:
    """The inputs of the graph at ``path`` and their dims, in order (read without its weights)."""
    graph = onnx.load(str(path), load_external_data=False).graph
    return {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}


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


def plan_calls(images: int, cfg: bool, batches: list[int], add: Callable[[int], str], apart: bool = False
               ) -> list[tuple[int, int]]:
    """The denoiser calls that draw ``images``: (batch, images in it) each, as few as the converted ``batches``
    allow (the largest that fits first). With guidance (``cfg``) an image takes two rows of a batch
    (unconditional, conditional), without one. With ``apart`` (a pipeline whose reference runs the guidance's
    halves as two calls, as diffusers' ``QwenImagePipeline`` does) a batch of ``k`` also draws ``k`` guided images,
    in two runs (``run_rows``): the call is ``(k, k)``, and a batch of ``2k`` in one run is taken before it. A rest
    no batch fits is refused, naming the ``--add`` (``add``: batch -> command) that fixes it."""
    rows = 2 if cfg else 1
    fits = {b // rows: b for b in sorted(batches) if b % rows == 0 and b >= rows}  # images -> one-run batch
    if cfg and apart:
        fits = {**{b: b for b in batches}, **fits}
    per_call = sorted(fits, reverse=True)
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
        calls.append((fits[k], k))
        left -= k
    return calls


def run_rows(component: Component, feeds: dict[str, np.ndarray], outputs: list[str], batch: int
             ) -> dict[str, np.ndarray]:
    """``component`` (converted at ``batch``) run on ``feeds`` whose every input holds ``n * batch`` rows along
    its first axis: ``n`` runs of ``batch`` rows each, their outputs concatenated in order (one run where
    ``n`` is 1)."""
    counts = {len(v) for v in feeds.values()}
    if len(counts) != 1 or next(iter(counts)) % batch:
        raise SdnpuError(f"{component.name} is converted at batch {batch}: its feeds hold "
                         f"{sorted(counts)} rows, not a multiple of it")
    n = next(iter(counts)) // batch
    if n == 1:
        return component.run(feeds, outputs)
    parts = [component.run({k: v[i * batch : (i + 1) * batch] for k, v in feeds.items()}, outputs)
             for i in range(n)]
    return {name: np.concatenate([p[name] for p in parts]) for name in outputs}


def halves(neg: np.ndarray | None, pos: np.ndarray | None, k: int) -> np.ndarray:
    """A denoiser input for ``k`` images: the unconditional rows then the conditional ones (diffusers' order),
    or only the conditional ones where there is no guidance (``neg`` empty)."""
    parts = ([neg] * k if neg is not None and len(neg) else []) + [pos] * k  # type: ignore[list-item]
    return np.concatenate(parts).astype(np.float32)


def load_scheduler(folder: Path, name: str | None) -> Any:
    """The folder's scheduler (``scheduler/scheduler_config.json``), or diffusers' scheduler class ``name``
    made from that config."""
    import diffusers  # diffusers at first use: the CLI starts without it (2-3 s, torch with it)

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
