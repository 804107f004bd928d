"""Where a zoo member's dispatch model loses more than PyTorch's own bf16 run: layer by layer.

    python bench/trace_bf16.py kandinsky3-unet                 # dynamo export, the member's example inputs
    python bench/trace_bf16.py kandinsky3-unet --draws 8       # the mean over 8 input draws (bench_zoo's draws)
    python bench/trace_bf16.py kandinsky3-unet --dd OTHER/dd   # an already compiled dispatch model of the export

Each SDConv and SDGemm of the dispatch model whose weight is one whole layer of the module (``dd/weights.json``
names the layer's parameter, no slice or phase of it taken) is matched with that ``nn.Conv2d`` / ``nn.Linear``
of PyTorch's module; the dispatch op's output becomes an output of a copy of the dispatch model. Each layer's
output is compared with PyTorch fp32's (forward hooks): the dispatch model's relative error (||ours - fp32|| /
||fp32||) beside PyTorch bf16's, in the order PyTorch runs the layers. A dispatch op that computes more than
its layer (a constant folded into its bias, a fused activation) is marked and its error measured against the
layer's fp32 output with the same constant added. The last column is the ratio: where it first grows past 1 is
where the dispatch model departs from what PyTorch's bf16 computes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import zoo  # noqa: E402


def _origin(record: Any) -> tuple[set[str], set[str]]:
    """The parameters a weights.json record is computed from, and the operations on the way."""
    inits: set[str] = set()
    ops: set[str] = set()
    stack = [record]
    while stack:
        r = stack.pop()
        if isinstance(r, dict):
            if "init" in r:
                inits.add(r["init"])
            if "op" in r:
                ops.add(r["op"])
            stack.extend(r.values())
        elif isinstance(r, list):
            stack.extend(r)
    return inits, ops


def _columns(record: dict) -> tuple[int, int] | None:
    """(start, stop) where an SDGemm's weight is a block of its layer's output columns: bf16(slice(axis 1,
    transpose(W)))."""
    r = record.get("x", {}) if record.get("op") == "bf16" else record
    if r.get("op") == "slice" and r.get("axis") == 1 and r.get("x", {}).get("op") == "transpose":
        return int(r["start"]), int(r["stop"])
    return None


def _bf16(a: np.ndarray) -> np.ndarray:
    """Round to bf16 (to nearest even), as float32."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.view(np.float32)


def matched_layers(dd: Path, source: Path) -> tuple[Any, dict[str, tuple[str, str, np.ndarray | None]]]:
    """The dispatch model with each matched op's output added as a graph output; {output: (layer, note, the
    constant its bias carries beyond the layer's own)}. A layer is matched where its op's weight is the whole
    parameter ``<layer>.weight``."""
    import onnx
    import onnx_ir as ir

    from sdnpu.formats.weights import constant_reader, evaluate

    model = onnx.load(str(dd / "replaced.onnx"))
    weights = json.loads((dd / "weights.json").read_text())["weights"]
    read = constant_reader(ir.load(str(source)))
    matched: dict[str, tuple[str, str, np.ndarray | None]] = {}
    for node in model.graph.node:
        if node.op_type not in ("SDConv", "SDGemm") or len(node.input) < 2:
            continue
        record = weights.get(node.input[1], {})
        inits, ops = _origin(record)
        columns = _columns(record) if node.op_type == "SDGemm" else None
        if len(inits) != 1 or not next(iter(inits)).endswith(".weight") or {"sum", "concat"} & ops or (
                "slice" in ops and columns is None):
            continue
        layer = next(iter(inits))[: -len(".weight")]
        note, extra = [], None
        if len(node.input) > 2:
            record = weights.get(node.input[2], {})
            b_inits, b_ops = _origin(record)
            if "sum" in b_ops:
                note.append("constant folded into the bias")
                inner = record["x"] if record.get("op") == "bf16" else record
                own = read(f"{layer}.bias").astype(np.float64).ravel() if f"{layer}.bias" in b_inits else 0.0
                if columns is not None and f"{layer}.bias" in b_inits:
                    own = own[columns[0]:columns[1]]
                extra = evaluate(inner, read).astype(np.float64).ravel() - own
        if any(a.name == "nonlinear" for a in node.attribute):
            continue  # not the layer's output
        if columns is not None:
            note.append(f"columns {columns[0]}:{columns[1]}")
        if node.op_type == "SDConv":
            note.append("NHWC")
        matched[node.output[0]] = (f"{layer}[{columns[0]}:{columns[1]}]" if columns else layer, ", ".join(note),
                                   extra)
        model.graph.output.append(onnx.helper.make_tensor_value_info(node.output[0], onnx.TensorProto.BFLOAT16,
                                                                     None))
    return model, matched


def _module_outputs(name: str, inputs: list[Any] | None, bf16: bool) -> tuple[dict[str, np.ndarray], list[Any]]:
    import torch

    wrapper, built = zoo.build(name)
    args = list(built.inputs if inputs is None else inputs)
    if bf16:
        wrapper = wrapper.to(torch.bfloat16)
        args = [a.to(torch.bfloat16) if a.is_floating_point() else a for a in args]
    seen: dict[str, np.ndarray] = {}
    hooks = []
    for path, mod in wrapper.named_modules():
        if isinstance(mod, (torch.nn.Conv2d, torch.nn.Linear)):
            def hook(_m: Any, _i: Any, out: Any, path: str = path) -> None:
                seen.setdefault(path, out.detach().float().numpy().copy())
            hooks.append(mod.register_forward_hook(hook))
    with torch.no_grad():
        outs = wrapper(*args)
    for h in hooks:
        h.remove()
    seen["<output>"] = outs[0].float().numpy().copy()
    return seen, list(built.inputs)


