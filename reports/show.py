"""``sdnpu report``: find reports under a path, print them, compare two, gate on a rate, and draw one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import onnx

from sdnpu.components import order_key, ordered
from sdnpu.errors import SdnpuError
from sdnpu.formats.keys import TARGET_KEY
from sdnpu.formats.sizes import sizes_of
from sdnpu.reports.report import build

SCHEMA = Path(__file__).with_name("report.schema.json")


def validate(report: dict[str, Any], where: Path) -> None:
    import jsonschema  # jsonschema at first use: the CLI starts without it (40-60 ms)

    try:
        jsonschema.validate(report, json.loads(SCHEMA.read_text()))
    except jsonschema.ValidationError as e:
        raise SdnpuError(f"{where} does not follow the report schema: {e.message}",
                         hint="regenerate it with `sdnpu compile` / `sdnpu convert`") from e


def _read(path: Path) -> dict[str, Any]:
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SdnpuError(f"cannot read the report {path}: {e}") from e
    validate(report, path)
    return report


def _from_onnx(path: Path) -> dict[str, Any]:
    """A report for a dispatch model that has none beside it (rebuilt from the model's own tags)."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError and friends
        raise SdnpuError(f"{path} is not a readable ONNX model: {type(e).__name__}: {e}") from e
    if not any(p.key == TARGET_KEY for p in model.metadata_props):
        raise SdnpuError(f"{path} is not a dispatch model: no target is recorded in it",
                         hint="compile it first: `sdnpu compile MODEL.onnx`")
    return build(path, None, [], {"component": path.parent.parent.name})


def find(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(component, report) pairs under ``path``: an output folder, a component folder, a dd/ folder, a
    report.json or a replaced.onnx."""
    return [(name, report) for name, report, _ in find_with_models(path)]


def _named(found: list[tuple[str, dict[str, Any], Path]]) -> list[tuple[str, dict[str, Any], Path]]:
    """Each report is named by the component it records, the folder name only where it has none."""
    out = []
    for name, r, m in found:
        label = str(r.get("component") or name)
        size = r.get("size")
        several = m.name not in ("replaced.onnx", "model.onnx") or len((r.get("sizes") or {}).get("sizes", [])) > 1
        if several and size:  # a component converted at several sizes: each line names its size
            label += f" {size['width']}x{size['height']}"
        out.append((label, r, m))
    return out


def find_with_models(path: Path) -> list[tuple[str, dict[str, Any], Path]]:
    """Like ``find``, with the dispatch model each report describes."""
    return _named(_find(Path(path)))


def _find(path: Path) -> list[tuple[str, dict[str, Any], Path]]:
    path = Path(path)
    if not path.exists():
        raise SdnpuError(f"{path} does not exist", hint="give an output folder, a component folder or a report")
    if path.is_file():
        if path.suffix == ".json":
            return [(path.parent.parent.name, _read(path), path.with_name(path.name.replace("report", "replaced", 1)
                                                                          .removesuffix(".json") + ".onnx"))]
        if path.suffix == ".onnx":
            beside = path.with_name(path.name.replace("replaced", "report", 1).removesuffix(".onnx") + ".json")
            return [(path.parent.parent.name, _read(beside) if beside.exists() else _from_onnx(path), path)]
        raise SdnpuError(f"{path} is neither a report.json nor an .onnx file")
    if (path / "report.json").is_file():
        return [(path.parent.name, _read(path / "report.json"), _model_of(path / "report.json"))]
    here = [path / d / "report.json" for d in OUT_DIRS if (path / d / "report.json").is_file()]
    if here:
        out = []
        for candidate in here:
            name = _labelled(path.name, candidate, len(here))
            out += [(name, _read(candidate), _model_of(candidate)),
                    *(_other_sizes(path, name) if candidate.parent.name == "dd" else [])]
        return out
    found = sorted((p.parent.parent.name, p) for d in OUT_DIRS for p in path.glob(f"*/{d}/report.json"))
    if not found:
        raise SdnpuError(f"no offload report under {path}",
                         hint="reports are written by `sdnpu convert` (OUT/<component>/dd/report.json, or "
                         "qnn/report.json for --target qnn-htp)")
    found.sort(key=lambda item: (order_key(item[0]), item[1].parent.name))
    out = []
    for name, p in found:  # each component's primary size, then its other sizes (sizes.json)
        both = sum(1 for d in OUT_DIRS if (p.parent.parent / d / "report.json").is_file())
        label = _labelled(name, p, both)
        out.append((label, _read(p), _model_of(p)))
        out += _other_sizes(p.parent.parent, label) if p.parent.name == "dd" else []
    return out


# the folders a compile writes beside model.onnx, by target kind: AMD's dispatch model, Qualcomm's QNN model
OUT_DIRS = ("dd", "qnn")


def _model_of(report: Path) -> Path:
    """The model a report describes: the dispatch model (dd/), or the graph QNN compiled (qnn/)."""
    return report.with_name("model.onnx" if report.parent.name == "qnn" else "replaced.onnx")


def _labelled(name: str, report: Path, compiles: int) -> str:
    """A component compiled for two targets names the second's: ``unet [qnn]``."""
    return f"{name} [{report.parent.name}]" if compiles > 1 and report.parent.name != "dd" else name


def _other_sizes(comp_dir: Path, name: str) -> list[tuple[str, dict[str, Any], Path]]:
    return [(name, _read(comp_dir / f.report), comp_dir / f.dispatch) for f in sizes_of(comp_dir) if not f.primary]


def summary_lines(reports: list[tuple[str, dict[str, Any]]]) -> str:
    width = max([16, *(len(name) + 2 for name, _ in reports)])
    head = (f"{'component':<{width}}{'offload':>9}{'dispatch':>10}{'CPU':>6}{'regions':>9}{'MACs on NPU':>13}"
            f"{'min cosine':>12}")
    lines = [head, "-" * len(head)]
    tot_npu = tot_cpu = 0
    for name, r in reports:
        s = r["summary"]
        fid = r.get("fidelity")
        cos = f"{fid['min_cosine']:.6f}" if fid else "-"
        share = s.get("macs_offloaded_share")
        macs = f"{100 * share:>12.2f}%" if share is not None else f"{'unknown':>13}"
        q = (r.get("qnn") or {}).get("trace")
        vendor = (f"  QNN takes {q.get('supported_nodes', 0)}/{q.get('total_onnx_nodes', 0)}"
                  f"{', whole' if r['qnn'].get('whole') else ''}" if q else "")
        lines.append(f"{name:<{width}}{100 * s['offload_rate']:>8.2f}%{s['offloaded_nodes']:>10}{s['cpu_nodes']:>6}"
                     f"{s['npu_regions']:>9}{macs}{cos:>12}{vendor}")
        tot_npu += s["offloaded_nodes"]
        tot_cpu += s["cpu_nodes"]
    shared: dict[str, tuple[int, list[str]]] = {}  # a step prologue (sdnpu.formats.prologue) counts once
    for name, r in reports:
        steps = r.get("prologue")
        if steps:
            shared.setdefault(steps["digest"], (len(steps["cpu_nodes"]), []))[1].append(name)
    for digest, (n, names) in shared.items():
        lines.append(f"{'step prologue':<{width}}{'':>9}{0:>10}{n:>6}   {digest}: one run a step for "
                     + ", ".join(names))
        tot_cpu += n
    total = tot_npu + tot_cpu
    lines.append(f"{'total':<{width}}{100 * tot_npu / total if total else 0:>8.2f}%{tot_npu:>10}{tot_cpu:>6}")
    return "\n".join(lines) + "\n"


def diff(a: list[tuple[str, dict[str, Any]]], b: list[tuple[str, dict[str, Any]]]) -> str:
    """What changed from A to B, per component present in either (two sizes of one component compare as
    that component: ``sdnpu report diff unet/dd/report.json unet/dd/report.1152x896.json``)."""
    da, db = dict(a), dict(b)
    if da.keys() != db.keys():
        base_a, base_b = {n.split(" ")[0]: r for n, r in a}, {n.split(" ")[0]: r for n, r in b}
        if len(base_a) == len(a) and len(base_b) == len(b):
            da, db = base_a, base_b
    lines: list[str] = []
    for name in ordered(set(da) | set(db)):
        if name not in da or name not in db:
            lines.append(f"{name}: only in {'B' if name in db else 'A'}")
            continue
        ra, rb = da[name], db[name]
        sa, sb = ra["summary"], rb["summary"]
        sizes = [f"{r['size']['width']}x{r['size']['height']}" if r.get("size") else None for r in (ra, rb)]
        if sizes[0] != sizes[1] and all(sizes):
            lines.append(f"{name}: {sizes[0]} -> {sizes[1]}")
        lines.append(f"{name}: offload {100 * sa['offload_rate']:.2f}% -> {100 * sb['offload_rate']:.2f}% "
                     f"({100 * (sb['offload_rate'] - sa['offload_rate']):+.2f} pts), CPU nodes {sa['cpu_nodes']} -> "
                     f"{sb['cpu_nodes']}, regions {sa['npu_regions']} -> {sb['npu_regions']}")
        for op in sorted(set(ra["offloaded_by_type"]) | set(rb["offloaded_by_type"])):
            na, nb = ra["offloaded_by_type"].get(op, 0), rb["offloaded_by_type"].get(op, 0)
            if na != nb:
                lines.append(f"  {op:<20}{na:>6} -> {nb:<6}({nb - na:+d})")
        key = lambda c: (c["op_type"], c["reason"])  # noqa: E731 - names differ between runs; kind and reason do not
        ca = sorted(map(key, ra["cpu_nodes"]))
        cb = sorted(map(key, rb["cpu_nodes"]))
        for op, reason in sorted(set(cb) - set(ca)):
            lines.append(f"  + CPU {op} ({cb.count((op, reason))}x): {reason}")
        for op, reason in sorted(set(ca) - set(cb)):
            lines.append(f"  - CPU {op} ({ca.count((op, reason))}x): {reason}")
    return "\n".join(lines) + "\n"


def below(reports: list[tuple[str, dict[str, Any]]], percent: float) -> list[str]:
    """Components whose offload rate is under ``percent`` (a percent, as coverage tools read a gate: 99.5 is
    99.5%, 1 is 1%)."""
    if not 0 <= percent <= 100:  # also refuses nan
        raise SdnpuError(f"--fail-under takes a percent between 0 and 100, not {percent}", hint="e.g. --fail-under 99")
    threshold = percent / 100
    return [f"{name}: {100 * r['summary']['offload_rate']:.2f}% < {100 * threshold:.2f}%"
            for name, r in reports if r["summary"]["offload_rate"] < threshold]
