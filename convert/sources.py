"""Where modules come from: a built-in preset, a local diffusers folder or a single-file checkpoint.

A *preset* is a diffusers config shipped in ``convert/presets/<name>/`` whose weights are drawn from a fixed
seed (no model hub here): a pipeline's (``model_index.json``) or one module's (``config.json``: the
ControlNets). A *pipeline folder* has ``model_index.json`` (as ``save_pretrained`` or a hub snapshot writes
it; a ControlNet pipeline's lists its ``controlnet``). A *component folder* is one module's folder
(``config.json`` plus weights), for example ``sdxl/unet`` or a ControlNet. A *single file* is one
``.safetensors`` checkpoint in a model's original layout (``sdnpu.convert.singlefile``): its modules' weights
are the file's, everything else (configs, tokenizers, scheduler, model_index.json) the preset's whose modules
its tensors fill exactly (``SingleFile``). All take the same export path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from sdnpu import families
from sdnpu.components import COMPONENTS, MODULES, module_of
from sdnpu.convert import singlefile
from sdnpu.convert.tokenizer import clip_vocab_and_merges, qwen_tokenizer_files, t5_tokenizer_files, tokenizer_files
from sdnpu.errors import SdnpuError
from sdnpu.fileio import atomic_write_bytes, atomic_write_json, staged_dir
from sdnpu.formats import generation
from sdnpu.specs import PipelineConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub is reachable; never try one

log = logging.getLogger(__name__)

PRESETS_DIR = Path(__file__).parent / "presets"
PRESET_SEED = 0

# Module classes we know how to export, by the name that model_index.json / config.json gives: the library that
# has the class, and the pipeline module a folder holding one alone stands for. The denoisers are the families'
# (``sdnpu.families``), all diffusers classes.
_CLASSES: dict[str, tuple[str, str]] = {
    **{f.denoiser_class: ("diffusers", f.denoiser) for f in families.TABLE},
    **{f.vae_class: ("diffusers", "vae") for f in families.TABLE},  # AutoencoderKL, Qwen-Image's own
    "CLIPTextModel": ("transformers", "text_encoder"),
    "CLIPTextModelWithProjection": ("transformers", "text_encoder_2"),
    "ControlNetModel": ("diffusers", "controlnet"),
    "T5EncoderModel": ("transformers", "text_encoder_3"),
    "Qwen2_5_VLForConditionalGeneration": ("transformers", "text_encoder"),  # Qwen-Image's: its language model
}
_WEIGHT_SUFFIXES = (".safetensors", ".bin")
_PIPELINE_FOLDERS = ("scheduler", "tokenizer", "tokenizer_2", "tokenizer_3")


def preset_names() -> list[str]:
    return sorted(p.name for p in PRESETS_DIR.iterdir()
                  if (p / "model_index.json").is_file() or (p / "config.json").is_file())


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SdnpuError(f"cannot read {path}: {e}", hint="the file must be valid JSON") from e
    if not isinstance(data, dict):
        raise SdnpuError(f"{path} does not hold a JSON object")
    return data


class _Configs(Mapping[str, dict[str, Any]]):
    """A source's module configs by module key, each read from its folder when first asked for."""

    def __init__(self, modules: Mapping[str, Path]) -> None:
        self._modules = modules
        self._read: dict[str, dict[str, Any]] = {}

    def __getitem__(self, key: str) -> dict[str, Any]:
        if key not in self._read:
            self._read[key] = _read_json(self._modules[key] / "config.json")
        return self._read[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._modules)

    def __len__(self) -> int:
        return len(self._modules)


def _module_class(config: dict[str, Any]) -> str | None:
    if "_class_name" in config:
        return str(config["_class_name"])
    arch = config.get("architectures")
    return str(arch[0]) if isinstance(arch, list) and arch else None


