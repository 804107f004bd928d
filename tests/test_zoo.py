"""The zoo (``tests/zoo.py``): every public architecture, exported once (``_held``: the exporter ``sdnpu
convert`` uses where it can export it), compiles to at least its recorded floor (``tests/zoo_floors.json``,
written by ``python bench/bench_zoo.py --floors``): offload counted AMD's way, CPU nodes, NPU regions, the
share of MACs on the NPU and the dispatch model against its fp32 graph; every dispatch op holds the target's
contract, and every CPU island is at the graph's edges or around an op the registry lacks. An export that
torch writes wrong is refused in one line that says so, nothing written. A rule change that loses offload on
any member fails here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sdnpu.convert.compile import compile_file
from sdnpu.errors import SdnpuError

from . import zoo
from .contract import problems

FLOORS = json.loads((Path(__file__).parent / "zoo_floors.json").read_text())
CASES = [(name, exporter) for name, m in zoo.MEMBERS.items() for exporter in m.exporters]


def _held(name: str) -> str:
    """The exporter the suite holds ``name`` to its floor with: the first of the member's exporters (dynamo, the
    one ``sdnpu convert`` uses, then TorchScript) whose graph compiles. One export per member and run; every
    exporter's floor is swept by ``bench/bench_zoo.py``."""
    exporters = zoo.MEMBERS[name].exporters
    return next((e for e in exporters if not {"refused", "exporter_bug"} & set(FLOORS[f"{name}/{e}"])), exporters[0])


HELD = [(name, _held(name)) for name, m in zoo.MEMBERS.items() if m.exporters]
COSINE = 0.999  # every member's dispatch model against its fp32 graph, at least


def test_every_member_has_a_floor_and_every_floor_a_member():
    assert sorted(FLOORS) == sorted(f"{n}/{e}" for n, e in CASES)
    assert all(m.exporters or m.why_not for m in zoo.MEMBERS.values())


@pytest.mark.slow
@pytest.mark.parametrize(("name", "exporter"), HELD, ids=[f"{n}-{e}" for n, e in HELD])
def test_the_member_compiles_to_its_floor(name, exporter, tmp_path):
    floor = FLOORS[f"{name}/{exporter}"]
    path, feeds, reference = zoo.export(name, exporter, tmp_path / "export")
    if "refused" in floor:  # torch wrote a graph that is not valid ONNX, or one onnxruntime cannot run
        with pytest.raises(SdnpuError, match=floor["refused"]):
            compile_file(path, tmp_path / "dd")
        assert not (tmp_path / "dd").exists()
        return
    agrees = zoo.agrees_with_pytorch(path, feeds, reference)
    if "exporter_bug" in floor:  # torch's graph computes something else than its module: nothing to compile
        assert not agrees, f"{name} {exporter}: the export agrees with PyTorch now; record its floor"
        return
    assert agrees, "the export is not PyTorch's module"
    report = compile_file(path, tmp_path / "dd")
    s = report["summary"]
    assert s["offload_rate"] >= floor["offload"] - 1e-9, (s["offload_rate"], floor)
    assert s["cpu_nodes"] <= floor["cpu_nodes"] and s["npu_regions"] <= floor["npu_regions"], (s, floor)
    assert (s["macs_offloaded_share"] or 0.0) >= floor["macs"] - 1e-9
    assert report["fidelity"]["min_cosine"] >= max(COSINE, floor["min_cosine"])
    # every CPU island is at the graph's edges or around an op the registry lacks: none the data flow does
    # not call for (so at most one island per run of registry-less ops)
    assert s["cpu_islands"]["avoidable"] == 0, s["cpu_islands"]
    checked, found = problems(tmp_path / "dd" / "replaced.onnx")
    assert checked > 0 and found == [], found[:5]
