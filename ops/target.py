"""A *target* is data: the NPU's op contract, one table per NPU stack.

For every op the target runs, the table says its domain and type, its inputs in order (activation, weight,
bias, AMD's dummy weight inputs, mask) with the dtype each is stored in, its attributes with their ONNX types
and how each value relates to the node's tensors, the ``in_dtypes`` / ``out_dtypes`` the NPU runtime keys
its kernels on, the layout of its activations, and its limits. Every entry cites the public source it was
read from; a capability that had to be assumed says so (``Limit.assumed``), each op that relies on one
carries its name (node metadata ``sdnpu.assumed``) and the report counts them.

The rules, glue, precision, partition and the report read the table: a dispatch op is a node whose
``(domain, op_type)`` is in it, and nothing else is.

Shapes are symbolic letters in the docs: ``X: [B, H, W, C]``. A *view* is the shape an op reads an input as
(its ``input_shape`` / ``a_shape`` attribute). A Reshape that only re-views contiguous memory in front of a
dispatch op is absorbed into it (the op's reference body reshapes the input to the view), so it costs no node.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sdnpu.errors import SdnpuError

# ONNX attribute types, as the tables write them (AttributeProto.AttributeType names).
INT, INTS, FLOAT, STRING, STRINGS = "INT", "INTS", "FLOAT", "STRING", "STRINGS"

Params = Mapping[str, Any]


@dataclass(frozen=True)
class Input:
    """One input of a dispatch op, in the order the NPU runtime reads them.

    ``role``: ``activation`` (a tensor another op produces; bf16, cast at a CPU edge), ``weight`` / ``bias``
    (initializers, stored as ``dtype`` in the dispatch model, transformed offline), ``dummy`` (an initializer
    AMD's kernels take but do not read, of fixed ``dummy_shape`` and ``dtype``), ``mask`` (an initializer
    the rule computes)."""

    name: str
    role: str
    dtype: str  # storage dtype in replaced.onnx: "bfloat16", "float", "uint8", "uint16"
    shape: str = ""  # symbolic, for the docs
    dummy_shape: tuple[int, ...] = ()
    packed: str = ""  # what `sdnpu pack` turns it into (AMD's physical format), where that differs
    block_axis: int | None = None  # a weight AMD's packer stores as bfp16ebs8: the axis of its 8-value blocks


@dataclass(frozen=True)
class Attr:
    """One attribute: its name, ONNX type, what its value is, and where that comes from.

    ``kind``: ``amd`` (AMD's test model for the op writes it), ``pass`` (AMD's ONNX pass writes it: the
    newer contract), ``copied`` (AMD's pass copies it from the op it replaces, e.g. a Conv's strides).
    ``required``: every node carries it (else only nodes that need it, e.g. ``nonlinear``)."""

    name: str
    type: str
    doc: str
    kind: str = "amd"
    required: bool = True


@dataclass(frozen=True)
class Limit:
    """A limit on the op's shapes or parameters. ``rule(params)`` returns a reason (the op cannot take
    these params) or None. With ``assumed``, the limit is a capability no public source states: ``rule``
    then returns a text when the op relies on it (which does not refuse the op, but is recorded)."""

    name: str
    doc: str
    source: str
    rule: Callable[[Params], str | None]
    assumed: bool = False


@dataclass(frozen=True)
class OpSpec:
    op_type: str
    doc: str
    inputs: tuple[Input, ...]
    attrs: tuple[Attr, ...]
    in_dtypes: tuple[str, ...]
    out_dtypes: tuple[str, ...]
    layout: str  # "NHWC", "BMK" ([B, M, K]), or "any" (element-wise)
    sources: tuple[str, ...]
    limits: tuple[Limit, ...] = ()
    # (attribute, input index): the attribute is the shape that input is read as (a view of its tensor)
    views: tuple[tuple[str, int], ...] = ()
    # (attribute, input index): the attribute equals that input's shape exactly (weights)
    exact_inputs: tuple[tuple[str, int], ...] = ()
    # (attribute, output index): the attribute equals that output's shape exactly
    exact_outputs: tuple[tuple[str, int], ...] = ()
    macs: Callable[[Params], int] | None = None  # from the node's attributes
    # the output's shape from the node's attributes (None: they do not say it); the size specializer
    # (sdnpu.passes.specialize) re-derives a compiled graph's shapes with it
    output: Callable[[Params], list[int]] | None = None
    bfp: str | None = None  # this op's BFP16 variant, where the target has one
    bfp_in_dtypes: tuple[str, ...] = ()

    def attr(self, name: str) -> Attr:
        return next(a for a in self.attrs if a.name == name)

    def input_views(self, attrs: Params) -> dict[int, list[int]]:
        """Input index -> the shape the op reads it as, from the node's attributes."""
        if "input_shape" in attrs and len(self.inputs) >= 3 and self.inputs[1].name == "K":  # the MHA ops
            b, m, k, n = attrs["input_shape"]
            return {0: [b, m, k], 1: [b, n, k], 2: [b, n, k]}
        return {i: list(attrs[a]) for a, i in self.views if a in attrs}

    def with_views(self, attrs: Params, views: Mapping[int, Sequence[int]]) -> dict[str, Any]:
        """``attrs`` with the view attributes set from ``views`` (input index -> shape): the inverse of
        ``input_views``."""
        out = dict(attrs)
        if "input_shape" in attrs and len(self.inputs) >= 3 and self.inputs[1].name == "K":  # the MHA ops
            out["input_shape"] = [*views[0], list(views[1])[1]]
            return out
        for a, i in self.views:
            if a in attrs and i in views:
                out[a] = [int(d) for d in views[i]]
        return out

    @property
    def activation_inputs(self) -> tuple[int, ...]:
        return tuple(i for i, spec in enumerate(self.inputs) if spec.role == "activation")

    def check(self, params: Params) -> tuple[str | None, list[str]]:
        """(the first limit that refuses these params, or None; the assumed capabilities they rely on)."""
        assumed: list[str] = []
        for limit in self.limits:
            why = limit.rule(params)
            if why is None:
                continue
            if not limit.assumed:
                return f"{self.op_type}: {why}", assumed
            assumed.append(limit.name)
        return None, assumed


