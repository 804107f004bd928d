"""The ``qnn-htp`` target's backend: Qualcomm's own compiler and runtime for the Hexagon NPU, reached through
onnxruntime's QNN execution provider (the ``onnxruntime-qnn`` package, a plugin EP for onnxruntime >= 1.24).

- **Sessions** (``session``): the EP library registered once per process, the QNN device taken from
  onnxruntime's EP devices, the HTP backend (``libQnnHtp.so`` in the wheel) with fp16 precision on the chosen
  HTP generation (``htp_arch`` + ``soc_model``: the emulator needs both). On a Snapdragon machine that is the
  NPU; on x86-64 the same backend compiles with Qualcomm's compiler and runs on an *emulator* of the HTP,
  200-400x slower than onnxruntime's CPU provider, whose timings say nothing of the NPU's.
- **The compile** (``compile_context``): QNN's compiler builds the graph into a context binary, written as an
  EPContext model (``ctx.onnx``) with the binary beside it (an attribute holds at most 2 GB), first with CPU
  fallback disabled (the session fails unless QNN takes every node); where it refuses one, again with fallback,
  so that its op trace names what it refused and why.
- **QNN's own count** (``read_trace``): the EP's framework op trace (``qnn_op_trace.json``): ONNX nodes
  supported and not (with QNN's reasons), QNN subgraphs, QNN ops.

Facts measured here (onnxruntime 1.32, onnxruntime-qnn 2.7.0 / QNN 2.51): FACTS.md, 2026-12-05.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort

from sdnpu.errors import SdnpuError
from sdnpu.ops.qnn_htp import Arch, arch as parse_arch

log = logging.getLogger(__name__)

EP = "QNNExecutionProvider"
CONTEXT = "ctx.onnx"  # the EPContext model, beside the graph it was compiled from
TRACE = "qnn_op_trace.json"
INSTALL = "pip install onnxruntime-qnn==2.7.0 (make venv installs it)"
# QNN's word for a graph whose weights and activations do not fit the HTP's memory (the first half of the SDXL UNet
# at 1024 px, 2.59 GB of fp16 weights, at graph finalize): a smaller piece fits
OUT_OF_MEMORY = "QNN_COMMON_ERROR_MEM_ALLOC"
_registered = False


def require() -> Any:
    """The ``onnxruntime_qnn`` module; missing, one line that names the install."""
    try:
        import onnxruntime_qnn  # optional: onnxruntime-qnn may be missing (then one line names the install)
    except ImportError:
        raise SdnpuError("the qnn-htp target needs onnxruntime-qnn (Qualcomm's execution provider), which is not "
                         "installed", hint=INSTALL) from None
    return onnxruntime_qnn


def versions() -> dict[str, str]:
    """onnxruntime-qnn's and QNN's versions (the report records them)."""
    q = require()
    info = getattr(q, "build_and_package_info", None)
    return {"onnxruntime": ort.__version__, "onnxruntime_qnn": getattr(info, "__version__", "?"),
            "qnn": getattr(info, "qnn_version", "?")}


# The HTP emulator's pace on this machine's 2 cores, from the runs measured here: the fidelity run is skipped where
# it would take longer than SDNPU_EMULATOR_MINUTES (default 30), and the report says so and why.
EMULATOR_GMACS_PER_S = 0.45  # sd-turbo's UNet at 512 px: 402 GMAC in 876 s (2026-12-05; tiny graphs run slower a MAC)
EMULATOR_MINUTES_ENV = "SDNPU_EMULATOR_MINUTES"
EMULATOR_MINUTES = 30.0


def too_slow_to_emulate(macs: int) -> str:
    """Why a model of ``macs`` multiply-accumulates is not run on the emulator ("" where it is run): it would
    take longer than ``SDNPU_EMULATOR_MINUTES``."""
    raw = os.environ.get(EMULATOR_MINUTES_ENV, "")
    try:
        minutes = float(raw) if raw else EMULATOR_MINUTES
    except ValueError:
        raise SdnpuError(f"{EMULATOR_MINUTES_ENV}={raw!r} is not a number of minutes",
                         hint=f"e.g. {EMULATOR_MINUTES_ENV}=120, or unset it for {EMULATOR_MINUTES:g}") from None
    seconds = macs / 1e9 / EMULATOR_GMACS_PER_S
    if seconds <= minutes * 60:
        return ""
    took = f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.0f} min"
    return (f"the HTP emulator would take about {took} ({macs / 1e9:,.0f} GMAC at the {EMULATOR_GMACS_PER_S} GMAC/s "
            f"it runs here), more than {EMULATOR_MINUTES_ENV}={minutes:g} minutes allows; the fp32 run and the fp16 "
            "headroom ran, and on a Snapdragon machine `sdnpu verify` runs the compiled model on the NPU")


def _device() -> Any:
    global _registered
    q = require()
    if not _registered:
        # QNN's refusals are the report's to name, with their reasons: not onnxruntime's log lines on stderr
        ort.set_default_logger_severity(3)
        try:
            ort.register_execution_provider_library(EP, q.get_library_path())
        except Exception as e:  # registered already by someone else in this process
            if "already registered" not in str(e).lower():
                why = " ".join(str(e).split())[:300]
                raise SdnpuError(f"onnxruntime cannot load Qualcomm's execution provider: {why}",
                                 hint=f"onnxruntime-qnn 2.7.0 needs onnxruntime >= 1.24 ({INSTALL})") from None
        _registered = True
    devices = [d for d in ort.get_ep_devices() if d.ep_name == EP]
    if not devices:
        raise SdnpuError("onnxruntime lists no QNN device", hint=INSTALL)
    return devices[0]


def is_emulated() -> bool:
    """True where the HTP backend runs on the emulator (any machine that is not ARM64): slow, and its timings are
    not the NPU's."""
    return platform.machine().lower() not in ("arm64", "aarch64")


