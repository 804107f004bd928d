"""``dd/weights.json``: where each constant of a compiled model came from, as an expression over the input
model's constants, and its replay.

A LoRA changes weights, not the graph: to apply one to a compiled model, sdnpu must know, for every weight
of every dispatch op, which tensor of the exported graph it was computed from and how (a transpose to
[K, N] or OHWI, a slice of GEGLU's projection, GroupNorm's gamma ++ beta, the bf16 or bfp16 rounding).
The passes compute each weight *by* the steps below (``sdnpu.passes.provenance`` records them while they
run), and the same functions replay it later, so the record cannot drift from what the compiler did.
Expressions (JSON):

    {"init": NAME}                          the input model's constant NAME (an initializer, or a Constant
                                            node's output, which the canonical steps lift to one)
    {"op": STEP, ...arguments, "x": EXPR}   one step of STEPS applied to EXPR
    {"op": "concat", "axis": A, "xs": [EXPR, ...]}
    {"op": "sum", "xs": [EXPR, ...]}        the EXPRs added, left to right, in the first one's dtype (a
                                            linear layer's bias with the constants added after it folded in)
    {"op": "onnx", "node": BASE64, "output": I, "xs": [EXPR, ...]}
                                            output I of one ONNX node (serialized NodeProto) evaluated on
                                            the EXPRs: a small weight the canonical steps folded
    {"array": [V, ...], "dtype": D, "shape": S}
                                            a small constant made from no weight, held in the record itself
                                            (a literal that is part of a sum with a weight)
    {"literal": true}                       made by the compiler from no weight (zero biases, dummies,
                                            attention masks, shapes)
    {"unknown": true}                       made by a step that did not say how: no replay (none is known;
                                            tests/test_provenance.py and every fuzz case fail on one)

The file: ``{"format": "sdnpu-weights", "version": 1, "source": <the input model's file name>, "weights":
{<initializer>: EXPR}}`` (``make_record``, ``write_record``, ``read_record``). ``evaluate(expr, read)``
replays an expression from the input model's constants (``read(name)``; ``constant_reader`` makes one over a
model, a weight at a time); ``check_replay`` replays a whole record against the compiled model, byte for byte
(the tests, each fuzz case, ``python -m tests.check_provenance``).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
from sdnpu.errors import SdnpuError
from sdnpu.nodeeval import run_node
from sdnpu.ops.bfp import BLOCK, round_bfp16

FORMAT, VERSION = "sdnpu-weights", 1
FILE = "weights.json"

Expr = dict[str, Any]
Step = tuple[str, dict[str, Any]]
LITERAL: Expr = {"literal": True}
UNKNOWN: Expr = {"unknown": True}


def _bf16(a: np.ndarray) -> np.ndarray:
    return a.astype(ml_dtypes.bfloat16)


def _bfp16(a: np.ndarray, axis: int) -> np.ndarray:
    """``a`` as AMD's packer stores it (zero-padded along ``axis`` to whole 8-value blocks, rounded, unpadded),
    held as bfloat16 (every bfp16 value is one)."""
    a = np.asarray(a, np.float32)
    size = a.shape[axis]
    pad = -size % BLOCK
    if pad:
        widths = [(0, 0)] * a.ndim
        widths[axis] = (0, pad)
        a = np.pad(a, widths)
    r = round_bfp16(a, axis)
    return _bf16(np.take(r, np.arange(size), axis=axis) if pad else r)


def _slice(a: np.ndarray, axis: int, start: int, stop: int) -> np.ndarray:
    index = [slice(None)] * a.ndim
    index[axis] = slice(start, stop)
    return np.ascontiguousarray(a[tuple(index)])


def _frames_in_channels(a: np.ndarray, frames: int, out_frames: int, stride: int, pad: int, dilation: int,
                        replicate: int = 0) -> np.ndarray:
    """A 3-D convolution's weight ``[OC, IC, KT, ...]`` as the 2-D one over its frames stacked in channels:
    ``[out_frames * OC, frames * IC, ...]``, block (t, f) the sum of the temporal taps k through which output frame
    t reads input frame f (``f = t * stride - pad + k * dilation - replicate``, where ``replicate`` copies of
    frame 0 stand in front: f < 0 reads frame 0), zeros where no tap does."""
    oc, ic, kt, *rest = a.shape
    out = np.zeros((out_frames, oc, frames, ic, *rest), a.dtype)
    for t in range(out_frames):
        for k in range(kt):
            f = t * stride - pad + k * dilation - replicate
            if -replicate <= f < frames:
                out[t, :, max(f, 0)] += a[:, :, k]
    return out.reshape(out_frames * oc, frames * ic, *rest)


def _block_diagonal(a: np.ndarray, groups: int) -> np.ndarray:
    """A grouped convolution's weight ``[OC, IC / G, ...]`` as the dense one ``[OC, IC, ...]``: output channel
    o reads its own group's input channels (block o // (OC / G)), zeros elsewhere."""
    oc, icg, *rest = a.shape
    out = np.zeros((oc, icg * groups, *rest), a.dtype)
    per = oc // groups
    for g in range(groups):
        out[g * per:(g + 1) * per, g * icg:(g + 1) * icg] = a[g * per:(g + 1) * per]
    return out


