"""QNN weight sharing: several graphs compiled into one context binary (onnxruntime-qnn's EPContext weight
sharing, ``ep.share_ep_contexts=1`` on every compile session and ``ep.stop_share_ep_contexts=1`` on the last,
all EPContext models of a group in one folder, embed mode 0). The weights are then stored once.

    python bench/bench_qnn_sharing.py [--groups ab,abc,a] [--unet] [--arch 73] [--load-share] [--out DIR]
                                      [--json FILE]

The groups:
- ``ab``, ``abc``, ``a``: a conv+matmul graph (10.1 M parameters, seeded) at the input shapes a [1,64,4,4],
  b [1,64,6,6] and c [2,64,4,4], with the same weights. ``a`` is the control: a weight-shared context that holds
  only one graph.
- ``unet`` (``--unet``): the tiny SDXL UNet as ``sdnpu convert`` exports it (batch 2), with a batch-1 copy.
  The copy is the same graph with its batch dimension and its hard-coded Reshape/Expand shapes set to 1.

For each group:
1. Each model is compiled alone, as sdnpu does (``qnn_htp.compile_context``). The bench sums the context
   binaries' bytes and runs each EPContext model on the HTP (on x86-64, the emulator).
2. All the models are compiled into one shared binary, and the bench records its bytes. The compile sessions are
   kept open and run: they hold the graphs just compiled into the shared context.
3. Their outputs are compared bit for bit with the separately compiled models' outputs. They are also compared
   with onnxruntime's CPU fp32 run (1 - cosine).
4. Each shared EPContext model is loaded from its file and run. On the emulator (onnxruntime-qnn 2.7.0, QNN 2.51)
   a shared binary with more than one graph crashes the loading process with SIGSEGV. A shared binary with one
   graph loads.

Each compile group and each load runs in a fresh process. The shared-context state is global to a process, and
the crash must not take the bench down. ``--load-share`` loads with ``ep.share_ep_contexts=1``, as the EP's
documentation does for shared contexts; without it, models load through sdnpu's own ``qnn_htp.session``. Both
crash on the emulator. The emulator's times are this CPU's, not the NPU's: they are not printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY = {"a": (1, 4), "b": (1, 6), "c": (2, 4)}  # stem -> (batch, side) of x [N, 64, side, side]
GROUPS = {"ab": ("a", "b"), "abc": ("a", "b", "c"), "a": ("a",)}
UNET = ("unet_b2", "unet_b1")
TIMEOUT = 1800  # seconds, for one worker process


# --- models (built in the main process) -----------------------------------------------------------------------

def tiny_models(folder: Path) -> dict[str, Path]:
    """The conv+matmul graph at each shape of TINY, the same seeded weights (same names, same values) in each."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    c, h1, h2, h3 = 64, 256, 2048, 4096

    def w(*shape: int) -> Any:
        fan_in = np.prod(shape[1:]) if len(shape) == 4 else shape[0]
        return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)

    weights = {"conv1.w": w(h1, c, 3, 3), "conv1.b": np.full(h1, 0.01, np.float32), "W1": w(h1, h2),
               "W2": w(h2, h3), "W3": w(h3, h1), "conv2.w": w(c, h1, 1, 1), "conv2.b": np.zeros(c, np.float32)}
    nodes = [
        helper.make_node("Conv", ["x", "conv1.w", "conv1.b"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Transpose", ["r1"], ["t1"], perm=[0, 2, 3, 1]),
        helper.make_node("MatMul", ["t1", "W1"], ["m1"]),
        helper.make_node("Relu", ["m1"], ["r2"]),
        helper.make_node("MatMul", ["r2", "W2"], ["m2"]),
        helper.make_node("Relu", ["m2"], ["r3"]),
        helper.make_node("MatMul", ["r3", "W3"], ["m3"]),
        helper.make_node("Transpose", ["m3"], ["t2"], perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["t2", "conv2.w", "conv2.b"], ["y"]),
    ]
    out = {}
    for stem, (n, side) in TINY.items():
        shape = [n, c, side, side]
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
                              [numpy_helper.from_array(v, k) for k, v in weights.items()])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        m = onnx.shape_inference.infer_shapes(m)
        onnx.checker.check_model(m)
        out[stem] = folder / f"{stem}.onnx"
        onnx.save(m, str(out[stem]))
    return out


def unet_models(folder: Path) -> dict[str, Any]:
    """The tiny SDXL UNet as sdnpu exports it (batch 2), and a batch-1 copy of it. The copy is the same graph
    with the batch dimension of its inputs and outputs set to 1. Its hard-coded shapes change as well: a leading
    2 of a Reshape becomes 1, an Expand to [2] becomes [1], and the time_ids' flatten to [12] becomes [6]. The
    copy is checked on the CPU: b1(x) must equal b2([x, x])[0]."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    from sdnpu.convert import ConvertOptions, convert

    start = time.perf_counter()
    convert("tiny-sdxl", "unet", out=folder / "tiny-sdxl", options=ConvertOptions(compile=False, check=False))
    seconds = time.perf_counter() - start
    b2 = folder / "unet_b2.onnx"
    shutil.copyfile(folder / "tiny-sdxl" / "unet" / "model.onnx", b2)
    m = onnx.load(str(b2))
    g = m.graph
    for v in list(g.input) + list(g.output):
        dims = v.type.tensor_type.shape.dim
        if len(dims) and dims[0].dim_value == 2:
            dims[0].dim_value = 1
    consts = {n.output[0]: n for n in g.node if n.op_type == "Constant"}
    inits = {t.name: t for t in g.initializer}

    def value(name: str) -> Any:
        if name in inits:
            return numpy_helper.to_array(inits[name])
        if name in consts:
            return numpy_helper.to_array(consts[name].attribute[0].t)
        return None

    changed = 0
    for n in g.node:
        if n.op_type not in ("Reshape", "Expand") or len(n.input) < 2:
            continue
        v = value(n.input[1])
        if v is None:
            continue
        new = v.copy()
        if n.op_type == "Expand" and v.tolist() == [2]:
            new = np.array([1], v.dtype)
        elif n.op_type == "Reshape" and v.ndim == 1 and len(v) >= 2 and v[0] == 2:
            new[0] = 1
        elif n.op_type == "Reshape" and v.tolist() == [12]:
            new = np.array([6], v.dtype)
        if not np.array_equal(new, v):
            name = f"{n.name}_b1shape"
            g.initializer.append(numpy_helper.from_array(new, name))
            n.input[1] = name
            changed += 1
    used = {x for n in g.node for x in n.input}
    keep = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(keep)
    del g.value_info[:]
    b1 = folder / "unet_b1.onnx"
    onnx.save(onnx.shape_inference.infer_shapes(m), str(b1))

    f1 = _feeds(b1, seed=7)
    f2 = {k: (np.concatenate([v, v]) if v.ndim and v.shape[0] == 1 else v) for k, v in f1.items()}
    y1 = ort.InferenceSession(str(b1), providers=["CPUExecutionProvider"]).run(None, f1)[0]
    y2 = ort.InferenceSession(str(b2), providers=["CPUExecutionProvider"]).run(None, f2)[0]
    check = {"convert_seconds": round(seconds, 1), "shapes_changed": changed,
             "b1_vs_b2_first_1_minus_cos": 1.0 - _cosine(y1[0], y2[0]),
             "b1_vs_b2_first_max_abs": float(np.max(np.abs(y1[0].astype(np.float64) - y2[0])))}
    return {"paths": {"unet_b2": b2, "unet_b1": b1}, "check": check}


def _feeds(model: Path, seed: int = 1) -> dict[str, Any]:
    """Seeded inputs for every graph input (standard normal floats, ones for integers)."""
    import numpy as np
    import onnx

    rng = np.random.default_rng(seed)
    types = {1: np.float32, 10: np.float16, 7: np.int64, 6: np.int32}
    feeds = {}
    for i in onnx.load(str(model), load_external_data=False).graph.input:
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        dt = types[i.type.tensor_type.elem_type]
        feeds[i.name] = rng.standard_normal(shape).astype(dt) if np.issubdtype(dt, np.floating) else np.ones(shape, dt)
    return feeds


def _cosine(a: Any, b: Any) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


# --- workers (each in a fresh process) -------------------------------------------------------------------------

def _options(arch: Any, *, fallback: bool = False, context: Path | None = None, share: bool = False,
             stop: bool = False) -> Any:
    """Session options as ``qnn_htp.session`` makes them (same provider options and config entries), plus the
    weight-sharing keys, which sdnpu's own ``session`` does not set."""
    import onnxruntime as ort

    from sdnpu.backends import qnn_htp

    dev = qnn_htp._device()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if not fallback:
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    if context is not None:
        so.add_session_config_entry("ep.context_enable", "1")
        so.add_session_config_entry("ep.context_file_path", str(context))
        so.add_session_config_entry("ep.context_embed_mode", "0")  # 1 conflicts with sharing (the EP says so)
    if share:
        so.add_session_config_entry("ep.share_ep_contexts", "1")
    if stop:
        so.add_session_config_entry("ep.stop_share_ep_contexts", "1")
    so.add_provider_for_devices([dev], qnn_htp.HtpOptions(arch, fallback=fallback).provider_options())
    return so


def _run(session: Any, inputs: Path) -> Any:
    import numpy as np

    with np.load(inputs) as z:
        feeds = {k: z[k] for k in z.files}
    return session.run(None, feeds)[0]


def _err(e: BaseException) -> str:
    return " ".join(str(e).split())[:400]


def _binaries(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(folder.glob("*.bin"))}


def worker_separate(spec: dict[str, Any]) -> dict[str, Any]:
    """Each model compiled alone by sdnpu's ``compile_context`` (one folder, distinct stems), then its EPContext
    model loaded by ``qnn_htp.session`` and run; outputs to ``spec['outputs']``."""
    import numpy as np

    from sdnpu.backends import qnn_htp

    arch = qnn_htp.parse_arch(spec["arch"])
    out = Path(spec["out"])
    res: dict[str, Any] = {"models": {}}
    outputs = {}
    for stem, model, inputs in zip(spec["stems"], spec["models"], spec["inputs"]):
        r: dict[str, Any] = {}
        res["models"][stem] = r
        try:
            c = qnn_htp.compile_context(Path(model), out, arch, stem)
            r.update(whole=c.whole, context=str(c.context), bin_bytes={b.name: b.stat().st_size for b in c.binaries})
        except Exception as e:
            r["error"] = f"compile: {_err(e)}"
            continue
        try:
            s = qnn_htp.session(c.context, qnn_htp.HtpOptions(arch, fallback=not c.whole))
            outputs[stem] = _run(s, Path(inputs))
            del s
        except Exception as e:
            r["error"] = f"run: {_err(e)}"
    np.savez(spec["outputs"], **outputs)
    return res


def worker_shared(spec: dict[str, Any]) -> dict[str, Any]:
    """All models compiled into one weight-shared context (share on every session, stop on the last; EPContext
    models ``<stem>_ctx.onnx`` in one folder). The compile sessions stay open and are run afterwards."""
    import numpy as np

    from sdnpu.backends import qnn_htp
    import onnxruntime as ort

    arch = qnn_htp.parse_arch(spec["arch"])
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"models": {}}
    sessions = []
    n = len(spec["models"])
    for i, (stem, model, fallback) in enumerate(zip(spec["stems"], spec["models"], spec["fallbacks"])):
        ctx = out / f"{stem}_ctx.onnx"
        r: dict[str, Any] = {"context": str(ctx)}
        res["models"][stem] = r
        try:
            so = _options(arch, fallback=fallback, context=ctx, share=True, stop=i == n - 1)
            sessions.append((stem, ort.InferenceSession(str(model), so)))
        except Exception as e:
            r["error"] = f"compile: {_err(e)}"
    res["bin_bytes"] = _binaries(out)
    res["ctx_models"] = sorted(p.name for p in out.glob("*_ctx.onnx"))
    # the shared binary's name, as each EPContext model references it
    import onnx

    for stem, r in res["models"].items():
        p = Path(r["context"])
        if p.is_file():
            attrs = [a for node in onnx.load(str(p), load_external_data=False).graph.node
                     if node.op_type == "EPContext" for a in node.attribute if a.name == "ep_cache_context"]
            r["ep_cache_context"] = [onnx.helper.get_attribute_value(a).decode() for a in attrs]
    outputs = {}
    inputs = dict(zip(spec["stems"], spec["inputs"]))
    for stem, s in sessions:
        try:
            outputs[stem] = _run(s, Path(inputs[stem]))
        except Exception as e:
            res["models"][stem]["error"] = f"run: {_err(e)}"
    np.savez(spec["outputs"], **outputs)
    return res


