"""Progress for long steps, through ``logging``: a start line, a heartbeat, an end line with time."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import resource
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass


def peak_rss_bytes() -> int:
    """Peak resident memory so far of this process or of the largest of its finished child processes (the
    workers of ``sdnpu.worker``, where the heavy runs happen), whichever is larger. Linux reports ru_maxrss in
    KiB; for RUSAGE_CHILDREN it is the largest child's peak, not a sum."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) * 1024


RELEASE_ABOVE_RSS = 3 << 30  # below this the process holds too little for a collection to matter


def release_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS. glibc keeps freed blocks below its
    (dynamic, up to 32 MB) mmap threshold in the heap, which is where a torch module's tensors live: without
    the trim, a dropped 10 GB UNet stays resident while onnxruntime loads its own copy. A full collection
    costs 0.1-0.3 s however little it frees: done only while the process holds more than
    ``RELEASE_ABOVE_RSS``."""
    if 0 < rss_bytes() < RELEASE_ABOVE_RSS:  # 0: not known (no /proc), collected
        return
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss_bytes() -> int:
    """Resident memory now (anonymous + file-backed pages, as /proc reports it)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return 0


@dataclass
class StepTimer:
    seconds: float = 0.0


@contextlib.contextmanager
def step(log: logging.Logger, what: str, heartbeat_s: float = 30.0) -> Iterator[StepTimer]:
    """Log ``what ...`` now, ``... still running`` every ``heartbeat_s``, and the time taken at the end."""
    timer = StepTimer()
    start = time.perf_counter()
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(heartbeat_s):
            log.info("%s ... still running (%.0f s)", what, time.perf_counter() - start)

    log.info("%s ...", what)
    thread = threading.Thread(target=beat, name="sdnpu-heartbeat", daemon=True)
    thread.start()
    try:
        yield timer
    finally:
        stop.set()
        thread.join()
        timer.seconds = time.perf_counter() - start
    log.info("%s: done in %.1f s (memory %.1f GB, peak %.1f GB)", what, timer.seconds, rss_bytes() / 1e9,
             peak_rss_bytes() / 1e9)
