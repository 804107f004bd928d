"""The sizes of a converted component: which files each size has, and ``sizes.json``, which lists them.

A component converted at several sizes keeps one graph per size over one copy of the weights
(``sdnpu.convert.shared`` writes them); this is what every stage reads of that layout (``runtime`` picks a
size's graphs, ``reports`` lists them), torch-free like every format here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdnpu.errors import SdnpuError
from sdnpu.fileio import atomic_write_json
from sdnpu.imagesize import Size

MANIFEST = "sizes.json"
FORMAT, VERSION = "sdnpu-sizes", 1


@dataclass(frozen=True)
class SizeFiles:
    """The files of one size in a component folder, relative to it. The primary size has the plain names
    (``model.onnx``, ``dd/replaced.onnx``, ...), which every single-size folder has too; another size has
    its ``WxH`` in them (``model.1152x896.onnx``, ``dd/replaced.1152x896.onnx``, ...)."""

    size: Size
    primary: bool

    def _name(self, stem: str, suffix: str) -> str:
        return f"{stem}{suffix}" if self.primary else f"{stem}.{self.size}{suffix}"

    @property
    def model(self) -> str:
        return self._name("model", ".onnx")

    @property
    def dispatch(self) -> str:
        return "dd/" + self._name("replaced", ".onnx")

    @property
    def report(self) -> str:
        return "dd/" + self._name("report", ".json")

    @property
    def text_report(self) -> str:
        return "dd/" + self._name("onnx_report", ".txt")

    @property
    def weights(self) -> str:
        return "dd/" + self._name("weights", ".json")

    @property
    def export(self) -> str:
        return self._name("export", ".json")

    @property
    def parameters(self) -> str:
        return self._name("parameters", ".json")

    def to_json(self) -> dict[str, Any]:
        return {"size": str(self.size), **self.size.to_json(), "model": self.model, "dispatch": self.dispatch,
                "report": self.report}


def read_manifest(comp_dir: Path) -> dict[str, Any] | None:
    """The component's ``sizes.json`` (None where there is none: a folder from before sizes were shared, or a
    component that does not depend on the size)."""
    path = Path(comp_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SdnpuError(f"cannot read {path}: {e}", hint="convert the component again") from e
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise SdnpuError(f"{path} is not a sizes manifest this sdnpu reads", hint="convert the component again")
    return manifest  # type: ignore[no-any-return]


def sizes_of(comp_dir: Path) -> list[SizeFiles]:
    """The sizes a component folder holds, the primary first: from ``sizes.json``, else the one size its
    ``export.json`` records (a folder converted at one size)."""
    manifest = read_manifest(comp_dir)
    if manifest is not None:
        return [SizeFiles(Size(e["height"], e["width"]), i == 0) for i, e in enumerate(manifest["sizes"])]
    export = Path(comp_dir) / "export.json"
    try:
        size = json.loads(export.read_text()).get("size")
    except (OSError, ValueError):
        return []
    return [SizeFiles(Size(size["height"], size["width"]), True)] if size else []


def write_manifest(comp_dir: Path, component: str, sizes: list[SizeFiles], shared: dict[str, Any]) -> None:
    """``sizes.json``: the sizes (the primary first), their files, and what each shares (``shared``: size ->
    ``{"model": ShareStats, "dispatch": ShareStats}`` as JSON)."""
    atomic_write_json(Path(comp_dir) / MANIFEST, {
        "format": FORMAT, "version": VERSION, "component": component,
        "sizes": [{**f.to_json(), "shared": shared.get(str(f.size))} for f in sizes]})
