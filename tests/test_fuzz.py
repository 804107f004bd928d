"""Differential fuzzing of the whole compiler: random graphs of the op families the rules know, and near
misses that must not fuse (tests/fuzzgraphs.py), each compiled by ``compile_model`` and checked by
tests/fuzz_repro.py: every stage passes the full checker, runs in onnxruntime and matches the input graph
within its precision's tolerance (fp32 tier before the precision pass, bf16 after; the module docstring of
fuzz_repro says how the tolerances were measured).

    SDNPU_FUZZ_N     cases in all (default 600, spread evenly over the families: 20-40 s on 2 cores);
                     ``make fuzz N=10000`` runs more
    SDNPU_FUZZ_OUT   where a failing graph goes (default fuzz-failures/): <hash>.onnx and <hash>.txt, whose
                     first line reproduces it: python -m tests.fuzz_repro fuzz-failures/<hash>.onnx
    SDNPU_FUZZ_SEED  another seed (default: derandomized, the same cases on every run, as CI needs)

One case in ten is also compiled with precision bfp16. Below the fuzz tests: the graphs the fuzzer found
bugs with, shrunk, kept as regression tests.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from hypothesis import HealthCheck, event, given, note, seed, settings
from hypothesis import strategies as st
from onnx import TensorProto as T
from onnx import helper

from .fuzz_repro import Mismatch, check, main, save_failure
from .fuzzgraphs import FAMILIES, case

N = int(os.environ.get("SDNPU_FUZZ_N", "600"))
OUT = Path(os.environ.get("SDNPU_FUZZ_OUT", "fuzz-failures"))
SEED = os.environ.get("SDNPU_FUZZ_SEED")
BFP16_SHARE = 10


def _fuzz(n: int) -> Any:
    """Hypothesis settings for ``n`` cases: no database (a failure is kept as an .onnx file instead), one
    minimal failure per test, derandomized unless SDNPU_FUZZ_SEED asks for other cases."""
    s = settings(max_examples=max(1, n), deadline=None, database=None, derandomize=SEED is None,
                 report_multiple_bugs=False, print_blob=False,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.large_base_example])

    def wrap(fn: Any) -> Any:
        fn = s(fn)
        return seed(int(SEED))(fn) if SEED is not None else fn

    return wrap


def _run(cases: st.SearchStrategy[tuple[onnx.ModelProto, str]], n: int, precision: str) -> None:
    """Check ``n`` drawn cases; on failure save the minimal failing graph and name its reproducer."""
    last: list[tuple[onnx.ModelProto, str, BaseException]] = []

    @_fuzz(n)
    @given(cases)
    def one(drawn: tuple[onnx.ModelProto, str]) -> None:
        model, description = drawn
        note(description)
        try:
            outcome = check(model, precision)
        except Exception as e:
            last[:] = [(model, description, e)]  # hypothesis replays the minimal failing case last
            raise
        for op in outcome.dispatch_ops:
            event(f"fused into {op}")

    try:
        one()
    except Exception as e:
        if last:
            model, description, error = last[0]
            e.add_note(f"reproduce: {save_failure(model, description, precision, error, OUT)}")
        raise


@pytest.mark.parametrize("family", list(FAMILIES))
def test_compiled_graph_matches_its_input(family: str) -> None:
    _run(case(family), N // len(FAMILIES), "bf16")


def test_bfp16_compiled_graph_matches_its_input() -> None:
    _run(st.sampled_from(list(FAMILIES)).flatmap(case), N // BFP16_SHARE, "bfp16")


# ---- regressions: graphs the fuzzer found bugs with (shrunk) ------------------------------------------------

def _model(nodes: list[onnx.NodeProto], inputs: dict[str, tuple[int, list[int]]],
           outputs: dict[str, tuple[int, list[int]]], inits: dict[str, np.ndarray]) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "regression",
                          [helper.make_tensor_value_info(n, t, s) for n, (t, s) in inputs.items()],
                          [helper.make_tensor_value_info(n, t, s) for n, (t, s) in outputs.items()],
                          [onnx.numpy_helper.from_array(a, n) for n, a in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])
    m = onnx.shape_inference.infer_shapes(m, strict_mode=True, data_prop=True)
    onnx.checker.check_model(m, full_check=True)
    return m


def _w(*shape: int, dtype: type = np.float32) -> np.ndarray:
    return (np.random.default_rng(0).standard_normal(shape) * 0.3).astype(dtype)


def fp16_div_output() -> onnx.ModelProto:
    """[fp16] Div(const scalar): the precision pass cast every value leaving the NPU back to fp32, so an fp16
    graph's output became fp32 (its declared type changed). Now the exit CastAvx restores the value's type."""
    return _model([helper.make_node("Div", ["x", "c"], ["y"])], {"x": (T.FLOAT16, [15])}, {"y": (T.FLOAT16, [15])},
                  {"c": np.asarray(1.5, np.float16)})


def fp16_conv_into_cpu_op() -> onnx.ModelProto:
    """[fp16] Conv -> Erf -> ...: the Erf stays on the CPU; it was fed the fp32 exit cast while its output
    stayed fp16, which made the dispatch model invalid (onnx.checker: 'Inferred elem type differs')."""
    return _model([helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Erf", ["c"], ["e"]),
                   helper.make_node("Add", ["e", "c"], ["y"])],
                  {"x": (T.FLOAT16, [1, 2, 3, 3])}, {"y": (T.FLOAT16, [1, 4, 3, 3])}, {"w": _w(4, 2, 1, 1, dtype=np.float16)})


def fp16_erf_gelu() -> onnx.ModelProto:
    """[fp16] x * (erf(x / sqrt 2) + 1) * 0.5 as TorchScript writes it: in fp16 sqrt 2 is stored as 1.4140625,
    1.5e-4 off, so canonicalize did not make it a Gelu and the Erf, Add and Muls stayed on the CPU."""
    h = np.float16
    return _model([helper.make_node("Div", ["x", "root2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
                   helper.make_node("Add", ["e", "one"], ["a"]), helper.make_node("Mul", ["x", "a"], ["m"]),
                   helper.make_node("Mul", ["m", "half"], ["y"])],
                  {"x": (T.FLOAT16, [2, 8])}, {"y": (T.FLOAT16, [2, 8])},
                  {"root2": np.asarray(2**0.5, h), "one": np.asarray(1, h), "half": np.asarray(0.5, h)})


def pad_crop_before_conv() -> onnx.ModelProto:
    """Pad with negative pads (a crop) before a Conv: canonicalize merged it into the Conv's pads, giving
    pads -1 (onnx.checker: 'Attribute pads must not contain negative values'). A crop stays a Pad now."""
    return _model([helper.make_node("Pad", ["x", "pads"], ["p"], mode="constant"),
                   helper.make_node("Conv", ["p", "w"], ["y"])],
                  {"x": (T.FLOAT, [1, 2, 5, 5])}, {"y": (T.FLOAT, [1, 3, 2, 2])},
                  {"pads": np.array([0, 0, -1, 0, 0, 0, 0, -1]), "w": _w(3, 2, 3, 3)})


def identity_of_an_output() -> onnx.ModelProto:
    """Sigmoid -> s (an output) -> Identity -> y (an output): onnx_ir's IdentityEliminationPass renamed s to y,
    so the graph returned y twice and lost s. canonicalize keeps such an Identity now."""
    return _model([helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Identity", ["s"], ["y"])],
                  {"x": (T.FLOAT, [2, 3])}, {"y": (T.FLOAT, [2, 3]), "s": (T.FLOAT, [2, 3])}, {})


def quick_gelu_rank_raising_constant() -> onnx.ModelProto:
    """x * sigmoid(x * c) with c = 1.702 of shape [1, 1, 1]: the product is [1, B, C]; SDQuickGelu(x) gave
    [B, C] under the [1, B, C] name (onnx.checker: 'Inferred shape and existing shape differ in rank')."""
    return _model([helper.make_node("Mul", ["x", "c"], ["m"]), helper.make_node("Sigmoid", ["m"], ["s"]),
                   helper.make_node("Mul", ["x", "s"], ["y"])],
                  {"x": (T.FLOAT, [4, 2])}, {"y": (T.FLOAT, [1, 4, 2])}, {"c": np.full((1, 1, 1), 1.702, np.float32)})


def erf_gelu_rank_raising_constant() -> onnx.ModelProto:
    """The Erf GELU with 0.5 of shape [1, 1, 1]: canonicalize made it Gelu(x) of x's shape [4, 2] while the
    graph output is [1, 4, 2]."""
    return _model([helper.make_node("Mul", ["x", "inv_root2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
                   helper.make_node("Add", ["e", "one"], ["a"]), helper.make_node("Mul", ["x", "a"], ["m"]),
                   helper.make_node("Mul", ["half", "m"], ["y"])],
                  {"x": (T.FLOAT, [4, 2])}, {"y": (T.FLOAT, [1, 4, 2])},
                  {"inv_root2": np.asarray(2**-0.5, np.float32), "one": np.asarray(1, np.float32),
                   "half": np.full((1, 1, 1), 0.5, np.float32)})


def transpose_without_perm() -> onnx.ModelProto:
    """A Transpose without perm (reverse the axes): glue read its perm as a list and crashed
    ('NoneType' object is not iterable). canonicalize writes the perm out."""
    return _model([helper.make_node("Mul", ["x", "c"], ["m"]), helper.make_node("Transpose", ["m"], ["y"])],
                  {"x": (T.FLOAT, [2, 3, 4])}, {"y": (T.FLOAT, [4, 3, 2])}, {"c": np.asarray(2, np.float32)})


def transposed_output_also_read() -> onnx.ModelProto:
    """NPU -> Transpose -> t, a graph output that a CPU node (Erf) also reads: the precision pass merged the
    Transpose into the exit CastAvx but rerouted only the graph output, and removing the old cast failed
    ('still being used by other nodes')."""
    return _model([helper.make_node("Mul", ["x", "c"], ["m"]), helper.make_node("Transpose", ["m"], ["t"], perm=[1, 0]),
                   helper.make_node("Erf", ["t"], ["y"])],
                  {"x": (T.FLOAT, [3, 2])}, {"y": (T.FLOAT, [2, 3]), "t": (T.FLOAT, [2, 3])},
                  {"c": np.asarray(2, np.float32)})


def linear_bias_raises_rank() -> onnx.ModelProto:
    """MatMul(x [B, K], W) + b of shape [1, 1, N]: the sum is [1, B, N]; SDGemm gives [B, N]."""
    return _model([helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])],
                  {"x": (T.FLOAT, [3, 4])}, {"y": (T.FLOAT, [1, 3, 5])}, {"w": _w(4, 5), "b": _w(1, 1, 5)})



def concat_of_three_into_sine() -> onnx.ModelProto:
    """Concat of three inputs -> x 500 -> Sin, the Concat also an output: glue lowers the Concat to a chain of
    two SDConcat whose middle value had no shape, so the precision pass left the first out of the fp32 island
    around the Sin and fed the island bf16 (onnx.checker: 'Inferred elem type differs ... (16) vs (1)')."""
    n = helper.make_node
    return _model([n("Concat", ["y", "x", "x"], ["c"], axis=0), n("Mul", ["c", "k"], ["m"]), n("Sin", ["m"], ["s"])],
                  {"x": (T.FLOAT, [3]), "y": (T.FLOAT, [2])}, {"s": (T.FLOAT, [8]), "c": (T.FLOAT, [8])},
                  {"k": np.asarray(500, np.float32)})


def sine_of_a_large_product() -> onnx.ModelProto:
    """Sin of x * 500 with 70000 values: the Mul is too large for the fp32 island, computes in bf16, and the
    island's SDSin was fed its bf16 result without a cast (an invalid model, as above)."""
    n = helper.make_node
    return _model([n("Mul", ["x", "k"], ["m"]), n("Sin", ["m"], ["s"])], {"x": (T.FLOAT, [70000])},
                  {"s": (T.FLOAT, [70000])}, {"k": np.asarray(500, np.float32)})

