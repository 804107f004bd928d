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

import onnx_ir as ir

from sdnpu.formats import weights as provenance

MAC_OPS = ("SDConv", "SDGemm", "SDMatMul")  # the ops whose weights a LoRA changes


def replay(source_path: Path, dd: Path, record: dict[str, Any] | None = None) -> dict[str, int]:
    """Replays ``dd/weights.json`` (or ``record``) against ``dd/replaced.onnx`` from the exported graph at
    ``source_path``; returns counts, raises AssertionError naming the first problem."""
    record = record or provenance.read_record(dd / provenance.FILE)
    read = provenance.constant_reader(ir.load(source_path))
    counts, problems = provenance.check_replay(record["weights"], ir.load(dd / "replaced.onnx").graph, read)
    assert not problems, f"{len(problems)} problems, the first: {problems[0]}"
    return counts


def mac_weights_named(folder: Path) -> int:
    """In a converted component folder: every SDConv / SDGemm / SDMatMul weight's float sources are module
    parameters in parameters.json; returns how many weights were traced."""
    from sdnpu.formats.parameters import FILE

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