@dataclass(frozen=True)
class SingleFile:
    """What a single-file checkpoint is: its layout, the modules it holds (module key -> its prefix in the
    file) and the preset whose configs its tensors fill, which gives the rest of the pipeline."""

    layout: singlefile.Layout
    prefixes: dict[str, str]
    preset: Source


@dataclass(frozen=True)
class Source:
    """A resolved SOURCE: its name, kind, folder (a single file: the file) and the modules it provides (module
    key -> the folder of its config.json; a single file's are its preset's)."""

    name: str
    kind: Literal["preset", "pipeline", "component", "single-file"]
    root: Path
    modules: dict[str, Path]
    classes: dict[str, str] = field(default_factory=dict)
    single: SingleFile | None = None  # a single file's layout and preset

    @property
    def components(self) -> list[str]:
        """The exportable components this source provides, in the canonical order (the UNet that takes a
        ControlNet's residuals where the source has a ControlNet too; asked for by name, any UNet gives it)."""
        return [c for c in COMPONENTS if module_of(c) in self.modules
                and (c != "unet_controlnet" or "controlnet" in self.modules)]

    def module_dir(self, component: str) -> Path:
        key = module_of(component)
        if key not in self.modules:
            if self.single is not None:
                raise SdnpuError(
                    f"{self.root.name} holds no {key} (for component {component!r}): the file holds "
                    f"{', '.join(self.modules)}",
                    hint="convert the others from the base model's diffusers folder into the same --out "
                    f"(this file provides: {', '.join(self.components)})")
            if self.kind == "component" or not (self.root / "model_index.json").is_file():
                raise SdnpuError(
                    f"{self.root} is a single {self.classes.get(next(iter(self.modules)), '')} folder: "
                    f"it has no {key!r} module for component {component!r}",
                    hint=f"this folder provides: {', '.join(self.components)}",
                )
            raise SdnpuError(
                f"pipeline {self.root} has no {key!r} module, needed for component {component!r}",
                hint=f"model_index.json must list {key!r} and the folder must hold {key}/config.json; "
                f"this pipeline provides: {', '.join(self.components) or 'nothing exportable'}",
            )
        return self.modules[key]

    def module_config(self, component: str) -> dict[str, Any]:
        return _read_json(self.module_dir(component) / "config.json")

    @cached_property
    def _configs(self) -> _Configs:
        return _Configs(self.modules)

    @property
    def family(self) -> str | None:
        """Its pipeline's family (``sdnpu.families.detect``'s name); None for one module's folder."""
        if self.single is not None:
            return self.single.preset.family
        if self.kind == "component" or not (self.root / "model_index.json").is_file():
            return None
        return families.detect(_read_json(self.root / "model_index.json")).name

    def pipeline_config(self) -> PipelineConfig:
        """The source's module configs (each read once, when first asked for), its family and T5's tokens
        (``sdnpu.specs``: every component's spec comes from it). A single file's are its preset's, all of them:
        the pipeline its modules join (a transformer alone takes its resolution from the preset's VAE)."""
        if self.single is not None:
            return self.single.preset.pipeline_config()
        # one module: as it was named (``text_encoder_2``: SDXL's), by its key alone, not its class
        family = self.family or (families.marked_by(self.modules) or families.DEFAULT).name
        return PipelineConfig(self._configs, family=family, text_len=self.generation().max_sequence_length)

    def generation(self) -> generation.Generation:
        """How the model is meant to be drawn (``sdnpu.formats.generation``: its steps, guidance and so the
        denoiser's default batch), from its folder's ``generation.json`` or its family's defaults (a single
        file: its preset's)."""
        if self.single is not None:
            return self.single.preset.generation()
        if self.kind == "component" or not (self.root / "model_index.json").is_file():
            return generation.Generation()
        return generation.read(self.root, self.family)

    def fingerprint(self) -> str:
        """A content hash of what defines the weights: the configs, and for folders each weight
        file's name and size (hashing 10 GB of weights would take minutes); for presets the seed; for a
        single file its name and size and its preset's."""
        h = hashlib.sha256()
        h.update(f"{self.kind}:{PRESET_SEED if self.kind == 'preset' else ''}".encode())
        if self.single is not None:
            h.update(f"{self.root.name}:{self.root.stat().st_size}:{self.single.preset.name}".encode())
        for key in sorted(self.modules):
            folder = self.modules[key]
            for f in sorted(folder.iterdir()):
                if f.name == "config.json":
                    h.update(f"{key}/{f.name}".encode() + f.read_bytes())
                elif f.suffix in _WEIGHT_SUFFIXES:
                    h.update(f"{key}/{f.name}:{f.stat().st_size}".encode())
        return h.hexdigest()[:16]

    def load_module(self, key: str) -> Any:
        """The torch module for pipeline module ``key`` in fp32 eval mode (seeded weights for presets; a single
        file's part read into the module its preset's config builds)."""
        import torch  # torch at first use: the CLI starts without it (about 1 s)

        folder = self.modules[key]
        cls_name = self.classes[key]
        if self.kind == "preset":
            torch.manual_seed(PRESET_SEED)
            module = self.build(key)
            if cls_name == "ControlNetModel":
                _unzero(module)
        elif self.single is not None:
            from accelerate import init_empty_weights  # parameters on the meta device, buffers computed

            with init_empty_weights():
                module = self.build(key)
            single = self.single
            part = next(p for p in single.layout.parts if p.module == key)
            module = singlefile.load_part(self.root, single.layout, part, single.prefixes[key],
                                          self._configs[key], module)
        else:
            library = _CLASSES[cls_name][0]
            module = _load_pretrained(getattr(__import__(library, fromlist=[cls_name]), cls_name), library, folder)
        if any(p.dtype != torch.float32 for p in module.parameters()):
            module = module.float()  # a config's torch_dtype (SDXL's text encoders say float16) is not ours
        return module.eval()

    def build(self, key: str) -> Any:
        """Module ``key`` as its config builds it, with PyTorch's default initialization (under a device context
        or ``init_empty_weights``: its parameters on the meta device)."""
        folder = self.modules[key]
        config = _read_json(folder / "config.json")
        cls_name = self.classes[key]
        library = _CLASSES[cls_name][0]
        cls = getattr(__import__(library, fromlist=[cls_name]), cls_name)
        try:
            if library == "diffusers":
                return cls.from_config(config)
            # a transformers model: its own config class (CLIPTextConfig, T5Config)
            return cls(cls.config_class(**{k: v for k, v in config.items() if k != "architectures"}))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise SdnpuError(f"cannot build {cls_name} from {folder / 'config.json'}: {e}") from e

    def weight_bytes(self, key: str) -> int:
        """fp32 weight bytes of module ``key``: counted on the meta device for presets, from the tensors' shapes
        for a single file, from the weight files' sizes for folders (fp16 files count twice)."""
        if self.kind == "preset":
            import torch  # presets only: a folder's size is read from its files

            with torch.device("meta"):
                module = self.build(key)
            return 4 * sum(p.numel() for p in module.parameters())
        if self.single is not None:
            shapes = singlefile.read_shapes(self.root)
            keys = singlefile.part_keys(shapes, self.single.layout, self.single.prefixes[key])
            return 4 * sum(math.prod(shapes[k]) for k in keys)
        total = 0
        for f in self.modules[key].iterdir():
            if f.suffix in _WEIGHT_SUFFIXES:
                total += f.stat().st_size * (2 if ".fp16." in f.name else 1)
        return total

    def check_pipeline_files(self) -> None:
        """Refuse now, before any export, what ``write_pipeline_files`` would fail on at the end: a preset's
        CLIP tokenizers need the merges file the package ships (a single file's are its preset's)."""
        if self.single is not None:
            return self.single.preset.check_pipeline_files()
        if self.kind != "preset" or not (self.root / "model_index.json").is_file():
            return
        if any(name in _read_json(self.root / "model_index.json") for name in ("tokenizer", "tokenizer_2")):
            clip_vocab_and_merges()

    def write_pipeline_files(self, out: Path) -> list[str]:
        """Copy what a runtime needs beside the graphs: model_index.json (and generation.json, written where the
        family's defaults are not the usual ones: a Flux.1 folder's), scheduler/,
        tokenizer/, tokenizer_2/, tokenizer_3/ (for presets the CLIP tokenizers are built from CLIP's BPE merges,
        a T5 tokenizer (SD3's third, Flux.1's second) and a Qwen2 one (Qwen-Image's) are stand-ins:
        ``sdnpu.convert.tokenizer.t5_tokenizer_files``, ``qwen_tokenizer_files``).
        Returns what it wrote. A single file's are its preset's."""
        if self.single is not None:
            return self.single.preset.write_pipeline_files(out)
        if self.kind == "component" or not (self.root / "model_index.json").is_file():
            return []  # one module (a ControlNet): it joins a pipeline folder, whose files are not its own
        written = []
        index = _read_json(self.root / "model_index.json")
        atomic_write_bytes(out / "model_index.json", (self.root / "model_index.json").read_bytes())
        written.append("model_index.json")
        if (self.root / generation.FILE).is_file():
            atomic_write_bytes(out / generation.FILE, (self.root / generation.FILE).read_bytes())
            written.append(generation.FILE)
        elif self.generation() != generation.Generation():  # a family's own defaults (Flux.1's): said in the folder
            atomic_write_json(out / generation.FILE, self.generation().to_json())
            written.append(generation.FILE)
        for name in _PIPELINE_FOLDERS:
            src = self.root / name
            if self.kind == "preset" and name.startswith("tokenizer"):
                if name not in index:
                    continue
                pad = _preset_pad(src, "<|endoftext|>" if name == "tokenizer" else "!")  # CLIP-L's, OpenCLIP's
                entry = index[name]  # a T5 tokenizer: SD3's third, Flux.1's second; Qwen-Image's Qwen2
                cls = str(entry[-1]) if isinstance(entry, list) else ""
                files = (t5_tokenizer_files() if cls.startswith("T5") else qwen_tokenizer_files()
                         if cls.startswith("Qwen2") else tokenizer_files(pad))
                with staged_dir(out / name) as stage:
                    for fname, data in files.items():
                        (stage / fname).write_bytes(data)
                written.append(name)
            elif src.is_dir():
                with staged_dir(out / name) as stage:
                    shutil.copytree(src, stage, dirs_exist_ok=True)
                written.append(name)
        return written