STEPS: dict[str, Callable[..., np.ndarray]] = {
    "transpose": lambda a, perm: np.ascontiguousarray(np.transpose(a, perm)),
    "reshape": lambda a, shape: a.reshape(shape),
    "slice": _slice,
    "astype": lambda a, dtype: a.astype(dtype),
    "broadcast": lambda a, shape: np.broadcast_to(a, shape).copy(),
    "neg": lambda a: -a,
    "reciprocal": lambda a: (1.0 / a).astype(a.dtype),
    "bf16": _bf16,  # round to nearest even, stored as bfloat16
    "bfp16": _bfp16,  # AMD's block format (ops/bfp.py) along ``axis``, stored as bfloat16
    "pad": lambda a, widths: np.pad(a, [tuple(w) for w in widths]),  # zeros around (a kernel made square)
    "frames_in_channels": _frames_in_channels,  # a Conv3d's weight as the 2-D conv's over frames in channels
    "block_diagonal": _block_diagonal,  # a grouped conv's weight as the dense conv's (zeros between groups)
}


def step(op: str, **args: Any) -> Step:
    """One transform of STEPS with its (JSON-able) arguments."""
    if op not in STEPS:
        raise ValueError(f"unknown provenance step {op!r}")
    return op, args


INLINE_LIMIT = 1 << 16  # elements: a literal held in the record itself, no more


def inline(a: np.ndarray) -> Expr:
    """A small literal as an expression that replays (its values in the record)."""
    assert a.size <= INLINE_LIMIT, a.shape
    return {"array": np.asarray(a).reshape(-1).tolist(), "dtype": str(np.asarray(a).dtype), "shape": list(a.shape)}


