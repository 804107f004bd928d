"""Progress for long steps, through ``logging``: a start line, a heartbeat, an end line with time."""

from __future__ import annotations

import contextlib
import logging
import resource
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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
    log.info("%s: done in %.1f s", what, timer.seconds)
