"""Text-to-image on a converted folder, every graph in onnxruntime (SDXL; SD 1.x/2.x folders too).

    prompt -> tokenizer(s) -> text encoder(s): penultimate hidden states (concatenated for SDXL's two) and
    text_encoder_2's pooled text_embeds -> UNet at batch 2 (negative, positive) with SDXL's time_ids ->
    classifier-free guidance -> scheduler step -> ... -> latents / scaling_factor -> VAE decoder -> PNG
    (image-to-image: the picture through the VAE encoder, noised to where ``strength`` of the schedule is left;
    inpainting: a mask over it, as diffusers' inpainting pipelines (``Inpainting``); with ControlNets, each step
    runs them first and the UNet that takes their residuals: runtime/controlnet.py)

The scheduler is the folder's (``scheduler/``) through diffusers, or any other diffusers scheduler by name.
Seeds give the same image twice: the initial noise is drawn with numpy from the seed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from sdnpu import families
from sdnpu.components import CLIP_ENCODERS
from sdnpu.errors import SdnpuError
from sdnpu.fileio import atomic_write_bytes
from sdnpu.formats import generation, handoff, prologue
from sdnpu.formats.handoff import handover
from sdnpu.runtime.controlnet import (
    ControlSpec,
    check_compatible,
    config_of,
    control_image,
    controlnet_folder,
    keep,
    residual_inputs,
)
from sdnpu.runtime.session import (
    Component,
    RuntimeOptions,
    add_command,
    batches_at,
    choose_optimize,
    component_path,
    open_component,
)
from sdnpu.runtime.stages import Stages, check_generate, halves, load_scheduler, plan_calls, read_index
from sdnpu.signatures import vae_scale_factor
from sdnpu.specs import pipeline_outputs

log = logging.getLogger(__name__)


@dataclass
class GenerateOptions:
    """What to draw (``sdnpu generate``'s options; the CLI takes steps and guidance from the folder's
    ``generation.json`` where not given: a Turbo folder's 1 step at guidance 0, ``sdnpu.formats.generation``)."""

    prompt: str
    negative_prompt: str = ""
    steps: int = 30
    guidance: float = 5.0
    seed: int = 0
    scheduler: str | None = None  # a diffusers scheduler class name; default: the folder's
    image: str | Path | None = None  # image-to-image: the starting picture
    strength: float | None = None  # how much of the schedule runs over it (1.0: all of it); default: 0.3, or
    # 1.0 when inpainting (SD 1.5 inpainting's default: the masked area drawn anew)
    controlnets: tuple[ControlSpec, ...] = ()  # ControlNets and their control images (runtime/controlnet.py)
    num_images: int = 1  # image k from seed + k
    mask: str | Path | None = None  # inpainting: white where to draw, black where to keep ``image``


class Pipeline(Stages):
    """A converted folder and the loop that runs its components (SDXL's and SD 1.x's; another family's folder
    gets its family's loop, named by its row in ``sdnpu.families``: an SD3 folder ``SD3Pipeline``, a Flux.1
    folder ``FluxPipeline``, with the same interface).

    By default each stage opens its sessions and drops them when done (text encoders, then the UNet, then
    the VAE), so the peak is the largest stage, not the sum: at full SDXL size in fp32 the four sessions
    together would not fit beside the UNet's activations on a 24 GiB machine. ``keep_sessions=True`` keeps
    them open for repeated generation; a set of component names keeps those (``sdnpu serve``: the ones that
    fit). ``runtime``: how sessions are made (a custom-op library, graph optimizations, threads; see
    ``sdnpu.runtime.session.RuntimeOptions``)."""

    def __new__(cls, folder: str | Path, *args: Any, **kwargs: Any) -> Any:
        # the family's loop, imported by the name its row gives (the transformer families' modules import
        # nothing of this one, and this one none of theirs)
        loop = families.load(families.detect(read_index(Path(folder))).runtime)
        if loop is not Pipeline:
            return loop(folder, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, folder: str | Path, reference: bool = False, keep_sessions: bool | frozenset[str] = False,
                 runtime: RuntimeOptions | None = None, size: Any = None) -> None:
        self._open(folder, reference, keep_sessions, runtime, size)
        self.family = families.detect(self.index)
        self.sdxl = self.family.text_encoders == CLIP_ENCODERS  # SDXL's prompt: both CLIP encoders'
        # the UNet, or where the folder holds only the one that takes a ControlNet's residuals, that one
        denoiser = "unet_controlnet" if not (self.folder / "unet").is_dir() and (
            self.folder / "unet_controlnet").is_dir() else "unet"
        needed = ["text_encoder", denoiser, "vae_decoder"] + (["text_encoder_2"] if self.sdxl else [])
        self.denoiser = denoiser
        paths = {name: component_path(self.folder, name, reference, self.size) for name in needed}
        self.vae_config = json.loads((self.folder / "vae_decoder" / "config.json").read_text())
        unet = onnx.load(str(paths[denoiser]), load_external_data=False)
        if prologue.of_proto(unet) is not None:  # its step prologue takes the inputs: the fp32 graph's are they
            unet = onnx.load(str(component_path(self.folder, denoiser, True, self.size)), load_external_data=False)
        self.unet_inputs = {i.name for i in unet.graph.input}
        sample = next(i for i in unet.graph.input if i.name == "sample")
        shape = [d.dim_value for d in sample.type.tensor_type.shape.dim]
        self.batches = batches_at(self.folder, denoiser, self.size) or [shape[0]]
        self.latent_shape = (1, int(self.vae_config.get("latent_channels", 4)), *shape[2:])
        # an inpainting UNet takes the mask and the masked picture's latents beside the latents (9 channels)
        self.inpainting_unet = shape[1] == 2 * self.latent_shape[1] + 1
        if shape[1] not in (self.latent_shape[1], 2 * self.latent_shape[1] + 1):
            raise SdnpuError(f"{paths[denoiser]} takes {shape[1]} latent channels: sdnpu runs denoisers of "
                             f"{self.latent_shape[1]} (text-to-image) or {2 * self.latent_shape[1] + 1} (inpainting)")
        factor = vae_scale_factor(self.vae_config)
        self.image_size = (factor * shape[2], factor * shape[3])  # (height, width) in pixels
        self.generation = generation.read(self.folder)

    @cached_property
    def tokenizers(self) -> list[Any]:
        # transformers at first use: the CLI starts without it (about 2 s, torch with it)
        from transformers import CLIPTokenizer

        names = ("tokenizer", "tokenizer_2") if self.sdxl else ("tokenizer",)
        return [CLIPTokenizer.from_pretrained(self.folder / name) for name in names]

    def _tokenize(self, text: str) -> tuple[np.ndarray, np.ndarray | None]:
        ids = []
        for tok in self.tokenizers:
            ids.append(np.asarray(tok(text, padding="max_length", max_length=tok.model_max_length,
                                      truncation=True).input_ids, dtype=np.int64)[None])
        return ids[0], ids[1] if self.sdxl else None

    def encode(self, text: str) -> tuple[np.ndarray, np.ndarray | None]:
        """(prompt embeddings [1, 77, C], pooled text_embeds [1, P] for SDXL)."""
        with self._using(*self._encoders()) as parts:
            return self._encode(parts, text)

    def _encoders(self) -> tuple[str, ...]:
        return self.family.text_encoders

    @property
    def encoders(self) -> tuple[str, ...]:
        """The text encoders this pipeline runs."""
        return self._encoders()

    def _encode(self, parts: dict[str, Component], text: str) -> tuple[np.ndarray, np.ndarray | None]:
        ids1, ids2 = self._tokenize(text)
        te1 = parts["text_encoder"]
        if not self.sdxl:
            return te1.run({"input_ids": ids1}, ["last_hidden_state"])["last_hidden_state"], None
        penultimate = [_penultimate(te1, self.folder / "text_encoder" / "config.json")]
        h1 = te1.run({"input_ids": ids1}, penultimate)[penultimate[0]]
        te2 = parts["text_encoder_2"]
        names = [_penultimate(te2, self.folder / "text_encoder_2" / "config.json"), "text_embeds"]
        out2 = te2.run({"input_ids": ids2}, names)  # type: ignore[dict-item]
        return np.concatenate([h1, out2[names[0]]], axis=-1), out2["text_embeds"]

    def __call__(self, opts: GenerateOptions, progress: Callable[[int, int], None] | None = None) -> np.ndarray:
        """The image, [H, W, 3] uint8 (``opts.num_images`` must be 1: ``generate`` draws several)."""
        if opts.num_images != 1:
            raise SdnpuError(f"a pipeline call draws one image, not {opts.num_images}",
                             hint="Pipeline.generate(opts) draws num_images")
        return self.generate(opts, progress)[0]

    def generate(self, opts: GenerateOptions, progress: Callable[[int, int], None] | None = None
                 ) -> list[np.ndarray]:
        """``opts.num_images`` images ([H, W, 3] uint8), image k from seed ``opts.seed + k``: equal to that seed
        drawn alone. They go through the denoiser in as few calls as its converted batches allow (``plan_calls``);
        ``progress`` is told of each step of each call."""
        if not opts.prompt.strip():
            raise SdnpuError("the prompt is empty", hint='say what to draw: --prompt "a cat"')
        check_generate(opts)
        inpainting = self._inpainting(opts)  # the picture and mask read, before any work
        controls = self._controls(opts)  # every ControlNet and control image checked before any work
        cfg = generation.uses_guidance(opts.guidance)
        unet_name = "unet_controlnet" if controls else "unet"
        calls = plan_calls(opts.num_images, cfg, self.batches,
                           lambda b: add_command(self.folder, self.denoiser, self.size, b))
        for spec, _, _ in controls:  # each ControlNet at every batch the plan runs
            for batch, _ in calls:
                component_path(controlnet_folder(spec.folder), "controlnet", self.reference, self.size, batch)
        with self._using(*self._encoders()) as parts:
            pos, pooled = self._encode(parts, opts.prompt)
            if not cfg:
                neg, neg_pooled = pos[:0], None if pooled is None else pooled[:0]
            elif self.sdxl and not opts.negative_prompt and self.index.get("force_zeros_for_empty_prompt", True):
                neg, neg_pooled = np.zeros_like(pos), np.zeros_like(pooled)
            else:
                neg, neg_pooled = self._encode(parts, opts.negative_prompt)
        images: list[np.ndarray] = []
        done = 0
        for batch, k in calls:
            text = halves(neg, pos, k)
            feeds: dict[str, np.ndarray] = {"encoder_hidden_states": text}
            if "text_embeds" in self.unet_inputs:
                h, w = self.image_size
                feeds["text_embeds"] = halves(neg_pooled, pooled, k)  # type: ignore[arg-type]
                feeds["time_ids"] = np.tile(np.asarray([h, w, 0, 0, h, w], np.float32), (batch, 1))
            latents = self._denoise(opts, feeds, [opts.seed + done + j for j in range(k)], batch, controls,
                                    unet_name, progress, inpainting)
            z = latents.numpy().astype(np.float32) / float(self.vae_config["scaling_factor"])
            with self._using("vae_decoder") as parts:
                for j in range(k):
                    image = parts["vae_decoder"].run({"latent_sample": z[j : j + 1]}, ["sample"])["sample"][0]
                    images.append((np.clip(image.transpose(1, 2, 0) / 2 + 0.5, 0, 1) * 255).round().astype(np.uint8))
            done += k
        return images

    def _denoise(self, opts: GenerateOptions, feeds: dict[str, np.ndarray], seeds: list[int], batch: int,
                 controls: list[tuple[ControlSpec, np.ndarray, dict[str, str]]], unet_name: str,
                 progress: Callable[[int, int], None] | None, inpainting: Inpainting | None = None) -> Any:
        """One denoiser call's images through every step: each image has its own scheduler and noise from its
        seed (so it equals its seed drawn alone); returns their latents, [k, C, h, w]."""
        import torch  # torch at first use: the CLI starts without it (about 1 s)

        k, cfg = len(seeds), batch == 2 * len(seeds)
        schedulers = [self._scheduler(opts.scheduler) for _ in seeds]
        for scheduler in schedulers:
            scheduler.set_timesteps(opts.steps)
        timesteps = schedulers[0].timesteps
        noise = [torch.from_numpy(self.noise(seed)) for seed in seeds]
        if opts.image is None:
            latents = [n * s.init_noise_sigma for n, s in zip(noise, schedulers, strict=True)]
        else:
            init = inpainting.image_latents if inpainting is not None else self._image_latents(opts.image)
            started = [self._start_from_image(opts, s, init, n) for s, n in zip(schedulers, noise, strict=True)]
            latents, timesteps = [x for x, _ in started], started[0][1]
        extra = None  # an inpainting UNet's mask and masked-picture channels, for every row of the batch
        if inpainting is not None and self.inpainting_unet:
            extra = torch.cat([inpainting.mask, inpainting.masked_latents], dim=1).repeat(batch, 1, 1, 1)
        # a scheduler that draws noise as it steps (LCM, the ancestral ones) draws it from the image's seed
        step_kwargs = [({"generator": torch.Generator().manual_seed(seed)}
                        if "generator" in inspect.signature(s.step).parameters else {})
                       for s, seed in zip(schedulers, seeds, strict=True)]
        stage = self._stage_runtime(unet_name, controls, batch)
        with self._using(unet_name, runtime=stage, batch=batch) as parts, \
                self._control_sessions(controls, stage, batch) as nets:
            for i, t in enumerate(timesteps):
                scaled = torch.cat([s.scale_model_input(x, t) for s, x in zip(schedulers, latents, strict=True)])
                model_in = torch.cat([scaled, scaled]) if cfg else scaled
                if extra is not None:
                    model_in = torch.cat([model_in, extra], dim=1)
                step_feeds = {**feeds, "sample": model_in.numpy().astype(np.float32),
                              "timestep": np.asarray(float(t), np.float32)}
                prepared: dict[str | None, dict[str, np.ndarray]] = {}  # each step prologue runs once a step

                def ready(model: Component) -> dict[str, np.ndarray]:
                    if model.prologue_digest not in prepared:
                        prepared[model.prologue_digest] = model.prepare(step_feeds)
                    return prepared[model.prologue_digest]

                unet = parts[unet_name]
                for (spec, cond, names), net in zip(controls, nets, strict=True):
                    share = keep(i, len(timesteps), spec)
                    if share == 0.0:  # outside its steps: diffusers runs it at scale 0, whose residuals are 0
                        continue
                    out = net.run({**step_feeds, **ready(net), "controlnet_cond": np.concatenate([cond] * batch),
                                   "conditioning_scale": np.asarray(spec.scale * share, np.float32)}, list(names),
                                  native=True)
                    for o, name in names.items():  # several ControlNets: their residuals summed
                        r = handover(out[o], net.handoff.get(o), unet.handoff.get(name))
                        step_feeds[name] = handoff.add(step_feeds[name], r) if name in step_feeds else r
                for name in {n for _, _, names in controls for n in names.values()} - step_feeds.keys():
                    step_feeds[name] = unet.zeros(name)  # no ControlNet acts on this step
                pred = torch.from_numpy(unet.run({**step_feeds, **ready(unet)}, ["out_sample"])["out_sample"])
                if cfg:
                    uncond, cond = pred[:k], pred[k:]
                    pred = uncond + opts.guidance * (cond - uncond)
                latents = [s.step(pred[j : j + 1], t, latents[j], return_dict=False, **kw)[0]
                           for j, (s, kw) in enumerate(zip(schedulers, step_kwargs, strict=True))]
                if inpainting is not None and not self.inpainting_unet:
                    # a text-to-image UNet inpaints as diffusers' pipelines make it: outside the mask the
                    # picture's latents, noised to the next step's level, replace what it drew
                    latents = [inpainting.keep_outside(x, s, n, timesteps, i)
                               for x, s, n in zip(latents, schedulers, noise, strict=True)]
                if progress is not None:
                    progress(i + 1, len(timesteps))
        return torch.cat(latents)

    def _controls(self, opts: GenerateOptions) -> list[tuple[ControlSpec, np.ndarray, dict[str, str]]]:
        """Each ControlNet of ``opts``, checked against this pipeline: (spec, its control image as the
        ControlNet takes it, its output -> the UNet input it feeds)."""
        if not opts.controlnets:
            return []
        component_path(self.folder, "unet_controlnet", self.reference, self.size)  # refused, with the fix, if absent
        controls = []
        for spec in opts.controlnets:
            folder = controlnet_folder(spec.folder)
            check_compatible(folder, self.folder)
            component_path(folder, "controlnet", self.reference, self.size)  # converted at this size
            names = residual_inputs(config_of(folder, "controlnet"))
            controls.append((spec, control_image(spec.image, self.image_size), names))
        return controls

    def _stage_runtime(self, unet_name: str, controls: list[tuple[ControlSpec, np.ndarray, dict[str, str]]],
                       batch: int) -> RuntimeOptions:
        """How the denoising stage's sessions are made. With ControlNets, the UNet and they run in turn and
        share one activation arena (at full size, one step: 12.5 GB of private memory against 16.2 GB with an
        arena each, ``bench/bench_controlnet_memory.py``); whether graph optimizations fit is chosen once for
        all of them (``choose_optimize``), where not given."""
        if not controls or (unet_name, batch) in self.parts:
            return self.runtime
        optimize = self.runtime.optimize
        if optimize is None:
            paths = [component_path(self.folder, unet_name, self.reference, self.size, batch),
                     *(component_path(controlnet_folder(spec.folder), "controlnet", self.reference, self.size, batch)
                       for spec, _, _ in controls)]
            optimize = choose_optimize(paths, self.reference)
        return dataclasses.replace(self.runtime, optimize=optimize, shared_arena=True)

    @contextlib.contextmanager
    def _control_sessions(self, controls: list[tuple[ControlSpec, np.ndarray, dict[str, str]]],
                          runtime: RuntimeOptions, batch: int) -> Iterator[list[Component]]:
        """The ControlNets' sessions at ``batch``, for the UNet's stage."""
        nets = [open_component(controlnet_folder(spec.folder), "controlnet", self.reference, runtime, self.size,
                               batch=batch) for spec, _, _ in controls]
        try:
            yield nets
        finally:
            nets.clear()

    def noise(self, seed: int) -> np.ndarray:
        """The starting noise for ``seed`` (unscaled; other pipelines take it as their ``latents``)."""
        return np.random.default_rng(seed).standard_normal(self.latent_shape).astype(np.float32)

    def _image_latents(self, image: str | Path | np.ndarray) -> Any:
        """Image-to-image: the picture's latents (the VAE encoder's mean, scaled; diffusers' pipelines draw a
        sample of the encoder's distribution with their generator: sdnpu takes its mean, the same every run).
        ``image``: a file, or pixels [1, 3, H, W] in [-1, 1]."""
        import torch  # torch at first use: the CLI starts without it (about 1 s)

        pixels = self._pixels(image) if not isinstance(image, np.ndarray) else image
        with self._using("vae_encoder") as parts:
            moments = parts["vae_encoder"].run({"sample": pixels}, ["latent_parameters"])["latent_parameters"]
        mean = moments[:, : self.latent_shape[1]]
        return torch.from_numpy(mean * float(self.vae_config["scaling_factor"]))

    def _picture(self, path: str | Path, mode: str) -> Any:
        """The picture at ``path`` in PIL ``mode``, resized to the image size as diffusers' image processor
        does (Lanczos)."""
        from PIL import Image, UnidentifiedImageError  # PIL at first use: the CLI starts without it (10 ms)

        h, w = self.image_size
        try:
            return Image.open(path).convert(mode).resize((w, h), Image.Resampling.LANCZOS)
        except (OSError, UnidentifiedImageError) as e:
            raise SdnpuError(f"cannot read {path} as an image: {e}", hint="give a PNG or JPEG file") from e

    def _pixels(self, path: str | Path) -> np.ndarray:
        """The picture as the VAE encoder takes it: [1, 3, H, W] in [-1, 1]."""
        return np.asarray(self._picture(path, "RGB"), np.float32).transpose(2, 0, 1)[None] / 127.5 - 1.0

    def _inpainting(self, opts: GenerateOptions) -> Inpainting | None:
        """The picture, mask and latents inpainting needs (None without ``opts.mask``), refused before any work
        where the options or the folder cannot inpaint."""
        if opts.mask is None:
            if self.inpainting_unet:
                raise SdnpuError(f"{self.folder}'s UNet is an inpainting UNet (it takes a mask and a masked picture)",
                                 hint="give the picture and what to redraw: --image in.png --mask mask.png")
            return None
        if opts.controlnets:
            raise SdnpuError("sdnpu does not inpaint with ControlNets", hint="drop --controlnet or --mask")
        component_path(self.folder, "vae_encoder", self.reference, self.size)  # refused, with the fix, if absent
        import torch  # torch at first use: the CLI starts without it (about 1 s)

        # diffusers' mask processor: grayscale, resized, binarized at one half; 1 = draw, 0 = keep
        mask = (np.asarray(self._picture(opts.mask, "L"), np.float32) / 255.0 >= 0.5).astype(np.float32)
        pixels = self._pixels(opts.image)
        masked = pixels * (mask < 0.5)  # the picture with the area to draw blacked out (0: mid grey in [-1, 1])
        latent = torch.nn.functional.interpolate(torch.from_numpy(mask)[None, None], size=self.latent_shape[2:])
        strength = opts.strength if opts.strength is not None else 1.0
        needs_image = not self.inpainting_unet or strength < 1.0
        return Inpainting(mask=latent, masked_latents=self._image_latents(masked) if self.inpainting_unet else None,
                          image_latents=self._image_latents(pixels) if needs_image else None)

    def _start_from_image(self, opts: GenerateOptions, scheduler: Any, init: Any, noise: Any) -> tuple[Any, Any]:
        """Image-to-image: the picture's latents ``init`` noised to the step where ``strength`` of the schedule
        remains, and the timesteps left to run (inpainting at strength 1: pure noise, as diffusers')."""
        strength = opts.strength if opts.strength is not None else (0.3 if opts.mask is None else 1.0)
        keep = min(int(opts.steps * strength), opts.steps)
        if keep == 0:
            raise SdnpuError(f"strength {strength} leaves no step of {opts.steps} to run",
                             hint="raise --strength or --steps")
        start = (opts.steps - keep) * scheduler.order
        timesteps = scheduler.timesteps[start:]
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(start)
        if opts.mask is not None and strength == 1.0:
            return noise * scheduler.init_noise_sigma, timesteps
        return scheduler.add_noise(init, noise, timesteps[:1]), timesteps

    def _scheduler(self, name: str | None) -> Any:
        return load_scheduler(self.folder, name)


@dataclass
class Inpainting:
    """What inpainting adds to a generation, as diffusers' ``StableDiffusionXLInpaintPipeline`` and
    ``StableDiffusionInpaintPipeline`` make it: the binarized mask at latent size (nearest), [1, 1, h, w]; the
    masked picture's latents for an inpainting UNet's extra channels; the picture's latents where the
    generation starts from them (strength below 1) or keeps them outside the mask (a text-to-image UNet)."""

    mask: Any
    masked_latents: Any
    image_latents: Any

    def keep_outside(self, latents: Any, scheduler: Any, noise: Any, timesteps: Any, i: int) -> Any:
        """After step ``i``: outside the mask the picture's latents noised to the next step's level (at the
        last step, the picture's latents themselves); inside it what the UNet drew."""
        import torch  # torch at first use: the CLI starts without it (about 1 s)

        proper = self.image_latents
        if i < len(timesteps) - 1:
            proper = scheduler.add_noise(proper, noise, torch.tensor([timesteps[i + 1]]))
        return (1 - self.mask) * proper + self.mask * latents


def _penultimate(component: Component, config_path: Path) -> str:
    """The hidden states SDXL reads from a text encoder: the penultimate layer's (``pipeline_outputs``, from
    the encoder's num_hidden_layers; a dispatch model keeps only that one, the fp32 graph has them all)."""
    try:
        config = json.loads(config_path.read_text())
        name = pipeline_outputs(component.name, config, families.SDXL.name)[-1]  # type: ignore[index]
    except (OSError, ValueError, KeyError) as e:
        raise SdnpuError(f"cannot read num_hidden_layers from {config_path}: {e}",
                         hint="the converted folder keeps each encoder's config.json: convert it again") from e
    if name not in component.outputs:
        raise SdnpuError(f"{component.path} has no output {name}: SDXL reads the penultimate hidden states",
                         hint="compile it again with --outputs pipeline (the default) or --outputs all")
    return name


def save_png(image: np.ndarray, path: Path) -> None:
    """Write ``image`` ([H, W, 3] uint8) as a PNG, atomically."""
    from PIL import Image  # PIL at first use: the CLI starts without it (10 ms)

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    atomic_write_bytes(Path(path), buf.getvalue())
