"""Target qnn-htp end to end, on Qualcomm's compiler and its HTP emulator (onnxruntime-qnn): the compile
(``sdnpu compile --target qnn-htp``: the rewritten graph, QNN's EPContext model, QNN's count beside sdnpu's,
fp16 headroom, fidelity), the convert, the report, the runtime, and the one-line errors. Each QNN graph is a
tiny component, compiled and run once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from sdnpu.convert import ConvertOptions, convert
from sdnpu.convert.compile import compile_file
from sdnpu.errors import SdnpuError
from sdnpu.passes.pipeline import CompileOptions
from sdnpu.reports import show

qnn = pytest.importorskip("sdnpu.backends.qnn_htp")

MIN_COSINE = 0.999  # the bar for an emulated fp16 component against its fp32 graph


def _signature(path: Path) -> list[tuple[str, object]]:
    g = onnx.load(str(path), load_external_data=False).graph
    return [(v.name, v.type.SerializeToString()) for v in [*g.input, *g.output]]


@pytest.fixture(scope="module")
def sd3_transformer(tiny_sd3, tmp_path_factory):
    """tiny-sd3's transformer compiled for qnn-htp: the graph whose patch embedding QNN computes wrong as it is.
    Its attentions' scores are put in head groups as a full-size transformer's are (the limit lowered to one head's
    scores: tiny-sd3's 2 heads are 1.3 MB each), so that form is the one QNN compiles and the emulator runs."""
    from sdnpu.passes.htp import heads

    out = tmp_path_factory.mktemp("qnn-sd3") / "qnn"
    source = tiny_sd3.out / "transformer" / "model.onnx"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(heads, "SCORES_LIMIT", _one_head(source))
        return source, out, compile_file(source, out, CompileOptions.named("qnn-htp"))


def _one_head(source: Path) -> int:
    """One head's scores of the graph's largest attention, in bytes."""
    g = onnx.shape_inference.infer_shapes(onnx.load(str(source), load_external_data=False)).graph
    info = {v.name: v for v in g.value_info}
    best = 0
    for n in g.node:
        if n.op_type == "Softmax" and n.input[0] in info:
            dims = [d.dim_value for d in info[n.input[0]].type.tensor_type.shape.dim]
            if len(dims) == 4:
                best = max(best, dims[0] * dims[2] * dims[3] * 4)
    assert best, "no rank-4 attention scores in the graph"
    return best


def test_qnn_takes_the_sd3_transformer_whole_and_computes_it_right(sd3_transformer):
    source, out, report = sd3_transformer
    q = report["qnn"]
    assert q["whole"] and q["trace"]["unsupported_nodes"] == 0 and q["trace"]["qnn_subgraphs"] == 1
    assert report["summary"]["cpu_nodes"] == 0  # sdnpu's table agrees
    assert report["fidelity"]["min_cosine"] >= MIN_COSINE  # 0.866 before the LayerNorm rewrite
    counts = {p["name"]: p["counts"] for p in report["passes"]}
    assert counts["htp_norms"]["broadcast Add -> Sub before LayerNorm"] >= 1
    assert counts["htp_rank6"]["rank-6 pixel shuffles -> DepthToSpace"] == 1
    assert counts["htp_heads"]["attentions in head groups"] >= 1 and counts["htp_heads"]["head groups"] >= 2
    assert (out / "ctx.onnx").is_file() and [b.startswith("ctx") for b in q["binaries"]] == [True]
    assert q["versions"]["qnn"] and q["arch"] == "v73"


def test_the_qnn_model_keeps_the_fp32_graphs_inputs_and_outputs(sd3_transformer):
    source, out, _ = sd3_transformer
    assert _signature(out / "model.onnx") == _signature(source)
    ctx = onnx.load(str(out / "ctx.onnx"), load_external_data=False).graph
    assert [v.name for v in ctx.input] == [v.name for v in onnx.load(str(source), load_external_data=False).graph.input]
    assert {n.op_type for n in ctx.node} == {"EPContext"}  # taken whole: one context node, nothing for the CPU


def test_the_report_shows_qnns_count_beside_sdnpus(sd3_transformer):
    _, out, report = sd3_transformer
    text = (out / "onnx_report.txt").read_text()
    assert "Qualcomm's compiler (QNN's own count, from its op trace)" in text
    assert f"QNN takes              {report['qnn']['trace']['supported_nodes']} of" in text
    assert "fp16 headroom" in text
    assert show.find(out / "report.json")[0][1]["qnn"]["whole"]  # validates against the schema


def test_a_node_qnn_refuses_is_named_with_qnns_reason(tmp_path):
    from onnx import TensorProto as T
    from onnx import helper

    nodes = [helper.make_node("Mul", ["x", "x"], ["a"], name="square"),
             helper.make_node("Erf", ["a"], ["b"], name="erf"),
             helper.make_node("Add", ["b", "x"], ["y"], name="add")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, [4, 8])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [4, 8])])
    (tmp_path / "m").mkdir()
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)]), str(tmp_path / "m" / "model.onnx"))
    report = compile_file(tmp_path / "m" / "model.onnx", tmp_path / "out", CompileOptions.named("qnn-htp"))
    q = report["qnn"]
    assert not q["whole"] and q["trace"]["unsupported_nodes"] == 1
    assert q["trace"]["refused"][0]["name"] == "erf" and "Erf" in q["trace"]["refused"][0]["reason"]
    assert [c["op_type"] for c in report["cpu_nodes"]] == ["Erf"]  # sdnpu's table names it too
    assert report["fidelity"]["min_cosine"] > 0.999  # the context runs, Erf on the CPU
    assert "erf" in (tmp_path / "out" / "onnx_report.txt").read_text()


