"""Replays a compiled component's weight record against its dispatch model, at any size.

    python -m tests.check_provenance models/sdxl-base/unet

For every constant of ``dd/replaced.onnx`` that ``dd/weights.json`` does not call a literal: evaluates its
expression from ``model.onnx``'s constants and compares bytes with the stored one; for every SDConv /
SDGemm / SDMatMul weight: its float sources must be named module parameters in ``parameters.json`` (where
the folder has one). Weights are read one at a time (onnx_ir's lazy external tensors), so a 10 GB UNet
needs about its largest weight in memory, not the model. Exits 1 on the first constant that differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from sdnpu.passes import provenance

MAC_OPS = ("SDConv", "SDGemm", "SDMatMul")  # the ops whose weights a LoRA changes


def _copy_and_release(tensor: Any) -> np.ndarray:
    """The tensor's values, copied; an external tensor's file mapping is dropped (else every mapped weight
    stays resident until the end)."""
    array = np.array(tensor.numpy())
    if isinstance(tensor, ir.ExternalTensor):
        tensor.release()
    return array


def _reader(model: ir.Model) -> Any:
    """``read(name)`` over a model's constants: initializers, or Constant nodes' values."""
    constants = {n.outputs[0].name: n for n in model.graph if n.op_type == "Constant"}

    def read(name: str) -> np.ndarray:
        v = model.graph.initializers.get(name)
        if v is not None and v.const_value is not None:
            return _copy_and_release(v.const_value)
        node = constants[name]
        attr = next(iter(node.attributes.values()))
        value = attr.value
        if isinstance(value, ir.TensorProtocol):
            return np.array(value.numpy())
        return np.asarray(value, np.float32 if attr.name.startswith("value_float") else np.int64)

    return read


def replay(source_path: Path, dd: Path, record: dict[str, Any] | None = None) -> dict[str, int]:
    """Replays ``dd/weights.json`` (or ``record``) against ``dd/replaced.onnx`` from the exported graph at
    ``source_path``; returns counts, raises AssertionError naming the first constant that differs."""
    record = record or provenance.read_record(dd / provenance.FILE)
    source = ir.load(source_path)
    compiled = ir.load(dd / "replaced.onnx")
    read = _reader(source)
    weights = record["weights"]
    assert set(weights) == set(compiled.graph.initializers), "the record and the model list other constants"
    counts = {"replayed": 0, "literal": 0, "bytes": 0}
    for name, v in compiled.graph.initializers.items():
        expr = weights[name]
        if expr.get("literal"):
            counts["literal"] += 1
            continue
        assert "unknown" not in json.dumps(expr), f"{name}: made by a step that did not record itself"
        got = provenance.evaluate(expr, read)
        want = _copy_and_release(v.const_value)
        assert (got.dtype, got.shape) == (want.dtype, want.shape), (name, got.dtype, want.dtype, got.shape)
        assert got.tobytes() == want.tobytes(), f"{name}: the replay differs from the stored weight"
        counts["replayed"] += 1
        counts["bytes"] += want.nbytes
    return counts


def mac_weights_named(folder: Path) -> int:
    """In a converted component folder: every SDConv / SDGemm / SDMatMul weight's float sources are module
    parameters in parameters.json; returns how many weights were traced."""
    from sdnpu.convert.parameters import FILE

    found = json.loads((folder / FILE).read_text())["initializers"]
    weights = provenance.read_record(folder / "dd" / provenance.FILE)["weights"]
    source = ir.load(folder / "model.onnx")
    floats = {n for n, v in source.graph.initializers.items() if v.dtype in (ir.DataType.FLOAT,
                                                                           ir.DataType.FLOAT16)}
    compiled = ir.load(folder / "dd" / "replaced.onnx")
    traced = 0
    for node in compiled.graph:
        if node.domain == "com.amd" and node.op_type.split("_")[0] in MAC_OPS:
            w = node.inputs[1]
            if w is not None and w.name in compiled.graph.initializers:
                sources = provenance.leaves(weights[w.name]) & floats
                assert sources and all(found.get(s, {}).get("param") for s in sources), (node.name, sources)
                traced += 1
    return traced


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path, help="a converted component folder (model.onnx, dd/)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        counts = replay(args.folder / "model.onnx", args.folder / "dd")
        traced = mac_weights_named(args.folder) if (args.folder / "parameters.json").exists() else None
    except AssertionError as e:
        print(f"MISMATCH: {e}")
        return 1
    print(f"{args.folder}: {counts['replayed']} constants replayed byte for byte ({counts['bytes'] / 1e9:.2f} GB), "
          f"{counts['literal']} literals" + (f", {traced} SDConv/SDGemm/SDMatMul weights named by module parameter"
                                             if traced is not None else "")
          + f" ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