# Wrong or invalid results, each found by the fuzzer; every one passes the full differential check now.
REGRESSIONS = [fp16_div_output, fp16_conv_into_cpu_op, fp16_erf_gelu, pad_crop_before_conv, identity_of_an_output,
               quick_gelu_rank_raising_constant, erf_gelu_rank_raising_constant, transpose_without_perm,
               transposed_output_also_read, linear_bias_raises_rank, concat_of_three_into_sine, sine_of_a_large_product]


@pytest.mark.parametrize("build", REGRESSIONS)
def test_fuzz_regression(build: Any) -> None:
    """Each passes the full differential check (valid at every stage, the input graph's numbers). Some no longer
    offload anything: an element-wise op on graph inputs alone stays on the CPU (a dispatch op there would cost
    a cast each way)."""
    check(build(), "bf16")


def test_fp16_erf_gelu_is_one_gelu() -> None:
    outcome = check(fp16_erf_gelu(), "bf16")
    assert dict(outcome.cpu_ops) == {"Gelu": 1}, outcome  # on graph inputs alone it stays on the CPU, whole


# Missed fusions (the numbers were right, the op stayed on the CPU):

def conv_silu_sigmoid_shared() -> onnx.ModelProto:
    """Conv -> SiLU whose Sigmoid is also a graph output: SDConv took the SiLU into its match, the shared
    Sigmoid made the whole match refused, and the Conv stayed on the CPU. Now the Conv fuses without it."""
    n = helper.make_node
    return _model([n("Conv", ["x", "w"], ["c"]), n("Sigmoid", ["c"], ["s"]), n("Mul", ["c", "s"], ["y"])],
                  {"x": (T.FLOAT, [1, 2, 4, 4])}, {"y": (T.FLOAT, [1, 3, 4, 4]), "s": (T.FLOAT, [1, 3, 4, 4])},
                  {"w": _w(3, 2, 1, 1)})


