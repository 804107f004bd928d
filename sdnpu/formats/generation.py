"""``generation.json``: how a model is meant to be drawn, where that differs from the usual 30 steps at guidance 5.

A guidance-free model (SDXL-Turbo and SD-Turbo: 1 to 4 steps at guidance 0; a guidance-distilled one) says so
here. A preset ships one (``convert/presets/<name>/generation.json``), a local pipeline folder may hold one
beside its ``model_index.json``, and ``sdnpu convert`` copies it into the converted folder, where
``sdnpu generate`` takes its steps and guidance unless told others. It also sets the denoiser's default batch
(``default_batch``): 1 where the guidance is at most 1 (no unconditional half to run), else 2.

::

    {"format": "sdnpu-generation", "version": 1, "steps": 1, "guidance": 0.0}

A guidance-distilled model whose transformer takes the guidance as an input (Flux.1 dev: ``"embedded_guidance":
true``) runs one half whatever the guidance: its default batch is 1. ``max_sequence_length`` (optional) is T5's
tokens, diffusers' argument of that name (Flux.1 schnell: 256); it sets the T5 encoder's and the transformer's
shapes. A Flux.1 folder without the file gets ``FluxPipeline``'s defaults (``family_default``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sdnpu import families
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
    embedded_guidance: bool = False  # the transformer takes the guidance (Flux.1 dev): no unconditional half
    max_sequence_length: int | None = None  # T5's tokens; None: the family's default

    @property
    def batch(self) -> int:
        """The denoiser's default batch: ``CFG_BATCH`` where the guidance needs both halves, else 1."""
        return CFG_BATCH if self.classifier_free else 1

    @property
    def classifier_free(self) -> bool:
        """Whether a step runs the unconditional half too at the default guidance."""
        return not self.embedded_guidance and uses_guidance(self.guidance)

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {"format": FORMAT, "version": VERSION, "steps": self.steps,
                                   "guidance": self.guidance}
        if self.embedded_guidance:
            data["embedded_guidance"] = True
        if self.max_sequence_length is not None:
            data["max_sequence_length"] = self.max_sequence_length
        return data


def family_default(family: str | None) -> Generation:
    """The defaults of a folder without ``generation.json``: diffusers' pipeline's for its family (its row's
    ``generation``, ``sdnpu.families``; Flux.1: ``FluxPipeline``'s 28 steps at guidance 3.5, embedded), else
    the usual ones."""
    return Generation(**families.named(family).generation)


def read(folder: Path, family: str | None = None) -> Generation:
    """``folder``'s generation defaults (``family_default`` where it has no ``generation.json``)."""
    path = Path(folder) / FILE
    if not path.is_file():
        return family_default(family)
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
    embedded, length = data.get("embedded_guidance", False), data.get("max_sequence_length")
    if not isinstance(embedded, bool):
        raise SdnpuError(f"{path}: embedded_guidance {embedded!r} is not true or false")
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
        raise SdnpuError(f"{path}: max_sequence_length {length!r} is not a whole number of at least 1")
    return Generation(steps, float(guidance), embedded, length)
