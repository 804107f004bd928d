"""The graph rounded to bf16 op by op (``sdnpu.reports.bf16``): what it rounds, what it keeps in fp32 as every
bf16 run of the module does (the timestep sinusoid's argument), and where it says bf16's error grows."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from sdnpu.reports.bf16 import fp32_arguments, measure, rounded

from .graphs import model, run
from .lowering import n, w


def sinusoid(activation_sin: bool = False):
    """diffusers' get_timestep_embedding as dynamo writes it (t[:, None] * freqs, Sin and Cos, Concat), then a
    linear layer; with ``activation_sin`` also a Sin of an activation (x @ w2), which bf16 runs round."""
    nodes = [n("Unsqueeze", ["t", "axis"], ["t1"]), n("Mul", ["t1", "freqs"], ["arg"]), n("Sin", ["arg"], ["s"]),
             n("Cos", ["arg"], ["c"]), n("Concat", ["s", "c"], ["e"], axis=-1), n("MatMul", ["e", "w"], ["y"])]
    inputs, outputs = {"t": [1]}, {"y": [1, 4]}
    half = 8  # Kandinsky 3's Timesteps (downscale_freq_shift=1): exp(-log(10000) k / (half - 1))
    inits = {"axis": np.array([1]), "w": w(2 * half, 4),
             "freqs": np.exp(-np.log(10000) * np.arange(half) / (half - 1)).astype(np.float32)[None]}
    if activation_sin:
        nodes += [n("MatMul", ["x", "w2"], ["h"]), n("Sin", ["h"], ["z"])]
        inputs["x"], outputs["z"], inits["w2"] = [1, 4], [1, 4], w(4, 4)
    return model(nodes, inputs, outputs, inits)


def test_a_timestep_sinusoids_argument_stays_fp32_and_an_activations_does_not():
    m = sinusoid(activation_sin=True)
    assert fp32_arguments(m) == {"arg", "t1", "t", "freqs", "axis"}  # not "h": an activation's Sin is rounded
    low = rounded(m)
    t = np.array([500.0], np.float32)
    x = np.random.default_rng(0).standard_normal((1, 4)).astype(np.float32)
    exact = dict(zip(["y", "z"], run(m, {"t": t, "x": x}), strict=True))
    got = dict(zip(["y", "z"], run(low, {"t": t, "x": x.astype(ml_dtypes.bfloat16).astype(np.float32)}), strict=True))
    # the sinusoid rounded once, after Sin / Cos, and the weights: a bf16 error, not a wrong angle
    np.testing.assert_allclose(got["y"], exact["y"], rtol=0.03, atol=0.03)
    assert not np.array_equal(got["z"], exact["z"])  # the activation's path is rounded


def test_the_sinusoid_is_not_where_bf16s_error_grows():
    """At t = 500, rounding t * freqs to bf16 moves the angle by up to 1 rad: the op-by-op rounding departed
    first at that Cos on Kandinsky 3's UNet, an error no bf16 run of the module (PyTorch's, sdnpu's) makes."""
    m = sinusoid()
    t = {"t": np.array([500.0], np.float32)}
    result = measure(m, t, {"y": run(m, t)[0]}, threshold=0.9999)
    assert not {d["op_type"] for d in result["departures"]} & {"Sin", "Cos", "Mul", "Concat"}, result
    assert result["min_cosine"] > 0.999, result
