"""Text-to-image on a converted Qwen-Image folder (``QwenImagePipeline``), every graph in onnxruntime, step for
step as diffusers' pipeline does it:

    prompt -> the chat template around it -> Qwen2.5-VL's language model (``text_encoder``): its last hidden
    states, the template's first 34 tokens dropped, at most T kept, padded to T with their mask -> the
    transformer on the latents packed 2 x 2 into tokens (timestep / 1000) -> true classifier-free guidance where
    the guidance is above 1: the negative prompt's prediction as the unconditional half, the combination rescaled
    to the conditional prediction's norm per token -> flow-matching Euler step (sigmas 1 .. 1/steps, shifted by
    ``mu`` from the image's token count) -> ... -> latents unpacked to one frame, * std + mean per channel (the
    VAE's ``latents_std`` / ``latents_mean``) -> VAE decoder (5-D, one frame) -> PNG

The guidance is ``QwenImagePipeline``'s ``true_cfg_scale``: above 1 the unconditional half runs with the
negative prompt (the empty prompt where none is given: diffusers runs it so for ``negative_prompt=""``), both
halves in one transformer call of batch 2 (each row with its own caption mask), or, where the transformer is
converted at batch 1 only, in two calls of one row, as ``QwenImagePipeline`` itself runs them; at most 1, none,
batch 1.
Several images per call go through the transformer's converted batches, each its own noise and scheduler.
Image-to-image, inpainting, ControlNets and LoRAs are refused with the reason.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from functools import cached_property
from typing import Any

import numpy as np
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
from transformers import AutoTokenizer

from sdnpu import families
from sdnpu.errors import SdnpuError
from sdnpu.formats.generation import uses_guidance
from sdnpu.runtime.flux import pack, unpack
from sdnpu.runtime.session import Component, add_command
from sdnpu.runtime.stages import TransformerStages, check_generate, load_scheduler, plan_calls, run_rows
from sdnpu.signatures import QWEN_TEMPLATE_TOKENS, latent_channels

log = logging.getLogger(__name__)

# QwenImagePipeline.prompt_template_encode: the prompt goes where {} is; its first QWEN_TEMPLATE_TOKENS tokens
# (the system prompt and the user turn's start, as Qwen2's tokenizer cuts them) are dropped from the states
PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                   "<|im_end|>\n<|im_start|>assistant\n")


class QwenImagePipeline(TransformerStages):
    """A converted Qwen-Image folder and the loop that runs it; the same interface as ``Pipeline`` (which gives
    this class for a Qwen-Image folder). Sessions are opened per stage and dropped after it unless
    ``keep_sessions``."""

    family = families.QWEN_IMAGE
    required = families.QWEN_IMAGE.text_encoders

    def _set_up(self) -> None:
        if self.runtime.loras:
            raise SdnpuError(f"{self.folder} is a Qwen-Image pipeline: sdnpu applies no LoRA to it yet",
                             hint="drop --lora")
        self.text_len = self.inputs["encoder_hidden_states"][1]
        self._packed_latents(latent_channels(self.vae_config))  # its VAE decoder takes [1, L, 1, h, w]

    @property
    def encoders(self) -> tuple[str, ...]:
        return self.required

    @cached_property
    def tokenizers(self) -> dict[str, Any]:
        if not (self.folder / "tokenizer").is_dir():
            raise SdnpuError(f"{self.folder} has no tokenizer/", hint="convert the pipeline again (it copies the "
                             "tokenizer)")
        return {"text_encoder": AutoTokenizer.from_pretrained(self.folder / "tokenizer")}

    def encode(self, parts: dict[str, Component], text: str) -> tuple[np.ndarray, np.ndarray]:
        """(the prompt's states [1, T, J], their mask [1, T] int64) as diffusers' ``encode_prompt`` gives them for
        ``max_sequence_length`` T: the templated prompt's states past the template's first tokens, at most T of
        them, then zeros (mask 0) up to T. The encoder's graph takes a fixed number of tokens: the prompt's are
        followed by padding, which its causal attention keeps out of the prompt's states."""
        encoder = parts["text_encoder"]
        length = encoder.inputs["input_ids"][1]
        if length != QWEN_TEMPLATE_TOKENS + self.text_len:
            raise SdnpuError(f"the text encoder takes {length} tokens, the transformer {self.text_len} past the "
                             f"template's {QWEN_TEMPLATE_TOKENS}",
                             hint="convert text_encoder and the transformer with the same max_sequence_length")
        tokenizer = self.tokenizers["text_encoder"]
        ids = tokenizer(PROMPT_TEMPLATE.format(text), max_length=length, truncation=True).input_ids
        n = len(ids) - QWEN_TEMPLATE_TOKENS  # the prompt's states
        if n < 1:
            raise SdnpuError(f"the templated prompt is {len(ids)} tokens: none past the template's "
                             f"{QWEN_TEMPLATE_TOKENS}", hint="the folder's tokenizer is not Qwen2's")
        feed = np.full((1, length), tokenizer.pad_token_id, np.int64)
        feed[0, : len(ids)] = ids
        hidden = encoder.run({"input_ids": feed}, ["last_hidden_state"])["last_hidden_state"]
        states = np.zeros((1, self.text_len, hidden.shape[2]), np.float32)
        states[0, :n] = hidden[0, QWEN_TEMPLATE_TOKENS : QWEN_TEMPLATE_TOKENS + n]
        mask = np.zeros((1, self.text_len), np.int64)
        mask[0, :n] = 1
        return states, mask

    def generate(self, opts: Any, progress: Callable[[int, int], None] | None = None) -> list[np.ndarray]:
        """``opts.num_images`` images, image k from seed ``opts.seed + k`` (as ``Pipeline.generate``)."""
        if not opts.prompt.strip():
            raise SdnpuError("the prompt is empty", hint='say what to draw: --prompt "a cat"')
        check_generate(opts)
        if opts.image is not None or opts.controlnets or getattr(opts, "mask", None) is not None:
            raise SdnpuError(f"{self.folder} is a Qwen-Image pipeline: sdnpu runs it text-to-image only",
                             hint="drop --image / --mask / --controlnet")
        cfg = uses_guidance(opts.guidance)
        calls = plan_calls(opts.num_images, cfg, self.batches,
                           lambda b: add_command(self.folder, "transformer", self.size, b), apart=True)
        log.info("Qwen-Image: %s, %d prompt tokens", f"true guidance {opts.guidance:g}" if cfg else "no guidance",
                 self.text_len)
        with self._using(*self.encoders) as parts:
            pos = self.encode(parts, opts.prompt)
            neg = self.encode(parts, opts.negative_prompt) if cfg else None
        images: list[np.ndarray] = []
        for batch, k in calls:
            rows = ([neg] * k if neg is not None else []) + [pos] * k  # the unconditional rows first
            feeds = {"encoder_hidden_states": np.concatenate([r[0] for r in rows]),
                     "encoder_hidden_states_mask": np.concatenate([r[1] for r in rows])}
            seeds = [opts.seed + len(images) + j for j in range(k)]
            tokens = self._denoise(opts, feeds, seeds, batch, cfg, progress)
            images += self._decode(unpack(tokens, *self.latent_shape[2:]))
        return images

    def scheduler(self, name: str | None, steps: int) -> Any:
        """The folder's scheduler (or ``name``) set for ``steps`` as ``QwenImagePipeline`` sets it: sigmas from 1
        to 1/steps, ``mu`` from the image's token count (used where the scheduler shifts dynamically)."""
        scheduler = load_scheduler(self.folder, name)
        c = scheduler.config
        if "sigmas" not in inspect.signature(scheduler.set_timesteps).parameters:
            raise SdnpuError(f"{type(scheduler).__name__} takes no sigmas: Qwen-Image runs a flow-matching "
                             "scheduler", hint="drop --scheduler (the folder's is FlowMatchEulerDiscreteScheduler)")
        tokens = (self.latent_shape[2] // 2) * (self.latent_shape[3] // 2)
        mu = calculate_shift(tokens, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                             c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        scheduler.set_begin_index(0)
        return scheduler

    def _denoise(self, opts: Any, feeds: dict[str, np.ndarray], seeds: list[int], batch: int, cfg: bool,
                 progress: Callable[[int, int], None] | None) -> np.ndarray:
        """One transformer call's images through every step, each with its own scheduler and seeded noise; with
        guidance the call's first half is the unconditional rows."""
        k = len(seeds)
        schedulers = [self.scheduler(opts.scheduler, opts.steps) for _ in seeds]
        latents = [torch.from_numpy(pack(self.noise(seed))) for seed in seeds]
        timesteps = schedulers[0].timesteps
        divisor = np.float32(self.family.timestep_divisor)  # the transformer takes diffusers' timestep / 1000
        rows = 2 * k if cfg else k  # a transformer of batch k runs the guided rows in two calls (``run_rows``)
        with self._using("transformer", batch=batch) as parts:
            for i, t in enumerate(timesteps):
                x = torch.cat(latents * 2 if cfg else latents).numpy().astype(np.float32)
                step_feeds = {**feeds, "hidden_states": x,
                              "timestep": np.full((rows,), np.float32(float(t)) / divisor, np.float32)}
                out = run_rows(parts["transformer"], step_feeds, ["out_sample"], batch)
                pred = torch.from_numpy(out["out_sample"])
                if cfg:
                    pred = guided(pred[:k], pred[k:], opts.guidance)
                latents = [s.step(pred[j : j + 1], t, latents[j], return_dict=False)[0]
                           for j, s in enumerate(schedulers)]
                if progress is not None:
                    progress(i + 1, len(timesteps))
        return torch.cat(latents).numpy().astype(np.float32)

    def _decode(self, latents: np.ndarray) -> list[np.ndarray]:
        """Denoised latents [k, L, h, w] -> k images [H, W, 3] uint8: as ``QwenImagePipeline`` (one frame; each
        channel / (1 / latents_std) + latents_mean, in float32), then the VAE decoder one image at a time."""
        c = self.vae_config
        shape = (1, -1, 1, 1, 1)
        mean = torch.tensor(c["latents_mean"], dtype=torch.float32).view(shape)
        inv_std = 1.0 / torch.tensor(c["latents_std"], dtype=torch.float32).view(shape)
        z = (torch.from_numpy(latents)[:, :, None] / inv_std + mean).numpy()
        images = []
        with self._using("vae_decoder") as parts:
            for j in range(len(z)):
                image = parts["vae_decoder"].run({"latent_sample": z[j : j + 1]}, ["sample"])["sample"][0, :, 0]
                images.append((np.clip(image.transpose(1, 2, 0) / 2 + 0.5, 0, 1) * 255).round().astype(np.uint8))
        return images


def guided(uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
    """``QwenImagePipeline``'s true classifier-free guidance: uncond + scale (cond - uncond), rescaled per token
    to the conditional prediction's norm (over its last axis)."""
    combined = uncond + scale * (cond - uncond)
    return combined * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))
