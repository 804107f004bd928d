"""Cutting a graph into pieces by weight (``sdnpu.convert.split``), for a vendor compiler that limits what one
compiled unit holds (QNN: one context). On onnxruntime's CPU provider: the pieces, run one after another, compute
what the whole graph computes, bit for bit. QNN's compile of the pieces, chained in one model, is in test_qnn.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper

from sdnpu.convert import split
from sdnpu.errors import SdnpuError


def _session(path: Path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the same kernels, whole or cut
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _feeds(sess: ort.InferenceSession) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for i in sess.get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in i.shape]
        out[i.name] = (rng.integers(0, 100, shape).astype(np.int64) if "int64" in i.type
                       else rng.standard_normal(shape).astype(np.float32))
    return out


def _weights(model: onnx.ModelProto) -> int:
    return sum(split.weight_bytes(t, 2) for t in model.graph.initializer)


@pytest.mark.parametrize(("component", "share"), [("unet", 0.3), ("unet", 0.55), ("vae_decoder", 0.3),
                                                   ("text_encoder_2", 0.98)])
def test_the_pieces_run_one_after_another_compute_the_graph(tiny_conversion, tmp_path, component, share):
    """A real export, cut at several limits: the UNet's skip connections cross its cuts, the text encoder's token
    table outweighs the rest of it (the even cut has no room; the pieces fill up instead)."""
    source = tiny_conversion.out / component / "model.onnx"
    model = onnx.shape_inference.infer_shapes(onnx.load(str(source), load_external_data=False))
    limit = int(_weights(model) * share)
    pieces = split.plan(model, limit)
    assert len(pieces) >= 2 and all(p.weight_bytes <= limit for p in pieces)
    assert [(p.start, p.end) for p in pieces] == list(zip([0, *(p.end for p in pieces[:-1])],
                                                          [p.end for p in pieces]))
    assert pieces[-1].end == len(model.graph.node)
    whole = _session(source)
    feeds = _feeds(whole)
    expected = dict(zip([o.name for o in whole.get_outputs()], whole.run(None, feeds), strict=True))
    values = dict(feeds)
    for p in pieces:
        path = source.parent / f"piece-test{p.index}.onnx"  # beside the graph: its weights stay where they are
        try:
            split.write_piece(model, p, path)
            onnx.checker.check_model(str(path), full_check=True)
            sess = _session(path)
            assert [i.name for i in sess.get_inputs()] == list(p.inputs)
            values.update(zip(p.outputs, sess.run(list(p.outputs), {k: values[k] for k in p.inputs}), strict=True))
        finally:
            path.unlink(missing_ok=True)
    for name, want in expected.items():
        np.testing.assert_array_equal(values[name], want, err_msg=name)


def test_a_piece_halved_still_computes_the_graph(tiny_conversion):
    """What the compile does with a piece QNN cannot fit in the HTP's memory: cut in two near its weight's middle,
    where the fewest bytes cross; the three pieces chained compute the UNet."""
    source = tiny_conversion.out / "unet" / "model.onnx"
    model = onnx.shape_inference.infer_shapes(onnx.load(str(source), load_external_data=False))
    first, second = split.plan(model, int(_weights(model) * 0.55))
    a, b = split.halve(model, first)
    assert (a.start, a.end, b.start, b.end) == (first.start, a.end, a.end, first.end) and a.start < a.end < b.end
    assert abs(a.weight_bytes - b.weight_bytes) < 0.5 * first.weight_bytes
    whole = _session(source)
    feeds = _feeds(whole)
    values = dict(feeds)
    for i, p in enumerate([a, b, second]):
        path = source.parent / f"piece-half{i}.onnx"
        try:
            split.write_piece(model, p, path)
            sess = _session(path)
            values.update(zip(p.outputs, sess.run(list(p.outputs), {k: values[k] for k in p.inputs}), strict=True))
        finally:
            path.unlink(missing_ok=True)
    np.testing.assert_array_equal(values["out_sample"], whole.run(["out_sample"], feeds)[0])


def test_a_piece_halved_for_this_machines_memory_is_cut_by_its_activations(tiny_conversion):
    """Where QNN's compile ran out of this machine's memory (which grows with the activations, not the weights),
    the piece is cut near the middle of the activation bytes its nodes write: on a UNet, whose weights sit in its
    low-resolution middle and whose large activations at its ends, another cut than the weight's."""
    source = tiny_conversion.out / "unet" / "model.onnx"
    model = onnx.shape_inference.infer_shapes(onnx.load(str(source), load_external_data=False))
    whole = split.piece_of(model, 0, len(model.graph.node))
    lay = split._layout(model, 2)
    by_weight = split.halve(model, whole)
    by_activations = split.halve(model, whole, by="activations")
    assert by_weight[0].end != by_activations[0].end
    written = lay.written.sum()
    share = lay.written[:by_activations[0].end].sum() / written
    assert 0.4 < share < 0.6 and abs(share - 0.5) < abs(lay.written[:by_weight[0].end].sum() / written - 0.5)