def test_a_low_cosine_from_an_inputs_fp16_rounding_is_named(tmp_path):
    """A float32 input reaches the HTP in fp16 (0.6 + 3e-5 arrives as 0.6: measured). Stable Cascade's
    ``timestep_ratio`` is multiplied by 10000 before its sinusoid, so that rounding alone moves the angles by up
    to a radian (its zoo row: cosine 0.995). The compile looks at a cosine below 0.999: the fp32 graph on the
    input rounded to fp16 loses as much, and the report and the log say the loss is the input's rounding."""
    from onnx import TensorProto as T
    from onnx import helper

    freqs = np.exp(-np.log(10000.0) * np.arange(16) / 15).astype(np.float32).reshape(1, 16)
    nodes = [helper.make_node("Unsqueeze", ["r", "one"], ["r1"]),
             helper.make_node("Mul", ["r1", "scale"], ["t"]), helper.make_node("Mul", ["t", "freqs"], ["a"]),
             helper.make_node("Sin", ["a"], ["s"]), helper.make_node("Cos", ["a"], ["c"]),
             helper.make_node("Concat", ["s", "c"], ["y"], axis=1)]
    inits = [onnx.numpy_helper.from_array(np.asarray([1], np.int64), "one"),
             onnx.numpy_helper.from_array(np.asarray(10000.0, np.float32), "scale"),
             onnx.numpy_helper.from_array(freqs, "freqs")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("r", T.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [2, 32])], inits)
    (tmp_path / "m").mkdir()
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "m" / "model.onnx"))
    report = compile_file(tmp_path / "m" / "model.onnx", tmp_path / "out", CompileOptions.named("qnn-htp"))
    fid = report["fidelity"]
    assert report["qnn"]["whole"] and fid["min_cosine"] < MIN_COSINE
    rounding = fid["input_rounding"]
    assert rounding["worst"] == "r" and 1 - rounding["min_cosine"] >= 0.5 * (1 - fid["min_cosine"])
    text = " ".join((tmp_path / "out" / "onnx_report.txt").read_text().split())
    assert f"rounded to fp16 (as the HTP takes it): r cosine {rounding['min_cosine']:.6f}" in text
    assert show.find(tmp_path / "out" / "report.json")  # validates against the schema


# tiny-sdxl's text encoder holds 3.24 MB of fp16 weights, 3.16 MB of them its token table: at 3.2 MB a context it
# is cut in two (as the SDXL UNet's 5.1 GB is at the default 2 GB a context), the contexts chained in one ctx.onnx
TEXT_ENCODER_CONTEXT_GB = 0.0032