def _unzero(module: Any) -> None:
    """A new ControlNet's output convolutions start at zero (diffusers' ``zero_module``: training grows them
    from the UNet's copy), so every residual it writes would be 0 and every comparison trivially exact. A
    seeded preset gets them drawn like any other convolution (torch's default init), as a trained one has
    them non-zero."""
    import torch  # torch at first use: the CLI starts without it (about 1 s)

    for name, m in module.named_modules():
        zeroed = name.startswith(("controlnet_down_blocks.", "controlnet_mid_block")) or \
            name == "controlnet_cond_embedding.conv_out"
        if zeroed and isinstance(m, torch.nn.Conv2d):
            m.reset_parameters()


def _load_pretrained(cls: Any, library: str, folder: Path) -> Any:
    import torch  # torch at first use: the CLI starts without it (about 1 s)

    names = [f.name for f in folder.iterdir() if f.suffix in _WEIGHT_SUFFIXES or f.name.endswith(".index.json")]
    if not names:
        raise SdnpuError(
            f"no weights in {folder}",
            hint="expected diffusion_pytorch_model.safetensors / model.safetensors (or .bin, or an fp16 variant)",
        )
    plain = [n for n in names if ".fp16." not in n]
    variant = None if plain else "fp16"
    kwargs: dict[str, Any] = {"local_files_only": True, "variant": variant}
    kwargs["torch_dtype"] = torch.float32
    try:
        return cls.from_pretrained(folder, **kwargs)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise SdnpuError(f"cannot load {cls.__name__} weights from {folder}: {e}",
                         hint="config.json there must describe a module that this diffusers/transformers can "
                         "build (known block types), and the weight files must be whole and match it") from e


