"""Block by block: T5 (SD3's ``text_encoder_3``, Flux.1's ``text_encoder_2``) and Flux.1's transformer
(``sdnpu.convert.blockwise_flux``) converted one block at a time, for a module whose fp32 weights do not fit this
machine's memory whole (T5-XXL: 19 GB; Flux.1: 47.6 GB). Each piece is a ``Piece``: a torch module, the names of
its inputs (the module's own for the first, earlier pieces' outputs for the others) and of its outputs.

T5's encoder is an embedding, blocks that each read the previous block's hidden states and one shared
position bias, and a final RMSNorm. The position bias depends on the sequence length and block 0's bucket
table only, so it is computed once here (``compute_bias``: [1, heads, S, S]) and each piece holds it as a
constant, as a whole-graph export folds it. The pieces: (embedding + block 0), blocks 1 .. n-2, (block n-1 +
final norm). Each is built with its weights alone, run in PyTorch, exported, checked against PyTorch,
compiled, and its dispatch model run; then the pieces' files are stitched into the component's graphs
(``sdnpu.convert.stitch``), each deleted as it is copied: memory holds one block (T5-XXL: 5.7 GB peak), the
disk the pieces' graphs until they become the stitched ones (T5-XXL: 19.05 GB fp32 and 9.79 GB bf16).

The checks: each piece runs in PyTorch on what PyTorch's earlier pieces gave, so its last piece's outputs are the
whole module's, without holding it whole. Each piece's fp32 graph runs on the same inputs as its PyTorch run:
its own export error, held to the check's tolerance piece by piece (the export check). The dispatch models
chain (piece ``i`` on what the earlier dispatch models gave) and their last outputs are measured against
PyTorch's chain: the stitched dispatch model computes what the chained pieces compute (the casts it cancels
between them are exact), and PyTorch's fp32 chain is the fp32 graph's within the export check. So a piece
costs one PyTorch run and two onnxruntime runs (a Flux.1 block at 1024 px: about 2 GB of attention scores
each), not three (an fp32 chain of its own as well).

Weights: a folder's come tensor by tensor from its safetensors files; a preset draws each piece from its own
seed (``PRESET_SEED + 1 + i`` for block ``i``, ``PRESET_SEED`` for the token table) with transformers' T5
initialization, so a piece's weights do not depend on the others (a whole preset module draws from one
stream: the two are different seeded weights of the same architecture).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from sdnpu import __version__, families
from sdnpu.convert import blockwise_qnn
from sdnpu.convert.compile import REPLACED, compile_into, log_offload, validate_dispatch_model, write_report
from sdnpu.convert.export import CHECK_RTOL, export_module
from sdnpu.convert.job import MODEL_FILE, Job, compile_info, write_records
from sdnpu.convert.options import ComponentResult
from sdnpu.convert.parameters import map_parameters
from sdnpu.convert.sources import PRESET_SEED, Source
from sdnpu.convert.stitch import StitchStats, stitch
from sdnpu.errors import SdnpuError
from sdnpu.fileio import pid_alive
from sdnpu.formats.prologue import FILE as PROLOGUE_FILE
from sdnpu.formats.weights import FILE as WEIGHTS_FILE
from sdnpu.formats.weights import make_record, read_record, write_record
from sdnpu.onnxrun import run_onnx
from sdnpu.passes.partition import partition
from sdnpu.progress import peak_rss_bytes, release_memory, step
from sdnpu.reports.fidelity import fidelity
from sdnpu.signatures import Signature

log = logging.getLogger(__name__)

# module classes that convert block by block: T5 (its pieces here) and the denoisers of families whose row names
# a module of pieces (``sdnpu.families``: Flux.1's transformer)
CLASSES = ("T5EncoderModel", *(f.denoiser_class for f in families.TABLE if f.blockwise))


def supports(src: Source, key: str) -> bool:
    return src.classes.get(key) in CLASSES


@dataclass
class Piece:
    """Piece ``i`` of ``n``: a torch module whose forward takes ``inputs`` (positionally) and returns ``outputs``
    (a tensor, or a tuple in that order). An output ``x.next`` feeds later pieces' input ``x``
    (``sdnpu.convert.stitch``); a piece with one output also feeds the next piece's ``hidden_states``."""

    i: int
    n: int
    module: Any
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    whole: Any = None  # param name in the piece -> the whole module's (None: the same)


def _t5_config(src: Source, key: str) -> Any:
    from transformers import T5Config

    config = json.loads((src.modules[key] / "config.json").read_text())
    return T5Config(**{k: v for k, v in config.items() if k != "architectures"})


