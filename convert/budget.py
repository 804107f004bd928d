"""Memory budgeting for a conversion: how much fp32 weight each module has, which modules export in a worker
process of their own, which convert block by block, and which cannot be converted here at all (refused
before anything is written)."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from sdnpu.components import module_of
from sdnpu.convert import blockwise
from sdnpu.convert.options import ConvertOptions
from sdnpu.convert.sources import Source
from sdnpu.errors import SdnpuError
from sdnpu.memory import available_bytes

log = logging.getLogger(__name__)

# Modules above this many bytes of fp32 weights are exported in a child process: torch 2.13's exporter
# keeps tensors alive after it returns (held outside Python's reach), and at full SDXL size that is 10 GB
# sitting beside onnxruntime's copy during the check. A process that exits gives everything back.
ISOLATE_BYTES = 1 << 30

# A module whose fp32 weights alone take more than this share of the available memory is refused before any
# export: the torch stage holds them beside PyTorch's activations and the exporter's own tensors (the SD 3.5
# transformer, 9.0 GB of weights, peaked at 21.4 GB over its whole conversion). T5 (SD 3.5's T5-XXL: 19.0 GB)
# goes block by block instead (BLOCKWISE_SHARE).
MODULE_SHARE = 0.8

# A module that can convert block by block does so where its fp32 weights exceed this share of the available
# memory: whole, its export holds the weights, PyTorch's run, the exporter's copies and then onnxruntime's copy
# (the SD 3.5 transformer peaked at 2.4x its weights), and block by block costs only time.
BLOCKWISE_SHARE = 0.5


# What a component's folder takes on disk, as a share of its module's fp32 weight bytes: the fp32 graph (1x) and
# the bf16 dispatch model (0.5x); sdxl-turbo's five components took 20 GB for 13.8 GB of fp32 weights (du).
DISK_SHARE = 1.5
# A standard target's (qnn-htp): the fp32 graph (1x), the rewritten fp32 graph (1x) and the fp16 context (0.5x;
# sd-turbo's UNet: 3.46 + 3.46 + 1.74 GB); block by block, the rewritten pieces are deleted once compiled.
STANDARD_DISK_SHARE = 2.5
# Block by block with --dispatch-only: the dispatch model (0.5x of the weights in bf16, more where a rewrite widens
# weights: Qwen-Image's caption mask rides in Q and K, its projections 4x wide, and its dispatch model measured
# 59.85 GB of bf16 weights, 56 GB on disk, 0.69x its 81.7 GB of fp32 weights), and while a piece compiles its fp32
# graph and dispatch model besides (1.5x a piece's weights: 0.025x for one of Qwen-Image's 60 blocks, 0.094x for
# one of T5-XXL's 24 with its 0.5 GB token table). Stitching consumes each piece's dispatch model as it copies it.
DISPATCH_ONLY_DISK_SHARE = 0.75


def human(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def module_bytes(src: Source, key: str) -> int:
    """fp32 weight bytes of module ``key`` (``Source.weight_bytes``)."""
    return src.weight_bytes(key)


def fits(need: int, share: float) -> bool:
    avail = available_bytes()
    return avail is None or need <= share * avail


def check_module_fits(key: str, need: int, comps: list[str]) -> None:
    """Refuse module ``key`` (``need`` bytes of fp32 weights) where it cannot fit (``MODULE_SHARE``)."""
    if fits(need, MODULE_SHARE):
        return
    avail = available_bytes()
    assert avail is not None
    names = [c for c in comps if module_of(c) == key]
    others = [c for c in comps if module_of(c) != key]
    hint = f"convert the others: --model {','.join(others)}" if others else "convert it on a machine with more memory"
    raise SdnpuError(f"{', '.join(names)} cannot be converted here: the {key} module's fp32 weights alone are "
                     f"{human(need)} and this machine has {human(avail)} available (its export holds them beside "
                     "PyTorch's activations and the exporter's own copies)", hint=hint)


@dataclass
class Budget:
    """Each module's fp32 weight bytes, and those that convert block by block."""

    weights: dict[str, int]
    by_block: set[str] = field(default_factory=set)
    standard: bool = False  # compiled for a standard target (its vendor's context beside a rewritten graph)
    dispatch_only: bool = False  # the modules converted block by block keep no fp32 graph (--dispatch-only)

    def disk_share(self, key: str) -> float:
        """What module ``key``'s folder takes on disk, as a share of its fp32 weight bytes."""
        if key in self.by_block and self.dispatch_only:
            return DISPATCH_ONLY_DISK_SHARE
        return STANDARD_DISK_SHARE if self.standard and key not in self.by_block else DISK_SHARE

    def isolate(self, key: str) -> bool:
        """Whether module ``key``'s torch stage runs in a worker process (``ISOLATE_BYTES``)."""
        return self.weights[key] > ISOLATE_BYTES


def plan(src: Source, comps: list[str], options: ConvertOptions) -> Budget:
    """The budget of converting ``comps`` of ``src``; a module that cannot fit is refused now."""
    budget = Budget({key: module_bytes(src, key) for key in dict.fromkeys(module_of(c) for c in comps)},
                    standard=options.compile and options.compile_options.target.kind == "standard",
                    dispatch_only=options.dispatch_only)
    for key, need in budget.weights.items():  # one that cannot fit: before anything is written
        if blockwise.supports(src, key) and (options.blockwise or not fits(need, BLOCKWISE_SHARE)):
            budget.by_block.add(key)
            log.info("%s: %s of fp32 weights; converting it block by block", key, human(need))
            continue
        check_module_fits(key, need, comps)
    if options.blockwise and not budget.by_block:
        log.warning("--blockwise: none of %s converts block by block (only %s do); converting them whole",
                    ", ".join(comps), ", ".join(blockwise.CLASSES))
    whole = [c for c in comps if module_of(c) not in budget.by_block]
    if options.dispatch_only and whole:
        log.warning("--dispatch-only: %s %s whole and %s the fp32 graph (--dispatch-only drops it for the modules "
                    "converted block by block: %s)", ", ".join(whole), "converts" if len(whole) == 1 else "convert",
                    "keeps" if len(whole) == 1 else "keep", ", ".join(sorted(budget.by_block)) or "none here")
    return budget


def check_disk(budget: Budget, comps: list[str], out_dir: Path) -> None:
    """Refuse now, before any export, a conversion whose folders would not fit on ``out_dir``'s disk
    (``Budget.disk_share`` of each component's module weights), less what a stopped block-by-block run of
    them already wrote (its finished pieces, which this run goes on after). Where the modules converted block by
    block keep their fp32 graphs, the hint names ``--dispatch-only``, which needs about half of that."""
    need = int(sum(budget.disk_share(module_of(c)) * budget.weights[module_of(c)] for c in comps))
    need -= sum(f.stat().st_size for c in comps if module_of(c) in budget.by_block
                for f in blockwise.work_dir(out_dir / c, c).rglob("*") if f.is_file())
    where = out_dir
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if need > free:
        smaller = [c for c in comps if module_of(c) in budget.by_block] if not budget.dispatch_only else []
        raise SdnpuError(f"{', '.join(comps)} need about {human(need)} on disk and {where} has {human(free)} free",
                         hint="free some space, or convert to another disk with --out DIR (or fewer components "
                         "with --model)" + (f"; --dispatch-only keeps {', '.join(smaller)} without the fp32 graph "
                                            f"(about {DISPATCH_ONLY_DISK_SHARE / DISK_SHARE:.0%} of the disk)"
                                            if smaller else ""))
