"""The offload report: ``dd/onnx_report.txt`` for people, ``dd/report.json`` for programs.

Built from what the compiler recorded, never by counting op types afterwards: the partition's regions and
CPU reasons (node metadata ``sdnpu.region`` / ``sdnpu.cpu_reason``), the rules' provenance tags
(``sdnpu.rule``), the views each op absorbed (``sdnpu.views``), the assumed capabilities each op relies on
(``sdnpu.assumed``) and the passes' counts. The offload rate is AMD's, under the model's target: dispatch ops
(the target's registry ops) / (dispatch ops + every other node, the boundary casts included).

Multiply-accumulates are counted over every op that has them: the dispatch ops from their attributes, the CPU
ones (Conv, ConvTranspose, MatMul, Gemm, Einsum, contrib attention) from their tensors' shapes. Where shapes
are missing nothing can be counted, and the share is "unknown" rather than a flattering 100%.
"""

from __future__ import annotations

import json
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import onnx

from sdnpu import __version__
from sdnpu.fileio import atomic_write_text
from sdnpu.formats import handoff, prologue
from sdnpu.formats.keys import ASSUMED_TAG, REASON_TAG, REGION_TAG, RULE_TAG, TARGET_KEY, VIEWS_TAG
from sdnpu.ops.target import DispatchTarget, Target, get_target

SCHEMA_VERSION = 2


def _meta(node: onnx.NodeProto) -> dict[str, str]:
    return {p.key: p.value for p in node.metadata_props}


def _shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    """Each value's static shape; [] where a dimension is symbolic or unknown (a text length that depends on a
    mask's values), as for a value without a shape: its ops' MACs are not known, never counted as 0."""
    shapes = {}
    for vi in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        dims = vi.type.tensor_type.shape.dim
        shapes[vi.name] = [d.dim_value for d in dims] if all(d.HasField("dim_value") for d in dims) else []
    for init in model.graph.initializer:
        shapes[init.name] = list(init.dims)
    return shapes