def _as_torch_layout(ours: np.ndarray, ref: np.ndarray, nhwc: bool) -> np.ndarray:
    if nhwc and ours.ndim == 4:
        return ours.transpose(0, 3, 1, 2)  # SDConv's NHWC
    return ours.reshape(ref.shape)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(np.linalg.norm(a64 - b64) / max(np.linalg.norm(b64), 1e-30))


def trace(name: str, exporter: str, dd: Path | None, draws: int, work: Path) -> list[dict]:
    import torch

    from sdnpu.convert.compile import compile_file
    from sdnpu.onnxrun import run_onnx

    path, feeds, _ = zoo.export(name, exporter, work / "export")
    if dd is None:
        dd = work / "dd"
        compile_file(path, dd)
    model, matched = matched_layers(dd, path)
    traced = work / "traced.onnx"
    import onnx

    onnx.save(model, str(traced))
    _, built = zoo.build(name)
    rows: dict[str, dict] = {}
    order: list[str] = []
    for draw in range(draws):
        g = torch.Generator().manual_seed(draw)
        inputs = [a if draw == 0 or not a.is_floating_point() or a.numel() < 8
                  else torch.randn(a.shape, generator=g) * a.std() + a.mean() for a in built.inputs]
        fp32, _ = _module_outputs(name, inputs, bf16=False)
        low, _ = _module_outputs(name, inputs, bf16=True)
        got = run_onnx(traced, {k: a.numpy() for k, a in zip(feeds, inputs, strict=True)})
        outputs = {**{v: got[v] for v in matched}, "<output>": got[next(iter(got))]}
        by_layer = {layer: (v, note, extra) for v, (layer, note, extra) in matched.items()}
        convs = {v for v, (_, note, _) in matched.items() if "NHWC" in note}
        by_layer["<output>"] = ("<output>", "", None)
        runs = list(fp32)  # the order PyTorch ran the layers in
        keys = sorted((k for k in by_layer if k.split("[")[0] in fp32), key=lambda k: (runs.index(k.split("[")[0]), k))
        for key in keys:
            value, note, extra = by_layer[key]
            layer = key.split("[")[0]
            ref, pt = fp32[layer], low[layer]
            if "[" in key:
                a, b = (int(x) for x in key[key.index("[") + 1:-1].split(":"))
                ref, pt = ref[..., a:b], pt[..., a:b]
            if extra is not None:  # ours carries the constant folded into its bias: the layer's output plus it,
                c = extra.reshape((1,) * (ref.ndim - 1) + (-1,)).astype(np.float32)  # PyTorch adds it in bf16
                ref, pt = ref + c, _bf16(pt + _bf16(c))
            ours = _as_torch_layout(outputs[value].astype(np.float32), ref, nhwc=value in convs)
            r = rows.setdefault(key, {"layer": key, "note": note, "ours": [], "pytorch": []})
            r["ours"].append(_rel(ours, ref))
            r["pytorch"].append(_rel(pt, ref))
            if key == "<output>":  # bench_zoo's measures too: max abs and 1 - cosine
                for who, got in (("ours", ours), ("pytorch", pt)):
                    m, c = _errors(got, ref)
                    r.setdefault(f"{who}_max_abs", []).append(m)
                    r.setdefault(f"{who}_1-cos", []).append(c)
            if draw == 0:
                order.append(key)
    out = []
    for layer in order:
        r = rows[layer]
        o, p = float(np.mean(r["ours"])), float(np.mean(r["pytorch"]))
        row = {"layer": layer, "note": r["note"], "ours": o, "pytorch": p, "ratio": o / p if p else None}
        row.update({k: v for k, v in r.items() if "max_abs" in k or "1-cos" in k})
        out.append(row)
    return out


def _errors(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    a, b = got.astype(np.float64).ravel(), want.astype(np.float64).ravel()
    return float(np.abs(a - b).max()), 1.0 - float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("member")
    ap.add_argument("--exporter", default="dynamo")
    ap.add_argument("--dd", type=Path, help="a compiled dispatch model of the member's export (default: compile)")
    ap.add_argument("--draws", type=int, default=1)
    ap.add_argument("--json", type=Path, help="write the rows here too")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sdnpu-trace-") as tmp:
        rows = trace(args.member, args.exporter, args.dd, args.draws, Path(tmp))
    print("| # | layer | note | ours: rel. error | PyTorch bf16 | ratio |\n|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        note = r["note"].replace("NHWC", "").strip(", ")
        print(f"| {i} | {r['layer']} | {note} | {r['ours']:.2e} | {r['pytorch']:.2e} | {ratio} |")
    last = rows[-1]
    for m in ("max_abs", "1-cos"):
        ours, theirs = np.asarray(last[f"ours_{m}"]), np.asarray(last[f"pytorch_{m}"])
        print(f"output, {m} over PyTorch bf16's: per draw {', '.join(f'{x:.2f}' for x in ours / theirs)}; of the "
              f"means {ours.mean() / theirs.mean():.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