def linear_product_also_output() -> onnx.ModelProto:
    """MatMul + bias whose product is also a graph output: the Add anchor refused (shared intermediate) and
    the MatMul anchor left the product to the Add anchor, so the MatMul stayed on the CPU."""
    n = helper.make_node
    return _model([n("MatMul", ["x", "w"], ["m"]), n("Add", ["m", "b"], ["y"])],
                  {"x": (T.FLOAT, [2, 3, 4])}, {"y": (T.FLOAT, [2, 3, 5]), "m": (T.FLOAT, [2, 3, 5])},
                  {"w": _w(4, 5), "b": _w(5)})


def group_norm_one_channel_per_group() -> onnx.ModelProto:
    """GroupNorm of [B, C, L] with G = C: the Reshape back to [B, C, L] changes nothing, canonicalize drops
    it, and SDGroupNormFusion (which wanted Reshape -> InstanceNormalization -> Reshape) did not match."""
    n = helper.make_node
    return _model([n("Reshape", ["x", "grouped"], ["r"]), n("InstanceNormalization", ["r", "ones", "zeros"], ["i"]),
                   n("Reshape", ["i", "back"], ["r2"]), n("Mul", ["r2", "gamma"], ["m"]), n("Add", ["m", "beta"], ["y"])],
                  {"x": (T.FLOAT, [2, 3, 8])}, {"y": (T.FLOAT, [2, 3, 8])},
                  {"grouped": np.array([2, 3, -1]), "ones": np.ones(3, np.float32), "zeros": np.zeros(3, np.float32),
                   "back": np.array([2, 3, 8]), "gamma": _w(3, 1) + 1, "beta": _w(3, 1)})


