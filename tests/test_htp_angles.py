"""Sinusoids' angles reduced exactly (``sdnpu.passes.htp.angles``) on small graphs, as op counts, onnx's full check
and onnxruntime's numbers before and after (fp32: every rewrite is exact or changes float32's last bits); then the
drift it avoids, on Qualcomm's compiler and its HTP emulator (onnxruntime-qnn)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from sdnpu.passes import htp

from .graphs import model, ops, run, to_ir, to_proto
from .htp_graphs import on_htp


def timestep_embedding(t: float) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """diffusers' get_timestep_embedding as exported, with Flux's scale: t * 1000, a column, times 8 frequencies
    (10000^(-i/8)), then Cos and Sin concatenated."""
    freqs = np.exp(-np.log(10000.0) * np.arange(8) / 8).astype(np.float32)
    nodes = [helper.make_node("Mul", ["t", "thousand"], ["scaled"]),
             helper.make_node("Unsqueeze", ["scaled", "last"], ["col"]),
             helper.make_node("Mul", ["col", "freqs"], ["angles"]),
             helper.make_node("Cos", ["angles"], ["c"]), helper.make_node("Sin", ["angles"], ["s"]),
             helper.make_node("Concat", ["c", "s"], ["y"], axis=-1)]
    m = model(nodes, {"t": [2]}, {"y": None}, {"thousand": np.float32(1000.0), "last": np.asarray([1], np.int64),
                                               "freqs": freqs})
    return m, {"t": np.asarray([t, 0.25], np.float32)}


def test_sinusoids_are_reduced_exactly_in_float32():
    m, feeds = timestep_embedding(0.987)
    after = to_ir(m)
    assert htp.reduce_angles_exactly(after).counts["sin/cos of x * W reduced exactly"] == 1
    proto = to_proto(after)
    onnx.checker.check_model(proto, full_check=True)
    assert ops(proto)["Sin"] == 1 and ops(proto)["Cos"] == 1 and ops(proto)["Gather"] == 6
    # float32 reference: angles up to 987 rad, each float32-rounded (a few 1e-5 rad); the rewrite reads them from
    # float64 tables, so it is the closer of the two to the exact values
    angles = np.float64(feeds["t"])[:, None] * 1000 * np.exp(-np.log(10000.0) * np.arange(8) / 8)
    exact = np.concatenate([np.cos(angles), np.sin(angles)], axis=-1)
    ours, theirs = run(proto, feeds)[0], run(m, feeds)[0]
    assert np.abs(ours - exact).max() <= np.abs(theirs - exact).max() + 1e-6
    assert np.abs(ours - exact).max() < 1e-4


def test_negative_angles_are_reduced_exactly_too():
    """Positions and offsets can be negative: the digits are taken of |x| and the sign put back on the sine (a
    negative x's fraction x - floor(x) is not exact in fp16; the fp32 check: the same values as before)."""
    m, _ = timestep_embedding(0.0)
    after = to_ir(m)
    assert htp.reduce_angles_exactly(after).counts["sin/cos of x * W reduced exactly"] == 1
    feeds = {"t": np.asarray([-0.987, -0.13], np.float32)}
    angles = np.float64(feeds["t"])[:, None] * 1000 * np.exp(-np.log(10000.0) * np.arange(8) / 8)
    exact = np.concatenate([np.cos(angles), np.sin(angles)], axis=-1)
    assert np.abs(run(to_proto(after), feeds)[0] - exact).max() < 1e-4


def test_a_scale_after_the_frequencies_is_folded_too():
    """diffusers' get_timestep_embedding(scale=1000) (AuraFlow) scales the product, not the timestep."""
    freqs = np.exp(-np.log(10000.0) * np.arange(8) / 8).astype(np.float32)
    nodes = [helper.make_node("Unsqueeze", ["t", "last"], ["col"]),
             helper.make_node("Mul", ["col", "freqs"], ["product"]),
             helper.make_node("Mul", ["product", "thousand"], ["angles"]),
             helper.make_node("Sin", ["angles"], ["y"])]
    m = model(nodes, {"t": [2]}, {"y": None}, {"thousand": np.float32(1000.0), "last": np.asarray([1], np.int64),
                                               "freqs": freqs})
    after = to_ir(m)
    assert htp.reduce_angles_exactly(after).counts["sin/cos of x * W reduced exactly"] == 1
    feeds = {"t": np.asarray([0.987, 0.25], np.float32)}
    np.testing.assert_allclose(run(to_proto(after), feeds)[0], run(m, feeds)[0], atol=1e-4)


# --- the fault, on Qualcomm's compiler and its emulator -----------------------------------------------------------

def test_qnn_computes_large_angles_wrong_and_their_reduction_right(tmp_path):
    """Flux.1's timestep embedding at t = 0.987 (987 rad): the HTP's fp16 product and its Sin drift; reduced
    exactly, the error is fp16's rounding of the values. The NPU reads the input in fp16 (0.987 arrives as
    0.98682: 0.18 rad at this scale, which no rewrite inside the graph can undo), so the reference is the fp32
    graph on the input as the NPU reads it."""
    m, feeds = timestep_embedding(0.987)
    ref = run(m, {k: v.astype(np.float16).astype(np.float32) for k, v in feeds.items()})[0]
    raw = on_htp(m, tmp_path / "raw.onnx", feeds)
    after = to_ir(m)
    htp.reduce_angles_exactly(after)
    fixed = on_htp(to_proto(after), tmp_path / "fixed.onnx", feeds)
    assert np.abs(raw - ref).max() > 0.05
    assert np.abs(fixed - ref).max() < 0.01
