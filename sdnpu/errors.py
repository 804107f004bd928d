"""The one exception type that users see: a message that names the problem and the fix."""

from __future__ import annotations

import errno


class SdnpuError(Exception):
    """An error caused by the user's input or environment, not by a bug in sdnpu.

    ``str(err)`` is the whole message; ``hint`` (optional) says how to fix it. The CLI prints both
    without a traceback and exits non-zero; anything that is not an ``SdnpuError`` is a bug and keeps
    its traceback.
    """

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message}\n  hint: {self.hint}"
        return self.message


def storage_error(err: OSError) -> SdnpuError | None:
    """The ``SdnpuError`` for an ``OSError`` that the machine, not sdnpu, caused: a full disk, a read-only
    file system, no permission. ``None`` for any other ``OSError`` (a bug, which keeps its traceback)."""
    where = f" ({err.filename})" if err.filename else ""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return SdnpuError(f"no space left on the device{where}: the disk or your quota is full",
                          hint="free some space (df -h shows what is left) or write elsewhere with --out; "
                          "no file was left half-written")
    if err.errno == errno.EROFS:
        return SdnpuError(f"cannot write{where}: read-only file system",
                          hint="choose a writable folder with --out; the previous output is unchanged")
    if err.errno in (errno.EACCES, errno.EPERM):
        return SdnpuError(f"permission denied{where}",
                          hint="choose a folder you may write to with --out, or fix its permissions")
    return None