@dataclass(frozen=True)
class HtpOptions:
    """How a QNN session is made: the HTP generation, CPU fallback, the op trace, and an EPContext to write."""

    arch: Arch = field(default_factory=lambda: parse_arch(None))
    fallback: bool = False
    trace_dir: Path | None = None
    context: Path | None = None  # write the compiled EPContext model here (binary beside it)
    threads: int | None = None

    def provider_options(self) -> dict[str, str]:
        q = require()
        out = {"backend_path": q.get_qnn_htp_path(), "enable_htp_fp16_precision": "1",
               "htp_arch": str(self.arch.arch), "soc_model": str(self.arch.soc_model)}
        if self.arch.optimization is not None:
            out["htp_graph_finalization_optimization_mode"] = str(self.arch.optimization)
        if self.trace_dir is not None:
            out.update(enable_framework_op_trace="1", framework_op_trace_dir=str(self.trace_dir))
        return out


def session(path: Path, options: HtpOptions = HtpOptions()) -> Any:
    """An onnxruntime session of ``path`` on Qualcomm's HTP (its EPContext model, or any graph QNN compiles on
    load). Without ``options.fallback`` it fails unless QNN takes every node."""
    dev = _device()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if options.threads:
        so.intra_op_num_threads = options.threads
    if not options.fallback:
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    if options.context is not None:
        so.add_session_config_entry("ep.context_enable", "1")
        so.add_session_config_entry("ep.context_file_path", str(options.context))
        so.add_session_config_entry("ep.context_embed_mode", "0")
    so.add_provider_for_devices([dev], options.provider_options())
    return ort.InferenceSession(str(path), so)


def read_trace(path: Path) -> dict[str, Any]:
    """QNN's own count from its op trace: the summary, and each node it did not take with QNN's reason."""
    data = json.loads(Path(path).read_text())
    s = data.get("summary") or {}  # a field QNN has nothing for is null (fusion_count where it took no node)
    refused = [{"name": n.get("name") or n.get("node_name", "?"), "op_type": n.get("op_type", "?"),
                "reason": n.get("reason") or n.get("unsupported_reason") or "refused by QNN"}
               for n in data.get("unsupported_nodes") or []]
    return {"total_onnx_nodes": int(s.get("total_onnx_nodes") or 0), "supported_nodes": int(s.get("supported_nodes") or 0),
            "unsupported_nodes": int(s.get("unsupported_nodes") or 0), "qnn_subgraphs": int(s.get("qnn_subgraphs") or 0),
            "total_qnn_ops": int(s.get("total_qnn_ops") or 0), "fusion_count": dict(s.get("fusion_count") or {}),
            "refused": refused}


