"""``<component>/dd/lora/``: the LoRA overlay of a compiled component, its manifest and its data file.

``sdnpu lora apply`` (``sdnpu.lora.overlay``) writes the dispatch-model constants a set of LoRAs changes into
``dd/lora/weights.data`` (each at a 64-byte aligned offset) and names them in ``dd/lora/lora.json``::

    {"format": "sdnpu-lora", "version": 1, "component": NAME, "loras": [<each file, name, scale, format,
     sha256>], "modules": N, "base": {"weights.json sha256": <digest of dd/weights.json>}, "data":
     "weights.data", "bytes": N, "tensors": {<initializer>: {"offset", "length", "data_type", "shape",
     "dtype"}}}

The runtime and ``sdnpu verify`` read it (``read_manifest``: checked against the component's base, so an
overlay of another compilation is refused); ``overlay_initializers`` maps its tensors without reading them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from sdnpu.errors import SdnpuError
from sdnpu.formats import weights

FORMAT, VERSION = "sdnpu-lora", 1
OVERLAY_DIR = "lora"  # <component>/dd/lora/
MANIFEST = "lora.json"
DATA = "weights.data"
ALIGN = 64


def base_digest(comp_dir: Path) -> str:
    """The digest an overlay records of the compilation it was computed for (its ``dd/weights.json``)."""
    return hashlib.sha256((comp_dir / "dd" / weights.FILE).read_bytes()).hexdigest()


def read_manifest(dd_dir: Path) -> dict[str, Any] | None:
    """``dd/lora/lora.json`` checked against the folder's base, or None where there is no overlay."""
    path = dd_dir / OVERLAY_DIR / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:
        raise SdnpuError(f"{path} is not readable JSON: {e}", hint="sdnpu lora remove, then apply again") from e
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise SdnpuError(f"{path} is not an sdnpu LoRA overlay this version reads",
                         hint="sdnpu lora remove, then apply again")
    if manifest["base"]["weights.json sha256"] != base_digest(dd_dir.parent):
        raise SdnpuError(f"the LoRA overlay in {dd_dir / OVERLAY_DIR} was computed for another compilation "
                         "of this component", hint="sdnpu lora remove, then apply the LoRAs again")
    data = dd_dir / OVERLAY_DIR / manifest["data"]
    if not data.is_file() or data.stat().st_size != manifest["bytes"]:
        raise SdnpuError(f"{data} is missing or truncated", hint="sdnpu lora remove, then apply again")
    return manifest  # type: ignore[no-any-return]


def overlay_initializers(dd_dir: Path) -> tuple[dict[str, np.ndarray], dict[str, Any] | None]:
    """The overlay's tensors (mapped from its data file, not read), by initializer name, and its manifest."""
    manifest = read_manifest(dd_dir)
    if manifest is None:
        return {}, None
    raw = np.memmap(dd_dir / OVERLAY_DIR / manifest["data"], dtype=np.uint8, mode="r")
    out = {}
    for name, t in manifest["tensors"].items():
        dtype = ml_dtypes.bfloat16 if t["dtype"] == "bfloat16" else np.dtype(t["dtype"])
        out[name] = raw[t["offset"]:t["offset"] + t["length"]].view(dtype).reshape(t["shape"])
    return out, manifest


def applied_names(folder: Path, components: tuple[str, ...]) -> str:
    """The LoRAs applied to any of ``components`` in the converted ``folder``, as one string ("" where none)."""
    names: list[str] = []
    for comp in components:
        path = folder / comp / "dd" / OVERLAY_DIR / MANIFEST
        if path.is_file():
            try:
                loras = json.loads(path.read_text())["loras"]
            except (ValueError, KeyError):
                continue
            names += [f"{x['name']}:{x['scale']:g}" for x in loras if f"{x['name']}:{x['scale']:g}" not in names]
    return ", ".join(names)
