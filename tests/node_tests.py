"""ONNX's own conformance node tests through ``sdnpu compile``: none may end in a traceback.

onnx ships the generators of its backend node tests (``onnx.backend.test.case.node``): each is a one-node
model with its inputs and expected outputs. Each is written as a backend test folder (``model.onnx``,
``test_data_set_0/input_N.pb``) and compiled. Every outcome but a traceback is allowed: a compile (fused
or not), or one clear line (``SdnpuError``: onnxruntime cannot run the model, a graph that is not what an NPU
takes). ``tests/test_node_tests.py`` runs them; ``python -m tests.node_tests [PATTERN]`` prints each outcome.
"""

from __future__ import annotations

import logging
import re
import sys
import tempfile
import traceback
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np


def cases(pattern: str = "") -> Iterator[Any]:
    """onnx's node test cases whose name matches ``pattern`` (a regular expression)."""
    import warnings

    from onnx.backend.test.case import node

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        found = node.collect_testcases(None)
    rx = re.compile(pattern)
    return (c for c in found if rx.search(c.name))


def write_case(case: Any, folder: Path) -> Path:
    """The case as a backend test folder; returns its model's path."""
    import onnx
    from onnx import numpy_helper

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    onnx.save(case.model, str(path))
    data = folder / "test_data_set_0"
    data.mkdir(exist_ok=True)
    inputs = case.data_sets[0][0] if case.data_sets else []
    graph_inputs = [vi.name for vi in case.model.graph.input]
    for i, value in enumerate(inputs):
        if isinstance(value, np.ndarray):
            name = graph_inputs[i] if i < len(graph_inputs) else f"input_{i}"
            (data / f"input_{i}.pb").write_bytes(numpy_helper.from_array(value, name).SerializeToString())
    return path


def outcome(case: Any, folder: Path) -> tuple[str, str]:
    """("compiled", summary) | ("refused", the one line) | ("traceback", the traceback)."""
    from sdnpu.convert.compile import compile_file

    from sdnpu.errors import SdnpuError

    path = write_case(case, folder)
    try:
        report = compile_file(path, folder / "dd")
    except SdnpuError as e:
        return "refused", str(e).splitlines()[0]
    except Exception:
        return "traceback", traceback.format_exc()
    s = report["summary"]
    fid = report.get("fidelity")
    return "compiled", (f"{s['offloaded_nodes']} dispatch ops, {s['cpu_nodes']} CPU nodes"
                        + (f", min cosine {fid['min_cosine']:.6f}" if fid else
                           f", no check: {report.get('fidelity_skipped')}"))


def sweep(pattern: str = "") -> Counter[str]:
    logging.getLogger("sdnpu").setLevel(logging.ERROR)
    counts: Counter[str] = Counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i, case in enumerate(cases(pattern)):
            kind, text = outcome(case, Path(tmp) / f"{i}_{case.name}")
            counts[kind] += 1
            print(f"{case.name}: {kind}: {text if kind != 'traceback' else text.splitlines()[-1]}", flush=True)
    return counts


if __name__ == "__main__":
    print(dict(sweep(sys.argv[1] if len(sys.argv) > 1 else "")))