def worker_load(spec: dict[str, Any]) -> dict[str, Any]:
    """One shared EPContext model loaded from its file and run: by ``qnn_htp.session``, or with
    ``ep.share_ep_contexts=1`` (``spec['share']``). On the emulator a multi-graph shared binary SIGSEGVs here."""
    import numpy as np

    from sdnpu.backends import qnn_htp
    import onnxruntime as ort

    arch = qnn_htp.parse_arch(spec["arch"])
    ctx = Path(spec["ctx"])
    print("loading", ctx.name, flush=True)
    try:
        if spec["share"]:
            s = ort.InferenceSession(str(ctx), _options(arch, fallback=spec["fallback"], share=True))
        else:
            s = qnn_htp.session(ctx, qnn_htp.HtpOptions(arch, fallback=spec["fallback"]))
    except Exception as e:
        return {"loaded": False, "error": f"load: {_err(e)}"}
    print("loaded", ctx.name, flush=True)
    try:
        y = _run(s, Path(spec["inputs"]))
    except Exception as e:
        return {"loaded": True, "error": f"run: {_err(e)}"}
    np.save(spec["outputs"], y)
    return {"loaded": True}


WORKERS = {"separate": worker_separate, "shared": worker_shared, "load": worker_load}


def _spawn(kind: str, spec: dict[str, Any], folder: Path) -> tuple[int, dict[str, Any], str]:
    """``kind``'s worker in a fresh process: its return code, its result (empty where it died before writing
    one) and the last line it wrote to stderr."""
    folder.mkdir(parents=True, exist_ok=True)
    spec_file, result_file = folder / f"{kind}.spec.json", folder / f"{kind}.result.json"
    result_file.unlink(missing_ok=True)
    spec_file.write_text(json.dumps({**spec, "result": str(result_file)}))
    try:
        p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", kind, str(spec_file)],
                           capture_output=True, text=True, timeout=TIMEOUT)
        rc, err = p.returncode, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, err = -999, f"timed out after {TIMEOUT} s {e.stderr or ''}"
    (folder / f"{kind}.stderr.txt").write_text(err if isinstance(err, str) else err.decode(errors="replace"))
    lines = [x.strip() for x in str(err).splitlines() if x.strip()]
    result = json.loads(result_file.read_text()) if result_file.is_file() else {}
    return rc, result, (lines[-1][:200] if lines else "")


