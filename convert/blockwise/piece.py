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
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

from safetensors import safe_open

from sdnpu.convert import singlefile
from sdnpu.convert.sources import PRESET_SEED, Source
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

    def part(self, build: Callable[[], Any], name: str, seed: int | None) -> Any:
        """Submodule ``name`` as ``build()`` makes it, with its weights: a preset's drawn from ``seed`` (None: the
        random stream as it stands), a folder's read from its tensors under ``name.``."""
        if self.preset:
            import torch  # with the first piece: the convert stage is imported without torch

            if seed is not None:
                torch.manual_seed(seed)
            return build().float().eval()
        return self.load(build, f"{name}.", f"the transformer's {name}")


Load = Callable[[str, "int | None"], Any]  # a submodule by name, with its weights from a seed (``Weights.part``)


def holding(parts: dict[str, Any]) -> Any:
    """A module holding ``parts`` under their whole module's dotted names (``transformer_blocks.3``: ModuleDicts
    for the ``*blocks`` containers), so a piece's parameters are named as the whole module's."""
    import torch  # with the first piece: the convert stage is imported without torch

    whole = torch.nn.Module()
    for name, part in parts.items():
        holder = whole
        *path, leaf = name.split(".")
        for p in path:
            if not hasattr(holder, p):
                holder.add_module(p, torch.nn.ModuleDict() if p.endswith("blocks") else torch.nn.Module())
            holder = getattr(holder, p)
        holder.add_module(leaf, part)
    return whole


def transformer_pieces(blocks: Sequence[str], first: Sequence[str], last: Sequence[str], load: Load,
                       make: Callable[[dict[str, Any], bool, bool], Any], inputs: tuple[str, ...],
                       outputs: tuple[str, ...], shared: tuple[str, ...], streams: tuple[str, ...],
                       only: Collection[int] | None, start: int) -> Iterator[Piece]:
    """A transformer's pieces in order, a block each: the first with the submodules ``first`` before it (its
    inputs the module's ``inputs``; it hands ``shared`` on beside the ``streams``), the last with ``last`` after it
    (its outputs the module's ``outputs``). ``make(parts, is_first, is_last)`` is the piece's module. A preset
    draws the edges from ``PRESET_SEED`` (each group's first from it, the rest in turn) and block ``i`` from
    ``PRESET_SEED + 1 + i``. ``only``: these pieces alone, the others not built; ``start``: from it on."""
    n = len(blocks)
    nexts = tuple(f"{s}.next" for s in streams)
    for i, block in enumerate(blocks):
        if i < start or (only is not None and i not in only):
            continue
        is_first, is_last = i == 0, i == n - 1
        parts = {}
        if is_first:
            parts.update((name, load(name, PRESET_SEED if name == first[0] else None)) for name in first)
        parts[block] = load(block, PRESET_SEED + 1 + i)
        if is_last:
            parts.update((name, load(name, PRESET_SEED if name == last[0] else None)) for name in last)
        ins = inputs if is_first else (*streams, *shared)
        outs = outputs if is_last else ((*nexts, *shared) if is_first else nexts)
        yield Piece(i, n, make(parts, is_first, is_last).eval(), ins, outs)


def whole_from_pieces(model: Any, blocks: Sequence[str], first: Sequence[str], last: Sequence[str], load: Load) -> Any:
    """``model`` (the whole module) holding the weights ``transformer_pieces`` gives its pieces (small modules
    only: tests compare against it)."""
    import torch  # with the first piece: the convert stage is imported without torch

    with torch.no_grad():
        for name in (*first, *last):
            seed = PRESET_SEED if name in (first[0], last[0]) else None
            model.get_submodule(name).load_state_dict(load(name, seed).state_dict())
        for i, name in enumerate(blocks):
            model.get_submodule(name).load_state_dict(load(name, PRESET_SEED + 1 + i).state_dict())
    return model.eval()


def link_values(values: dict[str, Any], names: tuple[str, ...], outs: list[Any] | tuple[Any, ...]) -> dict[str, Any]:
    """``values`` updated with a piece's outputs, each under the name later pieces read it by (any chain: arrays
    or tensors)."""
    new = dict(values)
    new.update((link_name(name), v) for name, v in zip(names, outs, strict=True))
    if len(outs) == 1:
        new[CHAIN_INPUT] = outs[0]
    return new