class _Weights:
    """The module's tensors by state-dict name, one piece at a time: a folder's safetensors, read lazily."""

    def __init__(self, src: Source, key: str) -> None:
        self.preset = src.kind == "preset"
        self.where: dict[str, Path] = {}
        if self.preset:
            return
        folder = src.modules[key]
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise SdnpuError(f"{folder} has no .safetensors weights: block-by-block conversion reads tensors one "
                             "at a time from safetensors files", hint="save the module with safe_serialization "
                             "(transformers' default), or convert it on a machine that holds it whole")
        plain = [f for f in files if ".fp16." not in f.name] or files
        from safetensors import safe_open

        for f in plain:
            with safe_open(str(f), framework="pt") as h:
                for name in h.keys():  # noqa: SIM118 -- safe_open handles have keys(), not iteration
                    self.where.setdefault(name, f)

    def tensors(self, prefix: str) -> dict[str, Any]:
        from safetensors import safe_open

        out: dict[str, Any] = {}
        by_file: dict[Path, list[str]] = {}
        for name, f in self.where.items():
            if name.startswith(prefix):
                by_file.setdefault(f, []).append(name)
        for f, names in by_file.items():
            with safe_open(str(f), framework="pt") as h:
                for name in names:
                    out[name[len(prefix):]] = h.get_tensor(name).float()
        return out

    def tensor(self, *names: str) -> Any:
        for name in names:
            if name in self.where:
                return self.tensors(name)[""]
        raise SdnpuError(f"the weights have none of {', '.join(names)}",
                         hint="the folder's safetensors must hold a transformers T5EncoderModel's state dict")


def _init(config: Any, module: Any) -> None:
    from transformers.models.t5.modeling_t5 import T5PreTrainedModel

    holder = SimpleNamespace(config=config)
    for m in module.modules():
        T5PreTrainedModel._init_weights(holder, m)  # uses self.config alone


def _block(config: Any, weights: _Weights, i: int) -> Any:
    import torch
    from transformers.models.t5.modeling_t5 import T5Block

    if weights.preset:
        torch.manual_seed(PRESET_SEED + 1 + i)
        block = T5Block(config, has_relative_attention_bias=i == 0, layer_idx=i)
        _init(config, block)
    else:
        with torch.device("meta"):
            block = T5Block(config, has_relative_attention_bias=i == 0, layer_idx=i)
        state = weights.tensors(f"encoder.block.{i}.")
        try:
            block.load_state_dict(state, assign=True)
        except RuntimeError as e:
            raise SdnpuError(f"block {i}'s weights do not match the config: {str(e)[:300]}") from e
        if any(p.is_meta for p in block.parameters()):
            raise SdnpuError(f"block {i}'s weights are incomplete in {sorted(set(weights.where.values()))[0].parent}")
    return block.float().eval()


def _embedding(config: Any, weights: _Weights) -> Any:
    import torch

    emb = torch.nn.Embedding(config.vocab_size, config.d_model)
    if weights.preset:
        torch.manual_seed(PRESET_SEED)
        with torch.no_grad():
            emb.weight.normal_(mean=0.0, std=config.initializer_factor * 1.0)
    else:
        with torch.no_grad():
            emb.weight.copy_(weights.tensor("shared.weight", "encoder.embed_tokens.weight"))
    return emb.eval()


def _final_norm(config: Any, weights: _Weights) -> Any:
    import torch
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
    with torch.no_grad():
        if weights.preset:
            norm.weight.fill_(config.initializer_factor * 1.0)
        else:
            norm.weight.copy_(weights.tensor("encoder.final_layer_norm.weight"))
    return norm.eval()


def _piece_class() -> Any:
    import torch

    class T5Piece(torch.nn.Module):
        """Block ``i`` of T5's encoder with the shared position bias as a constant; the embedding before
        the first, the final norm after the last."""

        def __init__(self, block: Any, bias: Any, embed: Any = None, norm: Any = None) -> None:
            super().__init__()
            self.block, self.embed, self.norm = block, embed, norm
            self.register_buffer("position_bias", bias)

        def forward(self, x: Any) -> Any:
            h = self.embed(x) if self.embed is not None else x
            h = self.block(h, position_bias=self.position_bias)[0]
            return self.norm(h) if self.norm is not None else h

    return T5Piece


