"""``generation.json``: how a model is meant to be drawn, where that differs from the usual 30 steps at guidance 5.

A guidance-free model (SDXL-Turbo and SD-Turbo: 1 to 4 steps at guidance 0; a guidance-distilled one) says so
here. A preset ships one (``convert/presets/<name>/generation.json``), a local pipeline folder may hold one
beside its ``model_index.json``, and ``sdnpu convert`` copies it into the converted folder, where
``sdnpu generate`` takes its steps and guidance unless told others. It also sets the denoiser's default batch
(``default_batch``): 1 where the guidance is at most 1 (no unconditional half to run), else 2.

::

    {"format": "sdnpu-generation", "version": 1, "steps": 1, "guidance": 0.0}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sdnpu.errors import SdnpuError
from sdnpu.signatures import CFG_BATCH

FILE = "generation.json"
FORMAT, VERSION = "sdnpu-generation", 1
DEFAULT_STEPS, DEFAULT_GUIDANCE = 30, 5.0


def uses_guidance(guidance: float) -> bool:
    """Whether a step runs the unconditional half too: diffusers' rule (``guidance_scale > 1``)."""
    return guidance > 1.0


@dataclass(frozen=True)
class Generation:
    """A model's generation defaults."""

    steps: int = DEFAULT_STEPS
    guidance: float = DEFAULT_GUIDANCE

    @property
    def batch(self) -> int:
        """The denoiser's default batch: ``CFG_BATCH`` where the guidance needs both halves, else 1."""
        return CFG_BATCH if uses_guidance(self.guidance) else 1

    def to_json(self) -> dict[str, object]:
        return {"format": FORMAT, "version": VERSION, "steps": self.steps, "guidance": self.guidance}


def read(folder: Path) -> Generation:
    """``folder``'s generation defaults (the usual ones where it has no ``generation.json``)."""
    path = Path(folder) / FILE
    if not path.is_file():
        return Generation()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise SdnpuError(f"cannot read {path}: {e}", hint=f"fix or delete it (it holds {FORMAT} defaults)") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise SdnpuError(f"{path} is not a {FORMAT} file version {VERSION}",
                         hint='write {"format": "sdnpu-generation", "version": 1, "steps": 1, "guidance": 0.0}')
    steps, guidance = data.get("steps", DEFAULT_STEPS), data.get("guidance", DEFAULT_GUIDANCE)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise SdnpuError(f"{path}: steps {steps!r} is not a whole number of at least 1")
    if isinstance(guidance, bool) or not isinstance(guidance, (int, float)) or guidance < 0:
        raise SdnpuError(f"{path}: guidance {guidance!r} is not a number of at least 0")
    return Generation(steps, float(guidance))