def test_a_graph_qnn_takes_nothing_of_is_reported_and_the_table_agrees(tmp_path):
    """A rank-5 Sqrt: QNN refuses it ("CreateQnnNode failed", measured; a rank-5 ReduceL2 was this graph before
    ``htp_ranks`` wrote reductions over lower-rank views), so it takes no node (its op trace says null where it has
    nothing to count: a TypeError in sdnpu before) and there is no context to write: one line naming the node and
    QNN's reason; sdnpu's table refuses it too."""
    from onnx import TensorProto as T
    from onnx import helper

    g = helper.make_graph([helper.make_node("Sqrt", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", T.FLOAT, [1, 32, 1, 16, 16])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [1, 32, 1, 16, 16])])
    (tmp_path / "m").mkdir()
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "m" / "model.onnx"))
    with pytest.raises(SdnpuError, match=r"QNN takes none of model.onnx's 1 nodes \(Sqrt: Failed to add node"):
        compile_file(tmp_path / "m" / "model.onnx", tmp_path / "out", CompileOptions.named("qnn-htp"))
    assert not (tmp_path / "out").exists()
    import onnx_ir as ir

    from sdnpu.passes.partition import refused

    graph = ir.load(tmp_path / "m" / "model.onnx").graph
    assert "rank 5" in " ".join(refused(graph, CompileOptions.named("qnn-htp").target).values())


def test_a_model_too_slow_for_the_emulator_is_compiled_and_says_why_it_is_not_run(tmp_path, monkeypatch):
    """At full size the emulator would take hours (sd-turbo's UNet, 402 GMAC): the compile still runs the fp32
    graph (fp16 headroom) and writes the context; the report says why the compiled model did not run."""
    from onnx import TensorProto as T
    from onnx import helper

    w = onnx.numpy_helper.from_array(np.eye(8, dtype=np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", T.FLOAT, [4, 8])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [4, 8])], initializer=[w])
    (tmp_path / "m").mkdir()
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)]), str(tmp_path / "m" / "model.onnx"))
    monkeypatch.setenv(qnn.EMULATOR_MINUTES_ENV, "0")  # 256 MACs is over no time at all
    report = compile_file(tmp_path / "m" / "model.onnx", tmp_path / "out", CompileOptions.named("qnn-htp"))
    assert report["qnn"]["whole"] and report["fidelity"] is None and report["fp16_headroom"] == []
    assert "the HTP emulator would take about" in report["fidelity_skipped"]
    assert "not measured: the HTP emulator would take" in (tmp_path / "out" / "onnx_report.txt").read_text()
    monkeypatch.setenv(qnn.EMULATOR_MINUTES_ENV, "soon")
    with pytest.raises(SdnpuError, match="is not a number of minutes"):
        qnn.too_slow_to_emulate(1)


@pytest.fixture(scope="module")
def qnn_text_encoder(tmp_path_factory):
    out = tmp_path_factory.mktemp("qnn-convert")
    result = convert("tiny-sdxl", "text_encoder", out=out,
                     options=ConvertOptions(target="qnn-htp", context_gb=TEXT_ENCODER_CONTEXT_GB))
    return out, result


def test_convert_writes_the_qnn_folder(qnn_text_encoder):
    out, result = qnn_text_encoder
    comp = out / "text_encoder"
    assert (comp / "qnn" / "ctx.onnx").is_file() and not (comp / "dd").exists()
    summary = result.components[0].report
    assert summary["vendor_whole"] and summary["vendor_taken"] == summary["vendor_nodes"]
    report = json.loads((comp / "qnn" / "report.json").read_text())
    assert report["target"] == "qnn-htp" and report["precision"] == "fp16"
    # CLIP's causal mask (float32's lowest) is within 4x of fp16's range: listed, with its guard; the last layer's
    # is no longer computed (the pipeline reads no output of that layer: htp_ranks' sweep removes the dead nodes)
    room = report["fp16_headroom"]
    assert room and all(e["guard"].startswith("a mask's") for e in room)
    assert all(e["after"] * 4 < 65504 for e in room if e["after"] is not None) and any(e["after"] for e in room)
    assert report["fidelity"]["min_cosine"] >= MIN_COSINE
    assert "QNN takes" in show.summary_lines(show.find(out))


def test_a_graph_over_one_contexts_limit_is_several_contexts_chained_in_one_model(qnn_text_encoder):
    """Each piece compiled by QNN with fallback disabled into its own binary; one EPContext node each, in one
    model with the fp32 graph's inputs and outputs; the fidelity above ran through the chain."""
    out, _ = qnn_text_encoder
    q = json.loads((out / "text_encoder" / "qnn" / "report.json").read_text())["qnn"]
    assert len(q["pieces"]) == 2 and all(p["whole"] and p["weight_bytes"] <= 3.2e6 for p in q["pieces"])
    assert q["binaries"] == ["ctx1_qnn.bin", "ctx2_qnn.bin"] and q["context_gb"] == TEXT_ENCODER_CONTEXT_GB
    assert q["trace"]["qnn_subgraphs"] == 2 and q["trace"]["unsupported_nodes"] == 0
    qdir = out / "text_encoder" / "qnn"
    ctx = onnx.load(str(qdir / "ctx.onnx"), load_external_data=False).graph
    assert [n.op_type for n in ctx.node] == ["EPContext", "EPContext"]
    assert _signature(qdir / "ctx.onnx") == _signature(qdir / "model.onnx")
    assert not list(qdir.glob("piece*.onnx")) and not list(qdir.glob("ctx?.onnx"))  # the pieces' files went
    assert "2 contexts, chained" in (qdir / "onnx_report.txt").read_text()