def test_a_graph_within_the_limit_is_one_piece(tiny_conversion):
    model = onnx.load(str(tiny_conversion.out / "vae_decoder" / "model.onnx"), load_external_data=False)
    (piece,) = split.plan(model, _weights(model))
    assert (piece.start, piece.end) == (0, len(model.graph.node))


def _chain(widths: list[int], skip: bool = False) -> onnx.ModelProto:
    """x [1, 64] through MatMuls of the given output widths, each followed by a Relu; with ``skip``, the first
    Relu's output is added back after the last MatMul (a skip connection every cut before it carries)."""
    rng = np.random.default_rng(0)
    nodes, inits, prev, width = [], [], "x", 64
    for i, w in enumerate(widths):
        inits.append(onnx.numpy_helper.from_array(rng.standard_normal((width, w)).astype(np.float32), f"w{i}"))
        nodes += [helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"]),
                  helper.make_node("Relu", [f"m{i}"], [f"r{i}"])]
        prev, width = f"r{i}", w
    if skip:
        nodes.append(helper.make_node("Add", [prev, "r0"], ["y"]))
        prev = "y"
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", T.FLOAT, [1, 64])],
                          [helper.make_tensor_value_info(prev, T.FLOAT, [1, width])], initializer=inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def test_a_cut_goes_where_the_fewest_bytes_cross():
    """Four equal MatMuls cut in two: between the second and the third, after the Relu or before it (the same
    bytes), and the skip connection is carried across as a second value."""
    model = _chain([64, 64, 64, 64], skip=True)
    first, second = split.plan(model, int(_weights(model) * 0.6))
    assert first.end in (3, 4)  # MatMul, Relu, MatMul | (Relu |) MatMul, Relu, ...
    assert set(first.outputs) == {"r0", model.graph.node[first.end - 1].output[0]}
    assert set(second.inputs) == set(first.outputs)


def test_one_node_heavier_than_the_limit_is_a_clear_error():
    model = _chain([64, 4096])
    with pytest.raises(SdnpuError, match=r"node .* \(MatMul\) alone holds 0.52 MB of weights, more than one"):
        split.plan(model, int(_weights(model) * 0.9))


def test_a_constant_is_copied_into_the_piece_that_reads_it_not_carried(tmp_path):
    model = _chain([64, 64, 64, 64])
    g = model.graph
    g.node.insert(0, helper.make_node("Constant", [], ["c"], value=onnx.numpy_helper.from_array(
        np.full((1, 64), 0.5, np.float32))))
    last = g.node[-1]
    g.node[-1].CopyFrom(helper.make_node("Relu", [last.input[0]], ["pre"]))
    g.node.append(helper.make_node("Add", ["pre", "c"], [g.output[0].name]))
    model = onnx.shape_inference.infer_shapes(model)
    pieces = split.plan(model, int(_weights(model) * 0.6))
    assert len(pieces) == 2 and all("c" not in p.inputs and "c" not in p.outputs for p in pieces)
    path = tmp_path / "last.onnx"
    split.write_piece(model, pieces[-1], path)
    assert "Constant" in {n.op_type for n in onnx.load(str(path)).graph.node}


