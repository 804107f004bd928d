"""The thin torch wrappers that give each component's module a positional, tuple-returning ``forward`` to
export, in the signature ``sdnpu.signatures.signature`` describes; the component table names each one
(``sdnpu.components``, its ``wrapper`` column).

This module imports torch: the stage that builds torch modules imports it when it runs (nothing else does).
The classes take the module as an argument and close over nothing: a class that captured the module would keep
its weights alive as long as anything (torch's export caches) holds the class.
"""

from __future__ import annotations

from typing import Any

import torch

from sdnpu import components
from sdnpu.errors import SdnpuError
from sdnpu.signatures import clip_projection, unet_text_time


class TextEncoder(torch.nn.Module):
    def __init__(self, model: Any, projection: bool) -> None:
        super().__init__()
        self.model = model
        self.projection = projection

    @classmethod
    def of(cls, module: Any, component: str, config: dict[str, Any]) -> torch.nn.Module:
        return cls(module, projection=clip_projection(component, config))

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.model(input_ids=input_ids, output_hidden_states=True, return_dict=True)
        first = (out.text_embeds, out.last_hidden_state) if self.projection else (
            out.last_hidden_state, out.pooler_output)
        return first + tuple(out.hidden_states)


class UNet(torch.nn.Module):
    def __init__(self, unet: Any) -> None:
        super().__init__()
        self.unet = unet

    @classmethod
    def of(cls, module: Any, component: str, config: dict[str, Any]) -> torch.nn.Module:
        return UNetTextTime(module) if unet_text_time(config) else UNet(module)

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor,
                encoder_hidden_states: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.unet(sample, timestep, encoder_hidden_states, return_dict=False)[0],)


class UNetTextTime(UNet):
    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,  # type: ignore[override]
                text_embeds: torch.Tensor, time_ids: torch.Tensor) -> tuple[torch.Tensor]:
        added = {"text_embeds": text_embeds, "time_ids": time_ids}
        return (self.unet(sample, timestep, encoder_hidden_states, added_cond_kwargs=added,
                          return_dict=False)[0],)


class VaeEncoder(torch.nn.Module):
    def __init__(self, vae: Any) -> None:
        super().__init__()
        self.vae = vae

    @classmethod
    def of(cls, module: Any, component: str, config: dict[str, Any]) -> torch.nn.Module:
        return cls(module)

    def forward(self, sample: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.vae.encode(sample, return_dict=False)[0].parameters,)


class VaeDecoder(VaeEncoder):
    def forward(self, latent_sample: torch.Tensor) -> tuple[torch.Tensor]:  # type: ignore[override]
        return (self.vae.decode(latent_sample, return_dict=False)[0],)


class UNetResiduals(torch.nn.Module):
    """The UNet taking a ControlNet's residuals: (sample, timestep, encoder_hidden_states, [text_embeds,
    time_ids], down_block_additional_residuals..., mid_block_additional_residual) -> out_sample."""

    def __init__(self, unet: Any, text_time: bool) -> None:
        super().__init__()
        self.unet = unet
        self.text_time = text_time

    @classmethod
    def of(cls, module: Any, component: str, config: dict[str, Any]) -> torch.nn.Module:
        return cls(module, text_time=unet_text_time(config))

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor]:
        n = 5 if self.text_time else 3
        sample, timestep, encoder_hidden_states = args[:3]
        added = {"text_embeds": args[3], "time_ids": args[4]} if self.text_time else None
        residuals = args[n:]
        return (self.unet(sample, timestep, encoder_hidden_states, added_cond_kwargs=added,
                          down_block_additional_residuals=tuple(residuals[:-1]),
                          mid_block_additional_residual=residuals[-1], return_dict=False)[0],)


class ControlNet(torch.nn.Module):
    """diffusers' ControlNetModel: (sample, timestep, encoder_hidden_states, [text_embeds, time_ids],
    controlnet_cond, conditioning_scale) -> the down-block residuals, then the mid-block's."""

    def __init__(self, controlnet: Any, text_time: bool) -> None:
        super().__init__()
        self.controlnet = controlnet
        self.text_time = text_time

    @classmethod
    def of(cls, module: Any, component: str, config: dict[str, Any]) -> torch.nn.Module:
        return cls(module, text_time=unet_text_time(config))

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        sample, timestep, encoder_hidden_states = args[:3]
        added = {"text_embeds": args[3], "time_ids": args[4]} if self.text_time else None
        controlnet_cond, conditioning_scale = args[-2:]
        down, mid = self.controlnet(sample, timestep, encoder_hidden_states, controlnet_cond=controlnet_cond,
                                    conditioning_scale=conditioning_scale, added_cond_kwargs=added,
                                    return_dict=False)
        return (*down, mid)


class T5Encoder(torch.nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    @classmethod
    def of(cls, module: Any, component: str, config: dict[str, Any]) -> torch.nn.Module:
        return cls(module)

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.model(input_ids=input_ids, return_dict=True).last_hidden_state,)


