"""Text-to-image on a converted Flux.1 folder (``FluxPipeline``: dev and schnell), every graph in onnxruntime,
step for step as diffusers' pipeline does it:

    prompt -> CLIP-L: its pooled output; T5 (``text_encoder_2``): its hidden states over ``max_sequence_length``
    tokens -> the transformer at batch 1 (no classifier-free guidance: dev takes the guidance as an input, schnell
    none) on the latents packed 2 x 2 into tokens, with their position ids -> flow-matching Euler step (sigmas
    1 .. 1/steps, shifted by the image's token count where the scheduler shifts dynamically) -> ... -> latents
    unpacked, / scaling_factor + shift_factor -> VAE decoder (16 latent channels) -> PNG

Several images per call go through the transformer's converted batches, each its own noise and scheduler.
LoRAs (the transformer's and CLIP-L's parts) apply as for SDXL: an overlay (``sdnpu lora apply``) or ``--lora``
at session open. Image-to-image, inpainting and ControlNets are refused with the reason.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from functools import cached_property
from typing import Any

import numpy as np
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from transformers import AutoTokenizer, CLIPTokenizer

from sdnpu import families
from sdnpu.errors import SdnpuError
from sdnpu.runtime.session import Component, add_command
from sdnpu.runtime.stages import TransformerStages, check_generate, load_scheduler, plan_calls
from sdnpu.signatures import flux_image_ids

log = logging.getLogger(__name__)

ENCODERS = families.FLUX.text_encoders  # CLIP-L (pooled), T5


def pack(latents: np.ndarray) -> np.ndarray:
    """[B, C, H, W] latents -> [B, (H/2)(W/2), 4C] tokens, as diffusers' ``FluxPipeline._pack_latents``."""
    b, c, h, w = latents.shape
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2).transpose(0, 2, 4, 1, 3, 5)
    return np.ascontiguousarray(x.reshape(b, (h // 2) * (w // 2), c * 4))


def unpack(tokens: np.ndarray, h: int, w: int) -> np.ndarray:
    """``pack``'s inverse for latents of h x w (``FluxPipeline._unpack_latents``)."""
    b, _, d = tokens.shape
    x = tokens.reshape(b, h // 2, w // 2, d // 4, 2, 2).transpose(0, 3, 1, 4, 2, 5)
    return np.ascontiguousarray(x.reshape(b, d // 4, h, w))


class FluxPipeline(TransformerStages):
    """A converted Flux.1 folder and the loop that runs it; the same interface as ``Pipeline`` (which gives
    this class for a Flux folder). Sessions are opened per stage and dropped after it unless ``keep_sessions``."""

    family = families.FLUX
    required = ENCODERS

    def _set_up(self) -> None:
        self.text_len = self.inputs["encoder_hidden_states"][1]
        self.guided = "guidance" in self.inputs
        self._packed_latents(int(self.vae_config.get("latent_channels", 16)))

    @property
    def encoders(self) -> tuple[str, ...]:
        return ENCODERS

    @cached_property
    def tokenizers(self) -> dict[str, Any]:
        for tok in ("tokenizer", "tokenizer_2"):
            if not (self.folder / tok).is_dir():
                raise SdnpuError(f"{self.folder} has no {tok}/", hint="convert the pipeline again (it copies the "
                                 "tokenizers)")
        return {"text_encoder": CLIPTokenizer.from_pretrained(self.folder / "tokenizer"),
                "text_encoder_2": AutoTokenizer.from_pretrained(self.folder / "tokenizer_2")}

    def _encode(self, parts: dict[str, Component], text: str) -> tuple[np.ndarray, np.ndarray]:
        """(T5's hidden states [1, T, J], CLIP-L's pooled output [1, P]) as diffusers' ``encode_prompt``."""
        clip = parts["text_encoder"]
        if "pooler_output" not in clip.outputs:
            raise SdnpuError(f"{clip.path} lacks pooler_output, which Flux.1 reads",
                             hint="compile it again with --outputs pipeline (the default) or --outputs all")
        pooled = clip.run({"input_ids": self._ids("text_encoder", text, clip.inputs["input_ids"][1])},
                          ["pooler_output"])["pooler_output"]
        t5 = parts["text_encoder_2"]
        hidden = t5.run({"input_ids": self._ids("text_encoder_2", text, t5.inputs["input_ids"][1])},
                        ["last_hidden_state"])["last_hidden_state"]
        if hidden.shape[1] != self.text_len:
            raise SdnpuError(f"the T5 encoder gives {hidden.shape[1]} tokens, the transformer takes {self.text_len}",
                             hint="convert text_encoder_2 and the transformer with the same max_sequence_length")
        return hidden, pooled

    def generate(self, opts: Any, progress: Callable[[int, int], None] | None = None) -> list[np.ndarray]:
        """``opts.num_images`` images, image k from seed ``opts.seed + k`` (as ``Pipeline.generate``)."""
        if not opts.prompt.strip():
            raise SdnpuError("the prompt is empty", hint='say what to draw: --prompt "a cat"')
        check_generate(opts)
        if opts.image is not None or opts.controlnets or getattr(opts, "mask", None) is not None:
            raise SdnpuError(f"{self.folder} is a Flux.1 pipeline: sdnpu runs it text-to-image only",
                             hint="drop --image / --mask / --controlnet")
        if opts.negative_prompt:
            log.warning("Flux.1 runs without classifier-free guidance: the negative prompt is not used")
        calls = plan_calls(opts.num_images, False, self.batches,
                           lambda b: add_command(self.folder, "transformer", self.size, b))
        log.info("Flux.1: %s guidance %g, %d T5 tokens, no classifier-free guidance",
                 "embedded" if self.guided else "no", opts.guidance if self.guided else 0, self.text_len)
        with self._using(*ENCODERS) as parts:
            hidden, pooled = self._encode(parts, opts.prompt)
        images: list[np.ndarray] = []
        for batch, k in calls:
            feeds = {"encoder_hidden_states": np.repeat(hidden, k, axis=0).astype(np.float32),
                     "pooled_projections": np.repeat(pooled, k, axis=0).astype(np.float32),
                     "img_ids": flux_image_ids(self.latent_shape[2:]),
                     "txt_ids": np.zeros((self.text_len, 3), np.float32)}
            if self.guided:
                feeds["guidance"] = np.full((batch,), opts.guidance, np.float32)
            tokens = self._denoise(opts, feeds, [opts.seed + len(images) + j for j in range(k)], batch, progress)
            images += self._decode(unpack(tokens, *self.latent_shape[2:]))
        return images

    def scheduler(self, name: str | None, steps: int) -> Any:
        """The folder's scheduler (or ``name``) set for ``steps`` as ``FluxPipeline`` sets it: sigmas from 1 to
        1/steps, ``mu`` from the image's token count (used where the scheduler shifts dynamically)."""
        scheduler = load_scheduler(self.folder, name)
        c = scheduler.config
        if "sigmas" not in inspect.signature(scheduler.set_timesteps).parameters:
            raise SdnpuError(f"{type(scheduler).__name__} takes no sigmas: Flux.1 runs a flow-matching scheduler",
                             hint="drop --scheduler (the folder's is FlowMatchEulerDiscreteScheduler)")
        tokens = (self.latent_shape[2] // 2) * (self.latent_shape[3] // 2)
        mu = calculate_shift(tokens, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                             c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        sigmas = None if c.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
        if sigmas is None:
            scheduler.set_timesteps(steps, mu=mu)
        else:
            scheduler.set_timesteps(sigmas=sigmas, mu=mu)
        return scheduler

    def _denoise(self, opts: Any, feeds: dict[str, np.ndarray], seeds: list[int], batch: int,
                 progress: Callable[[int, int], None] | None) -> np.ndarray:
        """One transformer call's images through every step, each with its own scheduler and seeded noise."""
        schedulers = [self.scheduler(opts.scheduler, opts.steps) for _ in seeds]
        latents = [torch.from_numpy(pack(self.noise(seed))) for seed in seeds]
        timesteps = schedulers[0].timesteps
        divisor = np.float32(self.family.timestep_divisor)  # the transformer takes diffusers' timestep / 1000
        with self._using("transformer", batch=batch) as parts:
            # its prologue (the rotary tables from the position ids, the same every step): computed once here
            feeds = {**feeds, **parts["transformer"].prepare(feeds)}
            for i, t in enumerate(timesteps):
                step_feeds = {**feeds, "hidden_states": torch.cat(latents).numpy().astype(np.float32),
                              "timestep": np.full((batch,), np.float32(float(t)) / divisor, np.float32)}
                pred = torch.from_numpy(parts["transformer"].run(step_feeds, ["out_sample"])["out_sample"])
                latents = [s.step(pred[j : j + 1], t, latents[j], return_dict=False)[0]
                           for j, s in enumerate(schedulers)]
                if progress is not None:
                    progress(i + 1, len(timesteps))
        return torch.cat(latents).numpy().astype(np.float32)