def _family_pieces(src: Source, key: str) -> Any:
    """The module of the family's own pieces for ``key``'s class (its row's ``blockwise``: Flux.1's
    ``sdnpu.convert.blockwise_flux``), or None (T5: its pieces are here). Imported when asked for, not at the
    top: it builds on this module (``Piece``, the weights), and the row names it as a string."""
    family = families.of_class(src.classes.get(key))
    return families.load(family.blockwise) if family is not None and family.blockwise else None


def pieces(src: Source, key: str, sig: Signature, start: int = 0) -> Iterator[Piece]:
    """The module's pieces in order for its graph's signature ``sig``, each built when asked for (the caller
    drops it); from piece ``start`` on (those before it are not built: a run that continues another)."""
    own = _family_pieces(src, key)
    if own is not None:
        yield from own.pieces(src, key, sig, _Weights(src, key), start=start)
        return
    yield from _t5_pieces(src, key, int(sig.inputs[0].shape[1]), sig.inputs[0].name, sig.outputs[0], start)


def _t5_whole(i: int, param: str) -> str:
    """A T5 piece's parameter as the whole T5EncoderModel names it (``map_parameters`` strips the piece's
    first child, ``block``)."""
    if param.startswith("embed."):
        return "shared." + param[len("embed."):]
    if param.startswith("norm."):
        return "encoder.final_layer_norm." + param[len("norm."):]
    if param == "position_bias":
        return "position_bias (computed from encoder.block.0's relative_attention_bias)"
    return f"encoder.block.{i}.{param}"


def _t5_pieces(src: Source, key: str, seq_len: int, in_name: str, out_name: str, start: int = 0
               ) -> Iterator[Piece]:
    import torch

    config = _t5_config(src, key)
    weights = _Weights(src, key)
    n = config.num_layers
    cls = _piece_class()
    first = _block(config, weights, 0)
    with torch.no_grad():  # block 0's bucket table makes every block's position bias
        bias = first.layer[0].SelfAttention.compute_bias(seq_len, seq_len).detach().clone()
    for i in range(start, n):
        block, first = first if i == 0 else _block(config, weights, i), None
        embed = _embedding(config, weights) if i == 0 else None
        norm = _final_norm(config, weights) if i == n - 1 else None
        yield Piece(i, n, cls(block, bias, embed, norm).eval(), (in_name if i == 0 else "hidden_states",),
                    (out_name if i == n - 1 else "block_output",), whole=_t5_whole)


def whole_module(src: Source, key: str) -> Any:
    """The module whose weights the pieces hold (small modules only: tests compare against it)."""
    own = _family_pieces(src, key)
    if own is not None:
        return own.whole_module(src, key, _Weights(src, key))
    import torch
    from transformers import T5EncoderModel

    config = _t5_config(src, key)
    weights = _Weights(src, key)
    model = T5EncoderModel(config).eval()
    with torch.no_grad():
        model.shared.weight.copy_(_embedding(config, weights).weight)
        for i in range(config.num_layers):
            model.encoder.block[i].load_state_dict(_block(config, weights, i).state_dict())
        model.encoder.final_layer_norm.weight.copy_(_final_norm(config, weights).weight)
    return model


@dataclass
class Chain:
    """The chains' current values by name (PyTorch, the dispatch model): what the pieces so far gave, the latest
    of each name."""

    torch: dict[str, np.ndarray]
    dispatch: dict[str, np.ndarray] | None


def link_values(values: dict[str, Any], names: tuple[str, ...], outs: list[Any] | tuple[Any, ...]) -> dict[str, Any]:
    """``values`` updated with a piece's outputs, each under the name later pieces read it by (any chain: arrays
    or tensors)."""
    from sdnpu.convert.stitch import link_name

    new = dict(values)
    new.update((link_name(name), v) for name, v in zip(names, outs, strict=True))
    if len(outs) == 1:
        new[CHAIN_INPUT] = outs[0]
    return new


CHAIN_INPUT = "hidden_states"  # what a piece with one output feeds in the next


