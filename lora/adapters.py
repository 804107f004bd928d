"""LoRA files, read the way diffusers reads them, and the weight change each one makes.

A LoRA file (safetensors) is read by diffusers' own loader (``lora_state_dict`` of the pipeline's class),
which knows the formats in use: diffusers/PEFT files (``unet.<module>.lora_A.weight``) and kohya/A1111 files
(``lora_unet_<module>.lora_down.weight`` with an ``alpha``, SDXL's UNet in its original ``input_blocks``
layout too). Each component's part is then loaded, still through diffusers, into a *skeleton* of the
component (its module tree on PyTorch's meta device: no weights, no memory), which gives PEFT's LoRA layers
with PEFT's scaling (alpha / rank, per-module ranks and alphas, rsLoRA). Their A and B matrices are then set
to the file's, so that the change of a weight is PEFT's own ``get_delta_weight``, the function diffusers'
``fuse_lora`` adds to the weight. Merging is ``W + d1 + d2 + ...`` in fp32, one LoRA after another, as
``fuse_lora`` merges its adapters.

``fuse_into`` does the same on a loaded PyTorch module through diffusers alone (``sdnpu convert --lora``):
the two paths meet in the tests, weight for weight.
"""

from __future__ import annotations

import hashlib
import json
import logging
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from safetensors import safe_open

from sdnpu import families
from sdnpu.components import LORA_MODULES, module_of
from sdnpu.errors import SdnpuError

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class LoraSpec:
    """One LoRA to apply: its file and its scale (``FILE[:SCALE]`` on the command line)."""

    path: Path
    scale: float = 1.0

    @classmethod
    def parse(cls, text: str) -> LoraSpec:
        head, sep, tail = str(text).rpartition(":")
        if sep:
            try:
                return cls(Path(head), float(tail))
            except ValueError:
                if Path(text).exists():
                    return cls(Path(text))
                raise SdnpuError(f"cannot read the LoRA scale in {text!r}",
                                 hint="write FILE or FILE:SCALE, e.g. style.safetensors:0.8") from None
        return cls(Path(text))

    def __str__(self) -> str:
        return f"{self.path}:{self.scale:g}"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class LoraFile:
    """A LoRA file as diffusers normalized it: the state dict (diffusers' keys, each prefixed by its
    component), the network alphas (kohya files) and the adapter metadata (diffusers files that carry it)."""

    spec: LoraSpec
    format: str  # "kohya" or "diffusers"
    sha256: str
    state_dict: dict[str, Any]
    alphas: dict[str, float] | None
    metadata: dict[str, Any] | None
    components: dict[str, int] = field(default_factory=dict)  # component -> keys for it

    def describe(self) -> dict[str, Any]:
        return {"file": str(self.spec.path), "name": self.spec.path.name, "scale": self.spec.scale,
                "format": self.format, "sha256": self.sha256}


FamilyName = str | bool  # a pipeline family's name (``sdnpu.families``); True / False: SDXL's / SD 1.x's


def family_of(family: FamilyName) -> families.Family:
    """The row of ``family`` (a bool says whether it is SDXL's), one that takes LoRAs."""
    if isinstance(family, bool):
        return families.SDXL if family else families.SD
    row = families.named(family) if family in families.NAMES else None
    if row is None or not row.lora:
        raise SdnpuError(f"a {family} pipeline takes no LoRAs in sdnpu",
                         hint="LoRAs apply to SDXL, SD 1.x/2.x and Flux.1 folders")
    return row


def _pipeline_class(family: FamilyName) -> Any:
    name = family_of(family).pipeline
    import diffusers  # diffusers at first use: the CLI starts without it (2-3 s, torch with it)

    return getattr(diffusers, name)


