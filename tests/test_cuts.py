"""The cuts pass (passes/cuts.py): the Slices and Splits left on the CPU become one Split per value and axis,
followed back through cuts and merging Reshapes; the parts are the same bits."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from sdnpu.passes.manager import entry_name, run_passes
from sdnpu.passes.pipeline import CompileOptions, compile_model, pipeline

from .graphs import feeds_for, model, ops, run, to_ir, to_proto, with_functions

B, ROWS, K, C, S = 1, 11, 6, 8, 5


def _table_model(blocks: int, spelling: str, overlap: bool = False) -> onnx.ModelProto:
    """x [B, S, C] through a Linear; a table [B, ROWS, C] from a Linear of cond; each block modulates x by two
    of its rows (Chroma's shape, spelled as ``spelling``)."""
    rng = np.random.default_rng(0)
    inits = {"wx": rng.standard_normal((C, C)).astype(np.float32) * 0.3,
             "wt": rng.standard_normal((K, C)).astype(np.float32) * 0.3, "one": np.ones((), np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "wx"], ["h0"]), helper.make_node("MatMul", ["cond", "wt"], ["t"])]

    def i64(name: str, v: list[int]) -> str:
        inits[name] = np.asarray(v, np.int64)
        return name

    h = "h0"
    for blk in range(blocks):
        lo = 2 * blk - (1 if overlap and blk else 0)
        if spelling == "slices":
            for j in range(2):
                nodes.append(helper.make_node("Slice", ["t", i64(f"s{blk}{j}", [lo + j - ROWS]),
                                                        i64(f"e{blk}{j}", [lo + j + 1]), i64(f"a{blk}{j}", [1])],
                                              [f"r{blk}{j}"]))
        else:  # Chroma: Slice(rows) -> Reshape([B, 2C]) -> Split(2) -> Unsqueeze
            nodes += [helper.make_node("Slice", ["t", i64(f"s{blk}", [lo]), i64(f"e{blk}", [lo + 2]),
                                                 i64(f"a{blk}", [1])], [f"sl{blk}"]),
                      helper.make_node("Reshape", [f"sl{blk}", i64(f"f{blk}", [B, 2 * C])], [f"fl{blk}"]),
                      helper.make_node("Split", [f"fl{blk}"], [f"c{blk}0", f"c{blk}1"], axis=1, num_outputs=2)]
            nodes += [helper.make_node("Unsqueeze", [f"c{blk}{j}", i64(f"u{blk}{j}", [1])], [f"r{blk}{j}"])
                      for j in range(2)]
        nodes += [helper.make_node("Add", ["one", f"r{blk}1"], [f"sc{blk}"]),
                  helper.make_node("Mul", [h, f"sc{blk}"], [f"m{blk}"]),
                  helper.make_node("Add", [f"m{blk}", f"r{blk}0"], [f"h{blk + 1}"])]
        h = f"h{blk + 1}"
    nodes.append(helper.make_node("MatMul", [h, "wx"], ["y"]))
    return model(nodes, {"x": [B, S, C], "cond": [B, ROWS, K]}, {"y": None}, inits)


def _compile(m: onnx.ModelProto):
    ir_model = to_ir(m)
    records = compile_model(ir_model)
    return ir_model, {r.name: r.result.counts for r in records}


@pytest.mark.parametrize("spelling", ["slices", "chroma"])
def test_every_blocks_rows_come_from_one_split_and_match(spelling):
    m = _table_model(3, spelling)
    compiled, counts = _compile(m)
    cpu = {k: v for k, v in ops(compiled).items() if not k.startswith("SD") and k != "CastAvx"}
    assert cpu == {"Split": 1}, cpu  # one node for the table, whatever the depth
    assert counts["cuts"]["values cut by one Split"] == 1
    out = to_proto(compiled)
    onnx.checker.check_model(out, full_check=True)
    without = to_ir(m)
    run_passes(without, [e for e in pipeline(CompileOptions()) if entry_name(e) != "cuts"])
    assert ops(without)["Slice"] == 6 if spelling == "slices" else ops(without)["Split"] == 3
    feeds = feeds_for(m)
    # the rows are the same bits: the dispatch model gives what it gives without the pass, exactly
    np.testing.assert_array_equal(run(with_functions(compiled), feeds)[0], run(with_functions(without), feeds)[0])


def test_overlapping_parts_are_left_as_they_are():
    m = _table_model(3, "chroma", overlap=True)  # rows 0-1, 1-2, 3-4 read whole, then chunked: rows overlap
    compiled, counts = _compile(m)
    # each chunk is one row, so the rows are disjoint or equal and still gathered ...
    assert counts["cuts"]["values cut by one Split"] == 1
    # ... but parts of two rows that overlap are not
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("MatMul", ["cond", "w2"], ["t"]),
             helper.make_node("Slice", ["t", "z", "two", "one_axis"], ["p"]),
             helper.make_node("Slice", ["t", "one", "three", "one_axis"], ["q"]),
             helper.make_node("Add", ["h", "p"], ["a"]), helper.make_node("Add", ["a", "q"], ["b"]),
             helper.make_node("MatMul", ["b", "w"], ["y"])]
    inits = {"w": rng.standard_normal((C, C)).astype(np.float32), "w2": rng.standard_normal((K, C)).astype(np.float32),
             "z": np.asarray([0]), "one": np.asarray([1]), "two": np.asarray([2]), "three": np.asarray([3]),
             "one_axis": np.asarray([1])}
    m = model(nodes, {"x": [B, 2, C], "cond": [B, ROWS, K]}, {"y": None}, inits)
    compiled, counts = _compile(m)
    assert not counts["cuts"], counts["cuts"]
    assert ops(compiled)["Slice"] == 2
