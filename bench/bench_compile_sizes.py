"""Compile time of many sizes: one full compile, then every other size re-derived from it, side by side with
compiling each of those sizes in full, in one run.

    python bench/bench_compile_sizes.py --models models/sdxl-base [--component unet] [--no-full]

Reads a component converted at several sizes (``--res sdxl-buckets``: the fp32 graphs ``model.onnx`` and
``model.WxH.onnx``). In a scratch folder (``--scratch``, default beside the models): compiles the primary's
fp32 graph in full (``sdnpu compile``'s path: passes, writing the bf16 weights, the full check, the report;
no fidelity run), then for each other size times what ``sdnpu convert`` does for it (``plan_specialization``
+ ``write_specialized``: re-derive, write the graph over the primary's data, the full check, the report), and
unless ``--no-full`` compiles that size in full too and checks that both graphs are the same, node for node
and tensor for tensor (names, types, shapes; the masks' bytes). Results go to bench/results.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _parts(path: Path) -> dict[str, object]:
    import onnx

    g = onnx.load(str(path), load_external_data=False).graph
    inits = {}
    for t in g.initializer:
        small = t.data_location != onnx.TensorProto.EXTERNAL
        inits[t.name] = (t.data_type, list(t.dims), bytes(t.raw_data) if small else None)
    return {"nodes": [n.SerializeToString() for n in g.node],
            "value_info": sorted(v.SerializeToString() for v in g.value_info),
            "io": [v.SerializeToString() for v in [*g.input, *g.output]], "initializers": inits}


def _mask_bytes(path: Path) -> dict[str, bytes]:
    """The attention masks' bytes, wherever the graph keeps them."""
    import onnx

    from sdnpu.convert import shared

    g = onnx.load(str(path), load_external_data=False).graph
    handles: dict = {}
    try:
        return {t.name: shared.tensor_bytes(path.parent, t, handles) for t in g.initializer if "mask" in t.name}
    finally:
        for f in handles.values():
            f.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="models/sdxl-base")
    p.add_argument("--component", default="unet")
    p.add_argument("--scratch", default=None)
    p.add_argument("--no-full", action="store_true", help="do not compile the other sizes in full")
    p.add_argument("--results", default=str(ROOT / "bench" / "results.md"))
    args = p.parse_args()

    from sdnpu.convert import shared
    from sdnpu.convert.compile import compile_file
    from sdnpu.convert.specialized import plan_specialization, write_specialized
    from sdnpu.passes.pipeline import CompileOptions
    from sdnpu.progress import release_memory
    from sdnpu.formats.sizes import sizes_of

    comp_dir = Path(args.models) / args.component
    sizes = sizes_of(comp_dir)
    if len(sizes) < 2:
        raise SystemExit(f"{comp_dir} holds {len(sizes)} size: convert it with --res sdxl-buckets first")
    scratch = Path(args.scratch) if args.scratch else comp_dir.parent / ".bench-compile-sizes"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    options = CompileOptions()
    rows = []
    try:
        primary = sizes[0]
        t0 = time.perf_counter()
        first = compile_file(comp_dir / primary.model, scratch / "dd", options, verify=False)
        one = time.perf_counter() - t0
        print(f"{primary.size} full compile {one:.1f} s, offload {100 * first['summary']['offload_rate']:.4f}%",
              flush=True)
        release_memory()
        dd = scratch / "dd" / "replaced.onnx"
        shared.make_shareable(dd)  # as convert does: a small model's weights move out of its graph, once
        total_spec = 0.0
        for f in sizes[1:]:
            source = comp_dir / f.model
            t0 = time.perf_counter()
            plan = plan_specialization(dd, source, options.target)
            planned = time.perf_counter() - t0
            out_name = f"replaced.{f.size}.onnx"
            report, stats = write_specialized(plan, scratch / "dd" / out_name, scratch / f"r-{f.size}",
                                              {"component": args.component}, options, None)
            spec = time.perf_counter() - t0
            total_spec += spec
            row = {"size": str(f.size), "specialize_s": round(spec, 2), "plan_s": round(planned, 3),
                   "offload": report["summary"]["offload_rate"], "graph_bytes": stats.graph_bytes,
                   "own_bytes": stats.own_bytes}
            if not args.no_full:
                t0 = time.perf_counter()
                full = compile_file(source, scratch / "full", options, verify=False)
                row["full_s"] = round(time.perf_counter() - t0, 1)
                a, b = _parts(scratch / "dd" / out_name), _parts(scratch / "full" / "replaced.onnx")
                same = {k: a[k] == b[k] if k != "initializers" else
                        {n: v[:2] for n, v in a[k].items()} == {n: v[:2] for n, v in b[k].items()}  # type: ignore[union-attr]
                        for k in a}
                masks = _mask_bytes(scratch / "dd" / out_name), _mask_bytes(scratch / "full" / "replaced.onnx")
                same["masks"] = masks[0] == masks[1]
                row["identical"] = all(same.values())
                row["differs"] = [k for k, v in same.items() if not v]
                row["full_offload"] = full["summary"]["offload_rate"]
                shutil.rmtree(scratch / "full")
                release_memory()
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    total = one + total_spec
    lines = [f"## Compile time of {len(sizes)} sizes: {args.component} of {Path(args.models).name}", "",
             f"`python bench/bench_compile_sizes.py --models {args.models} --component {args.component}`"
             f"{' --no-full' if args.no_full else ''}; one run, the same machine. The primary ({sizes[0].size}) "
             "compiled in full (passes, bf16 weights written, full check, report; no fidelity run); every other "
             "size re-derived from it as `sdnpu convert` does (re-derive, write the graph over the primary's "
             "data, full check, report)" + ("" if args.no_full else ", and compiled in full for comparison") + ".",
             "", "| size | re-derived s | of which re-deriving s | full compile s | same graph as the full compile "
             "| offload |", "|---|---|---|---|---|---|",
             f"| {sizes[0].size} (primary) | — | — | {one:.1f} | — | {100 * first['summary']['offload_rate']:.4f}% |"]
    for r in rows:
        same = "—" if "identical" not in r else ("yes" if r["identical"] else "no: " + ", ".join(r["differs"]))
        lines.append(f"| {r['size']} | {r['specialize_s']:.2f} | {r['plan_s']:.2f} | {r.get('full_s', '—')} | "
                     f"{same} | {100 * r['offload']:.4f}% |")
    lines += ["", f"All {len(sizes)} sizes: {total:.1f} s against {one:.1f} s for one ({total / one:.2f}x)."]
    if not args.no_full:
        full_total = one + sum(r["full_s"] for r in rows)
        lines.append(f"Compiling every size in full: {full_total:.1f} s ({full_total / one:.2f}x).")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.results, "a") as fh:
        fh.write("\n" + text)
    sys.exit(0 if all(r.get("identical", True) for r in rows) else 1)


if __name__ == "__main__":
    main()
