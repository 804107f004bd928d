"""Step prologues (issue 14): the CPU work on the step inputs that a ControlNet and the UNet beside it share
moves out of each dispatch model into one small model, run once a step for both. On small graphs: what moves
and what stays, the numbers (the same ops, split in two), the digest that says two prologues compute the same,
the sizes, and a missing prologue file. The real graphs: tests/test_controlnet.py."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import helper

from sdnpu.convert.compile import compile_file, run_onnx
from sdnpu.errors import SdnpuError
from sdnpu import onnxrun
from sdnpu.formats import prologue
from sdnpu.ops.target import get_target
from sdnpu.passes.manager import entry_name, run_passes
from sdnpu.passes.pipeline import CompileOptions, pipeline
from sdnpu.passes.prologue import cut_prologue

from .graphs import feeds_for, model, run

R = np.random.default_rng(5)
BF16_TOL = 2**-6  # two convolutions and an add in bf16 on values of order 1: measured under 2**-7 here


def w(*shape: int) -> np.ndarray:
    return (R.standard_normal(shape) * 0.3).astype(np.float32)


WEIGHTS = {"W1": w(8, 8, 3, 3), "B1": w(8), "W2": w(8, 8, 3, 3), "B2": w(8), "G": w(4, 8), "GB": w(8),
           "to4d": np.array([2, 8, 1, 1], np.int64)}
FREQS = w(4)


def step_graph(freq: float = 1.0, names: str = "", other: bool = False) -> onnx.ModelProto:
    """A step's shape in small: latents ``x`` through a convolution, plus a projection of a sinusoid of ``t``
    (CPU work on a step input, as the UNet's time embedding), then another convolution. ``names`` renames the
    internal values (another exporter's names); ``other``: the sinusoid also reads ``u``, an input that is not
    a step input."""
    arg = f"{names}arg"
    nodes = [helper.make_node("Conv", ["x", "W1", "B1"], [f"{names}h"], pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
             helper.make_node("Mul", ["t", f"{names}freq"], [arg])]
    if other:
        nodes.append(helper.make_node("Add", [arg, "u"], [f"{names}argu"]))
        arg = f"{names}argu"
    nodes += [helper.make_node("Sin", [arg], [f"{names}s"]),
              helper.make_node("Gemm", [f"{names}s", "G", "GB"], [f"{names}e"]),
              helper.make_node("Reshape", [f"{names}e", "to4d"], [f"{names}e4"]),
              helper.make_node("Add", [f"{names}h", f"{names}e4"], [f"{names}a"]),
              helper.make_node("Conv", [f"{names}a", "W2", "B2"], ["y"], pads=[1, 1, 1, 1], kernel_shape=[3, 3])]
    inputs = {"x": [2, 8, 6, 6], "t": [2, 4], **({"u": [2, 4]} if other else {})}
    return model(nodes, inputs, {"y": [2, 8, 6, 6]}, {**WEIGHTS, f"{names}freq": FREQS * np.float32(freq)})


def compiled(tmp: Path, m: onnx.ModelProto, steps: set[str] | None) -> tuple[Path, dict]:
    tmp.mkdir(parents=True, exist_ok=True)
    onnx.save(m, tmp / "model.onnx")
    report = compile_file(tmp / "model.onnx", tmp / "dd", CompileOptions(prologue=frozenset(steps or ())))
    return tmp / "dd" / "replaced.onnx", report


def cpu_ops(path: Path) -> Counter[str]:
    m = onnx.load(str(path))
    return Counter(n.op_type for n in m.graph.node if n.domain != "com.amd" or n.op_type == "CastAvx")


def test_the_step_inputs_cpu_work_moves_to_the_prologue_and_the_numbers_stay(tmp_path):
    m = step_graph()
    feeds = feeds_for(m)
    expected = run(m, feeds)[0]
    whole, _ = compiled(tmp_path / "whole", m, None)
    split, report = compiled(tmp_path / "split", m, {"x", "t"})
    before = cpu_ops(whole)
    assert before["Sin"] == before["Mul"] == 1 and before["CastAvx"] == 3  # x and t in, y out
    # left: y's cast and Transpose out; moved: the sinusoid and its cast, x's Transpose and cast
    assert cpu_ops(split) == Counter({"CastAvx": 1, "Transpose": 1})
    pro = split.with_name(prologue.FILE)
    onnx.checker.check_model(str(pro), full_check=True)
    assert cpu_ops(pro) == Counter({"Mul": 1, "Sin": 1, "Transpose": 1, "CastAvx": 2})
    spec = prologue.of_proto(onnx.load(str(split), load_external_data=False))
    assert spec is not None and spec.inputs == ("x", "t") and spec.file == prologue.FILE
    assert sorted(spec.outputs) == ["prologue.t", "prologue.x"]
    assert {i.name for i in onnx.load(str(split)).graph.input} == set(spec.outputs)
    # the same ops, split in two: the same numbers as the whole dispatch model, bit for bit
    got, ref = run_onnx(split, feeds)["y"], run_onnx(whole, feeds)["y"]
    np.testing.assert_array_equal(got, ref)
    assert np.abs(got - expected).max() < BF16_TOL * np.abs(expected).max()
    # the report: the graph's own rate, and the rate with the prologue counted in it
    s, steps = report["summary"], report["prologue"]
    assert s["cpu_nodes"] == 2 and len(steps["cpu_nodes"]) == 5
    assert steps["offload_rate_with_it"] == pytest.approx(s["offloaded_nodes"] / (s["offloaded_nodes"] + 7))
    assert report["fidelity"]["min_cosine"] > 0.999


def test_the_digest_says_what_the_prologue_computes(tmp_path):
    """Two graphs that compute the same from the same inputs under other internal names (two exporters, or a
    ControlNet and a UNet) write the same prologue; another frequency is another digest."""
    def digest(name: str, m: onnx.ModelProto) -> str:
        path, _ = compiled(tmp_path / name, m, {"x", "t"})
        spec = prologue.of_proto(onnx.load(str(path), load_external_data=False))
        assert spec is not None
        return spec.digest

    first = digest("a", step_graph())
    assert digest("b", step_graph(names="other_")) == first
    assert digest("c", step_graph(freq=0.5)) != first


def test_only_the_named_inputs_work_moves(tmp_path):
    # t's sinusoid also reads u (not a step input): t * freq moves (it reads t alone, and goes over fp32), the
    # rest stays with its cast; x's edge moves
    m = step_graph(other=True)
    path, _ = compiled(tmp_path / "other", m, {"x", "t"})
    assert cpu_ops(path)["Sin"] == cpu_ops(path)["Add"] == 1
    assert cpu_ops(path.with_name(prologue.FILE)) == Counter({"Mul": 1, "Transpose": 1, "CastAvx": 1})
    inputs = {i.name: i.type.tensor_type.elem_type for i in onnx.load(str(path)).graph.input}
    assert inputs == {"prologue.x": onnx.TensorProto.BFLOAT16, "prologue.t": onnx.TensorProto.FLOAT,
                      "u": onnx.TensorProto.FLOAT}
    feeds = feeds_for(m)
    np.testing.assert_allclose(run_onnx(path, feeds)["y"], run(m, feeds)[0], atol=BF16_TOL * 8)
    # no named input: nothing moves, no prologue
    path, report = compiled(tmp_path / "none", step_graph(), set())
    assert "prologue" not in report and not path.with_name(prologue.FILE).exists()


def test_the_prologue_serves_every_size(tmp_path):
    """Its shapes are symbolic: the values for other input sizes come out of the same prologue."""
    path, _ = compiled(tmp_path / "a", step_graph(), {"x", "t"})
    shapes = onnxrun.prologue_output_shapes(path.with_name(prologue.FILE), {"x": [2, 8, 10, 6], "t": [2, 4]})
    assert shapes == {"prologue.x": [2, 10, 6, 8], "prologue.t": [2, 4]}  # x NHWC


def test_a_missing_or_broken_prologue_and_a_missing_input_are_one_clear_error(tmp_path):
    from sdnpu.runtime.session import open_component_path

    path, _ = compiled(tmp_path / "a", step_graph(), {"x", "t"})
    feeds = feeds_for(step_graph())
    with pytest.raises(SdnpuError, match="the step prologue needs input 't'"):
        open_component_path(path, "controlnet").run({"x": feeds["x"]})
    pro = path.with_name(prologue.FILE)
    pro.write_bytes(pro.read_bytes()[:50])
    with pytest.raises(SdnpuError, match="onnxruntime cannot open the step prologue"):
        run_onnx(path, feeds)
    pro.unlink()
    with pytest.raises(SdnpuError, match="prologue.onnx not found: the dispatch model beside it takes"):
        run_onnx(path, feeds)
    with pytest.raises(SdnpuError, match="prologue.onnx not found"):
        open_component_path(path, "controlnet")


def test_a_size_compiled_in_full_reads_the_primarys_prologue_or_its_own(tmp_path):
    """Where the specializer refuses a size and it is compiled in full, its prologue is the primary's when they
    compute the same (one file serves every size), else its own copy under the size's name."""
    from sdnpu.convert.sized import place_prologue
    from sdnpu.imagesize import Size

    primary, _ = compiled(tmp_path / "primary", step_graph(), {"x", "t"})
    same, _ = compiled(tmp_path / "same", step_graph(names="other_"), {"x", "t"})
    place_prologue(same, primary.parent, Size.of("320x256"))
    assert sorted(p.name for p in primary.parent.glob("prologue*")) == [prologue.FILE]
    other, _ = compiled(tmp_path / "other", step_graph(freq=3.0), {"x", "t"})
    place_prologue(other, primary.parent, Size.of("320x256"))
    spec = prologue.of_proto(onnx.load(str(other), load_external_data=False))
    assert spec is not None and spec.file == "prologue.320x256.onnx"
    assert prologue.of_proto(onnx.load(str(primary.parent / spec.file))).digest == spec.digest
    moved = primary.parent / "replaced.320x256.onnx"  # where the size's model goes, beside the primary's
    moved.write_bytes(other.read_bytes())
    m = step_graph(freq=3.0)
    feeds = feeds_for(m)
    expected = run(m, feeds)[0]
    error = np.abs(run_onnx(moved, feeds)["y"] - expected).max()  # with its own prologue
    assert error < BF16_TOL * np.abs(expected).max()
    assert np.abs(run_onnx(primary, feeds)["y"] - expected).max() > 5 * error  # the primary's: another sinusoid


def test_pack_carries_the_prologue(tmp_path, monkeypatch):
    """`sdnpu pack` (with the stand-in for AMD's packer, as tests/test_pack.py) copies the step prologue beside
    the packed model: it is CPU work, nothing in it to pack."""
    from sdnpu.runtime import ddpackage
    from sdnpu.runtime.pack import pack_model

    from .test_pack import _install_stand_in

    path, _ = compiled(tmp_path / "a", step_graph(), {"x", "t"})
    _install_stand_in(monkeypatch)
    counts = pack_model(path, tmp_path / "packed", ddpackage.kernels_for("sdxl", "unet", 256))
    assert counts["step prologue copied"] == 1 and counts["SDConv weights -> bfp16ebs8 blob"] == 2
    assert (tmp_path / "packed" / prologue.FILE).read_bytes() == path.with_name(prologue.FILE).read_bytes()


# ---- the pass by itself (``sdnpu.passes.prologue.cut_prologue``), on what the passes before it leave -----------

def after_cleanup(m: onnx.ModelProto) -> ir.Model:
    irm = ir.serde.deserialize_model(m)
    passes = pipeline(CompileOptions())
    names = [entry_name(e) for e in passes]
    run_passes(irm, passes[:names.index("cleanup") + 1])
    return irm


def test_the_pass_cuts_the_step_inputs_cpu_work_into_a_model_of_its_own():
    m = step_graph()
    irm = after_cleanup(m)
    before = Counter(n.op_type for n in irm.graph)
    result = cut_prologue(irm, get_target(), frozenset({"x", "t"}))
    assert result.modified and result.counts == {"CPU nodes moved": 5, "values handed over": 2}
    pro = result.prologue
    moved = Counter(n.op_type for n in pro.graph)
    # x's Transpose and cast, t's frequency product, its Sin and cast
    assert moved == {"Transpose": 1, "CastAvx": 2, "Mul": 1, "Sin": 1}
    assert before - Counter(n.op_type for n in irm.graph) == moved
    assert [v.name for v in irm.graph.inputs] == ["prologue.x", "prologue.t"]
    record = prologue.decode(irm.metadata_props[prologue.KEY])
    assert record.inputs == ("x", "t") and record.outputs == ("prologue.x", "prologue.t")
    assert record == prologue.decode(pro.metadata_props[prologue.KEY])
    sessions = []
    for part in (pro, irm):
        proto = ir.serde.serialize_model(part)
        onnx.checker.check_model(proto, full_check=True)
        sessions.append(ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]))
    feeds = feeds_for(m)
    values = onnxrun.run_prologue(sessions[0], feeds)  # the prologue first, then the model on its values
    got = onnxrun.run(sessions[1], ["y"], values)[0]
    want = run(m, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=BF16_TOL, atol=BF16_TOL * np.abs(want).max())


def test_the_pass_leaves_a_graph_without_such_work_as_it_is():
    irm = after_cleanup(step_graph())
    result = cut_prologue(irm, get_target(), frozenset({"not_an_input"}))
    assert not result.modified and prologue.KEY not in irm.metadata_props
    assert [v.name for v in irm.graph.inputs] == ["x", "t"]
