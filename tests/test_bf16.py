"""The graph rounded to bf16 op by op (``sdnpu.reports.bf16``): what it rounds, what it keeps in fp32 as every
bf16 run of the module does (the timestep sinusoid's argument), and where it says bf16's error grows."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from diffusers.models.embeddings import Timesteps

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


class _TimeEmbedding(torch.nn.Module):
    """Kandinsky 3's time projection (the timestep expanded to the sample's batch, diffusers' Timesteps with
    downscale_freq_shift=1), then a linear layer added to the sample."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = Timesteps(16, flip_sin_to_cos=False, downscale_freq_shift=1)
        self.linear = torch.nn.Linear(16, 8)

    def forward(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.proj(t.expand(x.shape[0]))) + x


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_the_exported_timestep_sinusoids_argument_stays_fp32(exporter, tmp_path):
    """As torch's exporters write it (TorchScript expands the timestep to the batch through Where / Equal /
    ConstantOfShape first): the argument and the timestep stay fp32, and the rounding departs at no Sin or Cos."""
    module = _TimeEmbedding().eval()
    t, x = torch.tensor([500.0]), torch.zeros(1, 8)
    path = tmp_path / "m.onnx"
    with torch.no_grad():
        if exporter == "dynamo":
            torch.onnx.export(module, (t, x), dynamo=True, opset_version=18, input_names=["t", "x"],
                              output_names=["y"], verbose=False, report=False).save(str(path))
        else:
            torch.onnx.export(module, (t, x), str(path), dynamo=False, opset_version=17, input_names=["t", "x"],
                              output_names=["y"])
    m = onnx.load(str(path))
    trig = [node for node in m.graph.node if node.op_type in ("Sin", "Cos")]
    assert trig and all(node.input[0] in fp32_arguments(m) for node in trig) and "t" in fp32_arguments(m)
    feeds = {"t": t.numpy(), "x": x.numpy()}
    result = measure(m, feeds, {"y": run(m, feeds)[0]}, threshold=0.9999)
    assert not {d["op_type"] for d in result["departures"]} & {"Sin", "Cos"}, result