@pytest.mark.parametrize(("build", "op", "cpu"), [
    (conv_silu_sigmoid_shared, "SDConv", {"CastAvx", "Transpose", "Sigmoid"}),
    (linear_product_also_output, "SDGemm", {"CastAvx"}),
    (group_norm_one_channel_per_group, "SDGroupNorm", {"CastAvx", "Transpose", "Reshape"})])
def test_fuzz_missed_fusion(build: Any, op: str, cpu: set[str]) -> None:
    outcome = check(build(), "bf16")
    assert op in outcome.dispatch_ops and set(outcome.cpu_ops) == cpu, outcome


def test_a_refused_match_names_its_reason_on_every_node() -> None:
    """GroupNorm whose InstanceNormalization output is also a graph output: the report said 'no rule offloads
    InstanceNormalization'; the rule that refused (and why) is named on each node of the refused match."""
    from sdnpu.ops.tags import REASON_TAG
    from sdnpu.passes.pipeline import compile_model

    m = group_norm_one_channel_per_group()
    m.graph.output.append(helper.make_tensor_value_info("i", T.FLOAT, [2, 3, 8]))
    irm = ir.serde.deserialize_model(m)
    compile_model(irm)
    inorm = next(node for node in irm.graph if node.op_type == "InstanceNormalization")
    assert inorm.metadata_props[REASON_TAG] == "SDGroupNormFusion: intermediate 'i' is also used outside the pattern"


def test_a_wrong_result_is_reported_with_its_reproducer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness itself: a compiler that breaks the numbers fails the fuzz test, the graph lands on disk
    with the line that reruns it, and that line fails too (and passes once the compiler is right)."""
    from sdnpu.passes import pipeline
    from sdnpu.passes.manager import PassResult

    real = pipeline.pipeline

    def broken(options: Any) -> list[tuple[str, Any]]:
        def add_becomes_mul(m: Any) -> PassResult:
            node = next(n for n in m.graph if n.op_type == "SDAdd")
            node.op_type = "SDMul"  # a valid op of the table, with the wrong arithmetic
            del node.attributes["is_bias_add"]
            return PassResult(modified=True)

        passes = real(options)
        return [*passes[:5], ("break", add_becomes_mul), *passes[5:]]

    monkeypatch.setattr(pipeline, "pipeline", broken)
    monkeypatch.setattr(sys.modules[__name__], "OUT", tmp_path)
    model = _model([helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])],
                   {"x": (T.FLOAT, [2, 4]), "b": (T.FLOAT, [2, 3])}, {"y": (T.FLOAT, [2, 3])}, {"w": _w(4, 3)})
    with pytest.raises(Mismatch, match="dispatch model") as failure:
        _run(st.just((model, "MatMul + Add(activation)")), 1, "bf16")
    saved = list(tmp_path.glob("*.onnx"))
    line = saved[0].with_suffix(".txt").read_text().splitlines()[0] if len(saved) == 1 else ""
    assert line == f"python -m tests.fuzz_repro {saved[0]}" and f"reproduce: {line}" in failure.value.__notes__
    assert main([str(saved[0])]) == 1
    monkeypatch.setattr(pipeline, "pipeline", real)
    assert main([str(saved[0])]) == 0