@dataclass
class Compiled:
    """What QNN's compiler made of one graph."""

    whole: bool  # taken whole, with CPU fallback disabled
    context: Path  # the EPContext model
    binaries: list[Path]
    trace: dict[str, Any]
    seconds: float
    failure: str = ""  # what QNN said when it would not take the graph whole
    pieces: list[dict[str, Any]] = field(default_factory=list)  # one per context, where the graph was cut

    def files(self) -> list[Path]:
        """What QNN wrote for it: the EPContext model, its binaries, the op trace (where there is one)."""
        trace = self.context.with_name(TRACE if self.context.name == CONTEXT else f"{self.context.stem}_{TRACE}")
        return [self.context, *self.binaries, *([trace] if trace.is_file() else [])]

    def record(self) -> dict[str, Any]:
        """What ``from_record`` needs, the files by name (``sdnpu.convert.kept``)."""
        return {"whole": self.whole, "context": self.context.name, "binaries": [b.name for b in self.binaries],
                "trace": self.trace, "seconds": self.seconds, "failure": self.failure}

    @classmethod
    def from_record(cls, record: dict[str, Any], folder: Path) -> Compiled:
        return cls(whole=bool(record["whole"]), context=folder / record["context"],
                   binaries=[folder / b for b in record["binaries"]], trace=dict(record["trace"]),
                   seconds=float(record["seconds"]), failure=str(record.get("failure", "")))

    def to_json(self) -> dict[str, Any]:
        return {"whole": self.whole, "context": self.context.name, "binaries": [b.name for b in self.binaries],
                "context_bytes": sum(b.stat().st_size for b in self.binaries) + self.context.stat().st_size,
                "compile_seconds": round(self.seconds, 2), **({"failure": self.failure} if self.failure else {}),
                **({"pieces": self.pieces} if self.pieces else {}), "trace": self.trace}


_SUMMED = ("total_onnx_nodes", "supported_nodes", "unsupported_nodes", "qnn_subgraphs", "total_qnn_ops")


def chain(parts: list[Compiled], graph: Any, out_dir: Path) -> Compiled:
    """Contexts QNN compiled from consecutive pieces of one graph as one EPContext model, ``out_dir/ctx.onnx``:
    their nodes in order (each EPContext node reads its own binary), the inputs and outputs of ``graph`` (an
    ``onnx.GraphProto``: the graph that was cut). The pieces' own EPContext models go; their binaries and traces
    stay. QNN's count is the pieces' counts summed."""
    nodes: list[Any] = []
    inits: dict[str, Any] = {}
    opsets: dict[str, int] = {}
    ends = {o.name for o in graph.output}
    between: dict[str, Any] = {}  # the values one piece hands the next: an EPContext node's types are not inferred
    for part in parts:
        m = onnx.load(str(part.context), load_external_data=False)
        nodes += m.graph.node
        between.update((v.name, v) for v in m.graph.output if v.name not in ends)
        for t in m.graph.initializer:  # a piece QNN did not take whole keeps CPU nodes and their weights
            inits.setdefault(t.name, t)
        for o in m.opset_import:
            opsets[o.domain] = max(opsets.get(o.domain, 0), o.version)
    names = [a.s for n in nodes if n.op_type == "EPContext" for a in n.attribute if a.name == "partition_name"]
    if len(set(names)) != len(names):
        raise SdnpuError("QNN named two compiled pieces alike; they cannot share one model",
                         hint="this is worth reporting with the model")
    out = onnx.helper.make_model(
        onnx.helper.make_graph(nodes, graph.name or "main_graph", list(graph.input), list(graph.output),
                               initializer=list(inits.values()), value_info=list(between.values())),
        opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in sorted(opsets.items())])
    ctx = out_dir / CONTEXT
    ctx.write_bytes(out.SerializeToString())
    for part in parts:
        part.context.unlink()
    trace: dict[str, Any] = {k: sum(p.trace.get(k, 0) for p in parts) for k in _SUMMED}
    trace["fusion_count"] = {}
    for p in parts:
        for k, v in p.trace.get("fusion_count", {}).items():
            trace["fusion_count"][k] = trace["fusion_count"].get(k, 0) + v
    trace["refused"] = [r for p in parts for r in p.trace.get("refused", [])]
    pieces = [{"binaries": [b.name for b in p.binaries], "context_bytes": sum(b.stat().st_size for b in p.binaries),
               "compile_seconds": round(p.seconds, 2), "whole": p.whole} for p in parts]
    return Compiled(whole=all(p.whole for p in parts), context=ctx, binaries=[b for p in parts for b in p.binaries],
                    trace=trace, seconds=sum(p.seconds for p in parts),
                    failure="; ".join(p.failure for p in parts if p.failure), pieces=pieces)