def _fake_compiles(monkeypatch, tmp_path: Path, fits: int, died: int | None, message: str = ""):
    """``sdnpu.convert.standard``'s worker replaced by a vendor compile that has room for at most ``fits`` nodes:
    past it, the worker dies with ``died`` (-9: the kernel's out-of-memory killer) or the vendor says
    ``message``. Each compile the fake takes runs the piece it was given on onnxruntime's CPU provider."""
    from sdnpu.convert import standard
    from sdnpu.worker import WorkerDied

    calls: list[tuple[str, int]] = []

    def fake(fn, model, out_dir, arch, stem, *, what):
        n = len(onnx.load(str(model), load_external_data=False).graph.node)
        calls.append((stem, n))
        if n > fits:
            if died is not None:
                raise WorkerDied(f"the worker process {what} died (exit code {died})", None, died)
            raise SdnpuError(message)
        dest = Path(out_dir) / f"{stem}.onnx"
        onnx.save(onnx.load(str(model)), str(dest))  # stands for the vendor's context: the piece itself
        return dest

    monkeypatch.setattr(standard, "run_in_worker", fake)
    return calls


@pytest.mark.parametrize(("died", "message"), [(-9, ""), (None, "QNN_COMMON_ERROR_MEM_ALLOC (1002)")])
def test_a_unit_the_compile_has_no_room_for_is_cut_in_two_until_it_fits(monkeypatch, tmp_path, died, message):
    """The compile's process killed (this machine's memory) or QNN's own out-of-memory error: the unit is cut in
    two and compiled again, until each piece fits; the pieces, in order, compute the graph."""
    from sdnpu.backends import qnn_htp
    from sdnpu.convert import standard

    model = _chain([64] * 8, skip=True)
    source = tmp_path / "model.onnx"
    onnx.save(model, str(source), save_as_external_data=True, all_tensors_to_one_file=True, location="model.data",
              size_threshold=0)
    calls = _fake_compiles(monkeypatch, tmp_path, fits=5, died=died, message=message)
    out = tmp_path / "out"
    out.mkdir()
    parts, pieces, structure = standard.compile_pieces(source, out, "chain", qnn_htp, qnn_htp.parse_arch(None), None)
    assert calls[0] == ("ctx", 17) and pieces is not None and len(parts) == len(pieces) >= 4
    assert all(p.end - p.start <= 5 for p in pieces)
    assert [(p.start, p.end) for p in pieces] == list(zip([0, *(p.end for p in pieces[:-1])],
                                                          [p.end for p in pieces]))
    assert not list(tmp_path.glob(".model.piece*"))  # the pieces' files go once compiled
    values = {"x": np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)}
    expected = _session(source).run(None, values)[0]
    for part in parts:
        sess = _session(part)
        values.update(zip([o.name for o in sess.get_outputs()],
                          sess.run(None, {i.name: values[i.name] for i in sess.get_inputs()}), strict=True))
    np.testing.assert_array_equal(values[model.graph.output[0].name], expected)


def test_a_compile_that_fails_otherwise_is_not_cut(monkeypatch, tmp_path):
    from sdnpu.backends import qnn_htp
    from sdnpu.convert import standard

    source = tmp_path / "model.onnx"
    onnx.save(_chain([64] * 4), str(source))
    calls = _fake_compiles(monkeypatch, tmp_path, fits=2, died=-6)
    with pytest.raises(SdnpuError, match=r"died \(exit code -6\)"):
        standard.compile_pieces(source, tmp_path, "chain", qnn_htp, qnn_htp.parse_arch(None), None)
    assert len(calls) == 1