def attention_mask(length: int, n: int) -> np.ndarray:
    """The one additive row over the keys that an attention kernel reads: 0 for the ``n`` keys, -inf for the
    padding up to ``length`` (float32; the rules and the size specializer cast it)."""
    return np.where(np.arange(length) < n, 0.0, -np.inf).astype(np.float32)


@dataclass(frozen=True, kw_only=True)
class Target:
    """What every target says, whatever its NPU takes (``--target`` names one; the report names it).

    ``kind``: ``dispatch`` (the NPU runs custom ops from a table: ``DispatchTarget``, AMD's) or ``standard``
    (it runs standard ONNX ops within limits its vendor's op builders state: ``StandardTarget``, Qualcomm's);
    it chooses the pass list (``sdnpu.passes.pipeline``). ``precisions``: what ``--precision`` may say, the
    first the default. ``out_dir``: the folder beside ``model.onnx`` that a compile writes (``dd``, ``qnn``).
    ``backend``: the module (``sdnpu.backends.<name>``, named as a string so that ``ops/`` imports nothing
    above it) holding the vendor's compile step, packaging, session options and its own offload count; ""
    where the target has none (the dispatch model is the result). ``counted_by``: who counts the offload."""

    name: str
    doc: str
    kind: str
    precisions: tuple[str, ...]
    out_dir: str = "dd"
    backend: str = ""
    counted_by: str = "sdnpu, from the target's table"
    sources: Mapping[str, str] = field(default_factory=dict)  # citation prefix -> what and where
    cpu_reasons: Mapping[str, str] = field(default_factory=dict)  # ONNX op type -> why it stays on the CPU

    def is_dispatch(self, domain: str, op_type: str) -> bool:
        """A node the NPU runs, by its type alone (the table's limits are the passes' to check)."""
        raise NotImplementedError

    def is_boundary(self, domain: str, op_type: str) -> bool:
        """The CPU<->NPU boundary cast, where the target writes one."""
        return False

    def cpu_reason(self, op_type: str) -> str:
        return self.cpu_reasons.get(op_type, f"{op_type}: not in the {self.name} table")


@dataclass(frozen=True, kw_only=True)
class DispatchTarget(Target):
    """One NPU's custom-op contract: its dispatch ops, the CPU<->NPU boundary cast, and the sources cited."""

    kind: str = "dispatch"
    domain: str
    domain_version: int
    ops: Mapping[str, OpSpec]
    boundary: OpSpec  # the CPU<->NPU cast: runs on the CPU, never counted as offloaded
    # Attention: which op takes Q length M, K/V length N and H heads, and its mask length for (B, M, K, N)
    mha_variant: Callable[[int, int, int], str] | None = None
    mha_mask_length: Callable[[int, int, int, int], int] | None = None
    # op family ("gemm", "conv", "add", ...) -> this target's op type: what the rules and the glue ask for
    families: Mapping[str, str] = field(default_factory=dict)

    def op(self, family: str) -> OpSpec:
        """The target's op of ``family`` ("gemm": the linear layer's op, "add": the element-wise sum, ...)."""
        name = self.families.get(family)
        if name is None:
            raise SdnpuError(f"target {self.name} has no op of the {family!r} family",
                             hint=f"its table names {', '.join(sorted(self.families))}")
        return self.ops[name]

    def mha_mask(self, b: int, m: int, k: int, n: int) -> np.ndarray:
        """The attention's mask for (B, M, K, N): ``attention_mask`` at the target's length."""
        assert self.mha_mask_length is not None
        return attention_mask(self.mha_mask_length(b, m, k, n), n)

    def is_dispatch(self, domain: str, op_type: str) -> bool:
        return domain == self.domain and (op_type in self.ops or op_type in self.bfp_variants)

    @property
    def bfp_variants(self) -> dict[str, str]:
        """``_bfp`` op type -> the op it is a variant of."""
        return {spec.bfp: name for name, spec in self.ops.items() if spec.bfp}

    def base_spec(self, op_type: str) -> OpSpec:
        """The table entry of ``op_type`` or of the op it is the ``_bfp`` variant of."""
        return self.ops[self.bfp_variants.get(op_type, op_type)]

    def is_boundary(self, domain: str, op_type: str) -> bool:
        return domain == self.domain and op_type == self.boundary.op_type

    def spec(self, op_type: str) -> OpSpec:
        return self.ops[op_type]

    def cpu_reason(self, op_type: str) -> str:
        return self.cpu_reasons.get(op_type, f"{op_type}: not in the {self.name} registry")