def resolve_source(source: str | os.PathLike[str]) -> Source:
    """A preset name, a folder path or a single-file checkpoint -> Source, or an SdnpuError saying what was
    expected."""
    text = str(source)
    if text in preset_names():
        if not (PRESETS_DIR / text / "model_index.json").is_file():
            return _module_source(text, "preset", PRESETS_DIR / text)
        return _pipeline_source(text, "preset", PRESETS_DIR / text)
    path = Path(text).expanduser()
    if not path.exists():
        raise SdnpuError(
            f"source {text!r} is neither a preset nor an existing folder or file",
            hint=f"presets: {', '.join(preset_names())}; or a diffusers pipeline folder with model_index.json; "
            "or a single-file .safetensors checkpoint",
        )
    if singlefile.is_checkpoint_file(path):
        return _single_file_source(path.resolve())
    if not path.is_dir():
        raise SdnpuError(
            f"source {text!r} is a file, not a diffusers folder or a .safetensors checkpoint",
            hint="give the folder that holds model_index.json (a pipeline) or config.json (one module), or a "
            "single-file checkpoint (.safetensors); to compile a single ONNX file use `sdnpu compile`",
        )
    path = path.resolve()
    if (path / "model_index.json").is_file():
        return _pipeline_source(path.name, "pipeline", path)
    if (path / "config.json").is_file():
        return _module_source(path.name, "component", path)
    raise SdnpuError(
        f"{path} is not a diffusers folder: it has neither model_index.json nor config.json",
        hint="give a pipeline folder as `save_pretrained` or a hub snapshot writes it "
        "(model_index.json, unet/, vae/, text_encoder/, ...) or one module's folder",
    )