def _prod(xs: list[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def macs(node: onnx.NodeProto, shapes: dict[str, list[int]], target: Target) -> int | None:
    """Multiply-accumulates of ``node``: 0 for ops without any, None where they cannot be counted."""
    if isinstance(target, DispatchTarget) and target.is_dispatch(node.domain, node.op_type):
        spec = target.base_spec(node.op_type)
        return spec.macs(_attrs(node)) if spec.macs is not None else 0
    if node.domain not in ("", "ai.onnx", "com.microsoft"):
        return 0
    op = node.op_type
    ins = [shapes.get(n, []) for n in node.input]
    out = shapes.get(node.output[0], []) if node.output else []
    if op in ("Conv", "ConvTranspose"):
        if len(ins) < 2 or not ins[1] or not out:
            return None
        w = ins[1]
        if op == "Conv":
            return _prod(out) * _prod(w[1:])  # IC/g * KH * KW per output
        return _prod(ins[0]) * _prod(w[1:])  # ConvTranspose: every input value meets OC/g * KH * KW weights
    if op in ("MatMul", "Gemm"):
        if not ins or not ins[0] or not out:
            return None
        k = ins[0][-1] if not (op == "Gemm" and _attrs(node).get("transA")) else ins[0][0]
        return _prod(out) * k
    if op == "Einsum":
        if not out or not ins or any(not s for s in ins):
            return None
        eq = str(_attrs(node).get("equation", b"")).replace("b'", "").replace("'", "")
        lhs = eq.split("->")[0].split(",")
        if len(lhs) < 2:  # one operand: a permutation or a sum (SD3's unpatchify), no products
            return 0
        sizes = {c: d for term, s in zip(lhs, ins, strict=False) for c, d in zip(term.strip(), s, strict=False)}
        return _prod(list(sizes.values()))
    if op in ("Attention", "MultiHeadAttention"):
        if len(ins) > 2 and len(ins[0]) == 4 and len(ins[1]) == 4 and len(ins[2]) == 4:  # ONNX's [B, H, S, D]
            b, h, m, dq = ins[0]
            return b * h * m * ins[1][2] * (dq + ins[2][3])
        if not ins or len(ins[0]) != 3:
            return None
        b, m, c = ins[0]
        n = ins[1][1] if len(ins) > 1 and len(ins[1]) == 3 else m
        return 2 * b * m * n * c
    return 0


def macs_of(model: onnx.ModelProto, target: Target) -> int:
    """The multiply-accumulates of ``model``'s graph (nodes whose count is not known count 0)."""
    shapes = _shapes(model)
    return sum(macs(node, shapes, target) or 0 for node in model.graph.node)


def build(replaced: Path, source_model: Path | None, passes: list[dict[str, Any]],
          info: dict[str, Any] | None = None, fidelity: dict[str, Any] | None = None,
          target: Target | None = None) -> dict[str, Any]:
    """The report's data, from the dispatch model and the passes that made it."""
    model = onnx.load(str(replaced), load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    target = target or get_target(meta.get(TARGET_KEY, "amd-xdna2"))
    shapes = _shapes(model)
    offloaded, cpu, rules = [], [], Counter()
    mac_npu = mac_cpu = 0
    uncounted = 0
    views: Counter[str] = Counter()
    assumed: Counter[str] = Counter()
    assumed_ops = 0
    for node in model.graph.node:
        meta_n = _meta(node)
        if RULE_TAG in meta_n and target.is_dispatch(node.domain, node.op_type):
            rules[meta_n[RULE_TAG]] += 1
        m = macs(node, shapes, target)
        if m is None:
            uncounted += 1
            m = 0
        if REGION_TAG in meta_n:
            offloaded.append(node)
            mac_npu += m
            for record in filter(None, meta_n.get(VIEWS_TAG, "").split(";")):
                views[node.op_type] += 1
            names = [a for a in meta_n.get(ASSUMED_TAG, "").split(",") if a]
            for a in names:
                assumed[f"{node.op_type}: {a}"] += 1
            assumed_ops += bool(names)
        else:
            cpu.append({"name": node.name, "op_type": node.op_type,
                        "reason": meta_n.get(REASON_TAG, "not assigned by the partitioner")})
            mac_cpu += m
    by_type = Counter(n.op_type for n in offloaded)
    regions: dict[int, int] = Counter(int(_meta(n)[REGION_TAG]) for n in offloaded)
    partition = next((p for p in passes if p["name"] == "partition"), {})
    total = len(offloaded) + len(cpu)
    weight_after = sum(_tensor_bytes(t) for t in model.graph.initializer)
    weight_before = None
    if source_model is not None:
        src = onnx.load(str(source_model), load_external_data=False)
        weight_before = sum(_tensor_bytes(t) for t in src.graph.initializer)
    mac_total = mac_npu + mac_cpu
    share = mac_npu / mac_total if mac_total and not uncounted else None
    steps = _prologue(replaced, model, len(offloaded), total)
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "sdnpu", "version": __version__},
        **(info or {}),
        "target": target.name,
        "model": replaced.name,
        "inputs": {i.name: shapes.get(i.name, []) for i in model.graph.input},
        "outputs": {o.name: shapes.get(o.name, []) for o in model.graph.output},
        "handoff": {k: {"dtype": "bfloat16", "to_reference": list(v)} for k, v in handoff.of_proto(model).items()},
        **({"prologue": steps} if steps is not None else {}),
        "summary": {
            "total_nodes": total,
            "offloaded_nodes": len(offloaded),
            "cpu_nodes": len(cpu),
            "offload_rate": len(offloaded) / total if total else 0.0,
            "macs_total": mac_total,
            "macs_offloaded_share": share,
            "macs_uncounted_nodes": uncounted,
            "npu_regions": len(regions),
            "transitions": int(partition.get("counts", {}).get("transitions", 0)),
            "cpu_islands": {k.removeprefix("CPU islands").strip() or "total": int(v)
                            for k, v in partition.get("counts", {}).items() if k.startswith("CPU islands")},
            "weight_bytes_before": weight_before,
            "weight_bytes_after": weight_after,
            "absorbed_views": sum(views.values()),
            "ops_on_assumed_capabilities": assumed_ops,
        },
        "offloaded_by_type": dict(sorted(by_type.items(), key=lambda kv: (-kv[1], kv[0]))),
        "rules_fired": dict(sorted(rules.items(), key=lambda kv: (-kv[1], kv[0]))),
        "absorbed_views": dict(sorted(views.items(), key=lambda kv: (-kv[1], kv[0]))),
        "assumed_capabilities": dict(sorted(assumed.items(), key=lambda kv: (-kv[1], kv[0]))),
        "cpu_nodes": cpu,
        "regions": partition.get("regions", []),
        "passes": passes,
        "fidelity": fidelity,
    }


def _prologue(replaced: Path, model: onnx.ModelProto, offloaded: int, total: int) -> dict[str, Any] | None:
    """The step prologue of the dispatch model (``sdnpu.formats.prologue``): its file, digest, inputs and values,
    its CPU nodes with their reasons, and the offload rate with them counted in this graph (as if it did that
    work alone, as a graph without a prologue does)."""
    spec = prologue.of_proto(model)
    if spec is None:
        return None
    nodes = onnx.load(str(prologue.require(spec.path(replaced)))).graph.node
    cpu = [{"name": n.name, "op_type": n.op_type, "reason": _meta(n).get(REASON_TAG, "")} for n in nodes]
    return {"file": spec.file, "digest": spec.digest, "inputs": list(spec.inputs), "outputs": list(spec.outputs),
            "cpu_nodes": cpu, "offload_rate_with_it": offloaded / (total + len(cpu)) if total + len(cpu) else 0.0}


def _tensor_bytes(t: onnx.TensorProto) -> int:
    for entry in t.external_data:
        if entry.key == "length":
            return int(entry.value)
    if t.raw_data:
        return len(t.raw_data)
    itemsize = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return _prod(list(t.dims)) * itemsize


def _gb(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _lora_names(loras: list[dict[str, Any]]) -> str:
    return ", ".join(f"{x['name']}:{x['scale']:g} ({x['format']})" for x in loras)


def _islands_line(s: dict[str, Any]) -> list[str]:
    i = s.get("cpu_islands") or {}
    if "total" not in i:
        return []
    return [f"CPU islands            {i['total']} ({i.get('at the edges', 0)} at the edges, "
            f"{i.get('around ops the registry lacks', 0)} around ops the registry",
            f"                       lacks, {i.get('avoidable', 0)} avoidable)"]


def _lora_lines(r: dict[str, Any]) -> list[str]:
    """The LoRAs the weights carry: fused at conversion, and/or applied since (``sdnpu lora apply``)."""
    fused, applied = r.get("lora_fused"), r.get("lora")
    if not fused and not applied:
        return []
    lines = ["LoRA", "-" * 79]
    if fused:
        lines += textwrap.wrap(f"fused at conversion (diffusers' fuse_lora, {fused['modules']} modules): "
                               f"{_lora_names(fused['fused'])}", 77, initial_indent="  ", subsequent_indent="    ")
    if applied:
        lines += textwrap.wrap(f"applied (sdnpu lora apply; dd/lora/ over the base weights, which stay as they "
                               f"are): {_lora_names(applied['applied'])}", 77, initial_indent="  ",
                               subsequent_indent="    ")
        lines += textwrap.wrap(f"{applied['modules']} modules changed, {applied['tensors']} dispatch-model weights "
                               f"replaced ({_gb(applied['bytes'])}); graph, fusions and offload unchanged", 77,
                               initial_indent="  ", subsequent_indent="    ")
        for kind, label in (("fidelity", "once per op"), ("fidelity_pessimistic", "bf16 intermediates")):
            fid = applied.get(kind)
            if fid:
                lines += textwrap.wrap(f"against the fp32 graph with the same LoRAs ({label}): min cosine "
                                       f"{fid['min_cosine']:.6f}, max abs {fid['max_abs']:.3e}", 77,
                                       initial_indent="  ", subsequent_indent="    ")
        if not applied.get("fidelity"):
            lines.append("  fidelity with the LoRAs: not measured (sdnpu verify measures it)")
    return lines + [""]


def bf16_sensitive(fid: dict[str, Any]) -> str:
    """The line that says a dispatch model's loss is the graph's own sensitivity to bf16 (``fid["bf16_rounding"]``:
    the compile sets the graph's op-by-op bf16 rounding beside a loss past what bf16 usually loses)."""
    b = fid["bf16_rounding"]
    where = ", ".join(f"{d['op_type']} {d['node']}" for d in b["departures"][:3]) or "no single node"
    return (f"bf16-sensitive graph: cosine {fid['min_cosine']:.4f} against fp32, where the graph itself rounded to "
            f"bf16 op by op keeps {b['min_cosine']:.4f} ({b['ratio']:.2f}x its error); bf16's error grows first "
            f"at {where}")


def render_text(r: dict[str, Any]) -> str:
    """The report for an 80-column terminal."""
    s = r["summary"]
    lines = [f"sdnpu offload report: {r.get('component', r['model'])}", "=" * 79]
    src = r.get("source")
    if src:
        lines.append(f"source      {src.get('name')} ({src.get('kind')}, fingerprint {src.get('fingerprint')})")
    size = r.get("size")
    if size:
        batch = r.get("batch")
        lines.append(f"size        {size['width']}x{size['height']} px"
                     + (f"   batch {batch} (2 rows an image with guidance, 1 without)"
                        if batch is not None else ""))
    lines.append(f"target      {r.get('target', '?')}   precision {r.get('precision', 'bf16')}   "
                 f"tool sdnpu {r['tool']['version']}")
    kept = r.get("handoff", {})
    for kind in ("inputs", "outputs"):
        for name, shape in r[kind].items():
            form = "   bf16, the NPU's layout (handoff)" if name in kept else ""
            lines.append(f"{kind[:-1]:<11} {name} {shape}{form}")
    dropped = r.get("dropped_outputs")
    if dropped:
        lines.append(f"dropped     {len(dropped)} outputs the pipeline does not read (--outputs all keeps them):")
        lines += textwrap.wrap(", ".join(dropped), 79, initial_indent=" " * 12, subsequent_indent=" " * 12)
    lines += ["", "Summary", "-" * 79,
              f"total nodes            {s['total_nodes']}",
              (f"offloaded (dd fusion)  {s['offloaded_nodes']}" if "qnn" not in r else
               f"on the NPU (table)     {s['offloaded_nodes']}   (sdnpu's count by the target's table)"),
              f"CPU nodes              {s['cpu_nodes']}",
              (f"offload rate           {100 * s['offload_rate']:.2f}%  "
               f"({s['offloaded_nodes']} / ({s['offloaded_nodes']} + {s['cpu_nodes']}))"),
              *_prologue_summary(r),
              (f"MACs offloaded         {100 * s['macs_offloaded_share']:.2f}% of {s['macs_total']:,}"
               if s.get("macs_offloaded_share") is not None else
               f"MACs offloaded         unknown ({s.get('macs_uncounted_nodes', 0)} nodes without shapes)"),
              *([] if "qnn" in r else [
                  f"views absorbed         {s.get('absorbed_views', 0)} (Reshapes read as the op's own shape)",
                  f"assumed capabilities   {s.get('ops_on_assumed_capabilities', 0)} ops rely on one"]),
              f"NPU regions            {s['npu_regions']}",
              f"CPU<->NPU transitions  {s['transitions']}",
              *_islands_line(s),
              f"weights                {_gb(s['weight_bytes_before'])} -> {_gb(s['weight_bytes_after'])}",
              *(["fp32 graph             none kept (--dispatch-only): generate --reference cannot run it"]
                if (r.get("blockwise") or {}).get("dispatch_only") else []),
              ""]
    lines += _lora_lines(r)
    lines += _vendor_lines(r)
    lines += _headroom_lines(r)
    lines += ["Offloaded ops by type", "-" * 79]
    lines += [f"  {op:<24}{n:>6}" for op, n in r["offloaded_by_type"].items()]
    lines += ["", "Rules that fired", "-" * 79]
    lines += [f"  {rule:<24}{n:>6}" for rule, n in r["rules_fired"].items()]
    if r.get("absorbed_views"):
        lines += ["", "Views absorbed (by the op that reads them)", "-" * 79]
        lines += [f"  {op:<24}{n:>6}" for op, n in r["absorbed_views"].items()]
    if r.get("assumed_capabilities"):
        lines += ["", "Assumed capabilities (no public source states them)", "-" * 79]
        lines += [f"  {cap[:70]:<70}{n:>6}" for cap, n in r["assumed_capabilities"].items()]
    lines += ["", f"CPU nodes ({len(r['cpu_nodes'])})", "-" * 79]
    for c in r["cpu_nodes"]:
        lines.append(f"  {c['op_type']:<13} {c['name']}"[:79])
        lines += textwrap.wrap(c["reason"], 79, initial_indent=" " * 16, subsequent_indent=" " * 16) or [""]
    steps = r.get("prologue")
    if steps:
        lines += ["", f"Step prologue: {steps['file']} ({len(steps['cpu_nodes'])} CPU nodes, digest {steps['digest']})",
                  "-" * 79]
        lines += textwrap.wrap(f"the CPU work on {', '.join(steps['inputs'])}, moved out of this graph: its values "
                               f"({', '.join(steps['outputs'])}) are this graph's inputs. The runtime runs it "
                               "once for the models whose prologue has this digest (a ControlNet and the UNet that "
                               "takes its residuals: once a step), and once a generation where its inputs are the "
                               "same every step (Flux.1's position ids).", 77, initial_indent="  ",
                               subsequent_indent="  ")
        for c in steps["cpu_nodes"]:
            lines.append(f"  {c['op_type']:<14}{c['reason'][:62]}")
    lines += ["", f"NPU regions ({len(r['regions'])})", "-" * 79]
    for reg in r["regions"]:
        lines.append(f"  region {reg['index']}: {len(reg['nodes'])} ops, {len(reg['inputs'])} inputs, "
                     f"{len(reg['outputs'])} outputs")
        lines.append(f"    in:  {', '.join(reg['inputs'])[:70]}")
        lines.append(f"    out: {', '.join(reg['outputs'])[:70]}")
    lines += ["", "Fidelity against the fp32 graph", "-" * 79]
    fid = r.get("fidelity")
    if not fid:
        lines += textwrap.wrap("not measured" + (f": {r['fidelity_skipped']}" if r.get("fidelity_skipped") else ""),
                               77, initial_indent="  ", subsequent_indent="    ")
    else:
        for name, e in fid["outputs"].items():
            psnr = f"  PSNR {e['psnr_db']:.1f} dB" if "psnr_db" in e else ""
            lines.append(f"  {name[:28]:<28} max abs {e['max_abs']:.3e}  cosine {e['cosine']:.6f}{psnr}")
            if e.get("reference_not_finite"):
                lines.append(f"    the fp32 graph's own {name[:28]} holds {e['reference_not_finite']} values that are "
                             "not finite: measured over the finite ones")
        pes = r.get("fidelity_pessimistic")
        if pes:
            lines.append("  every body intermediate in bf16 (pessimistic; the above: once per op):")
            for name, e in pes["outputs"].items():
                psnr = f"  PSNR {e['psnr_db']:.1f} dB" if "psnr_db" in e else ""
                lines.append(f"  {name[:28]:<28} max abs {e['max_abs']:.3e}  cosine {e['cosine']:.6f}{psnr}")
        if fid.get("bf16_rounding"):
            lines += textwrap.wrap(bf16_sensitive(fid), 77, initial_indent="  ", subsequent_indent="    ")
        rounding = fid.get("input_rounding")
        if rounding and rounding.get("inputs"):
            lines += textwrap.wrap("the fp32 graph on each float input rounded to fp16 (as the HTP takes it): "
                                   + ", ".join(f"{k} cosine {c:.6f}" for k, c in rounding["inputs"].items()), 77,
                                   initial_indent="  ", subsequent_indent="    ")
        if fid.get("inputs"):
            lines += textwrap.wrap(f"inputs: {fid['inputs']}", 77, initial_indent="  ", subsequent_indent="    ")
        pipe = fid.get("pipeline")
        if pipe:
            lines.append(f"  whole pipeline, {pipe['steps']} steps, seed {pipe['seed']}: image PSNR "
                         f"{pipe['psnr_db']:.1f} dB against the fp32 graphs")
    lines += _size_lines(r)
    lines += ["", "Passes", "-" * 79]
    lines += _pass_lines(r["passes"])
    return "\n".join(lines) + "\n"


def _pass_lines(passes: list[dict[str, Any]]) -> list[str]:
    """One line a pass; a group's steps (``canonical/opset``, ...) under a line naming the group, indented, in a
    name column of their own width (the other passes keep theirs)."""
    shown = [(p, *p["name"].partition("/")) for p in passes]
    width = max([11, *(len(step) + 1 for _, _, _, step in shown if step)])
    lines: list[str] = []
    group = None
    for p, top, _, step in shown:
        if step and top != group:
            lines.append(f"  {top}")
        group = top if step else None
        counts = ", ".join(f"{k} {v}" for k, v in p["counts"].items() if v)
        if step:
            lines.append(f"    {step:<{width}}{p['seconds']:>6.1f} s  {counts[:66 - width]}".rstrip())
        else:
            lines.append(f"  {top:<13}{p['seconds']:>6.1f} s  {counts[:55]}".rstrip())
    return lines


def _vendor_lines(r: dict[str, Any]) -> list[str]:
    """What the vendor's compiler made of the graph (qnn-htp: QNN's own count from its op trace), beside
    sdnpu's count above."""
    q = r.get("qnn")
    if not q:
        return []
    t = q.get("trace") or {}
    v = q.get("versions", {})
    total, taken = t.get("total_onnx_nodes", 0), t.get("supported_nodes", 0)
    lines = ["Qualcomm's compiler (QNN's own count, from its op trace)", "-" * 79,
             f"QNN                    {v.get('qnn', '?')} (onnxruntime-qnn {v.get('onnxruntime_qnn', '?')}), HTP "
             f"{q.get('arch')} (soc_model {q.get('soc_model')}){', emulated on x86-64' if q.get('emulated') else ''}",
             "taken whole            " + ("yes: CPU fallback disabled, every node on the HTP" if q.get("whole")
                                             else "no"),
             f"QNN takes              {taken} of {total} nodes ({100 * taken / total if total else 0:.2f}%), "
             f"{t.get('unsupported_nodes', 0)} refused",
             f"QNN partitions, ops    {t.get('qnn_subgraphs', 0)}, {t.get('total_qnn_ops', 0)} QNN ops",
             f"context                {q.get('context')} + {', '.join(q.get('binaries', []))} "
             f"({_gb(q.get('context_bytes'))}), compiled in {q.get('compile_seconds', 0):.1f} s"]
    pieces = q.get("pieces") or []
    if pieces:
        why = (f"one holds at most {q['context_gb']} GB of fp16 weights (the HTP's 32-bit address space; "
               "--context-gb)" if q.get("context_gb") else "one per piece of the block-by-block conversion")
        lines += textwrap.wrap(f"{len(pieces)} contexts, chained: {why}", 79,
                               initial_indent="contexts               ", subsequent_indent=" " * 23)
        for i, p in enumerate(pieces, 1):
            lines.append(f"  {i}: {p.get('nodes', '?')} nodes, {_gb(p.get('weight_bytes'))} of weights -> "
                         f"{', '.join(p['binaries'])} ({_gb(p['context_bytes'])}, {p['compile_seconds']:.1f} s)"
                         + ("" if p.get("whole", True) else ", not whole"))
    if q.get("failure"):
        lines += textwrap.wrap(f"with fallback disabled QNN said: {q['failure']}", 77, initial_indent="  ",
                               subsequent_indent="    ")
    for n in t.get("refused", []):
        lines.append(f"  {n['op_type']:<13} {n['name']}"[:79])
        lines += textwrap.wrap(n["reason"], 79, initial_indent=" " * 16, subsequent_indent=" " * 16) or [""]
    return lines + [""]


def _headroom_lines(r: dict[str, Any]) -> list[str]:
    """The tensors within 4x of fp16's largest value in the fp32 run, for a target that computes in fp16."""
    if "fp16_headroom" not in r:
        return []
    near = r["fp16_headroom"]
    lines = ["fp16 headroom (tensors within 4x of 65504 in the fp32 run)", "-" * 79]
    if near is None:
        return lines + ["  not measured (no fidelity run)", ""]
    if not near:
        return lines + ["  none: every tensor stays below 16376 on the check's inputs", ""]
    for e in near:
        lines.append(f"  {e['tensor'][:48]:<48} max |x| {e['max_abs']:.4g} ({e['of_fp16_max']:.3g} of it)")
        after = e.get("after")
        guard = (f"guard: {e['guard']}" if e.get("guard") else "no guard: QNN computes it in fp16 as it is")
        if after is not None:
            guard += f"; after the rewrite max |x| {after:.4g}"
        lines += textwrap.wrap(guard, 77, initial_indent="    ", subsequent_indent="      ")
    return lines + [""]


def _prologue_summary(r: dict[str, Any]) -> list[str]:
    steps = r.get("prologue")
    if not steps:
        return []
    s, n = r["summary"], len(steps["cpu_nodes"])
    return [f"step prologue          {n} CPU nodes in {steps['file']}, run apart (see below)",
            (f"with them counted here {100 * steps['offload_rate_with_it']:.2f}%  "
             f"({s['offloaded_nodes']} / ({s['offloaded_nodes']} + {s['cpu_nodes']} + {n}))")]


def write(dd_dir: Path, report: dict[str, Any], name: str = "report.json", text: str = "onnx_report.txt") -> None:
    """The report as JSON and as text, in ``dd_dir`` (another size's: its ``WxH`` names, ``sdnpu.sizes``)."""
    atomic_write_text(dd_dir / name, json.dumps(report, indent=2, default=str) + "\n")
    atomic_write_text(dd_dir / text, render_text(report))


def _file_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def write_sizes(comp_dir: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Add the sizes table (one entry per size of ``sizes.json``, and the total) to the primary size's
    report (``dd/report.json``, ``dd/onnx_report.txt``), and return it."""
    dd = comp_dir / "dd"
    primary = json.loads((dd / "report.json").read_text())
    rows = []
    total = {"graph_bytes": 0, "own_data_bytes": 0}
    for entry in manifest.get("sizes", []):
        path = comp_dir / entry["report"]
        r = primary if entry["report"] == "dd/report.json" else json.loads(path.read_text())
        graph = comp_dir / entry["dispatch"]
        s = r["summary"]
        row = {"size": entry["size"], "report": entry["report"], "offload_rate": s["offload_rate"],
               "offloaded_nodes": s["offloaded_nodes"], "cpu_nodes": s["cpu_nodes"], "npu_regions": s["npu_regions"],
               "graph_bytes": _file_bytes(graph),
               "own_data_bytes": 0 if entry["report"] == "dd/report.json" else
               _file_bytes(graph.with_name(graph.name + ".data"))}
        rows.append(row)
        total["graph_bytes"] += row["graph_bytes"]
        total["own_data_bytes"] += row["own_data_bytes"]
    shared_data = dd / "replaced.onnx.data"
    table = {"sizes": rows, "shared_data": shared_data.name if shared_data.is_file() else None,
             "shared_data_bytes": _file_bytes(shared_data), **total,
             "total_bytes": _file_bytes(shared_data) + total["graph_bytes"] + total["own_data_bytes"]}
    primary["sizes"] = table
    write(dd, primary)
    return table


def _size_lines(r: dict[str, Any]) -> list[str]:
    t = r.get("sizes")
    if not t or len(t["sizes"]) < 2:
        return []
    lines = ["", f"Sizes ({len(t['sizes'])}; one copy of the weights, "
             f"{t['shared_data'] or 'inside the primary graph'}: {_gb(t['shared_data_bytes'])})", "-" * 79,
             f"  {'size':<11}{'offload':>9}{'dispatch':>10}{'CPU':>6}{'regions':>9}{'graph':>12}{'own data':>12}"]
    for row in t["sizes"]:
        lines.append(f"  {row['size']:<11}{100 * row['offload_rate']:>8.2f}%{row['offloaded_nodes']:>10}"
                     f"{row['cpu_nodes']:>6}{row['npu_regions']:>9}{_mb(row['graph_bytes']):>12}"
                     f"{_mb(row['own_data_bytes']):>12}")
    npu = sum(x["offloaded_nodes"] for x in t["sizes"])
    cpu = sum(x["cpu_nodes"] for x in t["sizes"])
    lines.append(f"  {'total':<11}{100 * npu / (npu + cpu) if npu + cpu else 0:>8.2f}%{npu:>10}{cpu:>6}{'':>9}"
                 f"{_mb(t['graph_bytes']):>12}{_mb(t['own_data_bytes']):>12}")
    lines.append(f"  dispatch models on disk: {_gb(t['total_bytes'])} for {len(t['sizes'])} sizes (the shared data, "
                 "every graph and its own data)")
    return lines


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"