@dataclass
class _Run:
    """A block-by-block conversion under way: the pieces' files and records so far, the times, the chains."""

    job: Job
    work: Path  # the pieces' folders
    feeds: dict[str, np.ndarray]  # the seeded inputs of the module
    out_names: tuple[str, ...]
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("torch_run", "export", "onnx_run", "compile", "stitch"), 0.0))
    fp32_parts: list[Path] = field(default_factory=list)
    dd_parts: list[Path] = field(default_factory=list)
    records: dict[str, dict[str, int]] = field(default_factory=dict)  # the pieces' pass counts, summed
    params: list[dict[str, Any]] = field(default_factory=list)  # each piece's parameters.json
    wholes: list[Any] = field(default_factory=list)  # each piece's parameter naming (``Piece.whole``)
    worst: dict[str, float] = field(default_factory=lambda: {"max_abs": 0.0, "max_rel": 0.0, "min_cosine": 1.0})
    last_check: dict[str, Any] | None = None  # the last piece's fp32 graph against PyTorch, by output
    n_params: int = 0
    chain: Chain | None = None
    partition: dict[str, Any] | None = None  # the stitched dispatch model's partition record
    qnn: blockwise_qnn.QnnChain | None = None  # a standard target's contexts (qnn-htp), None for AMD's

    def timed(self, what: str, started: float) -> None:
        self.seconds[what] += time.perf_counter() - started

    def __getstate__(self) -> dict[str, Any]:  # the job is the caller's: a run that goes on has its own
        return {k: v for k, v in self.__dict__.items() if k != "job"}


# A run that stops (an error, Ctrl-C, the machine) keeps its finished pieces in ``.<component>.pieces/`` beside
# the component's folder, with what the next run needs to go on after them (``STATE``: the chains' values, the
# records, the compiled contexts): the same command goes on there (Flux.1 dev at 1024 px for qnn-htp: hours).
STATE = "state.pkl"


def _fingerprint(job: Job) -> str:
    """What a finished piece depends on: the module's weights, the size, the options that change a piece."""
    o, sig = job.options, job.signature()
    return json.dumps({"sdnpu": __version__, "source": [job.origin.name, job.origin.fingerprint],
                       "component": job.component, "inputs": [x.to_json() for x in sig.inputs],
                       "outputs": list(sig.outputs),
                       "options": [o.exporter, o.opset, o.check, o.compile, o.outputs, o.target, o.precision,
                                   o.htp_arch, o.context_gb, repr(o.loras)]}, sort_keys=True)


def work_dir(stage: Path, component: str) -> Path:
    """Where a block-by-block conversion of ``component`` staged in ``stage`` keeps its pieces."""
    return stage.parent / f".{component}.pieces"


def _fresh(job: Job, work: Path) -> _Run:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    run = _Run(job, work, job.sample_inputs(), tuple(job.signature().outputs))
    target = job.options.compile_options.target
    if job.options.compile and target.kind == "standard":
        run.qnn = blockwise_qnn.start(work / target.out_dir, job.options.compile_options, run.feeds, run.out_names,
                                      emulate=job.options.check)
    return run


def _continued(job: Job, work: Path) -> _Run | None:
    """The run an earlier one left in ``work`` for the same job, its finished pieces' files all there; None
    where there is none, or it was another job's (then it goes)."""
    import pickle

    state = work / STATE
    if not state.is_file():
        return None
    try:
        with state.open("rb") as f:
            saved = pickle.load(f)  # noqa: S301 -- our own file, written by _checkpoint
    except Exception as e:  # written by another version of sdnpu, or torn: start again
        log.warning("[%s] the pieces left in %s cannot be read (%s): starting again", job.component, work,
                    type(e).__name__)
        return None
    pid = int(saved.get("pid", 0))
    if saved.get("running") and pid != os.getpid() and pid_alive(pid):
        raise SdnpuError(f"another sdnpu (pid {pid}) is converting {job.component} into {work.parent}",
                         hint="wait for it to finish, or stop it")
    if saved.get("fingerprint") != _fingerprint(job):
        log.info("[%s] the pieces left in %s are another conversion's: starting again", job.component, work)
        return None
    run: _Run = saved["run"]
    if not all(p.is_file() for p in [*run.fp32_parts, *run.dd_parts]):
        log.warning("[%s] the pieces left in %s are incomplete: starting again", job.component, work)
        return None
    run.job = job
    if run.qnn is not None:
        run.qnn.options = job.options.compile_options
    return run


def _checkpoint(run: _Run, running: bool = True) -> None:
    """What a run that stops after this piece leaves for the next (written whole, then renamed into place)."""
    import pickle

    tmp = run.work / f"{STATE}.tmp"
    with tmp.open("wb") as f:
        pickle.dump({"fingerprint": _fingerprint(run.job), "pid": os.getpid(), "running": running, "run": run}, f,
                    protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, run.work / STATE)