def test_the_runtime_runs_a_qnn_component_against_its_fp32_graph(qnn_text_encoder):
    from sdnpu.runtime.session import component_path, is_qnn_folder, open_component

    out, _ = qnn_text_encoder
    assert is_qnn_folder(out)
    assert component_path(out, "text_encoder").parts[-2:] == ("qnn", "ctx.onnx")
    ids = {"input_ids": np.arange(77, dtype=np.int64)[None] % 1000}
    ours = open_component(out, "text_encoder")
    ref = open_component(out, "text_encoder", reference=True)
    name = ours.outputs[0]
    a, b = ours.run(ids)[name], ref.run(ids)[name]
    cos = float((a.ravel() @ b.ravel()) / np.linalg.norm(a) / np.linalg.norm(b))
    assert cos >= MIN_COSINE


@pytest.mark.parametrize(("source", "component", "stop_at"), [("tiny-flux", "transformer", 2),
                                                              ("tiny-sd3", "text_encoder_3", None)])
def test_block_by_block_each_piece_is_a_context_and_the_chain_computes_the_module(tmp_path, monkeypatch, source,
                                                                                  component, stop_at):
    """Flux.1's transformer (pieces handing on two streams and the tables the first piece computes) and T5 (one
    chain value): each piece rewritten and compiled by QNN with fallback disabled into its own context, the
    contexts chained in one ctx.onnx with the fp32 graph's inputs and outputs, run on the emulator one after
    another against PyTorch's pieces chained. Flux's run is stopped in its third piece (Ctrl-C) and run again:
    the second run goes on after the two pieces the first finished, their contexts and emulated values kept."""
    from sdnpu.convert import blockwise
    from sdnpu.convert.blockwise import driver

    options = ConvertOptions(target="qnn-htp", blockwise=True)
    done: list[int] = []
    real = driver._piece

    def piece(run, p):
        if p.i == stop_at and -1 not in done:
            raise KeyboardInterrupt
        real(run, p)
        done.append(p.i)
        # the chain keeps each piece's graph to the end for the report: without its weights (Flux.1 dev's 57
        # pieces held 1.4 GB each, and its state file with them: 7 GB after 5 pieces, measured)
        held = [t for g in run.qnn.graphs for t in g.graph.initializer if np.prod(t.dims) * 4 > 1024]
        assert held and all(t.data_location == onnx.TensorProto.EXTERNAL and not t.raw_data for t in held)

    monkeypatch.setattr(driver, "_piece", piece)
    from sdnpu.convert.blockwise import state

    monkeypatch.setattr(state, "KEY", tmp_path / "home" / "state.key")  # this test's own user key
    if stop_at is not None:
        with pytest.raises(KeyboardInterrupt):
            convert(source, component, out=tmp_path, options=options)
        assert done == list(range(stop_at)) and (tmp_path / f".{component}.pieces" / blockwise.STATE).is_file()
        assert sorted(f.name for f in (tmp_path / f".{component}.pieces" / "qnn").glob("*.bin")) == [
            f"ctx{i}_qnn.bin" for i in range(1, stop_at + 1)]
        done.append(-1)
    convert(source, component, out=tmp_path, options=options)
    if stop_at is not None:
        assert done[done.index(-1) + 1] == stop_at  # the finished pieces are not done again
    comp = tmp_path / component
    report = json.loads((comp / "qnn" / "report.json").read_text())
    q = report["qnn"]
    n = report["blockwise"]["pieces"]
    assert q["whole"] and len(q["pieces"]) == n >= 2 and q["trace"]["unsupported_nodes"] == 0
    assert q["binaries"] == [f"ctx{i}_qnn.bin" for i in range(1, n + 1)]
    assert report["fidelity"]["min_cosine"] >= MIN_COSINE and "chained" in report["fidelity"]["inputs"]
    assert _signature(comp / "qnn" / "ctx.onnx") == _signature(comp / "model.onnx")
    assert report["summary"]["total_nodes"] == sum(p["nodes"] for p in q["pieces"])
    assert not (tmp_path / f".{component}.pieces").exists() and not (comp / "qnn" / "model.onnx").exists()
    text = " ".join((comp / "qnn" / "onnx_report.txt").read_text().split())
    assert f"{n} contexts, chained: one per piece of the block-by-block conversion" in text


