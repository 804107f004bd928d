"""A graph's interface before it is compiled: the static shapes of its inputs where it has dynamic axes, and the
outputs its dispatch model keeps (``--outputs``); for a graph compiled alone (``sdnpu compile``), what its
component folder says of it (its ``config.json``, the VAE's beside it, the pipeline's ``model_index.json``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import onnx

from sdnpu import families
from sdnpu.components import COMPONENTS
from sdnpu.errors import SdnpuError
from sdnpu.imagesize import Size
from sdnpu.passes.modelfile import unreadable
from sdnpu.signatures import signature, vae_scale_factor
from sdnpu.specs import default_resolution, pipeline_outputs

log = logging.getLogger(__name__)

# --outputs: "pipeline" (default) keeps what a diffusers pipeline reads, "all" keeps every output of the
# graph; anything else is a comma-separated list of output names.
OUTPUT_CHOICES = ("pipeline", "all")


def keep_outputs(spec: str, available: list[str], component: str, config: dict[str, Any] | None,
                 family: str | None) -> list[str] | None:
    """``--outputs`` -> the output names to keep (None: all). ``family``: the pipeline's
    (``sdnpu.families``' name), None where it is unknown."""
    if spec == "all":
        return None
    if spec == "pipeline":
        return _pipeline_keeps(available, component, config, family)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in available]
    if unknown or not names:
        raise SdnpuError(f"--outputs {spec!r}: {', '.join(unknown) or 'no name'} is not an output of the graph",
                         hint=f"choose from {', '.join(available)}, or pipeline / all")
    return names


def _pipeline_keeps(available: list[str], component: str, config: dict[str, Any] | None,
                    family: str | None) -> list[str] | None:
    if family is None and component == "text_encoder":
        log.info("[%s] keeping every output: no model_index.json says which pipeline reads it "
                 "(--outputs NAME,... chooses)", component)
        return None
    wanted = pipeline_outputs(component, config or {}, family) if config is not None else None
    if wanted is None:
        return None
    if not set(wanted) <= set(available):
        log.warning("[%s] keeping every output: the pipeline reads %s, the graph has %s", component,
                    ", ".join(wanted), ", ".join(available))
        return None
    return wanted if len(wanted) < len(available) else None


def dynamic_inputs(path: Path) -> dict[str, list[int | str]]:
    """The graph inputs with a dynamic (or unknown) axis, and their dims."""
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError and friends: a truncated file, or not ONNX
        raise unreadable(path, e) from e
    inits = {i.name for i in model.graph.initializer}
    dims = {vi.name: [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
                      for d in vi.type.tensor_type.shape.dim]
            for vi in model.graph.input if vi.name not in inits}
    return {k: v for k, v in dims.items() if any(not isinstance(d, int) or d < 0 for d in v)}


def static_shapes(path: Path, overrides: dict[str, list[int]] | None = None, res: int | str | Size | None = None
                  ) -> dict[str, list[int]]:
    """Static shapes for a graph's inputs where it has dynamic axes (optimum exports them). A component
    folder of an SD pipeline (``unet/model.onnx`` with its ``config.json``, as optimum writes it) gets the
    same shapes ``sdnpu convert`` uses at resolution ``res`` (default: the model's own, by the rule in
    ``sdnpu.specs``, from the component's config.json and the VAE's beside it); ``overrides``
    (``--shape``) win. Inputs that stay dynamic are an error naming them."""
    dynamic = dynamic_inputs(path)
    shapes: dict[str, list[int]] = {}
    component, config_path = path.parent.name, path.parent / "config.json"
    if dynamic and component in COMPONENTS and config_path.is_file():
        config = read_config(config_path)
        vae = _sibling_vae_config(path.parent) or (config if component.startswith("vae") else None)
        # a component of a denoiser's name: the module itself
        denoiser = config if component in families.DENOISER_MODULES else None
        size = Size.of(default_resolution(denoiser, vae) if res is None else res)
        sig = signature(component, config, size, vae_scale_factor(vae))
        shapes = {spec.name: list(spec.shape) for spec in sig.inputs if spec.name in dynamic}
    shapes.update(overrides or {})
    missing = {k: v for k, v in dynamic.items() if k not in shapes}
    if missing:
        raise SdnpuError(
            "the model has dynamic input axes, and an NPU needs static shapes: "
            + ", ".join(f"{k} {v}" for k, v in missing.items()),
            hint="pass them, e.g. " + " ".join(f"--shape {k}=" + ",".join("N" for _ in v) for k, v in missing.items()))
    return shapes


def read_config(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError) as e:
        raise SdnpuError(f"cannot read {path}: {e}", hint="it should be the component's diffusers config.json") from e


def _sibling_vae_config(folder: Path) -> dict[str, Any] | None:
    """The VAE's config beside a component folder (optimum writes vae_decoder/, diffusers vae/): it sets
    the latent size."""
    for name in ("vae_decoder", "vae", "vae_encoder"):
        path = folder.parent / name / "config.json"
        if path.is_file():
            return read_config(path)
    return None


def pipeline_kind(source: Path) -> str | None:
    """The family (``sdnpu.families``' name) of the pipeline ``source`` (``<pipeline>/<component>/model.onnx``)
    belongs to, from the pipeline's model_index.json; where there is none, the family its folder's name says
    alone (a ``text_encoder_2`` folder: SDXL's), else None."""
    try:
        index = json.loads((source.parent.parent / "model_index.json").read_text())
    except (OSError, ValueError):
        marked = families.marked_by([source.parent.name])
        return marked.name if marked is not None else None
    return families.detect(index).name if isinstance(index, dict) else None


def output_names(path: Path) -> list[str]:
    return [o.name for o in onnx.load(str(path), load_external_data=False).graph.output]