def add_up(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """``arrays`` added left to right (numpy broadcasting), in the first one's dtype: the one sum the compiler
    computes and the replay repeats."""
    total = np.array(arrays[0], copy=True)
    for a in arrays[1:]:
        total = (total + a).astype(total.dtype)
    return total


def apply(steps: Sequence[Step], a: np.ndarray) -> np.ndarray:
    for op, args in steps:
        a = STEPS[op](a, **args)
    return a


def chain(expr: Expr, steps: Sequence[Step]) -> Expr:
    """``expr`` with ``steps`` after it; a literal stays a literal (it has nothing to replay from)."""
    if expr.get("literal"):
        return LITERAL
    for op, args in steps:
        expr = {"op": op, **args, "x": expr}
    return expr


def folded(node_proto: Any, output: int, xs: Sequence[Expr | None]) -> Expr:
    """Output ``output`` of a node evaluated at compile time on constants with expressions ``xs`` (None: an
    omitted optional input): literal unless it read a weight."""
    if all(x is None or is_literal(x) for x in xs):
        return LITERAL
    return {"op": "onnx", "node": base64.b64encode(node_proto.SerializeToString()).decode("ascii"),
            "output": output, "xs": list(xs)}


def is_literal(expr: Expr) -> bool:
    """Whether ``expr`` reads no weight."""
    if expr.get("literal"):
        return True
    if "x" in expr:
        return is_literal(expr["x"])
    if "xs" in expr:
        return all(x is None or is_literal(x) for x in expr["xs"])
    return False


def leaves(expr: Expr) -> set[str]:
    """The input constants ``expr`` reads."""
    if "init" in expr:
        return {expr["init"]}
    if "x" in expr:
        return leaves(expr["x"])
    return set().union(*(leaves(x) for x in expr.get("xs", []) if x is not None))


def evaluate(expr: Expr, read: Callable[[str], np.ndarray]) -> np.ndarray:
    """Replay ``expr`` from the input model's constants."""
    if "init" in expr:
        return read(expr["init"])
    if "array" in expr:
        return np.asarray(expr["array"], dtype=expr["dtype"]).reshape(expr["shape"])
    if expr.get("literal") or expr.get("unknown"):
        raise ValueError(f"a {'literal' if expr.get('literal') else 'unknown'} constant has no replay")
    op = expr["op"]
    if op == "concat":
        return np.concatenate([evaluate(x, read) for x in expr["xs"]], axis=expr["axis"])
    if op == "onnx":
        return _run_node(expr, [None if x is None else evaluate(x, read) for x in expr["xs"]])
    if op == "sum":
        return add_up([evaluate(x, read) for x in expr["xs"]])
    args = {k: v for k, v in expr.items() if k not in ("op", "x")}
    return STEPS[op](evaluate(expr["x"], read), **args)


def _run_node(expr: Expr, arrays: list[np.ndarray | None]) -> np.ndarray:
    node = onnx.NodeProto()
    node.ParseFromString(base64.b64decode(expr["node"]))
    return run_node(node, arrays)[expr["output"]]


def tensor_values(tensor: Any) -> np.ndarray:
    """A tensor's values, in an array of its own. An external tensor is read from its file with read()
    calls straight into the array: nothing stays mapped (a mapping keeps every weight read resident until
    the model goes), and cold, it is about twice as fast as faulting the pages of a mapping in (the SDXL
    UNet's LoRA weights, `sdnpu lora apply`). Packed dtypes (int4, ...) go through onnx-ir's own reader."""
    if not isinstance(tensor, ir.ExternalTensor):
        return np.array(tensor.numpy())
    out = np.empty(tensor.shape.numpy(), tensor.dtype.numpy())
    if out.nbytes != tensor.nbytes:
        array = np.array(tensor.numpy())
        tensor.release()
        return array
    with open(tensor.path, "rb", buffering=0) as f:
        f.seek(tensor.offset or 0)
        view, got = memoryview(out.reshape(-1).view(np.uint8)), 0
        while got < out.nbytes:
            n = f.readinto(view[got:])
            if not n:
                raise ValueError(f"{tensor.path} ends inside {tensor.name}")
            got += n
    return out


def constant_reader(model: ir.Model) -> Callable[[str], np.ndarray]:
    """``read(name)`` over a model's constants, as ``{"init": name}`` names them: its initializers and its
    Constant nodes' values (which the canonical steps lift to initializers of the same name). Weights are read
    when asked for, one at a time."""
    constants = {n.outputs[0].name: n for n in model.graph if n.op_type == "Constant" and n.attributes}

    def read(name: str) -> np.ndarray:
        v = model.graph.initializers.get(name)
        if v is not None and v.const_value is not None:
            return tensor_values(v.const_value)
        attr = next(iter(constants[name].attributes.values()))
        if isinstance(attr.value, ir.TensorProtocol):
            return tensor_values(attr.value)
        return np.asarray(attr.value, np.float32 if attr.name.startswith("value_float") else np.int64)

    return read


def check_replay(weights: dict[str, Expr], compiled: ir.Graph, read: Callable[[str], np.ndarray]
                 ) -> tuple[dict[str, int], list[str]]:
    """Replays each expression of ``weights`` (a record's) from ``read`` and compares it, byte for byte,
    with the initializer of that name in ``compiled``. Returns counts and one line per problem: a constant
    without an expression, one that does not replay (unknown, or reading a constant the source lacks), one
    whose replay differs."""
    counts = {"replayed": 0, "literal": 0, "bytes": 0}
    problems = [f"the record lists {name!r}, the model has no such constant"
                for name in sorted(set(weights) - set(compiled.initializers))]
    for name, v in compiled.initializers.items():
        expr = weights.get(name)
        if expr is None:
            problems.append(f"constant {name!r} has no record")
            continue
        if expr.get("literal"):
            counts["literal"] += 1
            continue
        try:
            got = evaluate(expr, read)
        except (KeyError, ValueError) as e:
            problems.append(f"constant {name!r} does not replay: {e!r}")
            continue
        want = tensor_values(v.const_value)
        if (got.dtype, got.shape) != (want.dtype, want.shape):
            problems.append(f"constant {name!r}: the replay is {got.dtype} {list(got.shape)}, the model's "
                            f"{want.dtype} {list(want.shape)}")
        elif got.tobytes() != want.tobytes():
            problems.append(f"constant {name!r}: the replay differs from the stored values")
        else:
            counts["replayed"] += 1
            counts["bytes"] += want.nbytes
    return counts, problems


def make_record(source: str, weights: dict[str, Expr]) -> dict[str, Any]:
    """The record ``dd/weights.json`` holds: every initializer of a compiled graph with its expression;
    ``source``, the file name of the graph it was compiled from."""
    return {"format": FORMAT, "version": VERSION, "source": source, "weights": weights}


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Write a record (``make_record``) to ``path``, as compact JSON."""
    path.write_text(json.dumps(record))


def read_record(path: Path) -> dict[str, Any]:
    """``dd/weights.json``, checked: its format and version, or one line saying what is wrong."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SdnpuError(f"{path} is missing", hint="compile the model again with this version of sdnpu "
                         "(it writes the record beside dd/replaced.onnx)") from None
    except (OSError, ValueError) as e:
        raise SdnpuError(f"{path} is not readable JSON: {e}", hint="compile the model again") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise SdnpuError(f"{path} is not an sdnpu weight record", hint="compile the model again")
    if data.get("version") != VERSION:
        raise SdnpuError(f"{path} has record version {data.get('version')}, this sdnpu reads {VERSION}",
                         hint="compile the model again with this version of sdnpu")
    return data
