"""What a piece of a block-by-block conversion is (``Piece``), where its weights come from (``Weights``), and how
one piece's outputs reach the next (``link_values``): shared by the driver (``sdnpu.convert.blockwise.driver``)
and the modules that cut a module into pieces (``t5``, ``flux``, ``qwenimage``), which import nothing else of the
package.

Weights: a folder's come tensor by tensor from its safetensors files (``Weights``), a single file's a block at a
time through its reader (``sdnpu.convert.singlefile.PartReader``: diffusers' names from the original layout);
a preset's are drawn piece by piece, each from its own seed (the piece modules say which), so a piece's weights
do not depend on the others.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any

from safetensors import safe_open

from sdnpu.convert import singlefile
from sdnpu.convert.sources import Source
from sdnpu.convert.stitch import link_name
from sdnpu.errors import SdnpuError

CHAIN_INPUT = "hidden_states"  # what a piece with one output feeds in the next


@dataclass
class Piece:
    """Piece ``i`` of ``n``: a torch module whose forward takes ``inputs`` (positionally) and returns ``outputs``
    (a tensor, or a tuple in that order). An output ``x.next`` feeds later pieces' input ``x``
    (``sdnpu.convert.stitch``); a piece with one output also feeds the next piece's ``hidden_states``."""

    i: int
    n: int
    module: Any
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    whole: Any = None  # param name in the piece -> the whole module's (None: the same)



class Weights:
    """The module's tensors by state-dict name, one piece at a time: a folder's safetensors, read lazily (a
    single file's through its reader)."""

    def __init__(self, src: Source, key: str) -> None:
        self.preset = src.kind == "preset"
        self.where: dict[str, Path] = {}
        self.single: singlefile.PartReader | None = None
        if self.preset:
            return
        if src.single is not None:
            part = next(p for p in src.single.layout.parts if p.module == key)
            config = json.loads((src.modules[key] / "config.json").read_text())
            self.single = singlefile.PartReader(src.root, src.single.layout, part, src.single.prefixes[key], config)
            self.where = dict.fromkeys(self.single.names, src.root)
            return
        folder = src.modules[key]
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise SdnpuError(f"{folder} has no .safetensors weights: block-by-block conversion reads tensors one "
                             "at a time from safetensors files", hint="save the module with safe_serialization "
                             "(transformers' default), or convert it on a machine that holds it whole")
        plain = [f for f in files if ".fp16." not in f.name] or files
        for f in plain:
            with safe_open(str(f), framework="pt") as h:
                for name in h.keys():  # noqa: SIM118 -- safe_open handles have keys(), not iteration
                    self.where.setdefault(name, f)

    def tensors(self, prefix: str) -> dict[str, Any]:
        if self.single is not None:
            return self.single.tensors(prefix)
        out: dict[str, Any] = {}
        by_file: dict[Path, list[str]] = {}
        for name, f in self.where.items():
            if name.startswith(prefix):
                by_file.setdefault(f, []).append(name)
        for f, names in by_file.items():
            with safe_open(str(f), framework="pt") as h:
                for name in names:
                    out[name[len(prefix):]] = h.get_tensor(name).float()
        return out

    def tensor(self, *names: str) -> Any:
        for name in names:
            if name in self.where:
                return self.tensors(name)[""]
        raise SdnpuError(f"the weights have none of {', '.join(names)}",
                         hint="the folder's safetensors must hold a transformers T5EncoderModel's state dict")

    def load(self, build: Callable[[], Any], prefix: str, what: str) -> Any:
        """The module ``build()`` makes, holding the folder's tensors under ``prefix`` (built on the meta device:
        no memory goes to the weights they replace); ``what`` names it in errors."""
        import torch  # with the first piece: the convert stage is imported without torch

        with torch.device("meta"):
            module = build()
        try:
            module.load_state_dict(self.tensors(prefix), assign=True)
        except RuntimeError as e:
            raise SdnpuError(f"{what}'s weights do not match its config: {str(e)[:300]}") from e
        if any(p.is_meta for p in module.parameters()):
            raise SdnpuError(f"{what}'s weights are incomplete in {sorted(set(self.where.values()))[0].parent}")
        return module.float().eval()


def link_values(values: dict[str, Any], names: tuple[str, ...], outs: list[Any] | tuple[Any, ...]) -> dict[str, Any]:
    """``values`` updated with a piece's outputs, each under the name later pieces read it by (any chain: arrays
    or tensors)."""
    new = dict(values)
    new.update((link_name(name), v) for name, v in zip(names, outs, strict=True))
    if len(outs) == 1:
        new[CHAIN_INPUT] = outs[0]
    return new
