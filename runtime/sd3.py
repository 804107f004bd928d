"""Text-to-image on a converted Stable Diffusion 3 / 3.5 folder (``StableDiffusion3Pipeline``), every graph in
onnxruntime, step for step as diffusers' pipeline does it:

    prompt -> CLIP-L and CLIP-G: penultimate hidden states side by side, zero-padded to T5's width, and both
    pooled text_embeds side by side; T5: its hidden states (zeros where the folder has no text_encoder_3, as
    diffusers does without T5) -> prompt embeddings [CLIP 77 ; T5 77] -> the MMDiT at batch 2 (negative,
    positive; guidance at most 1: the positive alone, batch 1) -> classifier-free guidance -> flow-matching
    Euler step -> ... -> latents / scaling_factor + shift_factor -> VAE decoder (16 latent channels) -> PNG

The negative prompt is encoded like the prompt (SD3 has no zeroed empty prompt). Image-to-image and
ControlNets are SDXL/SD 1.x features here: refused with the reason.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Callable
from functools import cached_property
from typing import Any

import numpy as np

from sdnpu import families
from sdnpu.components import CLIP_ENCODERS
from sdnpu.errors import SdnpuError
from sdnpu.formats import generation
from sdnpu.runtime.session import Component, add_command
from sdnpu.runtime.stages import TransformerStages, check_generate, halves, load_scheduler, plan_calls
from sdnpu.signatures import vae_scale_factor
from sdnpu.specs import pipeline_outputs

log = logging.getLogger(__name__)


class SD3Pipeline(TransformerStages):
    """A converted SD3 folder and the loop that runs it; the same interface as ``Pipeline`` (which gives this
    class for an SD3 folder). Sessions are opened per stage and dropped after it unless ``keep_sessions``."""

    family = families.SD3
    required = CLIP_ENCODERS  # T5 is optional, as in diffusers: without it its part of the prompt is zeros

    def _set_up(self) -> None:
        self.t5 = (self.folder / "text_encoder_3" / "export.json").is_file()
        shape = self.inputs["hidden_states"]
        self.latent_shape = (1, *shape[1:])
        self.text_len = self.inputs["encoder_hidden_states"][1]  # CLIP's 77, then T5's tokens
        factor = vae_scale_factor(self.vae_config)
        self.image_size = (factor * shape[2], factor * shape[3])  # (height, width) in pixels

    @property
    def encoders(self) -> tuple[str, ...]:
        """The text encoders this folder runs (SD3's T5 only where it was converted)."""
        return self.family.text_encoders if self.t5 else self.required

    @cached_property
    def tokenizers(self) -> dict[str, Any]:
        # transformers at first use: the CLI starts without it (about 2 s, torch with it)
        from transformers import AutoTokenizer, CLIPTokenizer

        toks: dict[str, Any] = {name: CLIPTokenizer.from_pretrained(self.folder / tok)
                                for name, tok in zip(CLIP_ENCODERS, ("tokenizer", "tokenizer_2"), strict=True)}
        if self.t5:
            if not (self.folder / "tokenizer_3").is_dir():
                raise SdnpuError(f"{self.folder} has text_encoder_3 but no tokenizer_3/",
                                 hint="convert the pipeline again (it copies the tokenizers)")
            toks["text_encoder_3"] = AutoTokenizer.from_pretrained(self.folder / "tokenizer_3")
        return toks

    def _encode(self, parts: dict[str, Component], text: str) -> tuple[np.ndarray, np.ndarray]:
        """(prompt embeddings [1, 77 + T, J], pooled projections [1, P1 + P2]) as diffusers builds them."""
        hidden, pooled = [], []
        for name in CLIP_ENCODERS:
            enc = parts[name]
            config = json.loads((self.folder / name / "config.json").read_text())
            wanted = pipeline_outputs(name, config, self.family.name)
            if wanted is None or not set(wanted) <= set(enc.outputs):
                raise SdnpuError(f"{enc.path} lacks the outputs SD3 reads ({', '.join(wanted or [])})",
                                 hint="compile it again with --outputs pipeline (the default) or --outputs all")
            out = enc.run({"input_ids": self._ids(name, text, enc.inputs["input_ids"][1])}, wanted)
            hidden.append(out[wanted[-1]])
            pooled.append(out["text_embeds"])
        clip = np.concatenate(hidden, axis=-1)
        width = int(self.transformer_config["joint_attention_dim"])
        t5_len = self.text_len - clip.shape[1]
        if self.t5:
            enc = parts["text_encoder_3"]
            t5 = enc.run({"input_ids": self._ids("text_encoder_3", text, enc.inputs["input_ids"][1])},
                         ["last_hidden_state"])["last_hidden_state"]
            if t5.shape[1] != t5_len:
                raise SdnpuError(f"the T5 encoder gives {t5.shape[1]} tokens, the transformer takes {t5_len}",
                                 hint="convert text_encoder_3 and the transformer with the same sdnpu")
        else:
            t5 = np.zeros((1, t5_len, width), np.float32)
        clip = np.pad(clip, ((0, 0), (0, 0), (0, width - clip.shape[-1])))
        return np.concatenate([clip, t5], axis=1), np.concatenate(pooled, axis=-1)

    def generate(self, opts: Any, progress: Callable[[int, int], None] | None = None) -> list[np.ndarray]:
        """``opts.num_images`` images, image k from seed ``opts.seed + k`` (as ``Pipeline.generate``)."""
        if not opts.prompt.strip():
            raise SdnpuError("the prompt is empty", hint='say what to draw: --prompt "a cat"')
        check_generate(opts)
        if self.runtime.loras:
            raise SdnpuError(f"{self.folder} is an SD3 pipeline: sdnpu applies LoRAs to SDXL, SD 1.x and Flux.1 "
                             "folders only",
                             hint="drop --lora")
        if opts.image is not None or opts.controlnets:
            raise SdnpuError(f"{self.folder} is an SD3 pipeline: sdnpu runs it text-to-image only",
                             hint="drop --image / --controlnet (image-to-image and ControlNets are for SDXL and "
                             "SD 1.x folders)")
        cfg = generation.uses_guidance(opts.guidance)
        calls = plan_calls(opts.num_images, cfg, self.batches,
                           lambda b: add_command(self.folder, "transformer", self.size, b))
        log.info("SD3: text encoders %s%s", ", ".join(self.encoders),
                 "" if self.t5 else " (no text_encoder_3: T5's part of the prompt is zeros, as in diffusers)")
        with self._using(*self.encoders) as parts:
            pos, pooled = self._encode(parts, opts.prompt)
            neg, neg_pooled = self._encode(parts, opts.negative_prompt) if cfg else (pos[:0], pooled[:0])
        images: list[np.ndarray] = []
        for batch, k in calls:
            feeds = {"encoder_hidden_states": halves(neg, pos, k), "pooled_projections": halves(neg_pooled, pooled, k)}
            latents = self._denoise(opts, feeds, [opts.seed + len(images) + j for j in range(k)], batch, progress)
            images += self._decode(latents.numpy().astype(np.float32))
        return images

    def _scheduler(self, name: str | None) -> Any:
        scheduler = load_scheduler(self.folder, name)
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", False):  # as diffusers computes mu for the image size
            # diffusers at first use: the CLI starts without it (2-3 s, torch with it)
            from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

            patch = int(self.transformer_config.get("patch_size", 2))
            seq = (self.latent_shape[2] // patch) * (self.latent_shape[3] // patch)
            c = scheduler.config
            kwargs["mu"] = calculate_shift(seq, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                                           c.get("base_shift", 0.5), c.get("max_shift", 1.16))
        return scheduler, kwargs

    def _denoise(self, opts: Any, feeds: dict[str, np.ndarray], seeds: list[int], batch: int,
                 progress: Callable[[int, int], None] | None) -> Any:
        """One transformer call's images through every step, each with its own scheduler and seeded noise."""
        import torch  # torch at first use: the CLI starts without it (about 1 s)

        k, cfg = len(seeds), batch == 2 * len(seeds)
        schedulers = []
        for _ in seeds:
            scheduler, kwargs = self._scheduler(opts.scheduler)
            scheduler.set_timesteps(opts.steps, **kwargs)
            schedulers.append(scheduler)
        latents = [torch.from_numpy(self.noise(seed)) for seed in seeds]
        step_kwargs = [({"generator": torch.Generator().manual_seed(seed)}
                        if "generator" in inspect.signature(s.step).parameters else {})
                       for s, seed in zip(schedulers, seeds, strict=True)]
        timesteps = schedulers[0].timesteps
        with self._using("transformer", batch=batch) as parts:
            for i, t in enumerate(timesteps):
                x = torch.cat(latents)
                step_feeds = {**feeds, "hidden_states": torch.cat([x, x] if cfg else [x]).numpy().astype(np.float32),
                              "timestep": np.full((batch,), float(t), np.float32)}
                pred = torch.from_numpy(parts["transformer"].run(step_feeds, ["out_sample"])["out_sample"])
                if cfg:
                    uncond, cond = pred[:k], pred[k:]
                    pred = uncond + opts.guidance * (cond - uncond)
                latents = [s.step(pred[j : j + 1], t, latents[j], return_dict=False, **kw)[0]
                           for j, (s, kw) in enumerate(zip(schedulers, step_kwargs, strict=True))]
                if progress is not None:
                    progress(i + 1, len(timesteps))
        return torch.cat(latents)
