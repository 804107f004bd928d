"""Torch-free facts about diffusers pipelines that the export stage, the compiler driver and the runtime all
need (the runtime never imports the export stage)."""

from __future__ import annotations

from typing import Any


def pipeline_outputs(component: str, config: dict[str, Any], sdxl: bool) -> list[str] | None:
    """The outputs of ``component`` that a diffusers pipeline reads (None: all of them).

    The text encoders are exported with every hidden state (optimum's signature), but SDXL reads only the
    penultimate hidden states of both encoders and text_encoder_2's pooled ``text_embeds``; SD 1.x/2.x read
    ``last_hidden_state``. Every other output would cost a CastAvx on the CPU and, past the penultimate
    layer, NPU work nobody uses. The UNet and the VAEs have one output.
    """
    if component not in ("text_encoder", "text_encoder_2"):
        return None
    if not sdxl and component == "text_encoder":
        return ["last_hidden_state"]
    penultimate = f"hidden_states.{int(config['num_hidden_layers']) - 1}"
    return ["text_embeds", penultimate] if component == "text_encoder_2" else [penultimate]
