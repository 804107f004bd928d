"""A vendor compile cut into pieces goes on where it stopped: the units finished so far, kept between runs.

QNN's compile of a full-size denoiser cut into pieces takes hours on a laptop-class machine (SD 3.5 Medium at
1024 px: each of its 24 blocks is minutes of QNN's compiler), and a run can stop in the middle (Ctrl-C, the
machine, a piece that has to be cut again). ``Kept`` keeps, in a folder beside the output (``folder_for``), the
plan (the pieces' node ranges, as cut so far) and each finished unit's files, with ``units.json`` saying which is
which. The next run of the same command on the same rewritten graph, target architecture and unit size reads the
plan and links the finished units back instead of compiling them again; anything else starts again. The record
is JSON naming files in its own folder only (nothing in it runs), written whole and renamed into place after each
unit. The caller drops the folder once its output is complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdnpu import __version__
from sdnpu.errors import SdnpuError
from sdnpu.fileio import atomic_write_json, pid_alive

log = logging.getLogger(__name__)

STATE = "units.json"
_CHUNK = 1 << 24


def folder_for(out: Path) -> Path:
    """Where the units of a compile into ``out`` (the final folder, not its staging) are kept."""
    return out.parent / f".{out.name}.units"


def fingerprint(model: Path, **settings: Any) -> str:
    """What a unit depends on: the bytes of ``model`` and its data files, sdnpu's version, ``settings`` (the
    architecture, the unit size, the vendor's versions)."""
    h = hashlib.blake2b(digest_size=16)
    files = [model, *sorted(model.parent.glob(f"{model.name}.data*"))]
    for path in files:
        h.update(path.name.encode())
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    h.update(json.dumps({"sdnpu": __version__, **settings}, sort_keys=True, default=str).encode())
    return h.hexdigest()


@dataclass
class Kept:
    """The plan and the finished units of one compile (``folder`` None: nothing is kept, every run starts anew)."""

    folder: Path | None
    fingerprint: str | Callable[[], str] = ""  # a callable until first needed (``key``)
    plan: list[tuple[int, int]] = field(default_factory=list)  # the pieces' node ranges, as cut so far
    units: dict[str, dict[str, Any]] = field(default_factory=dict)  # "start:end" -> the unit's record

    @classmethod
    def open(cls, folder: Path | None, fingerprint: Callable[[], str], what: str) -> Kept:
        """The units an earlier run of the same compile left in ``folder``; an empty record where there are none
        (or they were another compile's: then they go). ``fingerprint`` is computed only where there is a record
        to compare, or one to write (a graph compiled as one unit takes neither)."""
        kept = cls(folder, fingerprint)
        if folder is None:
            return kept
        state = folder / STATE
        try:
            saved = json.loads(state.read_text()) if state.is_file() else None
        except (OSError, ValueError):
            saved = None
        if saved is not None:
            pid = int(saved.get("pid", 0))
            if pid != os.getpid() and pid_alive(pid):
                raise SdnpuError(f"another sdnpu (pid {pid}) is compiling {what} into {folder.parent}",
                                 hint="wait for it to finish, or stop it")
            units = {k: v for k, v in saved.get("units", {}).items() if _files_there(folder, v)}
            if saved.get("fingerprint") == kept.key() and isinstance(saved.get("plan"), list):
                kept.plan, kept.units = [(int(a), int(b)) for a, b in saved["plan"]], units
                if units:
                    log.info("[%s] going on from an earlier run: %d of its %d pieces compiled (%s)", what,
                             len(units), len(kept.plan), folder)
                kept.save()
                return kept
            log.info("[%s] the units in %s are another compile's: starting again", what, folder)
        shutil.rmtree(folder, ignore_errors=True)
        return kept

    def key(self) -> str:
        """The fingerprint (computed once, on first use)."""
        if callable(self.fingerprint):
            self.fingerprint = self.fingerprint()
        return self.fingerprint

    def save(self) -> None:
        if self.folder is not None and (self.plan or self.units):
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.folder / STATE, {
                "fingerprint": self.key(), "pid": os.getpid(), "plan": [list(r) for r in self.plan],
                "units": self.units})

    def replan(self, ranges: list[tuple[int, int]]) -> None:
        self.plan = list(ranges)
        self.save()

    def unit(self, start: int, end: int) -> dict[str, Any] | None:
        return self.units.get(f"{start}:{end}")

    def add(self, start: int, end: int, unit: Any) -> None:
        """A finished unit (the backend's, with ``files()`` and ``record()``): its files linked (or copied) into
        the folder, its record saved."""
        if self.folder is None:
            return
        files = unit.files()
        for f in files:
            _link(f, self.folder / f.name)
        self.units[f"{start}:{end}"] = {**unit.record(), "files": [f.name for f in files]}
        self.save()

    def restore(self, start: int, end: int, out_dir: Path) -> dict[str, Any]:
        """The unit's files linked back into ``out_dir``; its record."""
        assert self.folder is not None
        record = self.units[f"{start}:{end}"]
        for name in record["files"]:
            _link(self.folder / name, out_dir / name)
        return record

    def drop(self) -> None:
        """The compile is complete: what was kept goes."""
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def _files_there(folder: Path, record: Any) -> bool:
    """Whether ``record`` names plain files of ``folder`` only, all there (the context and binaries among them)."""
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, list) or not files:
        return False
    named = [record.get("context"), *(record.get("binaries") or [])]
    return (all(isinstance(n, str) and Path(n).name == n and (folder / n).is_file() for n in files)
            and all(n in files for n in named))


def _link(src: Path, dst: Path) -> None:
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:  # another file system
        shutil.copyfile(src, dst)