def _outcome(rc: int, result: dict[str, Any], last: str) -> str:
    """A load's outcome as the table says it: yes, "no: SIGSEGV" (or another signal), or the error line."""
    if rc < 0 and rc != -999:
        try:
            return f"no: {signal.Signals(-rc).name}"
        except ValueError:
            return f"no: signal {-rc}"
    if rc == -999:
        return "no: timed out"
    if result.get("loaded") and not result.get("error"):
        return "yes" if rc == 0 else f"yes, then exit code {rc}"
    if result.get("error"):
        return f"no: {result['error'][:150]}"
    return f"no: exit code {rc}: {last}"


# --- the bench ---------------------------------------------------------------------------------------------------

def bench_group(name: str, stems: tuple[str, ...], paths: dict[str, Path], inputs: dict[str, Path],
                refs: dict[str, Any], folder: Path, arch: str | None, load_share: bool) -> dict[str, Any]:
    import numpy as np

    shutil.rmtree(folder, ignore_errors=True)  # onnxruntime refuses to overwrite an EPContext model
    models = [str(paths[s]) for s in stems]
    ins = [str(inputs[s]) for s in stems]
    row: dict[str, Any] = {"group": name, "models": list(stems), "shapes": {}}
    import onnx

    for s in stems:
        g = onnx.load(str(paths[s]), load_external_data=False).graph
        row["shapes"][s] = [d.dim_value for d in g.input[0].type.tensor_type.shape.dim]

    # 1. separately (one process for the group)
    rc, sep, last = _spawn("separate", {"models": models, "stems": list(stems), "inputs": ins, "arch": arch,
                                        "out": str(folder / "separate"),
                                        "outputs": str(folder / "separate.npz")}, folder)
    row["separate"] = {"rc": rc, **sep}
    if rc != 0 and not sep:
        row["error"] = f"separate compile: exit code {rc}: {last}"
        return row
    sep_models = sep.get("models", {})
    row["separate_bytes"] = {s: sum(sep_models.get(s, {}).get("bin_bytes", {}).values()) for s in stems}
    sep_out = {}
    if (folder / "separate.npz").is_file():
        with np.load(folder / "separate.npz") as z:
            sep_out = {k: z[k] for k in z.files}

    # 2. shared (another process): one context binary, the compile sessions run
    fallbacks = [not sep_models.get(s, {}).get("whole", True) for s in stems]
    rc, sh, last = _spawn("shared", {"models": models, "stems": list(stems), "inputs": ins, "arch": arch,
                                     "fallbacks": fallbacks, "out": str(folder / "shared"),
                                     "outputs": str(folder / "shared.npz")}, folder)
    row["shared"] = {"rc": rc, **sh}
    if not sh:
        row["error"] = f"shared compile: exit code {rc}: {last}"
        return row
    row["shared_bytes"] = sum(sh.get("bin_bytes", {}).values())
    sh_out = {}
    if (folder / "shared.npz").is_file():
        with np.load(folder / "shared.npz") as z:
            sh_out = {k: z[k] for k in z.files}

    # 3. outputs: bitwise against the separate compiles, cosine against onnxruntime CPU fp32
    row["equal"], row["one_minus_cos_shared"], row["one_minus_cos_separate"] = {}, {}, {}
    for s in stems:
        if s in sh_out and s in sep_out:
            row["equal"][s] = bool(sh_out[s].shape == sep_out[s].shape and np.array_equal(sh_out[s], sep_out[s]))
        else:
            row["equal"][s] = None
        if s in sh_out:
            row["one_minus_cos_shared"][s] = 1.0 - _cosine(sh_out[s], refs[s])
        if s in sep_out:
            row["one_minus_cos_separate"][s] = 1.0 - _cosine(sep_out[s], refs[s])

    # 4. each shared EPContext model loaded from its file, in its own process
    row["loads"] = {}
    for s, fallback in zip(stems, fallbacks):
        ctx = Path(sh["models"][s]["context"])
        if not ctx.is_file():
            row["loads"][s] = {"outcome": "no: no EPContext model was written"}
            continue
        npy = folder / f"load_{s}.npy"
        rc, res, last = _spawn(f"load_{s}", {"ctx": str(ctx), "inputs": str(inputs[s]), "arch": arch,
                                             "share": load_share, "fallback": fallback, "outputs": str(npy)},
                               folder)
        rec = {"rc": rc, **res, "outcome": _outcome(rc, res, last)}
        if npy.is_file() and s in sep_out:
            rec["output_equal_to_separate"] = bool(np.array_equal(np.load(npy), sep_out[s]))
        row["loads"][s] = rec
    return row