def read_lora(spec: LoraSpec, family: FamilyName, unet_config: dict[str, Any] | None) -> LoraFile:
    """``spec``'s file read by diffusers for a pipeline of ``family`` (SDXL, SD 1.x, Flux.1) whose UNet has
    ``unet_config`` (it maps kohya's SDXL block names), or one line saying why it cannot be."""
    path = spec.path
    if not path.is_file():
        raise SdnpuError(f"LoRA file {path} not found", hint="give the path of a .safetensors LoRA file")
    try:
        with safe_open(str(path), "pt") as f:
            keys = list(f.keys())
    except Exception as e:  # safetensors' own error: truncated, not safetensors, bad header
        raise SdnpuError(f"{path} is not a readable safetensors file: {e}",
                         hint="LoRAs are read from .safetensors files (diffusers/PEFT or kohya format)") from e
    if not keys:
        raise SdnpuError(f"{path} holds no tensors", hint="give a LoRA file")
    kohya = all(k.startswith(("lora_te_", "lora_te1_", "lora_te2_", "lora_unet_", "lora_transformer_")) for k in keys)
    if not kohya and not any(".lora" in k or "lora_" in k for k in keys):
        raise SdnpuError(f"{path} is not a LoRA: none of its {len(keys)} tensors is a LoRA matrix "
                         f"(first key {keys[0]!r})", hint="give a diffusers/PEFT or kohya LoRA file")
    cls = _pipeline_class(family)
    try:
        if family_of(family).denoiser != "unet":  # a transformer's reader gives the alphas; a UNet's maps
            # kohya's SDXL block names by the UNet's config
            state_dict, alphas, metadata = cls.lora_state_dict(str(path.parent), weight_name=path.name,
                                                               return_alphas=True, return_lora_metadata=True)
        else:
            state_dict, alphas, metadata = cls.lora_state_dict(
                str(path.parent), weight_name=path.name, return_lora_metadata=True,
                unet_config=SimpleNamespace(**unet_config) if unet_config else None)
    except Exception as e:  # diffusers' converters raise ValueError/KeyError/AssertionError on keys they cannot place
        raise SdnpuError(f"diffusers cannot read the LoRA {path}: {type(e).__name__}: {_brief(e)}",
                         hint=f"is it a LoRA for this kind of pipeline ({cls.__name__})?") from e
    lora = LoraFile(spec, "kohya" if kohya else "diffusers", sha256(path), state_dict, alphas, metadata)
    stray = []
    for key in state_dict:
        prefix = key.split(".", 1)[0]
        if prefix in LORA_MODULES:
            lora.components[prefix] = lora.components.get(prefix, 0) + 1
        else:
            stray.append(key)
    if stray:
        raise SdnpuError(f"{path}: {len(stray)} keys belong to no component sdnpu applies LoRAs to (first "
                         f"{stray[0]!r})", hint=f"LoRAs change {', '.join(LORA_MODULES)}")
    able = {module_of(c) for c in family_of(family).lora}
    foreign = sorted(set(lora.components) - able)
    if foreign:
        raise SdnpuError(f"{path} changes {', '.join(foreign)}, which a {cls.__name__} has not: a LoRA made for "
                         "another kind of model", hint=f"a LoRA for this model changes {', '.join(sorted(able))}")
    return lora