def test_a_compile_in_pieces_that_stops_goes_on_after_the_pieces_it_finished(monkeypatch, tmp_path):
    """A compile in pieces stopped in its fourth compile (Ctrl-C, after a unit was cut in two for memory) keeps its
    plan and finished units in ``keep``: the same compile again compiles only the pieces not done (not the whole
    graph, not the unit that was cut), and the pieces it hands back compute the graph. Once the caller drops the
    folder, nothing is left."""
    from sdnpu.backends import qnn_htp
    from sdnpu.convert import kept, standard
    from sdnpu.worker import WorkerDied

    model = _chain([64] * 8, skip=True)
    source = tmp_path / "model.onnx"
    onnx.save(model, str(source), save_as_external_data=True, all_tensors_to_one_file=True, location="model.data",
              size_threshold=0)
    calls: list[int] = []
    stop_at: list[int] = [4]

    def fake(fn, model_path, out_dir, arch, stem, *, what):
        n = len(onnx.load(str(model_path), load_external_data=False).graph.node)
        calls.append(n)
        if len(calls) == stop_at[0]:
            raise KeyboardInterrupt
        if n > 5:
            raise WorkerDied(f"the worker process {what} died (exit code -9)", None, -9)
        dest = Path(out_dir) / f"{stem}.onnx"
        onnx.save(onnx.load(str(model_path)), str(dest))
        return qnn_htp.Compiled(whole=True, context=dest, binaries=[], trace={"supported_nodes": n}, seconds=1.0)

    monkeypatch.setattr(standard, "run_in_worker", fake)
    units = tmp_path / ".out.units"
    first = tmp_path / "first"
    first.mkdir()
    with pytest.raises(KeyboardInterrupt):
        standard.compile_pieces(source, first, "chain", qnn_htp, qnn_htp.parse_arch(None), None, keep=units)
    assert calls[0] == 17  # the whole graph, killed
    record = kept.Kept.open(units, lambda: "", "chain")  # another fingerprint: it starts again
    assert record.units == {} and record.plan == [] and not units.exists()
    # again, interrupted the same way, then the same command with nothing in its way
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        standard.compile_pieces(source, first, "chain", qnn_htp, qnn_htp.parse_arch(None), None, keep=units)
    done_before = sum(1 for n in calls[:-1] if n <= 5)
    assert done_before >= 1
    calls.clear()
    stop_at[0] = 0
    second = tmp_path / "second"
    second.mkdir()
    parts, pieces, _ = standard.compile_pieces(source, second, "chain", qnn_htp, qnn_htp.parse_arch(None), None,
                                               keep=units)
    compiled = [n for n in calls if n <= 5]  # the others were killed and cut
    assert 17 not in calls and len(compiled) == len(pieces) - done_before  # only the pieces not done
    assert [(p.start, p.end) for p in pieces] == list(zip([0, *(p.end for p in pieces[:-1])],
                                                          [p.end for p in pieces]))
    values = {"x": np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)}
    expected = _session(source).run(None, values)[0]
    for part in parts:
        sess = _session(part.context)
        values.update(zip([o.name for o in sess.get_outputs()],
                          sess.run(None, {i.name: values[i.name] for i in sess.get_inputs()}), strict=True))
    np.testing.assert_array_equal(values[model.graph.output[0].name], expected)
    kept.Kept(units).drop()
    assert not units.exists()


def test_a_kept_unit_naming_a_file_outside_its_folder_is_not_read(tmp_path):
    """units.json is read back as data: a unit whose context or files are not plain files of the folder (a record
    planted or torn) is dropped, and its piece compiled again."""
    import json

    from sdnpu.convert import kept

    units = tmp_path / ".out.units"
    record = kept.Kept(units, "fp", [(0, 3), (3, 5)])
    (tmp_path / "outside.onnx").write_bytes(b"x")
    units.mkdir()
    (units / "ctx1.onnx").write_bytes(b"x")
    record.units = {"0:3": {"context": "ctx1.onnx", "binaries": [], "files": ["ctx1.onnx"]},
                    "3:5": {"context": "../outside.onnx", "binaries": [], "files": ["ctx1.onnx"]}}
    record.save()
    assert json.loads((units / kept.STATE).read_text())["plan"] == [[0, 3], [3, 5]]
    again = kept.Kept.open(units, lambda: "fp", "chain")
    assert again.plan == [(0, 3), (3, 5)] and set(again.units) == {"0:3"}