def _cells(r: dict[str, Any]) -> list[str]:
    models = ", ".join(f"{s} [{','.join(map(str, r['shapes'][s]))}]" for s in r["models"])
    if "error" in r:
        return [r["group"], models, "", "", "", "", "", r["error"][:150]]
    sep = sum(r["separate_bytes"].values())
    shared = r["shared_bytes"]
    ratio = f"{100 * shared / sep:.1f} %" if sep and shared else "-"
    eq = list(r["equal"].values())
    errors = [f"{s}: {m['error']}" for s, m in r["shared"].get("models", {}).items() if m.get("error")]
    equal = "yes" if eq and all(e is True for e in eq) else ("no: " + errors[0][:100] if errors else "no")
    cos = list(r["one_minus_cos_shared"].values())
    cos_text = f"{max(cos):.2g}" if cos else "-"
    outcomes = [r["loads"][s]["outcome"] for s in r["models"]]
    loads = outcomes[0] if len(set(outcomes)) == 1 else "; ".join(f"{s}: {o}" for s, o in zip(r["models"], outcomes))
    return [r["group"], models, f"{sep:,}", f"{shared:,}", ratio, equal, cos_text, loads]


def markdown(rows: list[dict[str, Any]]) -> str:
    out = ["| group | models | separately (bytes) | shared (bytes) | shared / separately | outputs equal to separate "
           "| max 1-cos vs fp32 | shared model loads |", "|---|---|---|---|---|---|---|---|"]
    out += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", default="ab,abc,a", help=f"of {', '.join(GROUPS)} (comma-separated)")
    p.add_argument("--unet", action="store_true", help="also the tiny SDXL UNet at batch 2 and batch 1")
    p.add_argument("--arch", default=None, help="HTP generation (default v73)")
    p.add_argument("--load-share", action="store_true", help="load the shared models with ep.share_ep_contexts=1")
    p.add_argument("--out", default=None, help="keep the models and compiled files here")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        kind, spec_file = args.worker
        spec = json.loads(Path(spec_file).read_text())
        res = WORKERS["load" if kind.startswith("load") else kind](spec)
        Path(spec["result"]).write_text(json.dumps(res, indent=1))
        return 0

    import numpy as np
    import onnxruntime as ort

    from sdnpu.backends import qnn_htp

    groups = [g for g in args.groups.split(",") if g]
    for g in groups:
        if g not in GROUPS:
            p.error(f"unknown group {g!r}: choose of {', '.join(GROUPS)}")
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    info: dict[str, Any] = {"versions": qnn_htp.versions(), "arch": qnn_htp.parse_arch(args.arch).arch,
                            "load_share": args.load_share}
    with tempfile.TemporaryDirectory(prefix="bench-qnn-sharing-") as tmp:
        out = Path(args.out or tmp)
        models = out / "models"
        models.mkdir(parents=True, exist_ok=True)
        paths: dict[str, Path] = {}
        if groups:
            paths.update(tiny_models(models))
        todo = [(f"tiny {'+'.join(GROUPS[g])}", GROUPS[g]) for g in groups]
        if args.unet:
            u = unet_models(models)
            paths.update(u["paths"])
            info["unet"] = u["check"]
            todo.append(("tiny-sdxl unet", UNET))
        inputs, refs = {}, {}
        for stem, path in paths.items():  # the same seeded inputs for every process; the CPU fp32 reference
            feeds = _feeds(path)
            inputs[stem] = models / f"{stem}.inputs.npz"
            np.savez(inputs[stem], **feeds)
            refs[stem] = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        for name, stems in todo:
            print(f"{name}: {', '.join(stems)}", file=sys.stderr, flush=True)
            try:
                folder = out / name.replace(" ", "_").replace("+", "")
                rows.append(bench_group(name, stems, paths, inputs, refs, folder, args.arch, args.load_share))
            except Exception as e:
                rows.append({"group": name, "models": list(stems), "shapes": {s: [] for s in stems},
                             "error": f"{type(e).__name__}: {_err(e)}"})
    info["seconds"] = round(time.perf_counter() - start, 1)
    print(f"onnxruntime {info['versions']['onnxruntime']}, onnxruntime-qnn {info['versions']['onnxruntime_qnn']} "
          f"(QNN {info['versions']['qnn']}), htp_arch v{info['arch']}, "
          f"{'emulator' if qnn_htp.is_emulated() else 'device'}, loads "
          f"{'with ep.share_ep_contexts=1' if args.load_share else 'by qnn_htp.session'}")
    if "unet" in info:
        u = info["unet"]
        print(f"unet batch-1 copy vs batch 2 (CPU): 1-cos {u['b1_vs_b2_first_1_minus_cos']:.2g}, "
              f"max abs {u['b1_vs_b2_first_max_abs']:.2g} ({u['shapes_changed']} shapes changed)")
    print()
    print(markdown(rows), end="")
    if args.json:
        Path(args.json).write_text(json.dumps({"info": info, "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
