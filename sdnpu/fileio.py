"""Writes that never leave a half file: temporary name, fsync, rename into place.

A component folder is built complete in a staging folder beside its target and swapped in with one
atomic ``renameat2(RENAME_EXCHANGE)`` where the kernel offers it (two renames otherwise, recovered by
``recover_staging`` on the next run). An interrupted run therefore leaves the previous output intact,
and its leftovers are swept by the next run.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_STAGING = re.compile(r"^\.(?P<name>.+)\.(?P<kind>staging|old)-(?P<pid>\d+)$")


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


def commit_dir(staging: Path, target: Path) -> None:
    """Put the finished folder ``staging`` at ``target``, replacing what was there in one step."""
    _fsync_tree(staging)
    if not target.exists():
        os.rename(staging, target)
    elif _exchange(staging, target):
        shutil.rmtree(staging)  # now holds the previous output
    else:
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        os.rename(target, old)
        os.rename(staging, target)  # a crash between these two renames is undone by recover_staging
        shutil.rmtree(old)
    _fsync_path(target.parent)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (this one does)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def staging_target(stage: Path) -> Path | None:
    """The folder a staging folder (``staged_dir``) will replace; None where ``stage`` is not one."""
    m = _STAGING.match(stage.name)
    return stage.parent / m["name"] if m and m["kind"] == "staging" else None


def recover_staging(parent: Path) -> None:
    """Sweep what interrupted runs left in ``parent``: drop unfinished staging folders and temp
    files, and put back a previous output that a crash left set aside."""
    if not parent.is_dir():
        return
    for entry in sorted(parent.iterdir()):
        m = _STAGING.match(entry.name)
        tmp = re.match(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)$", entry.name)
        if tmp and not pid_alive(int(tmp["pid"])):
            log.info("removing %s left by an interrupted run", entry)
            entry.unlink(missing_ok=True)
            continue
        if not m or pid_alive(int(m["pid"])):
            continue
        target = parent / m["name"]
        if m["kind"] == "old" and not target.exists():
            log.warning("restoring %s from %s (a run stopped while replacing it)", target, entry.name)
            os.rename(entry, target)
        else:
            log.info("removing %s left by an interrupted run", entry)
            shutil.rmtree(entry, ignore_errors=True)


@contextlib.contextmanager
def staged_dir(target: Path) -> Iterator[Path]:
    """Yield an empty folder to fill; on normal exit it replaces ``target`` atomically, on any
    exception (or Ctrl-C) it is removed and ``target`` stays as it was."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    recover_staging(target.parent)
    staging = target.parent / f".{target.name}.staging-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    commit_dir(staging, target)
