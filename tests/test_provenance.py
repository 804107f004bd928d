"""dd/weights.json: every constant of a dispatch model replays, byte for byte, from the exported graph's constants
through the steps the record names (the groundwork LoRA needs: issue 12)."""

from __future__ import annotations

import copy
import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from sdnpu.errors import SdnpuError
from sdnpu.formats import weights as provenance
from tests.check_provenance import mac_weights_named, replay

COMPONENTS = ["text_encoder", "text_encoder_2", "vae_encoder", "vae_decoder", "unet"]


@pytest.mark.parametrize("component", COMPONENTS)
def test_every_dispatch_weight_replays_from_the_export(tiny_conversion, component):
    folder = tiny_conversion.out / component
    assert replay(folder / "model.onnx", folder / "dd")["replayed"] > 0
    assert mac_weights_named(folder) > 0


def test_bfp16_weights_replay(tiny_conversion, tmp_path):
    """The bfp16 step (AMD's block format, stored bf16) replays too."""
    from sdnpu.convert.compile import compile_file
    from sdnpu.passes.pipeline import CompileOptions

    source = tiny_conversion.out / "vae_decoder" / "model.onnx"
    compile_file(source, tmp_path / "dd", CompileOptions.named(precision="bfp16"), verify=False)
    record = provenance.read_record(tmp_path / "dd" / provenance.FILE)
    assert any('"bfp16"' in json.dumps(e) for e in record["weights"].values())
    assert replay(source, tmp_path / "dd", record)["replayed"] > 0


def _drop_step(node: dict) -> None:
    child = node["x"]
    node.clear()
    node.update(child)


MUTATIONS = {  # one wrong step each: a transpose left out, a slice one column off, the bf16 rounding dropped
    "transpose": lambda node: node.update(perm=list(range(len(node["perm"])))),
    "slice": lambda node: node.update(start=node["start"] + 1, stop=node["stop"] + 1),
    "bf16": _drop_step,
}


@pytest.mark.parametrize("op", sorted(MUTATIONS))
def test_a_wrong_record_is_caught(tiny_conversion, op):
    """The replay compares bytes: a record with one step wrong fails."""
    folder = tiny_conversion.out / "unet"
    record = provenance.read_record(folder / "dd" / provenance.FILE)

    def first(expr: dict) -> dict | None:
        while "x" in expr:
            if expr["op"] == op:
                return expr
            expr = expr["x"]
        return None

    node = next(n for n in map(first, record["weights"].values()) if n is not None)
    MUTATIONS[op](node)
    with pytest.raises(AssertionError):
        replay(folder / "model.onnx", folder / "dd", record)


def test_a_folded_weight_replays_through_the_onnx_node(tmp_path):
    """A small weight the canonical steps evaluate (a Reshape of LayerNorm's gamma) is recorded as the ONNX node
    it evaluated, and replays through it."""
    from sdnpu.convert.compile import compile_file

    k = 8
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((1, k)).astype(np.float32), "gamma2d"),
             numpy_helper.from_array(rng.standard_normal(k).astype(np.float32), "beta"),
             numpy_helper.from_array(np.asarray([k], np.int64), "flat")]
    nodes = [helper.make_node("Reshape", ["gamma2d", "flat"], ["gamma"]),
             helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5)]
    graph = helper.make_graph(nodes, "ln", [helper.make_tensor_value_info("x", T.FLOAT, [1, 64, k])],
                              [helper.make_tensor_value_info("y", T.FLOAT, [1, 64, k])], inits)
    source = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), str(source))
    compile_file(source, tmp_path / "dd", verify=False)
    record = provenance.read_record(tmp_path / "dd" / provenance.FILE)["weights"]
    ln = next(n for n in onnx.load(str(tmp_path / "dd" / "replaced.onnx")).graph.node if n.op_type == "SDLayerNorm")
    assert provenance.leaves(record[ln.input[1]]) == {"gamma2d", "flat"}  # the weight and the shape it read
    assert replay(source, tmp_path / "dd")["replayed"] >= 2


def test_a_record_of_another_format_or_version_is_refused(tmp_path):
    path = tmp_path / provenance.FILE
    with pytest.raises(SdnpuError, match="is missing"):
        provenance.read_record(path)
    path.write_text("{not json")
    with pytest.raises(SdnpuError, match="not readable JSON"):
        provenance.read_record(path)
    path.write_text(json.dumps({"format": "other"}))
    with pytest.raises(SdnpuError, match="not an sdnpu weight record"):
        provenance.read_record(path)
    path.write_text(json.dumps({"format": provenance.FORMAT, "version": provenance.VERSION + 1}))
    with pytest.raises(SdnpuError, match="record version"):
        provenance.read_record(path)


def test_steps_are_the_only_transforms():
    """An unknown step is refused when a pass names it, not when a record is replayed."""
    with pytest.raises(ValueError, match="unknown provenance step"):
        provenance.step("rotate", k=1)
    expr = provenance.chain({"init": "w"}, [provenance.step("transpose", perm=[1, 0]),
                                            provenance.step("slice", axis=1, start=1, stop=3)])
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert np.array_equal(provenance.evaluate(copy.deepcopy(expr), {"w": w}.__getitem__), w.T[:, 1:3])
    assert provenance.chain(provenance.LITERAL, [provenance.step("bf16")]) == provenance.LITERAL


@pytest.mark.parametrize("component", ["unet", "text_encoder_2", "vae_decoder"])
def test_every_mac_weight_names_its_module_parameter(tiny_conversion, component):
    """parameters.json + weights.json take every SDConv / SDGemm weight back to a module parameter (what a
    LoRA's keys name), and each named constant equals that parameter, as it is or transposed, exactly; every
    Linear and Conv2d weight of the module that the graph holds is found."""
    import torch

    from sdnpu.formats.parameters import FILE, FORMAT, VERSION
    from sdnpu.components import module_of
    from sdnpu.convert.sources import resolve_source

    folder = tiny_conversion.out / component
    record = json.loads((folder / FILE).read_text())
    assert (record["format"], record["version"], record["ambiguous"]) == (FORMAT, VERSION, 0)
    found = record["initializers"]
    assert mac_weights_named(folder) > 0

    module = resolve_source("tiny-sdxl").load_module(module_of(component))
    params = dict(module.named_parameters())
    read = provenance.constant_reader(ir.load(folder / "model.onnx"))
    for name, entry in found.items():
        p = params[entry["param"]].detach().numpy() if entry["param"] in params else None
        if p is None:
            continue  # a buffer
        expected = p.T if entry["transform"] == "transpose" else p
        assert np.array_equal(read(name), expected), name
    named = {e["param"] for e in found.values()}
    used = {p.split(".")[0] for p in named}  # the VAE halves use half of AutoencoderKL (decoder, post_quant_conv)
    layers = [f"{name}.weight" for name, m in module.named_modules()
              if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) and name.split(".")[0] in used]
    missing = [w for w in layers if w not in named]
    assert not missing, missing[:5]