def _module_source(name: str, kind: Literal["preset", "component"], path: Path) -> Source:
    """One module's folder (``config.json``): a component folder, or a one-module preset."""
    cls = _module_class(_read_json(path / "config.json"))
    if cls not in _CLASSES:
        raise SdnpuError(
            f"{path} holds a {cls or 'unknown'} module, which sdnpu cannot export",
            hint=f"supported module classes: {', '.join(_CLASSES)}",
        )
    key = _CLASSES[cls][1]
    return Source(name=name, kind=kind, root=path, modules={key: path}, classes={key: cls})


def _pipeline_source(name: str, kind: Literal["preset", "pipeline"], root: Path) -> Source:
    index = _read_json(root / "model_index.json")
    modules: dict[str, Path] = {}
    classes: dict[str, str] = {}
    for key in sorted(MODULES):
        entry = index.get(key)
        if not (isinstance(entry, list) and len(entry) == 2 and entry[1]):
            continue  # not part of this pipeline (e.g. SD 1.5 has no text_encoder_2)
        cls = str(entry[1])
        folder = root / key
        if not (folder / "config.json").is_file():
            raise SdnpuError(
                f"model_index.json in {root} lists {key!r} ({cls}) but {folder}/config.json is missing",
                hint="the pipeline folder is incomplete; copy the whole snapshot",
            )
        if cls not in _CLASSES:
            raise SdnpuError(
                f"{key!r} in {root} is a {cls}, which sdnpu cannot export",
                hint=f"supported module classes: {', '.join(_CLASSES)}",
            )
        modules[key] = folder
        classes[key] = cls
    return Source(name=name, kind=kind, root=root, modules=modules, classes=classes)