def test_the_qnn_options_are_checked_before_any_work():
    with pytest.raises(SdnpuError, match="has no precision 'bf16'"):
        ConvertOptions(target="qnn-htp", precision="bf16")
    with pytest.raises(SdnpuError, match="--htp-arch is for --target qnn-htp"):
        ConvertOptions(htp_arch=73)
    with pytest.raises(SdnpuError, match="unknown HTP architecture 'v68'"):
        ConvertOptions(target="qnn-htp", htp_arch="v68")
    assert ConvertOptions(target="qnn-htp", htp_arch="v81").compile_options.htp_arch == 81
    with pytest.raises(SdnpuError, match="--htp-optimization is for --target qnn-htp"):
        ConvertOptions(htp_optimization=1)
    with pytest.raises(SdnpuError, match="unknown QNN optimization mode '4'"):
        ConvertOptions(target="qnn-htp", htp_optimization="4")
    options = ConvertOptions(target="qnn-htp", htp_optimization="1").compile_options
    assert options.htp_optimization == 1 and CompileOptions.named("qnn-htp").htp_optimization is None


def test_the_optimization_mode_is_the_provider_option_qnn_reads_and_changes_what_a_kept_unit_depends_on(tmp_path):
    """QNN's default is left to QNN (no option); a mode given is the EP's finalization option. A compile in pieces
    kept with one mode is not taken up by a run with another (``sdnpu.convert.kept``: the mode is in the units'
    fingerprint)."""
    from sdnpu.convert.kept import fingerprint

    default = qnn.HtpOptions(qnn.parse_arch(None)).provider_options()
    assert "htp_graph_finalization_optimization_mode" not in default
    fast = qnn.HtpOptions(qnn.parse_arch("v81", 1)).provider_options()
    assert fast["htp_graph_finalization_optimization_mode"] == "1" and fast["htp_arch"] == "81"
    (tmp_path / "model.onnx").write_bytes(b"graph")
    common = {"arch": 73, "soc_model": 60, "unit_gb": 1.0, "vendor": {"qnn": "2.51"}}
    assert fingerprint(tmp_path / "model.onnx", **common) != fingerprint(tmp_path / "model.onnx", **common,
                                                                         optimization=1)


def test_an_optimization_mode_reaches_qnns_compiler(tmp_path):
    """QNN takes any value of the option without a word (a mode 9 compiles), so what shows the mode reached its
    compiler is what it builds: this attention over 512 tokens compiles into a smaller binary in mode 1 than by
    QNN's default (1,654,784 against 1,748,992 bytes, each the same in two compiles, measured on QNN 2.51; the bytes
    themselves differ from compile to compile, so they are not what is compared); the report records the mode."""
    from .htp_graphs import attention

    (tmp_path / "m").mkdir()
    onnx.save(attention(512, 512, 2, d=64), str(tmp_path / "m" / "model.onnx"))
    report = compile_file(tmp_path / "m" / "model.onnx", tmp_path / "fast",
                          CompileOptions.named("qnn-htp", htp_optimization=1))
    assert report["qnn"]["optimization"] == 1 and report["qnn"]["whole"]
    assert report["fidelity"]["min_cosine"] >= MIN_COSINE
    default = qnn.compile_context(tmp_path / "fast" / "model.onnx", tmp_path / "default", qnn.parse_arch(None))
    assert default.whole
    fast = (tmp_path / "fast" / "ctx_qnn.bin").stat().st_size
    assert fast < (tmp_path / "default" / "ctx_qnn.bin").stat().st_size


def test_a_missing_onnxruntime_qnn_is_one_line_naming_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime_qnn", None)
    with pytest.raises(SdnpuError, match="needs onnxruntime-qnn") as e:
        qnn.require()
    assert "pip install onnxruntime-qnn" in str(e.value)


def test_the_cli_takes_the_target_and_the_htp_arch(tmp_path, qnn_text_encoder):
    out, _ = qnn_text_encoder
    bad = subprocess.run([sys.executable, "-m", "sdnpu", "compile", str(out / "text_encoder" / "model.onnx"),
                          "--target", "qnn-htp", "--htp-arch", "v99"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown HTP architecture 'v99'" in bad.stderr and "Traceback" not in bad.stderr


def test_a_graph_that_crashes_qnns_compiler_is_one_line_and_writes_nothing(tmp_path):
    """ONNX's STFT node test crashes QNN 2.51's compile (SIGSEGV, measured): it runs in a process of its own."""
    from .node_tests import cases, write_case

    path = write_case(next(cases("^test_stft$")), tmp_path / "stft")
    with pytest.raises(SdnpuError, match="QNN's compiler crashed on stft"):
        compile_file(path, tmp_path / "out", CompileOptions.named("qnn-htp"))
    assert not (tmp_path / "out").exists()