def convert_blockwise(src: Source, job: Job, stage: Path) -> ComponentResult:
    """Convert ``job`` (T5, Flux.1's transformer) into ``stage`` block by block: ``model.onnx`` (+ data)
    stitched from the pieces' fp32 graphs, ``dd/`` from their dispatch models (a standard target's ``qnn/``: a
    context a piece, ``sdnpu.convert.blockwise_qnn``). Where a run of the same job stopped before, this one goes
    on after the pieces it finished (``STATE``). Returns the ComponentResult."""
    work = work_dir(stage, job.component)
    run = _continued(job, work)
    if run is None:
        run = _fresh(job, work)
    else:
        log.info("[%s] going on after the %d pieces an earlier run finished (kept in %s)", job.component,
                 len(run.fp32_parts), work)
    _checkpoint(run)
    started = time.perf_counter()
    try:
        for piece in pieces(src, job.key, job.signature(), start=len(run.fp32_parts)):
            i, n = piece.i, piece.n
            shutil.rmtree(work / f"piece{i:03d}", ignore_errors=True)  # what a run that stopped in it left
            _piece(run, piece)
            del piece
            _checkpoint(run)
            log.info("[%s] piece %d of %d done (%.0f s so far, peak memory %.1f GB)", job.component, i + 1, n,
                     time.perf_counter() - started, peak_rss_bytes() / 1e9)
    except BaseException:
        if run.fp32_parts:
            _checkpoint(run, running=False)
            log.warning("[%s] stopped: the %d pieces finished are kept in %s; the same command goes on after them",
                        job.component, len(run.fp32_parts), work)
        else:
            shutil.rmtree(work, ignore_errors=True)
        raise
    (work / STATE).unlink()  # stitching consumes the pieces: from here on a stopped run starts again
    try:
        check_data = _export_check(run)  # before stitching: a graph that does not match is not worth writing
        s32, summary = _stitch(run, stage)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    seconds = {k: round(v, 2) for k, v in run.seconds.items()}
    result = ComponentResult(component=job.component, path=stage / MODEL_FILE, nodes=s32.nodes,
                             parameters=run.n_params, seconds=seconds, peak_rss_bytes=peak_rss_bytes(),
                             check=check_data, report=summary)
    write_records(job, stage, result, _parameters(run.params, run.wholes, s32.alias), blockwise=True)
    return result


def _piece(run: _Run, piece: Piece) -> None:
    """``piece``: run in PyTorch on the torch chain, exported, run in onnxruntime on the fp32 chain (and alone
    on PyTorch's inputs, its own error), compiled and its dispatch model run on the dispatch chain."""
    import torch

    job, options, i = run.job, run.job.options, piece.i
    module = piece.module
    piece.module = None  # the caller's Piece must not keep the weights alive past this piece
    run.n_params += sum(p.numel() for p in module.parameters())
    folder = run.work / f"piece{i:03d}"
    folder.mkdir()
    path = folder / MODEL_FILE
    before = run.feeds if run.chain is None else run.chain.torch
    missing = [name for name in piece.inputs if name not in before]
    if missing:
        raise SdnpuError(f"{job.component}'s piece {i} takes {', '.join(missing)}, which no earlier piece gives")
    t0 = time.perf_counter()
    with torch.no_grad():
        t_in = tuple(torch.from_numpy(before[name]) for name in piece.inputs)
        got = module(*t_in)
        t_out = [o.numpy().copy() for o in (got if isinstance(got, tuple) else (got,))]
    run.timed("torch_run", t0)
    t0 = time.perf_counter()
    try:
        export_module(module, t_in, list(piece.inputs), list(piece.outputs), path, exporter=options.export_with)
        run.params.append(map_parameters(module, path))
        run.wholes.append(piece.whole)
    except SdnpuError:
        raise
    except Exception as e:
        raise SdnpuError(f"torch's {options.exporter} exporter failed on {job.component}'s piece {i}: "
                         f"{type(e).__name__}: {e}") from e
    run.timed("export", t0)
    del module, t_in, got
    release_memory()
    names = (piece.inputs, piece.outputs)
    _check_piece(run, i, path, {k: before[k] for k in piece.inputs}, dict(zip(piece.outputs, t_out, strict=True)))
    dispatch = _compile_piece(run, i, path, names) if options.compile and run.qnn is None else None
    if run.qnn is not None:
        blockwise_qnn.compile_piece(run.qnn, i, piece.n, path, piece.inputs, piece.outputs,
                                    {k: before[k] for k in piece.inputs} if options.check else None, job.component)
    previous = run.chain
    run.chain = Chain(link_values(before, piece.outputs, t_out),
                      None if dispatch is None else link_values(
                          run.feeds if previous is None or previous.dispatch is None else previous.dispatch,
                          piece.outputs, dispatch))
    run.fp32_parts.append(path)