class Transformer(torch.nn.Module):
    """SD3's MMDiT: (hidden_states, timestep, encoder_hidden_states, pooled_projections) -> out_sample."""

    def __init__(self, transformer: Any) -> None:
        super().__init__()
        self.transformer = transformer

    @classmethod
    def of(cls, module: Any, component: str, config: dict[str, Any]) -> torch.nn.Module:
        return cls(module)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                pooled_projections: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.transformer(hidden_states=hidden_states, timestep=timestep,
                                 encoder_hidden_states=encoder_hidden_states,
                                 pooled_projections=pooled_projections, return_dict=False)[0],)


class FluxTransformer(torch.nn.Module):
    """Flux.1's transformer: (hidden_states, timestep, encoder_hidden_states, pooled_projections, img_ids,
    txt_ids[, guidance]) -> out_sample, as ``FluxPipeline`` calls it (packed latents, timestep / 1000)."""

    def __init__(self, transformer: Any, guidance: bool) -> None:
        super().__init__()
        self.transformer = transformer
        self.guidance = guidance

    @classmethod
    def of(cls, module: Any, component: str, config: dict[str, Any]) -> torch.nn.Module:
        return cls(module, guidance=bool(config.get("guidance_embeds")))

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                pooled_projections: torch.Tensor, img_ids: torch.Tensor, txt_ids: torch.Tensor,
                guidance: torch.Tensor | None = None) -> tuple[torch.Tensor]:
        return (self.transformer(hidden_states=hidden_states, timestep=timestep,
                                 encoder_hidden_states=encoder_hidden_states, pooled_projections=pooled_projections,
                                 img_ids=img_ids, txt_ids=txt_ids, guidance=guidance if self.guidance else None,
                                 return_dict=False)[0],)


class QwenTextEncoder(torch.nn.Module):
    """Qwen-Image's text encoder (``Qwen2_5_VLForConditionalGeneration``): input_ids -> the language model's last
    hidden states (after its final norm: ``hidden_states[-1]``, what ``QwenImagePipeline`` reads). Its vision
    tower is not exported: the pipeline gives it no image. Without the attention mask: the attention is causal,
    so the padding after the prompt changes none of the prompt's states, and its text positions (0, 1, ... on
    each of the three rotary axes) are what Qwen2.5-VL computes from the mask for a prompt padded at its end."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model.model.language_model

    @classmethod
    def of(cls, module: Any, component: str, config: dict[str, Any]) -> torch.nn.Module:
        return cls(module)

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.model(input_ids=input_ids, use_cache=False, return_dict=True).last_hidden_state,)


class QwenImageTransformer(torch.nn.Module):
    """Qwen-Image's transformer: (hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_mask) ->
    out_sample, as ``QwenImagePipeline`` calls it (packed latents, timestep / 1000, the caption's mask) for an
    image of ``latent`` latents: its shape (one frame of (H/2f) x (W/2f) tokens) sets the rotary tables."""

    def __init__(self, transformer: Any, latent: tuple[int, int]) -> None:
        super().__init__()
        self.transformer = transformer
        self.shape = (1, latent[0] // 2, latent[1] // 2)

    @classmethod
    def of(cls, module: Any, component: str, config: dict[str, Any],
           latent: tuple[int, int] | None = None) -> torch.nn.Module:
        if latent is None:
            raise SdnpuError("Qwen-Image's transformer is exported for one image size: give its latent size",
                             hint="build_wrapper(..., latent=(height // f, width // f))")
        return cls(module, latent)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_hidden_states_mask: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.transformer(hidden_states=hidden_states, timestep=timestep,
                                 encoder_hidden_states=encoder_hidden_states,
                                 encoder_hidden_states_mask=encoder_hidden_states_mask,
                                 img_shapes=[[self.shape]] * hidden_states.shape[0], return_dict=False)[0],)


class QwenImageVaeEncoder(VaeEncoder):
    """Qwen-Image's VAE (``AutoencoderKLQwenImage``) on one frame: sample [1, 3, 1, H, W] -> its latent
    distribution's parameters [1, 2L, 1, H/f, W/f] (mean, then log-variance)."""


class QwenImageVaeDecoder(VaeDecoder):
    """Qwen-Image's VAE on one frame: latent_sample [1, L, 1, H/f, W/f] -> sample [1, 3, 1, H, W]."""


_BY_NAME: dict[str, Any] = {"TextEncoder": TextEncoder, "T5Encoder": T5Encoder, "Transformer": Transformer,
                            "FluxTransformer": FluxTransformer, "QwenTextEncoder": QwenTextEncoder,
                            "QwenImageTransformer": QwenImageTransformer, "QwenImageVaeEncoder": QwenImageVaeEncoder,
                            "QwenImageVaeDecoder": QwenImageVaeDecoder,
                            "UNet": UNet, "VaeEncoder": VaeEncoder, "VaeDecoder": VaeDecoder,
                            "ControlNet": ControlNet, "UNetResiduals": UNetResiduals}


def build_wrapper(component: str, module: Any, config: dict[str, Any], latent: tuple[int, int] | None = None) -> Any:
    """A torch module whose forward takes the signature's inputs in order and returns a tuple; ``latent``: the
    latent size (H/f, W/f) the graph is for, which a wrapper whose module takes the image's shape besides its
    tensors needs (Qwen-Image's transformer)."""
    cls = _BY_NAME[components.wrapper_of(component, config)]
    made = cls.of(module, component, config, latent) if cls is QwenImageTransformer else cls.of(module, component,
                                                                                                  config)
    return made.eval()