def compile_context(model: Path, out_dir: Path, arch: Arch, stem: str = "ctx") -> Compiled:
    """QNN's compiler on ``model``: ``out_dir/<stem>.onnx`` and its context binary (``<stem>_qnn.bin``), with the
    op trace (``qnn_op_trace.json``, ``<stem>_qnn_op_trace.json`` for a piece). CPU fallback disabled first; where
    QNN refuses a node, compiled again with fallback (the EPContext model then holds the refused nodes for the
    CPU), and the trace names them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = out_dir / f"{stem}.onnx"
    trace_out = out_dir / (TRACE if ctx.name == CONTEXT else f"{stem}_{TRACE}")
    trace_out.unlink(missing_ok=True)
    failure = ""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="qnn-trace-") as tmp:
        for fallback in (False, True):
            for stale in [ctx, *out_dir.glob(f"{stem}_*.bin")]:  # a refused first try may have written them
                stale.unlink(missing_ok=True)
            try:
                session(model, HtpOptions(arch, fallback=fallback, trace_dir=Path(tmp), context=ctx))
                break
            except SdnpuError:
                raise
            except Exception as e:
                if fallback:
                    raise SdnpuError(f"QNN's compiler cannot build {model.name}, even with CPU fallback: "
                                     f"{_message(e)}", hint="this graph holds something QNN's HTP backend cannot "
                                     "compile; `sdnpu compile --target amd-xdna2` or the fp32 graph on the CPU "
                                     "still run it") from None
                failure = _message(e)
                if OUT_OF_MEMORY in failure:  # not a node QNN refuses: fallback would fail the same way
                    raise SdnpuError(f"QNN's compiler ran out of the HTP's memory on {model.name}: {failure}",
                                     hint="a smaller --context-gb cuts the graph into smaller contexts") from None
                log.warning("QNN does not take %s whole (%s); compiling it with CPU fallback to name what it "
                            "refuses", model.name, failure[:200])
        seconds = time.perf_counter() - start
        trace_file = Path(tmp) / TRACE
        trace = read_trace(trace_file) if trace_file.is_file() else {}
        if trace_file.is_file():
            shutil.copyfile(trace_file, trace_out)
    if not ctx.is_file() and trace and not trace["supported_nodes"]:
        said = "; ".join(dict.fromkeys(f"{r['op_type']}: {r['reason']}" for r in trace["refused"]))
        raise SdnpuError(f"QNN takes none of {model.name}'s {trace['total_onnx_nodes']} nodes ({said[:300]}), so "
                         "there is nothing to compile for the HTP", hint="the graph runs on the CPU as it is; "
                         "`--target amd-xdna2` compiles it for AMD's NPU")
    if not ctx.is_file():
        raise SdnpuError(f"QNN compiled {model.name} but wrote no EPContext model",
                         hint="onnxruntime-qnn's EPContext support (ep.context_enable) may be missing in this "
                         "build; " + INSTALL)
    binaries = sorted(out_dir.glob(f"{stem}_*.bin"))
    return Compiled(whole=not failure, context=ctx, binaries=binaries, trace=trace, seconds=seconds,
                    failure=failure)


def _message(e: Exception) -> str:
    text = " ".join(str(e).split())
    return re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)[:500]
