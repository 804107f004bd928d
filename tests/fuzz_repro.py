"""Differential check of one ONNX graph through the whole compiler; the fuzz test's oracle and its reproducer.

    python -m tests.fuzz_repro fuzz-failures/1a2b3c4d5e6f.onnx [--precision bf16|bfp16]

compiles the graph (``compile_model``: canonical -> ... -> partition), checks every intermediate model
and the dispatch model with ``onnx.checker`` (full check), runs them in onnxruntime (graph optimizations
off) and compares with the input graph; exits 1 on a mismatch and prints which pass broke it.

What is compared, and the tolerances. The numbers below were measured with the cap off (CAP = inf) on 6000
drawn cases, 500 per family of tests/fuzzgraphs.py, 4703 of them distinct (1144 fp16), compiled with
precision bf16, and 1000 drawn from all families (762 distinct) compiled with precision bfp16 (hypothesis
seed 12345, generation only); "outputs changed" are those whose dispatch-model error is not 0:

- the *reference* is the input graph run in fp32 (an fp16 graph widened to fp32 first: its weights as
  stored, its own fp16 rounding counted as an error like ours); ``scale`` is max |reference| per output,
  ``err`` max |out - reference| over the output.
- fp32 tier (after the canonical steps, joint, fuse, layout and glue, fp32 graph): these passes change no precision,
  only the order of float operations (GroupNorm's body reduces differently from InstanceNormalization,
  MHA scales once instead of twice) and, in the canonical sinusoid, cos(a) into sin(a + pi/2), the fp32
  rounding of the argument (2^-24 |a|): ``err <= FP32_REL * scale``, FP32_REL = 1e-4, the project's tier
  (tests/test_pipeline.py). Measured over 24792 comparisons: err / scale p99 1.4e-6, at most 6.2e-6 but
  in 2 graphs, where an output is ill-conditioned even in fp32 (a LayerNorm over two nearly equal values
  after the sinusoid: 2.6e-4 and 3.6e-4). For such a graph, and only where the first bound refuses, the
  bound is ``EMUL_FACTOR * sens32 + FP32_REL * scale``, sens32 measured as (b) below with d in [-2^-24,
  2^-24] (fp32 rounding): there err / sens32 was 0.07.
- bf16 tier (the dispatch model): the precision pass rounds weights, inputs and each dispatch op's output to
  bf16 (eps 2^-8), and how much of that reaches an output depends on the graph: a GroupNorm over 2 values
  divides by a tiny variance, a Softmax sharpens differences, an output much smaller than the values it
  was computed from (h * gelu(g) with g < 0) loses relative precision. One bound relative to ``scale``
  alone would have to be loose for all graphs and would still fail the sensitive ones. So each graph's
  sensitivity is *measured* and the bound derived from it:
  ``sens`` = the largest change of the output when the input graph runs with (a) every float value -
  inputs, weights, each node's output - rounded to bf16 (``bf16_everywhere``), and (b) each of them
  multiplied by its own 1 + d, d uniform in [-2^-8, 2^-8] (``perturbed``, two draws: the propagated
  magnitude of bf16-sized errors, which (a) alone underestimates when its roundings happen to cancel).
  The dispatch model rounds at fewer places than (a) (a fused op computes in fp32 inside), so
  ``err <= EMUL_FACTOR * sens + LOW_BF16 * scale`` with EMUL_FACTOR = 4 and LOW_BF16 = 2^-8 (a bf16
  step of the largest output: graphs where (a) and (b) are exact, pure data movement). Measured on the 3606
  outputs changed: err / sens median 0.37, p99 1.0, max 12 (where err is far under the floor); the largest
  factor the floor needs is 2.8 (a one-channel resnet block), so the bound has 1.4x margin there.
- the cap: a very sensitive graph has a sensitivity bound wider than its output (measured sens / scale: p99
  1.1, max 34), so the bf16 and bfp16 bounds are ``min(sensitivity bound, CAP * scale)``, CAP = 0.25: a
  structural mistake (a wrong permutation, axis, scale or epsilon, a lost op) errs by about ``scale``, 4x
  the cap, and never passes. Measured with the cap off, err / scale over the outputs changed: bf16 median
  0.0036, p99 0.026, max 0.16 (the LayerNorm over two values above: 1.55x under the cap); bfp16 median
  0.013, p99 0.075, max 0.10.
- fresh feeds: the inputs are one draw (``feeds_for``, seed 0), and an output of a few values computed by
  cancellation can happen to be near 0 on it, its err / scale (and err / sens) then unbounded however right
  the compile. The default 600 cases hold one: a Linear to a single value after two tied layers, scale
  0.074 on seed 0 where seeds 1 and 2 give 10.8 and 2.8, err / scale 0.49; and a bfp16 MatMul [3] -> [1]
  the mutation family drew had err / sens 30, scale 0.055 on seed 0, 0.34 and 0.61 on seeds 1 and 2. An
  output over its bound whose scale is below SMALL = 1/4 of its scale on one of FRESH_FEEDS = 2 fresh
  draws (seeds 1, 2) is judged on those two instead, each with its own sensitivity, and must pass on both.
  A mistake is no smaller on a fresh draw, so it still fails. None of the measured cases needed it.
- beyond the cap at any feed: an output computed by cancellation in its weights (a one-value input through
  a Linear, a rotary embedding and a Linear whose products nearly cancel: output = x * c with |c| small)
  is off by more than the cap in the input graph's own ideal bf16 evaluation (``bf16_everywhere``: 0.81 x
  its scale in the case the fuzzer drew, fuzz-failures 469e6a8a29ed, kept as a regression test), so no
  correct bf16 compile meets the cap against fp32 there, on this feed or a fresh one. Such an output (and
  only one whose ideal bf16 evaluation exceeds the cap) is judged against that evaluation instead, under
  the same cap: a structural mistake still errs by about the values it mixes up, far above the cap; the
  dispatch model of that case equals the ideal evaluation bit for bit.
- fp16 tier (the passes before precision on an fp16 graph): fused ops compute in fp32 and round once where
  the input graph rounds after every node: ``err <= EMUL_FACTOR * sens16 + LOW_FP16 * scale``, sens16 the
  fp16 graph's own error and (b) with d in [-2^-11, 2^-11]; LOW_FP16 = 2^-10. Measured over 8072
  comparisons: err / sens16 median 0.20, p99 0.82; the factor needed is at most 0.49.
- bfp16 precision: the MAC ops' activations and weights are rounded to blocks of 8 sharing one exponent (7
  bits for a block's largest value, fewer for the others): ``err <= BFP_FACTOR * sens + LOW_BFP * scale``,
  BFP_FACTOR = 12, LOW_BFP = 2^-7. Measured on the 618 outputs changed: err / sens median 1.1, p99 4.9,
  factor needed at most 6.6 (1.8x margin).
- the precision contract (``storage_violations``), checked on every dispatch model: each dispatch op's
  outputs and activation inputs are bf16, its constants are initializers stored as the target's table says
  (``Input.dtype``), its dummies have the table's shape. An op left computing in fp32 passes every numeric
  bound (its numbers are better); this check reports it, naming the node.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper

from sdnpu.reports.bf16 import after_each_output as _after_each_output
from sdnpu.reports.bf16 import rounded_feeds
from sdnpu.reports.bf16 import rounded as bf16_everywhere  # weights and every float output rounded to bf16
from sdnpu.reports.bf16 import selectors as _selectors

FP32_REL = 1e-4
EMUL_FACTOR = 4.0
LOW_BF16 = 2.0**-8
LOW_FP16 = 2.0**-10
BFP_FACTOR = 12.0
LOW_BFP = 2.0**-7
CAP = 0.25  # the bf16 / bfp16 bound never exceeds CAP * scale (module docstring: how it was measured)
FRESH_FEEDS, SMALL = 2, 0.25  # an output over its bound whose scale is < SMALL x its scale on a fresh feed is
# judged on FRESH_FEEDS fresh feeds instead (module docstring)
BF16_EPS, FP16_EPS, FP32_EPS = 2.0**-8, 2.0**-11, 2.0**-24
SENSITIVITY_DRAWS = 2
FLOAT_TYPES = (T.FLOAT, T.FLOAT16)
STAGES = ("joint", "fuse", "layout", "glue", "frames")  # before precision: the fp32 / fp16 tier (and the canonical group's end)
NP_OF = {T.FLOAT: np.float32, T.FLOAT16: np.float16, T.BFLOAT16: ml_dtypes.bfloat16, T.INT64: np.int64,
         T.INT32: np.int32, T.BOOL: np.bool_}
STORAGE = {"bfloat16": T.BFLOAT16, "float": T.FLOAT, "uint8": T.UINT8, "uint16": T.UINT16}  # Input.dtype


ort.set_default_logger_severity(3)  # Resize's deprecated tf_half_pixel_for_nn warns on every session


class Mismatch(AssertionError):
    """The compiled graph is invalid, fails to run, or computes something else (the message says where)."""


@dataclass
class Outcome:
    """A passing check: every comparison made (stage, output, max |diff|, scale), each output's measured
    sensitivity to bf16 (for an fp16 graph, to fp16; for an ill-conditioned fp32 graph, to fp32) errors, and the
    op census of the dispatch model."""

    compared: list[tuple[str, str, float, float]] = field(default_factory=list)
    sensitivity: dict[str, float] = field(default_factory=dict)
    sensitivity16: dict[str, float] = field(default_factory=dict)
    sensitivity32: dict[str, float] = field(default_factory=dict)  # measured only where the fp32 tier needs it
    dispatch_ops: Counter[str] = field(default_factory=Counter)
    cpu_ops: Counter[str] = field(default_factory=Counter)


def fingerprint(model: onnx.ModelProto) -> str:
    return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()[:12]


def _elem(vi: onnx.ValueInfoProto) -> int:
    return vi.type.tensor_type.elem_type


def _dims(vi: onnx.ValueInfoProto) -> list[int]:
    return [d.dim_value for d in vi.type.tensor_type.shape.dim]


def feeds_for(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Standard-normal floats (integers in [0, 8)) in each input's type, the same for a given model."""
    rng = np.random.default_rng(seed)
    init = {t.name for t in model.graph.initializer}
    out = {}
    for vi in model.graph.input:
        if vi.name in init:
            continue
        shape, elem = _dims(vi), _elem(vi)
        if elem in FLOAT_TYPES:
            out[vi.name] = rng.standard_normal(shape).astype(NP_OF[elem])
        else:
            out[vi.name] = rng.integers(0, 8, shape).astype(NP_OF[elem])
    return out


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """onnxruntime CPU with its graph optimizations off (they would fold and reorder our mistakes away)."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds), strict=True))


def checked_run(proto: onnx.ModelProto, feeds: dict[str, np.ndarray], where: str) -> dict[str, np.ndarray]:
    """The full checker, then onnxruntime; either failing is a Mismatch that says where."""
    try:
        onnx.checker.check_model(proto, full_check=True)
        return run(proto, feeds)
    except Exception as e:
        raise Mismatch(f"{where}: {type(e).__name__}: {e}") from e


def _retype(model: onnx.ModelProto, convert: Callable[[int], int],
            array: Callable[[np.ndarray], np.ndarray]) -> onnx.ModelProto:
    m = copy.deepcopy(model)
    g = m.graph
    for vi in [*g.input, *g.output, *g.value_info]:
        vi.type.tensor_type.elem_type = convert(_elem(vi))
    for i, t in enumerate(g.initializer):
        if t.data_type in FLOAT_TYPES:
            g.initializer[i].CopyFrom(onnx.numpy_helper.from_array(array(onnx.numpy_helper.to_array(t)), t.name))
    for node in g.node:
        for a in node.attribute:
            if node.op_type in ("Cast", "EyeLike", "RandomNormal") and a.name in ("to", "dtype"):
                a.i = convert(a.i)
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type in FLOAT_TYPES:
                a.t.CopyFrom(onnx.numpy_helper.from_array(array(onnx.numpy_helper.to_array(a.t)), a.t.name))
    return m


def as_fp32(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph computing in fp32 (identity for an fp32 graph)."""
    if not _has_fp16(model):
        return model
    return _retype(model, lambda t: T.FLOAT if t == T.FLOAT16 else t, lambda a: a.astype(np.float32)
                   if a.dtype == np.float16 else a)


