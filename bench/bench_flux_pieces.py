"""Flux.1's transformer at its public size, some of its pieces: what one block costs and gives, measured the way
``sdnpu convert`` converts the whole transformer block by block (``sdnpu.convert.blockwise``), without the other
pieces (a whole conversion runs all 57; their stitching and the rest are not measured here).

    python bench/bench_flux_pieces.py --source flux-dev --res 1024 --pieces 0,1,19 --out /work/runs/flux-pieces

Piece 0 is the embeddings with the first double-stream block (it computes the timestep embedding and the rotary
tables every block reads), pieces 1-18 the other double-stream blocks, 19-56 the single-stream ones, 56 with
the output layers. Each piece runs on the outputs of the pieces before it in this run (piece 19 after 0 and 1
takes the double-stream blocks' streams as the single-stream blocks would: the values differ from a whole run's
past the skipped blocks, the shapes and the work do not). Per piece: PyTorch's fp32 run, the export, the ONNX
check against PyTorch, the compile, the dispatch model (reference bodies on the CPU) and PyTorch's own bf16 run
each on PyTorch's fp32 inputs of the piece against PyTorch's fp32 outputs, the contract check
(``tests/contract.py``), the offload counted AMD's way, the time and the process's peak
memory (the process's; a piece's large runs go to worker processes, as in a conversion: ``/usr/bin/time -v``
gives the largest of all). The per-piece dispatch models keep their casts at both ends (the stitched model
cancels them).

With ``--target qnn-htp`` each piece is compiled the way the conversion compiles it for Qualcomm's HTP (its
rewrites, QNN's compiler with CPU fallback disabled, its context(s)), and each context is run on the HTP emulator
alone, on PyTorch's fp32 inputs of the piece, against PyTorch's fp32 outputs, beside PyTorch's own fp16 run of
the piece (the HTP's precision). A double-stream block at 1024 px is about 900 GMAC: half an hour or more on the
emulator here, and 10-15 GB. The emulator's times are this CPU's, not the NPU's.

    python bench/bench_flux_pieces.py --target qnn-htp --pieces 1,19 --out /work/runs/flux-qnn-pieces

Another family's transformer that converts block by block takes the same run (its row's pieces: Qwen-Image's
60 dual-stream blocks, piece 0 with the embeddings, piece 59 with the output layers); ``--batch`` is the
transformer's (Qwen-Image's true CFG: 2), ``--no-low`` skips PyTorch's own bf16 run (and its comparison), which
holds a second copy of the piece's weights:

    python bench/bench_flux_pieces.py --source qwen-image --res 256 --batch 2 --pieces 0 --no-low --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default="flux-dev")
    ap.add_argument("--res", default="1024")
    ap.add_argument("--pieces", default="0,1,19", help="piece indices, increasing (0 is always run first; with "
                    "--target qnn-htp emulated only if listed)")
    ap.add_argument("--out", type=Path, required=True, help="a work folder (emptied)")
    ap.add_argument("--target", default="amd-xdna2", choices=("amd-xdna2", "qnn-htp"))
    ap.add_argument("--batch", type=int, default=1, help="the transformer's batch (default 1, Flux.1's)")
    ap.add_argument("--no-low", action="store_true", help="skip PyTorch's own bf16 / fp16 run of each piece")
    args = ap.parse_args()
    if args.target == "qnn-htp":  # each piece alone on the emulator below, not the chain of them
        os.environ["SDNPU_EMULATOR_MINUTES"] = "0"
    sys.path.insert(0, str(ROOT))
    import torch

    from sdnpu.convert.blockwise import driver
    from sdnpu.convert.blockwise.piece import Weights
    from sdnpu.convert.blockwise.state import Run
    from sdnpu.convert.driver import _prepare
    from sdnpu.convert.options import ConvertOptions
    from sdnpu.formats.sizes import Variant
    from sdnpu.imagesize import Size
    from sdnpu.progress import peak_rss_bytes
    from sdnpu.reports.fidelity import fidelity
    from tests.contract import problems

    from sdnpu.convert import budget

    budget.check_disk = lambda *_: None  # the whole folder's need: this run keeps one piece on the disk at a time
    asked = {int(x) for x in args.pieces.split(",")}
    wanted = sorted({0, *asked})
    shutil.rmtree(args.out, ignore_errors=True)
    run_ = _prepare(args.source, "transformer", args.out / "folder",
                    ConvertOptions(res=[Size.of(args.res)], blockwise=True, target=args.target))
    job = run_.job("transformer", Variant(Size.of(args.res), args.batch))
    src, sig = run_.src, job.signature()
    work = args.out / "pieces"
    work.mkdir(parents=True)
    run = Run(job, work, job.sample_inputs(), tuple(sig.outputs))
    module = driver._pieces_module(src, "transformer")  # the family's pieces (Flux.1's, Qwen-Image's)
    config = module._config(src, "transformer")
    factor = job.spec.vae_factor
    latent = (job.res.height // factor, job.res.width // factor)
    weights = Weights(src, "transformer")
    qnn = args.target == "qnn-htp"
    if qnn:
        from sdnpu.convert.blockwise import state

        run = state.fresh(job, work)
    low_dtype = torch.float16 if qnn else torch.bfloat16  # the target's precision
    rows = []
    for piece in module.pieces(src, "transformer", sig, weights, only=set(wanted), latent=latent):
        before = run.feeds if run.chain is None else run.chain.torch
        inputs = {k: before[k] for k in piece.inputs}
        if qnn:
            if run.qnn is None:
                raise SystemExit("the qnn-htp target's chain did not start (is --no-compile set?)")
            feed_names = {x: run.qnn.names[x] for x in piece.inputs}  # the chain's names of the piece's inputs
            parts_before = len(run.qnn.parts)
        bf16 = None
        if not args.no_low:
            low = piece.module.to(low_dtype)  # PyTorch's own bf16 / fp16 on the same inputs, first (then fp32)
            with torch.no_grad():
                got = low(*(torch.from_numpy(v).to(low_dtype) if v.dtype.kind == "f" else torch.from_numpy(v)
                            for v in inputs.values()))
            bf16 = [o.float().numpy() for o in (got if isinstance(got, tuple) else (got,))]
            piece.module = low.float()
            del got, low
        seconds_before = dict(run.seconds)
        start = time.perf_counter()
        i = piece.i
        driver._piece(run, piece)
        wall = time.perf_counter() - start
        if qnn and i not in asked:  # piece 0 only computes the blocks' inputs: not emulated unless asked for
            for part in run.qnn.parts[parts_before:]:
                for f in [part.context, *part.binaries]:
                    f.unlink(missing_ok=True)
            shutil.rmtree(work / f"piece{i:03d}", ignore_errors=True)
            continue
        if qnn:
            rows.append(_qnn_row(run, piece, i, config, inputs, feed_names, run.qnn.parts[parts_before:], bf16,
                                 wall, seconds_before))
            print(json.dumps(rows[-1]), flush=True)
            for part in run.qnn.parts[parts_before:]:  # the disk holds one piece's contexts at a time
                for f in [part.context, *part.binaries]:
                    f.unlink(missing_ok=True)
            shutil.rmtree(work / f"piece{i:03d}", ignore_errors=True)
            continue
        report = json.loads((work / f"piece{i:03d}" / "dd" / "report.json").read_text())
        chain = run.chain
        assert chain is not None and chain.dispatch is not None
        names = [n for n in piece.outputs if chain.torch[_link(n)].dtype.kind == "f"]  # not Qwen-Image's mask
        dd = driver._run_graph(work / f"piece{i:03d}" / "dd" / "replaced.onnx", inputs)  # alone, on PyTorch's
        ours = fidelity({n: chain.torch[_link(n)] for n in names}, {n: dd[n] for n in names})
        torch_fid = (fidelity({n: chain.torch[_link(n)] for n in names},
                              {n: v for n, v in zip(piece.outputs, bf16, strict=True) if n in names})
                     if bf16 is not None else {"max_abs": float("nan"), "min_cosine": float("nan")})
        s = report["summary"]
        rows.append({
            "piece": i, "what": _what(i, config),
            "dispatch": s["offloaded_nodes"], "cpu": s["cpu_nodes"], "offload": s["offload_rate"],
            "cpu_ops": dict(Counter(n["op_type"] for n in report["cpu_nodes"])),
            "macs_share": s["macs_offloaded_share"], "regions": s["npu_regions"],
            "contract_problems": len(problems(work / f"piece{i:03d}" / "dd" / "replaced.onnx")[1]),
            "onnx_max_rel": max(o["max_rel"] for o in (run.last_check or {}).values()),  # on PyTorch's inputs
            "ours_max_abs": ours["max_abs"], "ours_1mcos": 1 - ours["min_cosine"],
            "torch_bf16_max_abs": torch_fid["max_abs"], "torch_bf16_1mcos": 1 - torch_fid["min_cosine"],
            "seconds": round(wall, 1), "stage_seconds": {k: round(run.seconds[k] - seconds_before.get(k, 0), 1)
                                                         for k in run.seconds},
            "peak_gb": round(peak_rss_bytes() / 1e9, 2),
        })
        print(json.dumps(rows[-1]), flush=True)
        shutil.rmtree(work / f"piece{i:03d}", ignore_errors=True)  # the disk holds one piece at a time
    if qnn:
        _qnn_table(rows)
        shutil.rmtree(args.out, ignore_errors=True)
        return
    print("| piece | what | dispatch | CPU | offload | MACs on NPU | contract problems | ONNX vs PyTorch "
          "| ours: max abs / 1-cos | PyTorch bf16: max abs / 1-cos | ratio max abs / 1-cos | seconds | peak GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['piece']} | {r['what']} | {r['dispatch']} | {r['cpu']} | {r['offload']:.2%} | "
              f"{r['macs_share']:.2%} | {r['contract_problems']} | {r['onnx_max_rel']:.2g} | "
              f"{r['ours_max_abs']:.3g} / {r['ours_1mcos']:.3g} | "
              f"{r['torch_bf16_max_abs']:.3g} / {r['torch_bf16_1mcos']:.3g} | "
              f"{r['ours_max_abs'] / r['torch_bf16_max_abs']:.2f} / {r['ours_1mcos'] / r['torch_bf16_1mcos']:.2f} | "
              f"{r['seconds']} | {r['peak_gb']} |")
    shutil.rmtree(args.out, ignore_errors=True)


def _qnn_row(run, piece, i: int, config: dict, inputs: dict, feed_names: dict, parts: list, fp16: list,
             wall: float, seconds_before: dict) -> dict:
    """Piece ``i``'s QNN contexts run one after another on the HTP emulator on PyTorch's fp32 inputs."""
    from sdnpu.backends import backend_of
    from sdnpu.convert.standard import run_compiled
    from sdnpu.progress import peak_rss_bytes
    from sdnpu.reports.fidelity import fidelity
    from sdnpu.worker import run_in_worker

    chain = run.qnn
    arch = backend_of(chain.options.target).parse_arch(chain.options.htp_arch, chain.options.htp_optimization)
    values = {feed_names[k]: v for k, v in inputs.items()}
    t0 = time.perf_counter()
    for part in parts:
        values.update(run_in_worker(run_compiled, part.context, arch, not part.whole, values,
                                    what=f"running QNN's compile of piece {i}"))
    emulated = time.perf_counter() - t0
    names = list(piece.outputs)
    last = i == piece.n - 1
    got = {n: values[n if last and n in chain.module_outputs else f"b{i}/{n}"] for n in names}
    want = {n: run.chain.torch[_link(n)] for n in names}
    ours = fidelity(want, got)
    low = fidelity(want, dict(zip(names, fp16, strict=True)))
    trace = chain.rows[-len(parts):]
    return {"piece": i, "what": _what(i, config), "contexts": len(parts),
            "context_mb": round(sum(f.stat().st_size for p in parts for f in [p.context, *p.binaries]) / 1e6),
            "whole": all(p.whole for p in parts), "nodes": sum(r.get("nodes", 0) for r in trace),
            "ours_max_abs": ours["max_abs"], "ours_1mcos": 1 - ours["min_cosine"], "finite": bool(
                all(np.isfinite(v).all() for v in got.values())),
            "torch_fp16_max_abs": low["max_abs"], "torch_fp16_1mcos": 1 - low["min_cosine"],
            "seconds": round(wall, 1), "emulator_seconds": round(emulated, 1),
            "stage_seconds": {k: round(run.seconds[k] - seconds_before.get(k, 0), 1) for k in run.seconds},
            "peak_gb": round(peak_rss_bytes() / 1e9, 2)}


def _qnn_table(rows: list) -> None:
    print("| piece | what | contexts | MB | taken whole | QNN (fp16, emulated): max abs / 1-cos | finite "
          "| PyTorch fp16: max abs / 1-cos | convert s | emulator s | peak GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['piece']} | {r['what']} | {r['contexts']} | {r['context_mb']} | {r['whole']} | "
              f"{r['ours_max_abs']:.3g} / {r['ours_1mcos']:.3g} | {r['finite']} | "
              f"{r['torch_fp16_max_abs']:.3g} / {r['torch_fp16_1mcos']:.3g} | {r['seconds']} | "
              f"{r['emulator_seconds']} | {r['peak_gb']} |")


def _link(name: str) -> str:
    return name.removesuffix(".next")


def _what(i: int, config: dict) -> str:
    if "num_single_layers" not in config:  # one kind of block (Qwen-Image's)
        n = int(config.get("num_layers", 60))
        return ("embeddings + " if i == 0 else "") + f"block {i}" + (" + output layers" if i == n - 1 else "")
    doubles = int(config.get("num_layers", 19))
    total = doubles + int(config.get("num_single_layers", 38))
    if i == 0:
        return "embeddings + double-stream block 0"
    if i < doubles:
        return f"double-stream block {i}"
    return f"single-stream block {i - doubles}" + (" + output layers" if i == total - 1 else "")


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
