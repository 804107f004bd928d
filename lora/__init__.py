"""LoRAs on converted folders: read (``adapters``), applied as an overlay of changed weights (``overlay``),
or fused before export (``sdnpu convert --lora``)."""

from sdnpu.lora.adapters import Adapters, LoraFile, LoraSpec, fuse_into, read_lora

__all__ = ["Adapters", "LoraFile", "LoraSpec", "fuse_into", "read_lora"]
