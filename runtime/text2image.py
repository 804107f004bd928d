"""Text-to-image on a converted folder, every graph in onnxruntime (SDXL; SD 1.x/2.x folders too).

    prompt -> tokenizer(s) -> text encoder(s): penultimate hidden states (concatenated for SDXL's two) and
    text_encoder_2's pooled text_embeds -> UNet at batch 2 (negative, positive) with SDXL's time_ids ->
    classifier-free guidance -> scheduler step -> ... -> latents / scaling_factor -> VAE decoder -> PNG
    (image-to-image: the picture through the VAE encoder, noised to where ``strength`` of the schedule is left;
    with ControlNets, each step runs them first and the UNet that takes their residuals: runtime/controlnet.py)

The scheduler is the folder's (``scheduler/``) through diffusers, or any other diffusers scheduler by name.
Seeds give the same image twice: the initial noise is drawn with numpy from the seed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from sdnpu.components import CLIP_ENCODERS
from sdnpu.errors import SdnpuError
from sdnpu.fileio import atomic_write_bytes
from sdnpu.formats import handoff, prologue
from sdnpu.formats.handoff import handover
from sdnpu.imagesize import Size
from sdnpu.runtime.controlnet import (
    ControlSpec,
    check_compatible,
    config_of,
    control_image,
    controlnet_folder,
    keep,
    residual_inputs,
)
from sdnpu.runtime.sd3 import SD3Pipeline, is_sd3
from sdnpu.runtime.session import Component, RuntimeOptions, choose_optimize, component_path, open_component
from sdnpu.runtime.stages import Stages, load_scheduler, read_index
from sdnpu.signatures import UNET_BATCH, vae_scale_factor
from sdnpu.specs import pipeline_outputs

log = logging.getLogger(__name__)


@dataclass
class GenerateOptions:
    prompt: str
    negative_prompt: str = ""
    steps: int = 30
    guidance: float = 5.0
    seed: int = 0
    scheduler: str | None = None  # a diffusers scheduler class name; default: the folder's
    image: str | Path | None = None  # image-to-image: the starting picture
    strength: float = 0.3  # how much of the schedule runs over it (1.0: all of it, as text-to-image)
    controlnets: tuple[ControlSpec, ...] = ()  # ControlNets and their control images (runtime/controlnet.py)


class Pipeline(Stages):
    """A converted folder and the loop that runs its components (an SD3 folder gets ``SD3Pipeline``, with
    the same interface).

    By default each stage opens its sessions and drops them when done (text encoders, then the UNet, then
    the VAE), so the peak is the largest stage, not the sum: at full SDXL size in fp32 the four sessions
    together would not fit beside the UNet's activations on a 24 GiB machine. ``keep_sessions=True`` keeps
    them open for repeated generation. ``runtime``: how sessions are made (a custom-op library, graph
    optimizations, threads; see ``sdnpu.runtime.session.RuntimeOptions``)."""

    def __new__(cls, folder: str | Path, *args: Any, **kwargs: Any) -> Any:
        if is_sd3(read_index(Path(folder))):
            return SD3Pipeline(folder, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, folder: str | Path, reference: bool = False, keep_sessions: bool = False,
                 runtime: RuntimeOptions | None = None, size: Any = None) -> None:
        import onnx

        self.folder = Path(folder)
        self.reference, self.keep, self.runtime = reference, keep_sessions, runtime or RuntimeOptions()
        self.index = read_index(self.folder)
        self.sdxl = "text_encoder_2" in self.index and self.index["text_encoder_2"][1] is not None
        # the UNet, or where the folder holds only the one that takes a ControlNet's residuals, that one
        denoiser = "unet_controlnet" if not (self.folder / "unet").is_dir() and (
            self.folder / "unet_controlnet").is_dir() else "unet"
        needed = ["text_encoder", denoiser, "vae_decoder"] + (["text_encoder_2"] if self.sdxl else [])
        self.size = Size.of(size) if size is not None else None  # None: the folder's primary size
        paths = {name: component_path(self.folder, name, reference, self.size) for name in needed}
        self.parts: dict[str, Component] = {}
        self.vae_config = json.loads((self.folder / "vae_decoder" / "config.json").read_text())
        unet = onnx.load(str(paths[denoiser]), load_external_data=False)
        if prologue.of_proto(unet) is not None:  # its step prologue takes the inputs: the fp32 graph's are they
            unet = onnx.load(str(component_path(self.folder, denoiser, True, self.size)), load_external_data=False)
        self.unet_inputs = {i.name for i in unet.graph.input}
        sample = next(i for i in unet.graph.input if i.name == "sample")
        shape = [d.dim_value for d in sample.type.tensor_type.shape.dim]
        if shape[0] != UNET_BATCH:
            raise SdnpuError(f"the UNet in {self.folder} runs at batch {shape[0]}; guidance needs batch {UNET_BATCH}")
        self.latent_shape = (1, *shape[1:])
        factor = vae_scale_factor(self.vae_config)
        self.image_size = (factor * shape[2], factor * shape[3])  # (height, width) in pixels

    @cached_property
    def tokenizers(self) -> list[Any]:
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
        return CLIP_ENCODERS if self.sdxl else CLIP_ENCODERS[:1]

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
        """The image, [H, W, 3] uint8."""
        import torch

        if not opts.prompt.strip():
            raise SdnpuError("the prompt is empty", hint='say what to draw: --prompt "a cat"')
        if opts.steps < 1:
            raise SdnpuError(f"steps must be at least 1, not {opts.steps}")
        controls = self._controls(opts)  # every ControlNet and control image checked before any work
        with self._using(*self._encoders()) as parts:
            pos, pooled = self._encode(parts, opts.prompt)
            if self.sdxl and not opts.negative_prompt and self.index.get("force_zeros_for_empty_prompt", True):
                neg, neg_pooled = np.zeros_like(pos), np.zeros_like(pooled)
            else:
                neg, neg_pooled = self._encode(parts, opts.negative_prompt)
        feeds: dict[str, np.ndarray] = {"encoder_hidden_states": np.concatenate([neg, pos]).astype(np.float32)}
        if "text_embeds" in self.unet_inputs:
            h, w = self.image_size
            feeds["text_embeds"] = np.concatenate([neg_pooled, pooled]).astype(np.float32)  # type: ignore[list-item]
            feeds["time_ids"] = np.tile(np.asarray([h, w, 0, 0, h, w], np.float32), (UNET_BATCH, 1))
        scheduler = self._scheduler(opts.scheduler)
        scheduler.set_timesteps(opts.steps)
        noise = torch.from_numpy(self.noise(opts.seed))
        timesteps = scheduler.timesteps
        if opts.image is None:
            latents = noise * scheduler.init_noise_sigma
        else:
            latents, timesteps = self._start_from_image(opts, scheduler, noise)
        # a scheduler that draws noise as it steps (LCM, the ancestral ones) draws it from the seed
        step_kwargs = ({"generator": torch.Generator().manual_seed(opts.seed)}
                       if "generator" in inspect.signature(scheduler.step).parameters else {})
        unet_name = "unet_controlnet" if controls else "unet"
        stage = self._stage_runtime(unet_name, controls)
        with self._using(unet_name, runtime=stage) as parts, self._control_sessions(controls, stage) as nets:
            for i, t in enumerate(timesteps):
                model_in = scheduler.scale_model_input(torch.cat([latents, latents]), t)
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
                    out = net.run({**step_feeds, **ready(net), "controlnet_cond": cond,
                                   "conditioning_scale": np.asarray(spec.scale * share, np.float32)}, list(names),
                                  native=True)
                    for o, name in names.items():  # several ControlNets: their residuals summed
                        r = handover(out[o], net.handoff.get(o), unet.handoff.get(name))
                        step_feeds[name] = handoff.add(step_feeds[name], r) if name in step_feeds else r
                for name in {n for _, _, names in controls for n in names.values()} - step_feeds.keys():
                    step_feeds[name] = unet.zeros(name)  # no ControlNet acts on this step
                pred = unet.run({**step_feeds, **ready(unet)}, ["out_sample"])["out_sample"]
                uncond, cond = pred[:1], pred[1:]
                guided = torch.from_numpy(uncond + opts.guidance * (cond - uncond))
                latents = scheduler.step(guided, t, latents, return_dict=False, **step_kwargs)[0]
                if progress is not None:
                    progress(i + 1, len(timesteps))
        z = latents.numpy().astype(np.float32) / float(self.vae_config["scaling_factor"])
        with self._using("vae_decoder") as parts:
            image = parts["vae_decoder"].run({"latent_sample": z}, ["sample"])["sample"][0]
        return (np.clip(image.transpose(1, 2, 0) / 2 + 0.5, 0, 1) * 255).round().astype(np.uint8)

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

    def _stage_runtime(self, unet_name: str, controls: list[tuple[ControlSpec, np.ndarray, dict[str, str]]]
                       ) -> RuntimeOptions:
        """How the denoising stage's sessions are made. With ControlNets, the UNet and they run in turn and
        share one activation arena (at full size, one step: 12.5 GB of private memory against 16.2 GB with an
        arena each, ``bench/bench_controlnet_memory.py``); whether graph optimizations fit is chosen once for
        all of them (``choose_optimize``), where not given."""
        if not controls or unet_name in self.parts:
            return self.runtime
        optimize = self.runtime.optimize
        if optimize is None:
            paths = [component_path(self.folder, unet_name, self.reference, self.size),
                     *(component_path(controlnet_folder(spec.folder), "controlnet", self.reference, self.size)
                       for spec, _, _ in controls)]
            optimize = choose_optimize(paths, self.reference)
        return dataclasses.replace(self.runtime, optimize=optimize, shared_arena=True)

    @contextlib.contextmanager
    def _control_sessions(self, controls: list[tuple[ControlSpec, np.ndarray, dict[str, str]]],
                          runtime: RuntimeOptions) -> Iterator[list[Component]]:
        """The ControlNets' sessions, for the UNet's stage."""
        nets = [open_component(controlnet_folder(spec.folder), "controlnet", self.reference, runtime, self.size)
                for spec, _, _ in controls]
        try:
            yield nets
        finally:
            nets.clear()

    def noise(self, seed: int) -> np.ndarray:
        """The starting noise for ``seed`` (unscaled; other pipelines take it as their ``latents``)."""
        return np.random.default_rng(seed).standard_normal(self.latent_shape).astype(np.float32)

    def _start_from_image(self, opts: GenerateOptions, scheduler: Any, noise: Any) -> tuple[Any, Any]:
        """Image-to-image: the picture's latents (the VAE encoder's mean, scaled), noised to the step where
        ``strength`` of the schedule remains, and the timesteps left to run."""
        import torch
        from PIL import Image, UnidentifiedImageError

        if not 0 < opts.strength <= 1:
            raise SdnpuError(f"strength must be in (0, 1], not {opts.strength}")
        h, w = self.image_size
        try:
            picture = Image.open(opts.image).convert("RGB").resize((w, h), Image.Resampling.LANCZOS)
        except (OSError, UnidentifiedImageError) as e:
            raise SdnpuError(f"cannot read {opts.image} as an image: {e}", hint="give a PNG or JPEG file") from e
        pixels = np.asarray(picture, np.float32).transpose(2, 0, 1)[None] / 127.5 - 1.0
        with self._using("vae_encoder") as parts:
            moments = parts["vae_encoder"].run({"sample": pixels}, ["latent_parameters"])["latent_parameters"]
        mean = moments[:, : self.latent_shape[1]]
        init = torch.from_numpy(mean * float(self.vae_config["scaling_factor"]))
        keep = min(int(opts.steps * opts.strength), opts.steps)
        if keep == 0:
            raise SdnpuError(f"strength {opts.strength} leaves no step of {opts.steps} to run",
                             hint="raise --strength or --steps")
        start = (opts.steps - keep) * scheduler.order
        timesteps = scheduler.timesteps[start:]
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(start)
        return scheduler.add_noise(init, noise, timesteps[:1]), timesteps

    def _scheduler(self, name: str | None) -> Any:
        return load_scheduler(self.folder, name)


def _penultimate(component: Component, config_path: Path) -> str:
    """The hidden states SDXL reads from a text encoder: the penultimate layer's (``pipeline_outputs``, from
    the encoder's num_hidden_layers; a dispatch model keeps only that one, the fp32 graph has them all)."""
    try:
        config = json.loads(config_path.read_text())
        name = pipeline_outputs(component.name, config, sdxl=True)[-1]  # type: ignore[index]
    except (OSError, ValueError, KeyError) as e:
        raise SdnpuError(f"cannot read num_hidden_layers from {config_path}: {e}",
                         hint="the converted folder keeps each encoder's config.json: convert it again") from e
    if name not in component.outputs:
        raise SdnpuError(f"{component.path} has no output {name}: SDXL reads the penultimate hidden states",
                         hint="compile it again with --outputs pipeline (the default) or --outputs all")
    return name


def save_png(image: np.ndarray, path: Path) -> None:
    """Write ``image`` ([H, W, 3] uint8) as a PNG, atomically."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    atomic_write_bytes(Path(path), buf.getvalue())