def _run_graph(path: Path, feeds: dict[str, np.ndarray], optimize: bool = False) -> dict[str, np.ndarray]:
    """``run_onnx``, in a worker process where the run is large (``sdnpu.worker.run_graph_isolated``): one piece
    after another, the heaps finished sessions leave would add up."""
    from sdnpu.worker import run_graph_isolated

    return run_graph_isolated(run_onnx, path, feeds, optimize, what=f"running {path.parent.name}")


def _check_piece(run: _Run, i: int, path: Path, feeds: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """The piece's fp32 graph on PyTorch's inputs of the piece (``feeds``) against PyTorch's outputs (``want``):
    its own export error, within the check's tolerance or an SdnpuError naming the piece."""
    if not run.job.options.check:
        return
    t0 = time.perf_counter()
    res = _run_graph(path, feeds, optimize=True)
    run.timed("onnx_run", t0)
    fid = fidelity(want, {k: res[k] for k in want})
    rel = max(e["max_rel"] for e in fid["outputs"].values())
    worst = run.worst
    worst["max_abs"] = max(worst["max_abs"], fid["max_abs"])
    worst["max_rel"] = max(worst["max_rel"], rel)
    worst["min_cosine"] = min(worst["min_cosine"], fid["min_cosine"])
    run.last_check = fid["outputs"]
    name = max(fid["outputs"], key=lambda k: fid["outputs"][k]["max_rel"])
    log.info("[%s] piece %d: ONNX vs PyTorch max rel error %.3g (%s)", run.job.component, i, rel, name)
    if not rel <= CHECK_RTOL:
        raise SdnpuError(f"the exported {run.job.component} does not match PyTorch in its piece {i}: off by "
                         f"{rel:.3g} of its range (tolerance {CHECK_RTOL:g})", hint="try the other exporter (--exporter)")


def _compile_piece(run: _Run, i: int, path: Path, names: tuple[tuple[str, ...], tuple[str, ...]]
                   ) -> list[np.ndarray] | None:
    """The piece compiled (its pass counts summed into ``run.records``) and, where the job checks, its dispatch
    model run on the dispatch chain."""
    piece_in, piece_out = names
    options = run.job.options
    t0 = time.perf_counter()
    report = compile_into(path, path.parent / "dd", {"component": f"{run.job.component} block {i}"},
                          options.compile_options, check=None)
    run.timed("compile", t0)
    for rec in report["passes"]:
        bucket = run.records.setdefault(rec["name"], {})
        for k, v in rec.get("counts", {}).items():
            if isinstance(v, (int, float)):
                bucket[k] = bucket.get(k, 0) + v
    dispatch = None
    if options.check:
        values = run.feeds if run.chain is None or run.chain.dispatch is None else run.chain.dispatch
        t0 = time.perf_counter()
        res = _run_graph(path.parent / "dd" / REPLACED, {k: values[k] for k in piece_in})
        dispatch = [res[k] for k in piece_out]
        run.timed("onnx_run", t0)
    run.dd_parts.append(path.parent / "dd" / REPLACED)
    return dispatch


def _export_check(run: _Run) -> dict[str, Any] | None:
    """The export check of the whole module: every piece's fp32 graph against PyTorch on PyTorch's inputs
    (``_check_piece``), the worst of them."""
    if not run.job.options.check:
        return None
    worst = run.worst
    log.info("[%s] ONNX vs PyTorch, piece by piece over %d pieces: max abs error %.3g, max rel error %.3g, "
             "min cosine %.9f", run.job.component, len(run.fp32_parts), worst["max_abs"], worst["max_rel"],
             worst["min_cosine"])
    return {"max_abs_error": worst["max_abs"], "max_rel_error": worst["max_rel"], "min_cosine": worst["min_cosine"],
            "rel_tolerance": CHECK_RTOL, "outputs": run.last_check, "blockwise": True,
            "measured": "each piece's fp32 graph against PyTorch on PyTorch's inputs of the piece; the worst piece"}


def _stitch(run: _Run, stage: Path) -> tuple[StitchStats, dict[str, Any] | None]:
    """The pieces stitched into ``stage/model.onnx`` and ``stage/dd/replaced.onnx`` (each piece deleted as it
    is copied), both checked, and the dispatch model's report. Returns the fp32 stitch and the summary."""
    import onnx

    comp, options = run.job.component, run.job.options
    t0 = time.perf_counter()
    with step(log, f"[{comp}] stitching {len(run.fp32_parts)} pieces into {MODEL_FILE}"):
        s32 = stitch(run.fp32_parts, stage / MODEL_FILE, CHAIN_INPUT, consume=True)
    sdd = None
    if options.compile and run.qnn is None:
        (stage / "dd").mkdir(exist_ok=True)
        target = options.compile_options.target
        with step(log, f"[{comp}] stitching {len(run.dd_parts)} dispatch models into dd/{REPLACED}"):
            sdd = stitch(run.dd_parts, stage / "dd" / REPLACED, CHAIN_INPUT,
                         cast=(target.domain, "CastAvx"), consume=True)
        log.info("[%s] %d boundary casts between the blocks cancelled; %d repeated constants and %d repeated "
                 "nodes kept once", comp, sdd.casts_cancelled, sdd.deduplicated, sdd.repeated_nodes)
        run.partition, kept = _repartition(stage / "dd" / REPLACED, target, run.job.spec.prologue, comp)
        _stitch_provenance(run.dd_parts, stage / "dd", s32.alias, sdd.alias, kept)
    run.seconds["stitch"] = time.perf_counter() - t0
    if run.qnn is not None:  # the contexts go where the component's folder has them
        blockwise_qnn.move(run.qnn, stage / options.compile_options.target.out_dir)
    shutil.rmtree(run.work, ignore_errors=True)
    with step(log, f"[{comp}] validating the stitched graph (onnx.checker, full check)") as t:
        onnx.checker.check_model(str(stage / MODEL_FILE), full_check=True)
    run.seconds["onnx_check"] = t.seconds
    if run.qnn is not None:
        info = {**compile_info(run.job, None), "peak_rss_bytes": peak_rss_bytes()}
        reference = run.chain.torch if run.chain is not None and options.check else None
        report = blockwise_qnn.finish(run.qnn, comp, stage / MODEL_FILE, info, reference)
        log_offload(comp, report)
        return s32, report["summary"]
    return s32, (_report(run, stage, sdd) if sdd is not None else None)


def _report(run: _Run, stage: Path, sdd: StitchStats) -> dict[str, Any]:
    """The stitched dispatch model validated, its chained pieces' outputs measured against PyTorch's chain (the
    fp32 reference: each piece's fp32 graph within the export check of it), and reported."""
    comp, options, chain = run.job.component, run.job.options, run.chain
    assert chain is not None
    validate_dispatch_model(stage / "dd" / REPLACED, comp, "stitched from its blocks", "`--no-compile` keeps the graph")
    fid_dd = None
    if options.check:
        assert chain.dispatch is not None
        fid_dd = fidelity({k: chain.torch[k] for k in run.out_names}, {k: chain.dispatch[k] for k in run.out_names})
        fid_dd["inputs"] = (f"the module's seeded inputs, {len(run.dd_parts)} pieces: the dispatch models chained, "
                            "against PyTorch's fp32 pieces chained (each piece's fp32 graph within "
                            f"{CHECK_RTOL:g} of PyTorch on the same inputs)")
        log.info("[%s] dispatch vs fp32 (chained): min cosine %.6f, max abs error %.3g", comp,
                 fid_dd["min_cosine"], fid_dd["max_abs"])
    passes = [{"name": k, "seconds": 0.0, "counts": v} for k, v in run.records.items() if k != "partition"]
    if run.partition is not None:
        passes.append(run.partition)
    passes.append({"name": "stitch", "seconds": round(run.seconds["stitch"], 3),
                   "counts": {"pieces": sdd.pieces, "boundary casts cancelled": sdd.casts_cancelled,
                              "repeated constants kept once": sdd.deduplicated,
                              "repeated nodes kept once": sdd.repeated_nodes}})
    info = {**compile_info(run.job, None), "target": options.compile_options.target.name,
            "precision": options.precision, "peak_rss_bytes": peak_rss_bytes(),
            "blockwise": {"pieces": len(run.dd_parts)}}
    report = write_report(stage / "dd", stage / "dd" / REPLACED, stage / MODEL_FILE, passes, info, fid_dd)
    log_offload(comp, report)
    return report["summary"]  # type: ignore[no-any-return]


def _parameters(per_piece: list[dict[str, Any]], wholes: list[Any], alias: dict[str, str]) -> dict[str, Any]:
    """parameters.json for the stitched graph: each piece's record under its prefix, named as the whole module
    names its parameters (each piece's ``whole``; None: the piece names them so)."""
    found: dict[str, Any] = {}
    ambiguous = 0
    n = len(per_piece)
    for i, (record, naming) in enumerate(zip(per_piece, wholes, strict=True)):
        def whole(param: str, i: int = i, naming: Any = naming) -> str:
            return param if naming is None else naming(i, param)

        for name, entry in record["initializers"].items():
            stitched = f"b{i}/{name}"
            if stitched in alias:
                continue  # kept once, under the first piece's name
            if entry.get("param") is not None:
                found[stitched] = {**entry, "param": whole(entry["param"])}
            else:
                found[stitched] = {**entry, "candidates": [whole(c) for c in entry.get("candidates", [])]}
                ambiguous += 1
    return {**(per_piece[0] if per_piece else {}), "module": "", "ambiguous": ambiguous, "initializers": found,
            "blockwise": n}


def _stitch_provenance(parts: list[Path], dd_dir: Path, alias32: dict[str, str], alias_dd: dict[str, str],
                       kept: set[str]) -> None:
    """dd/weights.json for the stitched dispatch model: each piece's record under its prefix, its ``init``
    references renamed to the stitched fp32 graph's constants (a repeat to the one kept); only the constants
    the model holds (``kept``: those its prologue took are the prologue's)."""

    def rename(expr: Any, i: int) -> Any:
        if isinstance(expr, dict):
            if "init" in expr:
                name = f"b{i}/{expr['init']}"
                return {**expr, "init": alias32.get(name, name)}
            return {k: rename(v, i) for k, v in expr.items()}
        if isinstance(expr, list):
            return [rename(v, i) for v in expr]
        return expr

    stitched_weights: dict[str, Any] = {}
    for i, part in enumerate(parts):
        record = read_record(part.parent / WEIGHTS_FILE)
        for name, expr in record["weights"].items():
            stitched = f"b{i}/{name}"
            if stitched not in alias_dd and stitched in kept:
                stitched_weights[stitched] = rename(expr, i)
    write_record(dd_dir / WEIGHTS_FILE, make_record("model.onnx", stitched_weights))


def _repartition(path: Path, target: Any, prologue_inputs: frozenset[str], name: str
                 ) -> tuple[dict[str, Any], set[str]]:
    """The regions again over the stitched dispatch model (each piece numbered its own from 0, and the blocks'
    regions meet where the casts went), after the views the seams left between dispatch ops are absorbed (a
    piece's output viewed back to its own shape, now read by the next piece's op: ``passes.views``) and, where
    the component has one, its prologue is cut (``passes.prologue``: Flux.1's rotary tables, which its first
    piece computes and hands to every block; in a piece they are a graph output, so only the stitched model has
    a prologue). The graph is read without its weights (but the small constants a prologue may take) and
    written back so. Returns the partition's record (the stitched model's, in place of the pieces' summed) and
    the names of the constants the model keeps."""
    import onnx
    import onnx_ir as ir
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    from sdnpu.passes.modelfile import save
    from sdnpu.passes.prologue import prologue_pass
    from sdnpu.passes.views import absorb_views

    proto = onnx.load(str(path), load_external_data=False)
    if prologue_inputs:
        for t in proto.graph.initializer:  # a table's frequencies, column indices: kept in the graph proper
            size = next((int(e.value) for e in t.external_data if e.key == "length"), None)
            if uses_external_data(t) and size is not None and size <= _SMALL_CONSTANT:
                load_external_data_for_tensor(t, str(path.parent))
                t.data_location = onnx.TensorProto.DEFAULT
                del t.external_data[:]
    model = ir.serde.deserialize_model(proto)
    absorb_views(model, target)
    if prologue_inputs:
        cut = prologue_pass(model, target, prologue_inputs)
        if cut.modified:
            save(cut.details["prologue"], path.parent / PROLOGUE_FILE)
            validate_dispatch_model(path.parent / PROLOGUE_FILE, name,
                                    f"cut from the stitched {path.name}", "`--no-compile` keeps the graph")
    result = partition(model, target)
    out = ir.serde.serialize_model(model)
    onnx.save(out, str(path))
    record = {"name": "partition", "seconds": 0.0, "counts": result.counts,
              "regions": [asdict(reg) for reg in result.details["regions"]]}  # type: ignore[attr-defined]
    return record, {t.name for t in out.graph.initializer}


_SMALL_CONSTANT = 1 << 16  # bytes: constants read into memory for the prologue pass (it copies what it moves)