def _has_fp16(model: onnx.ModelProto) -> bool:
    g = model.graph
    return any(_elem(vi) == T.FLOAT16 for vi in [*g.input, *g.output]) or any(
        t.data_type == T.FLOAT16 for t in g.initializer)


def perturbed(model: onnx.ModelProto, feeds: dict[str, np.ndarray], rel: float, seed: int
              ) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The graph and feeds with every float input, weight and node output multiplied by its own fixed
    1 + d, d uniform in [-rel, rel]: how far errors of relative size ``rel`` anywhere move the result
    (the propagated magnitude, measured). Rounding to nearest errs by at most rel / 2 per value."""
    rng = np.random.default_rng(seed)
    keep = _selectors(model)

    def jitter(a: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):  # a mask's float min may round past it: -inf, as bf16 makes it
            return (a * (1 + rng.uniform(-rel, rel, a.shape))).astype(a.dtype)

    m = copy.deepcopy(model)
    for i, t in enumerate(m.graph.initializer):
        if t.data_type in FLOAT_TYPES and t.name not in keep:
            m.graph.initializer[i].CopyFrom(onnx.numpy_helper.from_array(jitter(onnx.numpy_helper.to_array(t)),
                                                                         t.name))

    def wrap(exact: str, name: str, elem: int, shape: list[int]) -> list[onnx.NodeProto]:
        noise = (1 + rng.uniform(-rel, rel, shape)).astype(NP_OF[elem])
        m.graph.initializer.append(onnx.numpy_helper.from_array(noise, f"{name}__noise"))
        return [helper.make_node("Mul", [exact, f"{name}__noise"], [name])]

    jittered = {k: jitter(v) if v.dtype in (np.float32, np.float16) else v for k, v in feeds.items()}
    return _after_each_output(m, wrap), jittered


def _max_diff(a: np.ndarray, ref: np.ndarray) -> float:
    with np.errstate(invalid="ignore"):  # inf - inf where both are infinite: compared elsewhere
        d = np.abs(a.astype(np.float64) - ref.astype(np.float64))
    return float(d[np.isfinite(d)].max(initial=0.0))


def _compare(tier: str, outs: dict[str, np.ndarray], ref: dict[str, np.ndarray],
             bound: Callable[[str, float], float], where: str,
             wider: Callable[[str, float], float] | None = None,
             over: list[tuple[str, float, str]] | None = None) -> list[tuple[str, str, float, float]]:
    """Each output against its reference: present, same shape, NaNs and infinities in the same places, and
    max |diff| within ``bound(name, scale)``, or ``wider(name, scale)`` where given (a bound that costs a
    measurement: taken only for an output the first one refuses). An output over its bound raises, or with
    ``over`` is appended to it as (name, scale, message) for the caller to judge."""
    compared = []
    for name, r in ref.items():
        if name not in outs:
            raise Mismatch(f"{where}: output {name!r} is missing (has {sorted(outs)})")
        o = outs[name].astype(np.float64)
        r64 = r.astype(np.float64)
        if o.shape != r64.shape:
            raise Mismatch(f"{where}: output {name!r} has shape {o.shape}, expected {r64.shape}")
        if not np.array_equal(np.isnan(o), np.isnan(r64)):
            raise Mismatch(f"{where}: output {name!r} has NaNs where the reference has none (or the reverse)")
        finite = np.isfinite(r64) & np.isfinite(o)
        if not np.array_equal(np.isinf(o) & (o > 0), np.isinf(r64) & (r64 > 0)) or \
                not np.array_equal(np.isinf(o) & (o < 0), np.isinf(r64) & (r64 < 0)):
            raise Mismatch(f"{where}: output {name!r} has infinities where the reference has none (or the reverse)")
        scale = float(np.abs(r64[finite]).max()) if finite.any() else 0.0
        err = float(np.abs(o[finite] - r64[finite]).max()) if finite.any() else 0.0
        limit = bound(name, scale)
        if not err <= limit and wider is not None:
            limit = wider(name, scale)
        compared.append((where, name, err, scale))
        if not err <= limit:
            message = f"{where}: output {name!r} max |diff| {err:.4g} > {limit:.4g} (scale {scale:.4g}, {tier} tier)"
            if over is None:
                raise Mismatch(message)
            over.append((name, scale, message))
    return compared


def _scale(a: np.ndarray) -> float:
    """max |a| over its finite values (``_compare``'s scale)."""
    a = np.asarray(a, np.float64)
    finite = a[np.isfinite(a)]
    return float(np.abs(finite).max()) if finite.size else 0.0


def _signature(model: onnx.ModelProto) -> list[tuple[str, int, list[int]]]:
    """Names, types and shapes of the graph's inputs and outputs: compiling must not change them."""
    init = {t.name for t in model.graph.initializer}
    return [(vi.name, _elem(vi), _dims(vi)) for vi in [*model.graph.input, *model.graph.output] if vi.name not in init]


def _sensitivity(wide: onnx.ModelProto, feeds32: dict[str, np.ndarray], ref: dict[str, np.ndarray], eps: float,
                 rounded: dict[str, np.ndarray]) -> dict[str, float]:
    """Per output: the largest change from the reference of ``rounded`` (the graph run with its values
    rounded to the precision) and of SENSITIVITY_DRAWS runs of ``perturbed`` by ``eps``."""
    sens = {n: _max_diff(rounded[n], r) for n, r in ref.items()}
    for seed in range(SENSITIVITY_DRAWS):
        out = run(*perturbed(wide, feeds32, eps, seed))
        for n, r in ref.items():
            sens[n] = max(sens[n], _max_diff(out[n], r))
    return sens


def storage_violations(model: onnx.ModelProto, target: Any) -> list[str]:
    """What in the dispatch model breaks the target's precision contract, one line per problem naming the
    node: every dispatch op's outputs bf16; its activation inputs bf16 (a constant one, such as SDAdd's or
    SDMul's second operand, a bf16 initializer); its weights, biases, masks and dummies initializers stored
    in the table's dtype (``Input.dtype``), the dummies of the table's ``dummy_shape``. A dispatch op left
    computing in fp32 (or fp16) passes every numeric bound, so this is checked on its own."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    types = {vi.name: _elem(vi) for vi in [*g.input, *g.output, *g.value_info]}
    types |= {name: t.data_type for name, t in inits.items()}
    name_of = {v: k for k, v in STORAGE.items()}
    problems = []
    for node in g.node:
        if not target.is_dispatch(node.domain, node.op_type):
            continue
        spec = target.base_spec(node.op_type)
        where = f"dispatch op {node.name} ({node.op_type})"
        for out in node.output:
            if types.get(out) != T.BFLOAT16:
                problems.append(f"{where}: output {out!r} is {T.DataType.Name(types.get(out, 0))}, not bfloat16")
        if len(node.input) != len(spec.inputs):
            problems.append(f"{where}: {len(node.input)} inputs, the table has {len(spec.inputs)}")
        for name, role in zip(node.input, spec.inputs, strict=False):
            have = types.get(name, 0) if name else 0
            want = T.BFLOAT16 if role.role == "activation" else STORAGE[role.dtype]
            label = f"{where}: {role.role} {role.name} {name!r}"
            if role.role != "activation" and name not in inits:
                problems.append(f"{label} is not an initializer")
            if have != want:
                problems.append(f"{label} is {T.DataType.Name(have)}, the table stores {name_of[want]}")
            if role.role == "dummy" and name in inits and tuple(inits[name].dims) != role.dummy_shape:
                problems.append(f"{label} has shape {list(inits[name].dims)}, the table's is {list(role.dummy_shape)}")
    return problems


def provenance_violations(source: onnx.ModelProto, compiled: ir.Model, final: onnx.ModelProto) -> list[str]:
    """Every constant of the dispatch model replays from the input graph's constants through the steps its
    record names, byte for byte (passes/provenance.py: what a LoRA needs); one line per constant that does
    not, or that a pass made without saying how."""
    from sdnpu.formats.weights import check_replay, constant_reader
    from sdnpu.passes import provenance

    read = constant_reader(ir.serde.deserialize_model(source))
    weights = provenance.record(compiled.graph, "fuzz")["weights"]
    return check_replay(weights, ir.serde.deserialize_model(final).graph, read)[1]


def check(model: onnx.ModelProto, precision: str = "bf16") -> Outcome:
    """Compile ``model`` and compare every stage with it; raises ``Mismatch`` (or the compiler's error)."""
    from sdnpu.formats.keys import REASON_TAG, REGION_TAG
    from sdnpu.passes.cleanup import attach_functions
    from sdnpu.passes.pipeline import CompileOptions, compile_model, pass_names

    options = CompileOptions.named(precision=precision)
    target = options.target
    # the canonical steps are checked once, after the last of them (every step of the group would multiply the
    # fuzz run's onnxruntime sessions by forty)
    stages = {*STAGES, [n for n in pass_names(options) if n.startswith("canonical/")][-1]}

    onnx.checker.check_model(model, full_check=True)
    feeds = feeds_for(model)
    fp16 = _has_fp16(model)
    wide, feeds32 = as_fp32(model), {k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in feeds.items()}
    ref = run(wide, feeds32)
    outcome = Outcome()
    ideal = run(bf16_everywhere(model), rounded_feeds(model, feeds))
    outcome.sensitivity = _sensitivity(wide, feeds32, ref, BF16_EPS, ideal)
    if fp16:
        outcome.sensitivity16 = _sensitivity(wide, feeds32, ref, FP16_EPS, run(model, feeds))

    def early(name: str, scale: float) -> float:
        if fp16:
            return EMUL_FACTOR * outcome.sensitivity16[name] + LOW_FP16 * scale
        return FP32_REL * scale

    def early_ill_conditioned(name: str, scale: float) -> float:
        if not outcome.sensitivity32:  # measured once, and only for a graph that needs it
            outcome.sensitivity32 = _sensitivity(wide, feeds32, ref, FP32_EPS, ref)
        return EMUL_FACTOR * outcome.sensitivity32[name] + FP32_REL * scale

    def after_each(stage: str, m: ir.Model) -> None:
        if stage not in stages:
            return
        attach_functions(m, target)
        outs = checked_run(ir.serde.serialize_model(m), feeds, f"after {stage}")
        outcome.compared += _compare("fp16" if fp16 else "fp32", outs, ref, early, f"after {stage}",
                                     None if fp16 else early_ill_conditioned)

    irm = ir.serde.deserialize_model(copy.deepcopy(model))
    compile_model(irm, options, after_each=after_each)
    final = ir.serde.serialize_model(irm)
    outs = checked_run(final, feeds, f"dispatch model ({precision})")
    if _signature(final) != _signature(model):
        raise Mismatch(f"dispatch model ({precision}): inputs and outputs {_signature(final)} differ from the input "
                       f"graph's {_signature(model)}")
    problems = storage_violations(final, target)
    if problems:
        raise Mismatch(f"dispatch model ({precision}): {len(problems)} breaches of the "
                       f"{target.name} table's precision contract: " + "; ".join(problems[:5]))
    problems = provenance_violations(model, irm, final)
    if problems:
        raise Mismatch(f"dispatch model ({precision}): {len(problems)} constants without a true record of "
                       "where they came from: " + "; ".join(problems[:5]))
    factor, low = (BFP_FACTOR, LOW_BFP) if precision == "bfp16" else (EMUL_FACTOR, LOW_BF16)
    where = f"dispatch model ({precision})"

    def bound(sens: dict[str, float]) -> Callable[[str, float], float]:
        return lambda n, s: min(factor * sens[n] + low * s, CAP * s)

    over: list[tuple[str, float, str]] = []
    outcome.compared += _compare(precision, outs, ref, bound(outcome.sensitivity), where, over=over)
    # an output whose ideal bf16 evaluation is itself beyond the cap (cancellation the graph has at any feed)
    # is judged against that evaluation, under the same cap (module docstring)
    over = [(name, scale, message) for name, scale, message in over
            if not (precision == "bf16" and _max_diff(ideal[name], ref[name]) > CAP * scale
                    and _max_diff(outs[name], ideal[name]) <= CAP * scale)]
    if over:  # a mismatch, unless each output over its bound only happens to be small on this feed
        fresh = []
        for k in range(1, FRESH_FEEDS + 1):
            feeds_k = feeds_for(model, seed=k)
            feeds32_k = {n: v.astype(np.float32) if v.dtype == np.float16 else v for n, v in feeds_k.items()}
            fresh.append((k, feeds_k, feeds32_k, run(wide, feeds32_k)))
        for name, scale, message in over:
            typical = max(_scale(ref_k[name]) for *_, ref_k in fresh)
            if not scale < SMALL * typical:
                raise Mismatch(message)
        name, _, message = over[0]
        for k, feeds_k, feeds32_k, ref_k in fresh:
            sens_k = _sensitivity(wide, feeds32_k, ref_k, BF16_EPS, run(bf16_everywhere(model),
                                                                         rounded_feeds(model, feeds_k)))
            outs_k = checked_run(final, feeds_k, f"{where}, feed {k}")
            try:
                outcome.compared += _compare(precision, outs_k, ref_k, bound(sens_k), f"{where}, feed {k}")
            except Mismatch as e:
                raise Mismatch(f"{message}; {name!r} is small on this feed, but on a fresh one: {e}") from None
    for node in final.graph.node:
        props = {p.key: p.value for p in node.metadata_props}
        if target.is_dispatch(node.domain, node.op_type):
            outcome.dispatch_ops[node.op_type] += 1
            if REGION_TAG not in props:
                raise Mismatch(f"dispatch op {node.name} ({node.op_type}) has no NPU region")
        else:
            outcome.cpu_ops[node.op_type] += 1
            if not props.get(REASON_TAG):
                raise Mismatch(f"CPU node {node.name} ({node.op_type}) has no reason")
    return outcome


def reproducer(path: Path, precision: str) -> str:
    """The one line that reruns a saved failure."""
    extra = "" if precision == "bf16" else f" --precision {precision}"
    return f"python -m tests.fuzz_repro {path}{extra}"


def save_failure(model: onnx.ModelProto, description: str, precision: str, error: BaseException,
                 folder: Path) -> str:
    """Write the failing input graph as ``<hash>.onnx`` and its reproducer line as ``<hash>.txt``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{fingerprint(model)}.onnx"
    onnx.save(model, str(path))
    line = reproducer(path, precision)
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    path.with_suffix(".txt").write_text(f"{line}\n# {description}\n# {type(error).__name__}: {first}\n")
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz_repro", description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--precision", choices=("bf16", "bfp16"), default="bf16")
    args = parser.parse_args(argv)
    model = onnx.load(str(args.model))
    if model.doc_string:
        print(f"graph: {model.doc_string}")
    try:
        outcome = check(model, args.precision)
    except Exception as e:  # noqa: BLE001  (a mismatch, or the compiler failing on a valid graph)
        print(f"FAIL: {type(e).__name__}: {e}")
        return 1
    print(f"ok: dispatch ops {dict(outcome.dispatch_ops)}, CPU {dict(outcome.cpu_ops)}")
    for where, name, err, scale in outcome.compared:
        print(f"  {where:28s} {name}: max |diff| {err:.3g}, scale {scale:.3g}"
              + (f", sensitivity {outcome.sensitivity[name]:.3g}" if where == f"dispatch model ({args.precision})"
                 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