def _brief(e: Exception, limit: int = 200) -> str:
    """An exception's message on one line, cut to ``limit`` characters (diffusers lists every key it could not
    place: thousands of characters)."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3].rstrip(",; ") + "..."


def _skeleton(folder: Path, component: str) -> Any:
    """The component's module tree on the meta device (no weights), from its config.json."""
    # accelerate at first use: the CLI starts without it (1-2 s, torch with it)
    from accelerate import init_empty_weights

    config = json.loads((folder / component / "config.json").read_text())
    with init_empty_weights(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if module_of(component) in families.DENOISER_MODULES:
            import diffusers  # diffusers at first use: the CLI starts without it (2-3 s, torch with it)

            cls_name = config.get("_class_name") or families.SD.denoiser_class  # a UNet's config may not say
            cls = getattr(diffusers, cls_name, None)
            family = families.of_class(cls_name)
            if cls is None or family is None or family.denoiser not in family.lora:
                raise SdnpuError(f"{folder / component} is a {cls_name}: sdnpu applies LoRAs to SDXL and SD 1.x "
                                 "UNets and Flux.1 transformers")
            return cls.from_config(config)
        import transformers  # transformers at first use: the CLI starts without it (about 2 s, torch with it)

        arch = (config.get("architectures") or ["CLIPTextModel"])[0]
        cls = getattr(transformers, arch)
        return cls(cls.config_class.from_dict(config))


def _peft_state_dict(state_dict: dict[str, Any], component: str) -> dict[str, Any]:
    """The component's keys as PEFT names them (the conversions diffusers' loaders apply)."""
    from diffusers.utils import (  # diffusers at first use: the CLI starts without it (2-3 s, torch with it)
        convert_state_dict_to_diffusers,
        convert_state_dict_to_peft,
        convert_unet_state_dict_to_peft,
    )

    sd = {k.removeprefix(f"{component}."): v for k, v in state_dict.items() if k.startswith(f"{component}.")}
    if not sd:
        return sd
    if component in families.DENOISER_MODULES:
        return sd if "lora_A" in next(iter(sd)) else convert_unet_state_dict_to_peft(sd)
    return convert_state_dict_to_peft(convert_state_dict_to_diffusers(sd))


def _load_adapter(module: Any, lora: LoraFile, component: str, adapter: str, family: FamilyName) -> None:
    """``lora``'s part for ``component`` into ``module`` as adapter ``adapter``, by diffusers' loaders (the
    denoisers' own ``load_lora_adapter``, the family's pipeline's for a text encoder)."""
    if component in families.DENOISER_MODULES:
        module.load_lora_adapter(lora.state_dict, prefix=component, network_alphas=lora.alphas,
                                 adapter_name=adapter, metadata=lora.metadata)
    else:
        _pipeline_class(family).load_lora_into_text_encoder(
            lora.state_dict, lora.alphas, module, prefix=component, adapter_name=adapter, metadata=lora.metadata)


def _lora_layers(module: Any) -> Iterator[tuple[str, Any]]:
    from peft.tuners.lora import LoraLayer  # peft at first use: the CLI starts without it (3-6 s, torch with it)

    for name, m in module.named_modules():
        if isinstance(m, LoraLayer):
            yield name, m


class Adapters:
    """The LoRAs of one component over its skeleton: which modules they change and, on demand, each
    module's weight change per LoRA (PEFT's ``get_delta_weight``, scaled as ``set_adapters`` scales)."""

    def __init__(self, folder: Path, component: str, loras: Sequence[LoraFile], family: FamilyName) -> None:
        import torch  # torch at first use: the CLI starts without it (about 1 s)

        self.component = component
        module = module_of(component)
        self.names: list[str] = []
        self.loras: list[LoraFile] = []
        skeleton = _skeleton(folder, component)
        parts = []
        for lora in loras:  # every LoRA is loaded before any matrix is set: a later load moves the
            sd = _peft_state_dict(lora.state_dict, module)  # earlier adapters' back to the meta device
            if not sd:
                continue
            adapter = f"lora{len(self.names)}"
            _check_targets(sd, skeleton, lora, module)
            try:
                with warnings.catch_warnings():  # loading into meta tensors is a no-op torch warns about
                    warnings.simplefilter("ignore")
                    _load_adapter(skeleton, lora, module, adapter, family)
            except SdnpuError:
                raise
            except Exception as e:
                raise SdnpuError(f"{lora.spec.path}: diffusers cannot load its {component} part: "
                                 f"{type(e).__name__}: {e}", hint="is it a LoRA for this base model?") from e
            self.names.append(adapter)
            self.loras.append(lora)
            parts.append((adapter, lora, sd))
        layers = dict(_lora_layers(skeleton))
        for adapter, lora, sd in parts:
            used = set()
            for name, layer in layers.items():
                if adapter not in layer.lora_A:
                    continue
                a, b = sd.get(f"{name}.lora_A.weight"), sd.get(f"{name}.lora_B.weight")
                if a is None or b is None:
                    raise SdnpuError(f"{lora.spec.path}: module {component}.{name} has no "
                                     f"{'lora_A' if a is None else 'lora_B'} matrix", hint="the file is incomplete")
                want_a, want_b = tuple(layer.lora_A[adapter].weight.shape), tuple(layer.lora_B[adapter].weight.shape)
                if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                    raise SdnpuError(f"{lora.spec.path}: {component}.{name}: LoRA matrices {list(a.shape)} and "
                                     f"{list(b.shape)}, the module takes {list(want_a)} and {list(want_b)}",
                                     hint="a LoRA made for another base model (SD 1.5 on SDXL?)")
                # The file's matrices, in the module's dtype (fp32), as diffusers' load_state_dict puts them.
                layer.lora_A[adapter].weight = torch.nn.Parameter(a.to(torch.float32), requires_grad=False)
                layer.lora_B[adapter].weight = torch.nn.Parameter(b.to(torch.float32), requires_grad=False)
                layer.set_scale(adapter, lora.spec.scale)  # as diffusers' set_adapters(names, weights)
                used.update((f"{name}.lora_A.weight", f"{name}.lora_B.weight"))
            extra = sorted(set(sd) - used)
            if extra:
                raise SdnpuError(f"{lora.spec.path}: {len(extra)} {component} tensors are not plain LoRA matrices "
                                 f"of a module (first {extra[0]!r})",
                                 hint="sdnpu applies LoRA A/B matrices (no DoRA, LoKr or LoRA biases)")
        self._layers = layers

    @property
    def modules(self) -> list[str]:
        """The modules any LoRA changes, in the module tree's order."""
        return list(self._layers)

    def weight_name(self, module: str) -> str:
        return f"{module}.weight"

    def merged(self, module: str, base: Any) -> Any:
        """``base`` (the module's fp32 weight, a torch tensor) plus each LoRA's change, in order: a copy."""
        import torch  # torch at first use: the CLI starts without it (about 1 s)

        return self.merge_into(module, torch.as_tensor(base).clone())

    def merge_into(self, module: str, w: Any) -> Any:
        """Add each LoRA's change to the fp32 tensor ``w`` in place (a strided view works: the graph may hold
        the weight transposed), as PEFT's merge does: ``w += delta``, one LoRA after another."""
        import torch  # torch at first use: the CLI starts without it (about 1 s)

        layer = self._layers[module]
        with torch.no_grad():
            for adapter in self.names:
                if adapter in layer.lora_A:
                    delta = layer.get_delta_weight(adapter)
                    if delta.device.type != "cpu" or delta.shape != w.shape:  # never a silent no-op
                        raise RuntimeError(f"{self.component}.{module}: LoRA {adapter} gives a {delta.device.type} "
                                           f"change of shape {list(delta.shape)} for a weight of {list(w.shape)}")
                    w += delta
        return w


def _check_targets(sd: dict[str, Any], skeleton: Any, lora: LoraFile, component: str) -> None:
    """Every module the file names exists in the component, is one a LoRA can change, and takes the file's
    A and B matrices (their ranks agreeing): checked before diffusers loads anything, to say it in one line."""
    import torch  # torch at first use: the CLI starts without it (about 1 s)

    modules = dict(skeleton.named_modules())
    shapes: dict[str, dict[str, list[int]]] = {}
    for key, value in sd.items():
        name, _, kind = key.partition(".lora_")
        m = modules.get(name)
        m = getattr(m, "base_layer", m)  # a module an earlier LoRA already wraps
        if m is None:
            raise SdnpuError(f"{lora.spec.path}: key {component}.{key} matches no module of the {component}",
                             hint="a LoRA made for another base model (SD 1.5 on SDXL?), or for another component")
        if not isinstance(m, torch.nn.Linear | torch.nn.Conv2d):
            raise SdnpuError(f"{lora.spec.path}: {component}.{name} is a {type(m).__name__}; sdnpu applies LoRAs "
                             "to Linear and Conv2d modules", hint="is it a LoRA for this base model?")
        shapes.setdefault(name, {})[kind.split(".", 1)[0]] = list(value.shape)
    for name, found in shapes.items():
        m = getattr(modules[name], "base_layer", modules[name])
        a, b = found.get("A"), found.get("B")
        if a is None or b is None:
            continue  # reported, with the module, where the matrices are set
        if isinstance(m, torch.nn.Linear):
            fits = len(a) == 2 and len(b) == 2 and a[1] == m.in_features and b[0] == m.out_features
            takes = f"[r, {m.in_features}] and [{m.out_features}, r]"
        else:
            fits = (len(a) == 4 and len(b) == 4 and a[1] == m.in_channels // m.groups and b[0] == m.out_channels
                    and tuple(a[2:]) in ((1, 1), tuple(m.kernel_size)) and tuple(b[2:]) == (1, 1))
            takes = f"[r, {m.in_channels // m.groups}, kh, kw] and [{m.out_channels}, r, 1, 1]"
        if not fits or a[0] != b[1]:
            raise SdnpuError(f"{lora.spec.path}: {component}.{name}: LoRA matrices {a} and {b}, the module takes "
                             f"{takes}", hint="a LoRA made for another base model (SD 1.5 on SDXL?)")


def fuse_into(module: Any, component: str, loras: Sequence[LoraFile], family: FamilyName) -> int:
    """Fuse ``loras`` into the loaded PyTorch ``module`` with diffusers (load each as an adapter, set the
    scales, ``fuse_lora``, unload the LoRA layers), as ``sdnpu convert --lora`` does before exporting.
    Returns how many modules changed."""
    # diffusers at first use: the CLI starts without it (2-3 s, torch with it)
    from diffusers.loaders.lora_base import fuse_text_encoder_lora
    from diffusers.utils.peft_utils import recurse_remove_peft_layers, set_weights_and_activate_adapters  # as above

    names, scales = [], []
    part = module_of(component)
    for lora in loras:
        sd = _peft_state_dict(lora.state_dict, part)
        if not sd:
            continue
        _check_targets(sd, module, lora, part)
        adapter = f"lora{len(names)}"
        _load_adapter(module, lora, part, adapter, family)
        names.append(adapter)
        scales.append(lora.spec.scale)
    if not names:
        return 0
    changed = sum(1 for _ in _lora_layers(module))
    set_weights_and_activate_adapters(module, names, scales)
    if part in families.DENOISER_MODULES:
        module.fuse_lora(adapter_names=names)
        module.unload_lora()
    else:  # as the pipeline's fuse_lora and unload_lora_weights do for a text encoder
        fuse_text_encoder_lora(module, adapter_names=names)
        recurse_remove_peft_layers(module)
        if hasattr(module, "peft_config"):
            del module.peft_config
            module._hf_peft_config_loaded = None
    return changed
