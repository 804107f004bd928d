"""T5 converted block by block (``sdnpu.convert.blockwise``): what a machine without the memory for SD 3.5's
T5-XXL (19 GB of fp32 weights) does. Each block is exported, checked and compiled alone, and the pieces are
stitched (``sdnpu.convert.stitch``): the stitched graphs must compute what the whole module computes and
compile to what the whole graph compiles to."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from sdnpu.convert import convert
from sdnpu.convert.compile import run_onnx
from tests.conftest import once

IDS = np.random.default_rng(3).integers(0, 1000, (1, 77)).astype(np.int64)


def _outputs(folder):
    t5 = folder / "text_encoder_3"
    fp32 = run_onnx(t5 / "model.onnx", {"input_ids": IDS})["last_hidden_state"]
    dd = run_onnx(t5 / "dd" / "replaced.onnx", {"input_ids": IDS})["last_hidden_state"]
    return fp32, dd


@pytest.fixture(scope="module")
def blockwise_preset(tmp_path_factory):
    """tiny-sd3's T5 where it does not fit: the driver converts it block by block by itself. Beside it, the
    same T5 converted whole (other seeded weights, the same graph)."""
    from sdnpu.convert import budget

    def blocks(out: Path):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(budget, "available_bytes", lambda: 20_000_000)  # 20 MB: the T5's 17.5 MB are over half
            return convert("tiny-sd3", "text_encoder_3", out=out)

    result = once(tmp_path_factory, "t5-blockwise", blocks)
    whole = once(tmp_path_factory, "t5-whole", lambda out: convert("tiny-sd3", "text_encoder_3", out=out))
    return result, whole


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory):
    """tiny-sd3's T5 as transformers' save_pretrained writes it (one module's folder, safetensors)."""
    from sdnpu.convert import resolve_source

    def make(root: Path) -> Path:
        resolve_source("tiny-sd3").load_module("text_encoder_3").save_pretrained(root / "t5")
        return root / "t5"

    return once(tmp_path_factory, "t5-folder", make)


def test_a_t5_that_does_not_fit_converts_block_by_block_and_matches_the_module(blockwise_preset):
    from sdnpu.convert.blockwise import whole_module
    from sdnpu.formats import weights as provenance

    blockwise_preset, _ = blockwise_preset
    out = blockwise_preset.out / "text_encoder_3"
    export = json.loads((out / "export.json").read_text())
    assert export["blockwise"] and export["check"]["max_rel_error"] < 1e-5
    module = whole_module(blockwise_preset.source, "text_encoder_3")
    with torch.no_grad():
        ref = module(torch.from_numpy(IDS)).last_hidden_state.numpy()
    fp32, dd = _outputs(blockwise_preset.out)
    np.testing.assert_allclose(fp32, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    cos = float(dd.ravel() @ fp32.ravel() / np.linalg.norm(dd) / np.linalg.norm(fp32))
    assert cos > 0.9999, cos  # measured 0.99998 (bf16 dispatch ops)
    for graph in (out / "model.onnx", out / "dd" / "replaced.onnx"):
        onnx.checker.check_model(str(graph), full_check=True)
    # every weight of the stitched dispatch model replays from the stitched fp32 graph's constants
    import onnx_ir as ir

    record = provenance.read_record(out / "dd" / provenance.FILE)
    counts, problems = provenance.check_replay(record["weights"], ir.load(out / "dd" / "replaced.onnx").graph,
                                               provenance.constant_reader(ir.load(out / "model.onnx")))
    assert not problems and counts["replayed"] > 0, problems[:5]


def test_the_stitched_dispatch_model_is_what_the_whole_graph_compiles_to(blockwise_preset):
    """The same dispatch ops, CPU nodes and NPU regions as the whole graph's compile (other seeded weights, the
    same graph): the casts between the blocks went, the regions met."""
    by_block, at_once = blockwise_preset
    stitched = json.loads((by_block.out / "text_encoder_3" / "dd" / "report.json").read_text())
    whole = json.loads((at_once.out / "text_encoder_3" / "dd" / "report.json").read_text())
    assert stitched["offloaded_by_type"] == whole["offloaded_by_type"]
    for key in ("offloaded_nodes", "cpu_nodes", "npu_regions", "macs_offloaded_share"):
        assert stitched["summary"][key] == whole["summary"][key], key
    assert sorted(n["op_type"] for n in stitched["cpu_nodes"]) == sorted(n["op_type"] for n in whole["cpu_nodes"])
    assert "stitch" in {p["name"] for p in stitched["passes"]}


def test_a_local_t5_folder_converts_block_by_block_as_it_does_whole(t5_folder, tmp_path, caplog):
    """A save_pretrained folder's T5 read tensor by tensor (--blockwise): the stitched graph computes what
    transformers' own T5EncoderModel computes from those files, and what the whole export computes."""
    from transformers import T5EncoderModel

    with caplog.at_level(logging.INFO):
        convert(t5_folder, "text_encoder_3", out=tmp_path / "b", blockwise=True)
    assert "converting it block by block" in caplog.text
    convert(t5_folder, "text_encoder_3", out=tmp_path / "w")
    module = T5EncoderModel.from_pretrained(t5_folder).eval()
    with torch.no_grad():
        ref = module(torch.from_numpy(IDS)).last_hidden_state.numpy()
    (b32, bdd), (w32, wdd) = _outputs(tmp_path / "b"), _outputs(tmp_path / "w")
    scale = np.abs(ref).max()
    np.testing.assert_allclose(b32, ref, rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(b32, w32, rtol=0, atol=1e-5 * scale)
    # the dispatch models: both bf16, so apart by bf16 rounding of different op orders at most
    assert np.abs(bdd - wdd).max() < 0.02 * scale


def _piece(folder, first: bool, last: bool, w: np.ndarray, shared: np.ndarray):
    """x -> (x @ w) * shared: a chained piece with its weights in an external data file."""
    from onnx import TensorProto, helper, numpy_helper

    x = "input" if first else "hidden_states"
    y = "y" if last else "block_output"
    nodes = [helper.make_node("MatMul", [x, "w"], ["h"]), helper.make_node("Mul", ["h", "shared"], [y])]
    graph = helper.make_graph(nodes, "p", [helper.make_tensor_value_info(x, TensorProto.FLOAT, [2, 32])],
                              [helper.make_tensor_value_info(y, TensorProto.FLOAT, [2, 32])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(shared, "shared")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    folder.mkdir()
    onnx.save(model, str(folder / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="model.onnx.data", size_threshold=0)
    return folder / "model.onnx"


def test_stitching_copies_external_weights_keeps_repeats_once_and_consumes_the_pieces(tmp_path):
    from sdnpu.convert.stitch import stitch

    rng = np.random.default_rng(0)
    shared = rng.standard_normal(32).astype(np.float32)  # 128 bytes: inline in the stitched graph
    ws = [rng.standard_normal((32, 32)).astype(np.float32) for _ in range(3)]  # 4 kB each: in its data file
    parts = [_piece(tmp_path / f"p{i}", i == 0, i == 2, w, shared) for i, w in enumerate(ws)]
    x = rng.standard_normal((2, 32)).astype(np.float32)
    want = x
    for w in ws:
        want = (want @ w) * shared
    stats = stitch(parts, tmp_path / "model.onnx", "hidden_states", consume=True)
    assert stats.pieces == 3 and stats.deduplicated == 2 and stats.initializers == 4
    assert not any(p.exists() or (p.parent / "model.onnx.data").exists() for p in parts)
    stitched = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)
    external = {t.name for t in stitched.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    assert external == {"b0/w", "b1/w", "b2/w"} and stats.data_bytes >= 3 * 4096
    onnx.checker.check_model(str(tmp_path / "model.onnx"), full_check=True)
    got = run_onnx(tmp_path / "model.onnx", {"input": x})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_block_by_block_needs_safetensors_and_says_so(t5_folder, tmp_path):
    """A T5 folder with .bin weights cannot be read a tensor at a time: one line naming the folder and the fix,
    and nothing written."""
    import shutil

    from transformers import T5EncoderModel

    from sdnpu.errors import SdnpuError

    folder = tmp_path / "t5-bin"
    T5EncoderModel.from_pretrained(t5_folder).save_pretrained(folder, safe_serialization=False)
    assert not list(folder.glob("*.safetensors"))
    out = tmp_path / "out"
    with pytest.raises(SdnpuError, match="has no .safetensors weights") as e:
        convert(folder, "text_encoder_3", out=out, blockwise=True)
    assert "safe_serialization" in (e.value.hint or "")
    assert not any(out.rglob("*.onnx"))
    shutil.rmtree(folder)


def test_a_stopped_block_by_block_run_goes_on_after_its_finished_pieces(blockwise_preset, tmp_path, monkeypatch,
                                                                        caplog):
    """Stopped in its second piece (Ctrl-C), the run keeps the first beside the component's folder and the same
    command goes on after it: the graphs are the ones an unstopped run writes, byte for byte. A run with other
    options starts again, as does one whose state this user's key did not sign; a finished run leaves nothing."""
    from sdnpu.convert import ConvertOptions, blockwise
    from sdnpu.convert.blockwise import driver

    done: list[int] = []
    real = driver._piece

    def piece(run, p):
        if p.i == 1 and stop[0]:
            stop[0] = False
            raise KeyboardInterrupt
        real(run, p)
        done.append(p.i)

    monkeypatch.setattr(driver, "_piece", piece)
    from sdnpu.convert.blockwise import state

    monkeypatch.setattr(state, "KEY", tmp_path / "home" / "state.key")  # this test's own user key
    work = tmp_path / ".text_encoder_3.pieces"
    options = ConvertOptions(blockwise=True)
    stop = [True]
    with pytest.raises(KeyboardInterrupt):
        convert("tiny-sd3", "text_encoder_3", out=tmp_path, options=options)
    assert done == [0] and (work / blockwise.STATE).is_file() and not (tmp_path / "text_encoder_3").exists()
    with caplog.at_level(logging.INFO, logger="sdnpu"):
        convert("tiny-sd3", "text_encoder_3", out=tmp_path, options=options)
    assert done == [0, 1] and "going on after the 1 pieces" in caplog.text and not work.exists()
    by_block, _ = blockwise_preset
    for f in ("model.onnx", "model.onnx.data", "dd/replaced.onnx"):
        a, b = tmp_path / "text_encoder_3" / f, by_block.out / "text_encoder_3" / f
        assert a.read_bytes() == b.read_bytes(), f

    stop[0], done[:] = True, []
    with pytest.raises(KeyboardInterrupt):
        convert("tiny-sd3", "text_encoder_3", out=tmp_path, options=options)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sdnpu"):
        convert("tiny-sd3", "text_encoder_3", out=tmp_path, options=ConvertOptions(blockwise=True, check=False))
    assert done == [0, 0, 1] and "another conversion's: starting again" in caplog.text and not work.exists()

    stop[0], done[:] = True, []  # a state this user's key did not sign is not read (a pickle runs code)
    with pytest.raises(KeyboardInterrupt):
        convert("tiny-sd3", "text_encoder_3", out=tmp_path, options=options)
    blob = bytearray((work / blockwise.STATE).read_bytes())
    blob[-1] ^= 1
    (work / blockwise.STATE).write_bytes(bytes(blob))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sdnpu"):
        convert("tiny-sd3", "text_encoder_3", out=tmp_path, options=options)
    assert done == [0, 0, 1] and "not signed by this user's sdnpu" in caplog.text


def test_the_disk_check_counts_what_a_stopped_run_already_wrote(tmp_path, monkeypatch):
    """A conversion is refused before any work where its folder would not fit on the disk; a block-by-block run
    that goes on after a stopped one needs that much less (its finished pieces are on the disk already)."""
    import shutil
    from collections import namedtuple

    from sdnpu.convert import budget
    from sdnpu.errors import SdnpuError

    plan = budget.Budget({"text_encoder_3": 100_000_000}, by_block={"text_encoder_3"})  # 150 MB to write
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _where: usage(0, 0, 120_000_000))
    with pytest.raises(SdnpuError, match=r"text_encoder_3 need about 0.15 GB on disk and .* has 0.12 GB free"):
        budget.check_disk(plan, ["text_encoder_3"], tmp_path)
    pieces = tmp_path / ".text_encoder_3.pieces" / "piece000"
    pieces.mkdir(parents=True)
    (pieces / "model.onnx.data").write_bytes(b"\0" * 40_000_000)
    budget.check_disk(plan, ["text_encoder_3"], tmp_path)  # 110 MB still to write
