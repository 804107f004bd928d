"""The sizes of a converted component: which files each size has, and ``sizes.json``, which lists them.

A component converted at several sizes keeps one graph per size over one copy of the weights
(``sdnpu.convert.shared`` writes them); this is what every stage reads of that layout (``runtime`` picks a
size's graphs, ``reports`` lists them), torch-free like every format here. A denoiser (``sdnpu.signatures.
batched``) may also hold several batches (2 for classifier-free guidance, 1 guidance-free, more for several
images per call): each (size, batch) pair, a ``Variant``, is one entry, and the files of a batch other than the
primary's name it (``model.512x512.b1.onnx``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdnpu.errors import SdnpuError
from sdnpu.fileio import atomic_write_json
from sdnpu.imagesize import Size
from sdnpu.signatures import batched

MANIFEST = "sizes.json"
FORMAT, VERSION = "sdnpu-sizes", 1


@dataclass(frozen=True)
class Variant:
    """One shape a component is converted at: its image size and, for a denoiser, its batch (None: a
    component that takes none, or a folder that does not record it)."""

    size: Size
    batch: int | None = None

    def __str__(self) -> str:
        return str(self.size) if self.batch is None else f"{self.size} at batch {self.batch}"


@dataclass(frozen=True)
class SizeFiles:
    """The files of one variant in a component folder, relative to it. The primary has the plain names
    (``model.onnx``, ``dd/replaced.onnx``, ...), which every single-size folder has too; another size has
    its ``WxH`` in them (``model.1152x896.onnx``, ``dd/replaced.1152x896.onnx``, ...), and a batch other than
    the primary's its ``bN`` after that (``model.512x512.b1.onnx``)."""

    size: Size
    primary: bool
    batch: int | None = None
    named_batch: bool = False  # its batch is not the primary's: its names carry it

    @classmethod
    def of(cls, variant: Variant, primary_batch: int | None) -> SizeFiles:
        """The files of ``variant`` beside a primary at ``primary_batch`` (not the primary itself)."""
        named = variant.batch is not None and primary_batch is not None and variant.batch != primary_batch
        return cls(variant.size, False, variant.batch, named)

    @property
    def variant(self) -> Variant:
        return Variant(self.size, self.batch)

    @property
    def tag(self) -> str:
        """What its names carry (empty for the primary)."""
        if self.primary:
            return ""
        return f"{self.size}.b{self.batch}" if self.named_batch else str(self.size)

    def _name(self, stem: str, suffix: str) -> str:
        return f"{stem}{suffix}" if self.primary else f"{stem}.{self.tag}{suffix}"

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
        return {"size": str(self.size), **self.size.to_json(),
                **({"batch": self.batch} if self.batch is not None else {}), "model": self.model,
                "dispatch": self.dispatch, "report": self.report}


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


def _export_batch(export: Path) -> int | None:
    """The denoiser batch an ``export.json`` records: its ``batch``, or in a folder from before batches were a
    choice, its first input's first dimension where the component takes one (None: it takes none)."""
    try:
        record = json.loads(export.read_text())
    except (OSError, ValueError):
        return None
    if "batch" in record or not batched(str(record.get("component"))):
        return record.get("batch")  # type: ignore[no-any-return]
    inputs = record.get("inputs") or []
    return int(inputs[0]["shape"][0]) if inputs and inputs[0].get("shape") else None


def sizes_of(comp_dir: Path) -> list[SizeFiles]:
    """The variants a component folder holds, the primary first: from ``sizes.json``, else the one its
    ``export.json`` records (a folder converted at one size)."""
    comp_dir = Path(comp_dir)
    manifest = read_manifest(comp_dir)
    if manifest is None:
        try:
            size = json.loads((comp_dir / "export.json").read_text()).get("size")
        except (OSError, ValueError):
            return []
        return [SizeFiles(Size(size["height"], size["width"]), True, _export_batch(comp_dir / "export.json"))
                ] if size else []
    files: list[SizeFiles] = []
    for i, e in enumerate(manifest["sizes"]):
        size = Size(e["height"], e["width"])
        if i == 0:
            files.append(SizeFiles(size, True, e["batch"] if "batch" in e else _export_batch(comp_dir / "export.json")))
            continue
        batch = e["batch"] if "batch" in e else _export_batch(comp_dir / SizeFiles(size, False).export)
        files.append(SizeFiles.of(Variant(size, batch), files[0].batch))
    return files


def write_manifest(comp_dir: Path, component: str, sizes: list[SizeFiles], shared: dict[Variant, Any]) -> None:
    """``sizes.json``: the variants (the primary first), their files, and what each shares (``shared``: variant
    -> ``{"model": ShareStats, "dispatch": ShareStats}`` as JSON)."""
    atomic_write_json(Path(comp_dir) / MANIFEST, {
        "format": FORMAT, "version": VERSION, "component": component,
        "sizes": [{**f.to_json(), "shared": shared.get(f.variant)} for f in sizes]})
