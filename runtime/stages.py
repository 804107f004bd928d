"""What the text-to-image loops of every pipeline share (``sdnpu.runtime.text2image`` for SDXL and SD 1.x,
``sdnpu.runtime.sd3``): a converted folder's ``model_index.json``, its scheduler, and sessions opened per stage."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sdnpu.errors import SdnpuError
from sdnpu.imagesize import Size
from sdnpu.progress import release_memory
from sdnpu.runtime.session import Component, RuntimeOptions, open_component


class Stages:
    """Sessions opened per stage of a pipeline (``folder``, ``reference``, ``runtime``, ``size``, ``keep``:
    set by the pipeline), dropped after it unless kept."""

    folder: Path
    reference: bool
    keep: bool
    runtime: RuntimeOptions
    size: Size | None
    parts: dict[str, Component]

    @contextlib.contextmanager
    def _using(self, *names: str, runtime: RuntimeOptions | None = None) -> Iterator[dict[str, Component]]:
        """Sessions for ``names`` for the length of a stage (kept when ``keep_sessions``); ``runtime``: how to
        make them, where not as the pipeline's."""
        runtime = runtime or self.runtime
        parts = {n: self.parts.get(n) or open_component(self.folder, n, self.reference, runtime, self.size)
                 for n in names}
        if self.keep:
            self.parts.update(parts)
        try:
            yield parts
        finally:
            parts.clear()
            if not self.keep:
                release_memory()


def load_scheduler(folder: Path, name: str | None) -> Any:
    """The folder's scheduler (``scheduler/scheduler_config.json``), or diffusers' scheduler class ``name``
    made from that config."""
    import diffusers

    config = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    cls_name = name or config["_class_name"]
    cls = getattr(diffusers, cls_name, None)
    if cls is None or not hasattr(cls, "from_config"):
        raise SdnpuError(f"unknown scheduler {cls_name!r}",
                         hint="a diffusers scheduler class, e.g. EulerDiscreteScheduler, DDIMScheduler "
                         "(FlowMatchEulerDiscreteScheduler for SD3)")
    return cls.from_config(config)




def read_index(folder: Path) -> dict[str, Any]:
    """A converted folder's ``model_index.json``, or the error that says it is not one."""
    path = folder / "model_index.json"
    if not path.is_file():
        raise SdnpuError(f"{folder} is not a converted pipeline folder (no model_index.json)",
                         hint="make convert MODEL=all writes one: models/<source name>/")
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SdnpuError(f"cannot read {path}: {e}", hint="convert the pipeline again") from e
    if not isinstance(index, dict):
        raise SdnpuError(f"{path} does not hold a JSON object", hint="convert the pipeline again")
    return index