def _preset_pad(folder: Path, default: str) -> str:
    """The pad token of a preset's CLIP tokenizer: ``default`` (SDXL's: CLIP-L pads with ``<|endoftext|>``,
    OpenCLIP's bigG with ``!``), or what the preset's ``<tokenizer>/special_tokens_map.json`` says (SD 2.x's
    one tokenizer is OpenCLIP's: ``!``)."""
    path = folder / "special_tokens_map.json"
    return str(_read_json(path).get("pad_token", default)) if path.is_file() else default


def _single_file_source(path: Path) -> Source:
    """A single-file checkpoint: its layout from its keys, its configs from a preset (``match_preset``)."""
    layout, prefixes, preset = match_preset(singlefile.read_shapes(path), path.name)
    modules = {k: preset.modules[k] for k in prefixes}
    lacks = [p.module for p in layout.parts if p.module not in prefixes and p.module in preset.modules]
    log.info("%s: %s %s checkpoint holding %s; its configs, tokenizers and scheduler are preset %s's%s", path.name,
             _article(layout.title), layout.title, ", ".join(modules), preset.name,
             f"; it holds no {', '.join(lacks)} (convert them from the base model's diffusers folder into the "
             "same --out)" if lacks else "")
    return Source(name=path.stem, kind="single-file", root=path, modules=modules,
                  classes={k: preset.classes[k] for k in modules}, single=SingleFile(layout, prefixes, preset))


def match_preset(shapes: dict[str, tuple[int, ...]], name: str
                 ) -> tuple[singlefile.Layout, dict[str, str], Source]:
    """A single file's layout (from its keys), the modules it holds (-> their prefixes) and the first preset of
    its family whose modules its tensors fill exactly (``singlefile.fits``: the file's shapes through the
    converters, no tensor read), the presets that keep the family's own generation defaults first; else one
    line naming the closest preset and why it does not fit. ``name`` names the file in messages."""
    import torch  # torch at first use: the CLI starts without it (about 1 s)

    layout = singlefile.detect(shapes, name)
    prefixes = layout.held(shapes)
    if layout.denoiser.module not in prefixes:
        raise SdnpuError(f"{name} holds no {layout.title} {layout.denoiser.module}: it holds "
                         f"{', '.join(prefixes) or 'nothing sdnpu reads'} ({singlefile.summary(shapes)})",
                         hint="sdnpu converts a single file that holds its model's denoiser")
    presets = [resolve_source(n) for n in preset_names() if (PRESETS_DIR / n / "model_index.json").is_file()]
    candidates = sorted((p for p in presets if p.family == layout.family),
                        key=lambda p: ((p.root / generation.FILE).is_file(), p.name))
    misfits: dict[str, list[str]] = {}
    for preset in candidates:
        reasons = []
        for part in layout.parts:
            if part.module not in prefixes:
                continue
            if part.module not in preset.modules:
                reasons.append(f"its {part.module} has no place in it")
                continue
            with torch.device("meta"):
                module = preset.build(part.module)
            reason = singlefile.fits(shapes, layout, part, prefixes[part.module], preset._configs[part.module],
                                     module)
            if reason is not None:
                reasons.append(reason)
        if not reasons:
            return layout, prefixes, preset
        misfits[preset.name] = reasons
    closest = min(misfits, key=lambda n: len(misfits[n])) if misfits else None
    why = f" (closest, {closest}: {misfits[closest][0]})" if closest else ""
    raise SdnpuError(f"{name} is {_article(layout.title)} {layout.title} checkpoint whose shapes match no "
                     f"{layout.title} preset{why}",
                     hint="sdnpu takes a single file's configs from a preset of its architecture "
                     f"({', '.join(p.name for p in candidates)}); the model's diffusers folder converts without one")


def _article(title: str) -> str:
    return "an" if title.startswith("S") else "a"  # an SDXL, an SD3, a Flux.1
