"""What QNN's compile takes on this machine, piece by piece: time and peak memory against a piece's nodes, weights,
activations written and largest tensor. It calibrates how ``sdnpu.convert.split`` plans the pieces of a graph for
the machine that compiles it (QNN's HTP compile grows with the activations a piece writes, not its weights).

For a component converted (or compiled) with ``--target qnn-htp`` (its ``model.onnx`` in the forms the HTP takes),
each ``--range START:END`` (node positions, the graph's order) is cut out, written beside the graph (pointing
into its data file) and compiled by QNN with CPU fallback off in a process of its own. Its peak resident memory
(``VmHWM``) is read every 2 s; a compile past ``--timeout`` seconds is stopped and said so, with the peak so far.

    python bench/bench_qnn_compile_memory.py MODEL.onnx --range 69:253 --range 2461:2591 [--json FILE]
    python bench/bench_qnn_compile_memory.py MODEL.onnx --blocks transformer_blocks 0,13  # a block by its weights
    python bench/bench_qnn_compile_memory.py --attention 4429,6,2 --attention 4480,6,2 --timeout 300

``--attention N,HEADS,BATCH[,MQ]`` compiles one attention alone instead, as SDXL's and SD 3's export it: Q and Kᵀ
each scaled by a ``Mul``, ``MatMul``, ``Softmax``, ``MatMul`` over ``[BATCH, HEADS, N, 64]`` (MQ: that many
queries, N keys).

``--blocks PREFIX N,M`` takes the nodes of block N (from the first node that reads a weight named
``PREFIX.N.`` to the node before the first that reads ``PREFIX.N+1.``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _compile(path: str, out_dir: str, arch: str) -> None:
    """(In its own process.) QNN's compile of one piece."""
    from sdnpu.backends import qnn_htp

    qnn_htp.compile_context(Path(path), Path(out_dir), qnn_htp.parse_arch(arch), "piece")


def _peak(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    m = re.search(r"VmHWM:\s+(\d+) kB", text)
    return int(m.group(1)) * 1024 if m else 0


def attention(n: int, heads: int, batch: int, queries: int, path: Path) -> None:
    """One attention alone (see the module's docstring), written to ``path``."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    d = 64
    io = [helper.make_tensor_value_info("q", TensorProto.FLOAT, [batch, heads, queries, d]),
          helper.make_tensor_value_info("kt", TensorProto.FLOAT, [batch, heads, d, n]),
          helper.make_tensor_value_info("v", TensorProto.FLOAT, [batch, heads, n, d])]
    nodes = [helper.make_node("Mul", ["q", "c"], ["qs"]), helper.make_node("Mul", ["kt", "c"], ["ks"]),
             helper.make_node("MatMul", ["qs", "ks"], ["s"]), helper.make_node("Softmax", ["s"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["o"])]
    graph = helper.make_graph(nodes, "attention", io, [helper.make_tensor_value_info(
        "o", TensorProto.FLOAT, [batch, heads, queries, d])],
        initializer=[numpy_helper.from_array(np.asarray([d ** -0.25], np.float32), "c")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def _run(path: Path, out: Path, arch: str, timeout: float) -> dict[str, Any]:
    """QNN's compile of ``path`` in a process of its own, its time and peak memory."""
    proc = multiprocessing.get_context("spawn").Process(target=_compile, args=(str(path), str(out), arch))
    t0, peak, row = time.perf_counter(), 0, {}
    proc.start()
    while proc.is_alive():
        peak = max(peak, _peak(proc.pid))
        if time.perf_counter() - t0 > timeout:
            proc.kill()
            row["stopped"] = f"after {timeout:.0f} s"
            break
        time.sleep(1)
    proc.join()
    row.update(seconds=round(time.perf_counter() - t0, 1), peak_rss_gb=round(peak / 1e9, 2), exitcode=proc.exitcode)
    ctx = sorted(out.glob("piece_*.bin"))
    row["context_mb"] = round(sum(p.stat().st_size for p in ctx) / 1e6, 1) if ctx else None
    for p in out.glob("*"):
        p.unlink()
    if out.is_dir():
        out.rmdir()
    return row


def block_range(model: Any, prefix: str, n: int) -> tuple[int, int]:
    """Nodes of block ``n``: from the first reading a weight ``<prefix>.<n>.`` to the last before block n+1's."""
    owner = re.compile(re.escape(prefix) + r"\.(\d+)\.")
    cur, start, end = -1, None, len(model.graph.node)
    for k, node in enumerate(model.graph.node):
        for x in node.input:
            m = owner.search(x)
            if m:
                cur = max(cur, int(m.group(1)))
        if cur == n and start is None:
            start = k
        if cur > n:
            end = k
            break
    if start is None:
        raise SystemExit(f"no weight named {prefix}.{n}.*")
    return start, end


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path, nargs="?", help="a qnn-htp model.onnx (the graph in the forms the HTP takes)")
    ap.add_argument("--attention", action="append", default=[], help="N,HEADS,BATCH[,MQ]: one attention alone")
    ap.add_argument("--range", action="append", default=[], help="START:END node positions (repeatable)")
    ap.add_argument("--blocks", nargs=2, metavar=("PREFIX", "N,M"), help="blocks by their weights' prefix")
    ap.add_argument("--arch", default="73")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import onnx

    from sdnpu.convert import split

    rows: list[dict[str, Any]] = []
    for spec in args.attention:
        n, heads, batch, *rest = (int(x) for x in spec.split(","))
        path = Path(f"/tmp/bench-attention-{n}-{heads}-{batch}.onnx")
        attention(n, heads, batch, rest[0] if rest else n, path)
        row = {"attention": spec, "scores_gb": round(batch * heads * (rest[0] if rest else n) * n * 4 / 1e9, 3),
               **_run(path, Path(f"/tmp/bench-attention-{n}-out"), args.arch, args.timeout)}
        path.unlink()
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.model is None:
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return 0
    structure = onnx.shape_inference.infer_shapes(onnx.load(str(args.model), load_external_data=False))
    ranges = [tuple(int(x) for x in r.split(":")) for r in args.range]
    if args.blocks:
        ranges += [block_range(structure, args.blocks[0], int(n)) for n in args.blocks[1].split(",")]
    lay = split._layout(structure, 2)
    for start, end in ranges:
        piece = split.piece_of(structure, start, end)
        path = args.model.parent / f".bench.piece{start}.onnx"
        out = Path(f"/tmp/bench-qnn-mem-{start}")
        split.write_piece(structure, piece, path)
        row: dict[str, Any] = {
            "nodes": end - start, "range": f"{start}:{end}", "weights_gb": round(piece.weight_bytes / 1e9, 3),
            # written activations in the graph's float32 (the HTP's fp16 holds half)
            "written_gb": round(float(lay.written[start:end].sum()) / 1e9, 2),
            "largest_gb": round(float(lay.written[start:end].max()) / 1e9, 3),
            "ops": dict(sorted({op: sum(1 for n in lay.nodes[start:end] if n.op_type == op)
                                for op in {n.op_type for n in lay.nodes[start:end]}}.items()))}
        row.update(_run(path, out, args.arch, args.timeout))
        path.unlink(missing_ok=True)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "ops"}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