@dataclass(frozen=True)
class NodeInfo:
    """What a standard target's limits read of one node: its type, attributes, and each input's and output's
    element type (ONNX's name: ``FLOAT``, ``INT64``, ...) and static shape (None where unknown); ``None`` for
    an input left out. ``constant``: the indices of the inputs that are constants (initializers)."""

    op_type: str
    attrs: Mapping[str, Any]
    inputs: tuple[tuple[str, tuple[int, ...] | None] | None, ...]
    outputs: tuple[tuple[str, tuple[int, ...] | None], ...]
    constant: frozenset[int] = frozenset()
    values: Mapping[int, np.ndarray] = field(default_factory=dict)  # small constant inputs' values

    def rank(self, i: int = 0) -> int | None:
        x = self.inputs[i] if i < len(self.inputs) else None
        return None if x is None or x[1] is None else len(x[1])


NodeLimit = Callable[[NodeInfo], "str | None"]


@dataclass(frozen=True)
class OpSupport:
    """One standard ONNX op a standard target takes, with the limits its vendor's op builder checks (each a
    ``rule(info)`` returning why the node is refused, or None) and where that was read."""

    op_type: str
    source: str
    limits: tuple[NodeLimit, ...] = ()
    doc: str = ""


@dataclass(frozen=True, kw_only=True)
class StandardTarget(Target):
    """An NPU that takes standard ONNX ops within limits (Qualcomm's HTP through onnxruntime-qnn): ``ops`` the
    op types it takes and their limits; ``dtypes`` the element types it maps (others refused, with
    ``dtype_reason``); ``max_rank`` the largest tensor rank, where one holds for every op. Its vendor's compiler
    has the last word on each node (``counted_by``); this table is sdnpu's own count, and the reason it gives
    for a refusal. ``unit_gb``: a graph with more weight than one compiled unit holds is cut into several
    (``sdnpu.convert.split``), chained in one model."""

    kind: str = "standard"
    ops: Mapping[str, OpSupport]
    dtypes: frozenset[str]
    max_rank: int | None = None  # None: no rank limit for every op (each op's own limits say theirs)
    dtype_reason: str = ""
    unit_gb: float | None = None  # the most weight one compiled unit holds (GB, compiled precision); None: no limit
    unit_why: str = ""  # where that limit comes from

    def is_dispatch(self, domain: str, op_type: str) -> bool:
        return domain in ("", "ai.onnx") and op_type in self.ops

    def check(self, domain: str, info: NodeInfo) -> str | None:
        """Why the NPU refuses this node, or None where the table says it takes it."""
        if domain not in ("", "ai.onnx"):
            return f"{info.op_type} (domain {domain}): not a standard ONNX op"
        spec = self.ops.get(info.op_type)
        if spec is None:
            return self.cpu_reason(info.op_type)
        for kind, values in (("input", info.inputs), ("output", info.outputs)):
            for v in values:
                if v is None:
                    continue
                dtype, shape = v
                if dtype not in self.dtypes:
                    return f"{info.op_type}: {kind} of type {dtype.lower()}: {self.dtype_reason}"
                if shape is not None and self.max_rank is not None and len(shape) > self.max_rank:
                    return f"{info.op_type}: {kind} of rank {len(shape)} ({self.name} takes at most {self.max_rank})"
        for limit in spec.limits:
            why = limit(info)
            if why is not None:
                return f"{info.op_type}: {why}"
        return None


def prod(xs: Sequence[int]) -> int:
    return math.prod(int(x) for x in xs)


DEFAULT_TARGET = "amd-xdna2"
_FACTORIES: dict[str, Callable[[], Target]] = {}
_CACHE: dict[str, Target] = {}


def register(name: str, factory: Callable[[], Target]) -> None:
    """A target's table module calls it as it loads; the package (``sdnpu.ops``) imports the built-in ones, so
    they are here before any module of it is used."""
    _FACTORIES[name] = factory


def target_names() -> list[str]:
    return sorted(_FACTORIES)


def get_target(name: str = DEFAULT_TARGET) -> Target:
    """The target called ``name``; an unknown name is an SdnpuError listing the known ones."""
    if name not in _FACTORIES:
        raise SdnpuError(f"unknown target {name!r}", hint=f"choose one of: {', '.join(sorted(_FACTORIES))}")
    if name not in _CACHE:
        _CACHE[name] = _FACTORIES[name]()
    return _CACHE[name]
