"""The one exception type that users see: a message that names the problem and the fix."""

from __future__ import annotations


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
