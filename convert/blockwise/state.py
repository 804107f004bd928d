"""A block-by-block conversion under way (``Run``): the pieces' files and records so far, the chains' values, the
times; and how a run that stops leaves it for the next.

A run that stops (an error, Ctrl-C, the machine) keeps its finished pieces in ``.<component>.pieces/`` beside the
component's folder (``work_dir``), with what the next run needs to go on after them (``STATE``: the chains'
values, the records, the checks, the compiled contexts), written after each piece. The same command goes on
there (Flux.1 dev at 1024 px for qnn-htp is hours of QNN's compiles); a run whose job differs in anything a piece
depends on (``_fingerprint``) starts again. The state is a pickle of this module's ``Run``, signed with a key of the
user's own (``KEY``, made on first use, readable by the user alone): a state the key does not sign (planted in a
shared folder, say) is not unpickled, as sdnpu refuses a pickled checkpoint (it runs code); it is read back by the
same version of sdnpu only (the fingerprint holds the version).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import pickle
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sdnpu import __version__
from sdnpu.convert.blockwise import qnn
from sdnpu.convert.job import Job
from sdnpu.errors import SdnpuError
from sdnpu.fileio import pid_alive

log = logging.getLogger(__name__)


@dataclass
class Chain:
    """The chains' current values by name (PyTorch, the dispatch model): what the pieces so far gave, the latest
    of each name."""

    torch: dict[str, np.ndarray]
    dispatch: dict[str, np.ndarray] | None



@dataclass
class Run:
    """A block-by-block conversion under way: the pieces' files and records so far, the times, the chains."""

    job: Job
    work: Path  # the pieces' folders
    feeds: dict[str, np.ndarray]  # the seeded inputs of the module
    out_names: tuple[str, ...]
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("torch_run", "export", "onnx_run", "compile", "stitch"), 0.0))
    fp32_parts: list[Path] = field(default_factory=list)  # with --dispatch-only, deleted once compiled
    fp32_nodes: int = 0  # the pieces' fp32 graphs' nodes (the stitched graph's, where none is stitched)
    dd_parts: list[Path] = field(default_factory=list)
    records: dict[str, dict[str, int]] = field(default_factory=dict)  # the pieces' pass counts, summed
    params: list[dict[str, Any]] = field(default_factory=list)  # each piece's parameters.json
    wholes: list[Any] = field(default_factory=list)  # each piece's parameter naming (``Piece.whole``)
    worst: dict[str, float] = field(default_factory=lambda: {"max_abs": 0.0, "max_rel": 0.0, "min_cosine": 1.0})
    last_check: dict[str, Any] | None = None  # the last piece's fp32 graph against PyTorch, by output
    n_params: int = 0
    chain: Chain | None = None
    stitched: list[dict[str, Any]] = field(default_factory=list)  # the passes on the stitched dispatch model
    qnn: qnn.QnnChain | None = None  # a standard target's contexts (qnn-htp), None for AMD's

    def timed(self, what: str, started: float) -> None:
        self.seconds[what] += time.perf_counter() - started

    def __getstate__(self) -> dict[str, Any]:  # the job is the caller's: a run that goes on has its own
        return {k: v for k, v in self.__dict__.items() if k != "job"}


STATE = "state.pkl"
KEY = Path.home() / ".cache" / "sdnpu" / "state.key"  # this user's: a state it does not sign is not read


def _key() -> bytes | None:
    """This user's key for signing a state (made on first use, readable by the user alone); None where it cannot
    be kept (no writable home): then no run leaves a state, and none goes on."""
    try:
        if not KEY.is_file():
            KEY.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(KEY, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
        return KEY.read_bytes()
    except OSError as e:
        log.warning("no key for the pieces' state (%s): a run that stops here starts again", e)
        return None


def _fingerprint(job: Job) -> str:
    """What a finished piece depends on: the module's weights, the size, the options that change a piece."""
    o, sig = job.options, job.signature()
    return json.dumps({"sdnpu": __version__, "source": [job.origin.name, job.origin.fingerprint],
                       "component": job.component, "inputs": [x.to_json() for x in sig.inputs],
                       "outputs": list(sig.outputs),
                       "options": [o.exporter, o.opset, o.check, o.compile, o.outputs, o.target, o.precision,
                                   o.htp_arch, o.context_gb, repr(o.loras), o.dispatch_only]
                                  + ([o.htp_optimization] if o.htp_optimization is not None else [])},
                      sort_keys=True)


def work_dir(stage: Path, component: str) -> Path:
    """Where a block-by-block conversion of ``component`` staged in ``stage`` keeps its pieces."""
    return stage.parent / f".{component}.pieces"


def fresh(job: Job, work: Path) -> Run:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    run = Run(job, work, job.sample_inputs(), tuple(job.signature().outputs))
    target = job.options.compile_options.target
    if job.options.compile and target.kind == "standard":
        run.qnn = qnn.start(work / target.out_dir, job.options.compile_options, run.feeds, run.out_names,
                            emulate=job.options.check)
    return run


def continued(job: Job, work: Path) -> Run | None:
    """The run an earlier one left in ``work`` for the same job, its finished pieces' files all there; None
    where there is none, or it was another job's (then it goes)."""
    state = work / STATE
    if not state.is_file():
        return None
    key = _key()
    if key is None:
        return None
    blob = memoryview(state.read_bytes())  # slices of it are views: a large state is not held twice
    if not hmac.compare_digest(blob[:32], hmac.new(key, blob[32:], hashlib.sha256).digest()):
        log.warning("[%s] the state in %s is not signed by this user's sdnpu: starting again (it is not read: a "
                    "pickle runs code)", job.component, work)
        return None
    try:
        saved = pickle.loads(blob[32:])  # noqa: S301 -- signed above with this user's key: written by checkpoint
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
    run: Run = saved["run"]
    kept = run.dd_parts if job.options.dispatch_only else [*run.fp32_parts, *run.dd_parts]  # fp32 ones deleted
    if not all(p.is_file() for p in kept):
        log.warning("[%s] the pieces left in %s are incomplete: starting again", job.component, work)
        return None
    run.job = job
    if run.qnn is not None:
        run.qnn.options = job.options.compile_options
    return run


def checkpoint(run: Run, running: bool = True) -> None:
    """What a run that stops after this piece leaves for the next, signed with this user's key (written whole,
    then renamed into place); nothing where there is no key."""
    key = _key()
    if key is None:
        return
    blob = pickle.dumps({"fingerprint": _fingerprint(run.job), "pid": os.getpid(), "running": running, "run": run},
                        protocol=pickle.HIGHEST_PROTOCOL)
    tmp = run.work / f"{STATE}.tmp"
    tmp.write_bytes(hmac.new(key, blob, hashlib.sha256).digest() + blob)
    os.replace(tmp, run.work / STATE)


