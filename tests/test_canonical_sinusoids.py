"""Sinusoids (``sdnpu.passes.canonical.sinusoids``) on tiny graphs: the flipped halves reordered (bit for bit),
Sin and Cos of one argument as one Sin with a phase (within the fp32 rounding of the argument), several inputs'
chains as one (bit for bit); each result passes onnx's full check, and each near miss stays as it was."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from sdnpu.passes.canonical import sinusoids
from sdnpu.passes.canonical.driver import sweep
from sdnpu.passes.pipeline import canonicalize

from .graphs import model, ops, rewritten, run, to_ir, to_proto

HALF = 4
FREQS = np.exp(-np.log(10000) * np.arange(HALF) / HALF).astype(np.float32)[None]  # [1, 4]: at most 1


def n(op: str, ins: list[str], outs: list[str], **attrs) -> onnx.NodeProto:
    return helper.make_node(op, ins, outs, **attrs)


def embedding(flip: bool, slice_at: int = HALF, freqs: np.ndarray = FREQS, both_const: bool = True) -> onnx.ModelProto:
    """diffusers' get_timestep_embedding as dynamo writes it: Concat(Sin(t f), Cos(t f)) and, with ``flip``,
    its halves swapped by two Slices and a Concat (flip_sin_to_cos)."""
    nodes = [n("Mul", ["t", "f"], ["a"]), n("Sin", ["a"], ["s"]), n("Cos", ["a"], ["c"]),
             n("Concat", ["s", "c"], ["e" if flip else "y"], axis=-1)]
    inits = {"f": freqs}
    inputs = {"t": [2, 1]}
    if not both_const:  # the frequencies an input: no constant to scale
        del inits["f"]
        inputs["f"] = [1, HALF]
    if flip:
        nodes += [n("Slice", ["e", "h0", "h1", "ax"], ["e2"]), n("Slice", ["e", "z", "h0", "ax"], ["e1"]),
                  n("Concat", ["e2", "e1"], ["y"], axis=-1)]
        inits |= {"h0": np.array([slice_at]), "h1": np.array([2 * HALF]), "z": np.array([0]), "ax": np.array([-1])}
    return model(nodes, inputs, {"y": [2, 2 * HALF]}, inits)


@pytest.mark.parametrize(("slice_at", "fires"), [(HALF, True), (HALF - 1, False)])
def test_the_flipped_halves_are_the_parts_reordered(slice_at, fires):
    """Concat(Slice(C, h:), Slice(C, :h)) of C = Concat(Sin, Cos) is Concat(Cos, Sin); near miss: the Slices
    cut elsewhere than between the parts."""
    irm, counts = rewritten(embedding(True, slice_at), sinusoids.unflip_concat, sweep)
    assert counts["sin/cos halves reordered"] == int(fires)
    assert ops(irm)["Slice"] == (0 if fires else 2) and ops(irm)["Concat"] == (1 if fires else 2)


def _ulps_of_the_argument(t: np.ndarray) -> float:
    """sin(a + pi/2) for cos(a): the argument a = t f and a + phase each rounded to fp32, half an ulp of |a|
    (and of |a| + pi/2) each; the sine moves by as much. In units of fp32's eps at the output's scale (1)."""
    a = float(np.abs(t).max() * FREQS.max())
    return (a + np.pi / 2) + 2


@pytest.mark.parametrize("flip", [False, True])
def test_sin_and_cos_of_one_argument_are_one_sin_with_a_phase(flip):
    t = {"t": np.array([[3.5], [-1.25]], np.float32)}
    # (the flipped graph's first Concat, left unread by unflip, swept: the pipeline rewrites it too, then sweeps)
    steps = ((sinusoids.unflip_concat, sweep, sinusoids.merge_sinusoids, sweep) if flip
             else (sinusoids.merge_sinusoids, sweep))
    irm, counts = rewritten(embedding(flip), *steps, feeds=t, ulps=_ulps_of_the_argument(t["t"]))
    assert counts["sinusoids -> one Sin"] == 1 and dict(ops(irm)) == {"Mul": 1, "Add": 1, "Sin": 1}


def test_sin_and_cos_of_frequencies_that_are_no_constant_stay():
    m = embedding(False, both_const=False)
    irm, counts = rewritten(m, sinusoids.merge_sinusoids, sweep, feeds={"t": np.ones((2, 1), np.float32),
                                                              "f": FREQS.copy()})
    assert counts["sinusoids -> one Sin"] == 0 and ops(irm)["Cos"] == 1


def test_the_sinusoidal_embedding_is_one_sin_with_a_phase():
    """diffusers' get_timestep_embedding (flip_sin_to_cos) as dynamo writes it, through all the canonical steps:
    Sin, Cos, Concat, two Slices and a Concat become Mul, Add, Sin; the numbers stay within fp32 rounding of
    arguments up to 1000 rad."""
    half = 8
    freqs = np.exp(-np.log(10000) * np.arange(half) / half).astype(np.float32)[None]
    m = model([n("Mul", ["t", "f"], ["a"]), n("Sin", ["a"], ["s"]), n("Cos", ["a"], ["c"]),
               n("Concat", ["s", "c"], ["e"], axis=-1), n("Slice", ["e", "h0", "h1", "ax"], ["e2"]),
               n("Slice", ["e", "z", "h0", "ax"], ["e1"]), n("Concat", ["e2", "e1"], ["y"], axis=-1)],
              {"t": [2, 1]}, {"y": [2, 2 * half]},
              {"f": freqs, "h0": np.array([half]), "h1": np.array([2 * half]), "z": np.array([0]),
               "ax": np.array([-1])})
    irm = to_ir(m)
    canonicalize(irm)
    assert dict(ops(irm)) == {"Mul": 1, "Add": 1, "Sin": 1}
    t = {"t": np.array([[999.0], [1.0]], np.float32)}
    np.testing.assert_allclose(run(to_proto(irm), t)[0], run(m, t)[0], atol=1e-4)


@pytest.mark.parametrize("case", ["same", "other_freqs"])
def test_size_condition_sinusoids_of_several_inputs_are_one_chain(case):
    """CogView4's original size, crop and target size: each [2, k] flattened to a column, times the
    frequencies plus the phase, Sin, viewed back as [2, k F], concatenated. The same chain once over the
    inputs' Concat, the same numbers bit for bit; near miss: one chain with other frequencies stays."""
    f, ks = 4, (2, 1, 2)
    freqs = np.linspace(0.1, 1.0, f, dtype=np.float32)[None]
    inits = {"f": freqs, "g": freqs * (2 if case == "other_freqs" else 1), "p": np.full((1, f), 0.5, np.float32)}
    nodes, parts = [], []
    for i, k in enumerate(ks):
        inits[f"s{i}"], inits[f"o{i}"] = np.array([2 * k, 1]), np.array([2, k * f])
        nodes += [n("Reshape", [f"c{i}", f"s{i}"], [f"col{i}"]),
                  n("Mul", [f"col{i}", "g" if i == 1 else "f"], [f"m{i}"]),
                  n("Add", [f"m{i}", "p"], [f"a{i}"]), n("Sin", [f"a{i}"], [f"sn{i}"]),
                  n("Reshape", [f"sn{i}", f"o{i}"], [f"r{i}"])]
        parts.append(f"r{i}")
    nodes.append(n("Concat", parts, ["y"], axis=1))
    m = model(nodes, {f"c{i}": [2, k] for i, k in enumerate(ks)}, {"y": [2, sum(ks) * f]}, inits)
    irm = to_ir(m)
    counts = canonicalize(irm).counts
    assert counts["parallel column chains -> one"] == (1 if case == "same" else 0)
    if case == "same":
        assert dict(ops(irm)) == {"Concat": 1, "Reshape": 2, "Mul": 1, "Add": 1, "Sin": 1}
    feeds = {f"c{i}": np.random.default_rng(i).uniform(0, 1024, (2, k)).astype(np.float32) for i, k in enumerate(ks)}
    np.testing.assert_array_equal(run(to_proto(irm), feeds)[0], run(m, feeds)[0])
    # the rewrite alone, on the graph as exported: the same count, the same numbers bit for bit, a valid graph
    _, alone = rewritten(m, sinusoids.merge_column_chains, feeds=feeds)
    assert alone["parallel column chains -> one"] == counts["parallel column chains -> one"]
