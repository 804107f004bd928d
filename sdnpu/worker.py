"""Run one function in a spawned worker process, so that the memory it used goes back when it ends.

The export stage needs it because torch's exporter keeps tensors alive after it returns; ``sdnpu verify``
because an onnxruntime session leaves gigabytes in the process after it is deleted (measured on the SDXL VAE
decoder at 1024 px: 9.5 GB still resident after the fp32 session was gone, and the next session's 13.7 GB on
top of it was killed by the kernel on a 24 GB machine). A process that exits gives everything back.

The function and its arguments are pickled (a module-level function; small arguments), its result comes back
by pipe. An SdnpuError in the worker is raised again in the caller as it was; any other exception comes back
as one naming ``what`` with the worker's traceback; a worker that dies (the kernel's out-of-memory killer)
is a ``WorkerDied`` (an SdnpuError) with its exit code. The worker dies with its parent (Ctrl-C, SIGKILL): no orphan keeps
writing.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import traceback
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from sdnpu.errors import SdnpuError
from sdnpu.memory import estimate

log = logging.getLogger(__name__)

ISOLATE_RUNS_ABOVE = 1 << 30  # bytes (``memory.estimate``): a graph's run past this goes to a worker process

T = TypeVar("T")

KILLED = -9  # a worker's exit code when SIGKILL ended it: most often the kernel's out-of-memory killer
CRASHED = -11  # SIGSEGV


class WorkerDied(SdnpuError):
    """The worker process ended without an answer; ``exitcode`` is its exit code (minus the signal that ended
    it): ``KILLED`` (the kernel's out-of-memory killer, mostly) or ``CRASHED`` (a segmentation fault)."""

    def __init__(self, message: str, hint: str | None, exitcode: int | None) -> None:
        super().__init__(message, hint)
        self.exitcode = exitcode


def run_in_worker(fn: Callable[..., T], *args: Any, what: str) -> T:
    """``fn(*args)`` in a spawned process; ``what`` names the work in errors (``"exporting unet"``)."""
    import multiprocessing  # multiprocessing where a worker starts: the CLI starts without it (1 ms)

    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    level = logging.getLogger("sdnpu").getEffectiveLevel()
    proc = ctx.Process(target=_main, args=(sender, fn, args, level), name=f"sdnpu-{what.replace(' ', '-')}")
    proc.start()
    sender.close()
    try:
        kind, payload = receiver.recv()
    except EOFError:
        kind, payload = "died", None
    finally:
        proc.join()
    if kind == "ok":
        return payload  # type: ignore[no-any-return]
    if kind == "error":
        raise SdnpuError(*payload)
    if kind == "crash":
        raise SdnpuError(f"{what} failed: {payload}")
    raise WorkerDied(f"the worker process {what} died (exit code {proc.exitcode})",
                     "a negative code is the signal that killed it; -9 is often the kernel's "
                     "out-of-memory killer: close other large jobs and retry", proc.exitcode)


def _main(conn: Any, fn: Callable[..., Any], args: tuple[Any, ...], level: int) -> None:
    try:  # die with the parent
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("sdnpu").setLevel(level)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    try:
        conn.send(("ok", fn(*args)))
    except SdnpuError as e:
        conn.send(("error", (e.message, e.hint)))
    except BaseException as e:  # a bug: send the traceback, the parent names the work
        conn.send(("crash", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def run_graph_isolated(fn: Callable[..., T], path: Any, *args: Any, what: str) -> T:
    """``fn(path, *args)`` (an onnxruntime run of the graph at ``path``) in this process where the run is small,
    in a worker where it passes ``ISOLATE_RUNS_ABOVE`` (``sdnpu.memory.estimate``): a finished onnxruntime session
    leaves its gigabytes in the heap (a Flux.1 block at 1024 px, whose attention scores alone are 2 GB; SD 3.5's
    transformer at 1024 px, 10.8 GB left after its fp32 run and the next run killed for memory)."""
    if estimate(path).bytes < ISOLATE_RUNS_ABOVE:
        return fn(path, *args)
    return run_in_worker(fn, path, *args, what=what)
