"""Single-file checkpoints: one ``.safetensors`` in a model's original layout, read into diffusers modules.

The fine-tunes people share are one file in the layout of the model's own code, not a diffusers folder: the
UNet under ``model.diffusion_model.``, the VAE under ``first_stage_model.``, the text encoders under
``conditioner.embedders.N.`` (SDXL) or ``cond_stage_model.`` (SD 1.x/2.x); SD3's and Flux.1's under their
own names. A file holds modules' weights only: the configs, tokenizers and scheduler come from the preset
whose modules the file's tensors fill (``sdnpu.convert.sources.match_preset`` picks it; ``fits`` here says
whether one does).

========== ====================================================== ==========================================
layout     told by (``detect``)                                   its parts, by prefix (``LAYOUTS``)
========== ====================================================== ==========================================
SDXL       ``model.diffusion_model.input_blocks.``, and           unet, vae (``first_stage_model.``), CLIP-L
           ``conditioner.embedders.`` or the UNet's ``label_emb``  (``conditioner.embedders.0.transformer.``),
                                                                  OpenCLIP bigG (``...embedders.1.model.``)
SD 1.x     ``input_blocks.``, CLIP-L or no text encoder           unet, vae, CLIP-L
                                                                  (``cond_stage_model.transformer.``)
SD 2.x     ``input_blocks.``, ``cond_stage_model.model.``         unet, vae, OpenCLIP-H
SD3 / 3.5  ``joint_blocks.``, bare or under                       transformer, vae, CLIP-L, CLIP-G, T5
           ``model.diffusion_model.``                             (``text_encoders.{clip_l,clip_g,t5xxl}.``)
Flux.1     ``double_blocks.``, bare (BFL's release) or under      transformer, vae (``vae.``), CLIP-L, T5
           ``model.diffusion_model.`` (ComfyUI's)
========== ====================================================== ==========================================

Reading a part: its tensors (the keys under its prefix, read from the file alone, in fp32) go through
diffusers' converter for it (``diffusers.loaders.single_file_utils``: ``convert_ldm_unet_checkpoint``,
``convert_ldm_vae_checkpoint``, ``convert_ldm_clip_checkpoint``, ``convert_open_clip_checkpoint``,
``convert_sd3_transformer_checkpoint_to_diffusers``; T5's names are transformers' under a prefix) with the
preset's config, and the result must fill the module exactly: every parameter, each of its shape
(``mismatch``; the same check on the file's shapes alone, ``fits``, picks the preset before any tensor is
read). Where diffusers' loader does not do what a conversion needs, sdnpu does its own:

- Flux.1's transformer (``_bfl``): diffusers' converter splits the single-stream blocks' fused projection at
  FLUX.1's width (3072) whatever the file's; this one reads the width from the config (the tests hold it to
  diffusers' at FLUX.1's width), and reads a block at a time where the module converts block by block
  (``PartReader``; T5 too).
- the parts are read one by one, each from its own prefix: diffusers' pipeline loader tells CLIP-L from
  OpenCLIP bigG by their widths, which a small model can share, and leaves a parameter the file lacks on the
  meta device without a word; here a missing one is an error.

SD3's CLIP-L takes the identity as its projection, as diffusers' loader gives it: SD3's own code reads CLIP-L's
pooled output unprojected, and its files carry no projection for it (or one it ignores).

Pickles (``.ckpt``, ``.pt``, ``.bin``) are refused: loading one runs code from the file.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from sdnpu import families
from sdnpu.errors import SdnpuError

PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".pkl")
UNET = "model.diffusion_model."  # the denoiser's prefix in a whole checkpoint (SD's, SDXL's, ComfyUI's)
# tensors a file may hold that no module reads: the position ids older CLIP checkpoints saved
IGNORED = ("position_ids",)


@dataclass(frozen=True)
class Part:
    """One module of a layout: where its tensors are (the first prefix the file has; ``""``: the keys under no
    other part's prefix, a file of the denoiser alone) and the converter that reads them (``CONVERTERS``)."""

    module: str  # the pipeline module (model_index.json's key)
    prefixes: tuple[str, ...]
    converter: str

    def prefix(self, keys: Mapping[str, Any]) -> str | None:
        """The prefix this part has in ``keys`` (a file's), or None where the file lacks the part."""
        for p in self.prefixes:
            if p and any(k.startswith(p) for k in keys):
                return p
        return "" if "" in self.prefixes else None


@dataclass(frozen=True)
class Layout:
    """A family's original layout: its title, the family of the pipeline it makes (``sdnpu.families``), and
    its parts, the denoiser first."""

    title: str
    family: str
    parts: tuple[Part, ...]

    @property
    def denoiser(self) -> Part:
        return self.parts[0]

    def held(self, keys: Mapping[str, Any]) -> dict[str, str]:
        """The modules ``keys`` (a file's) hold -> their prefixes, the denoiser first."""
        found = {}
        for part in self.parts:
            prefix = part.prefix(keys)
            if prefix is not None and (prefix or _bare(self, keys)):
                found[part.module] = prefix
        return found


def _bare(layout: Layout, keys: Mapping[str, Any]) -> bool:
    """Whether ``keys`` hold tensors under no prefix of ``layout``'s parts (a bare denoiser)."""
    named = [p for part in layout.parts for p in part.prefixes if p]
    return any(not k.startswith(tuple(named)) for k in keys)


_VAE = Part("vae", ("first_stage_model.",), "vae")
SDXL = Layout("SDXL", families.SDXL.name, (
    Part("unet", (UNET,), "unet"), _VAE,
    Part("text_encoder", ("conditioner.embedders.0.transformer.",), "clip"),
    Part("text_encoder_2", ("conditioner.embedders.1.model.",), "open_clip")))
SD1 = Layout("SD 1.x", families.SD.name, (
    Part("unet", (UNET,), "unet"), _VAE,
    Part("text_encoder", ("cond_stage_model.transformer.",), "clip")))
SD2 = Layout("SD 2.x", families.SD.name, (
    Part("unet", (UNET,), "unet"), _VAE,
    Part("text_encoder", ("cond_stage_model.model.",), "open_clip")))
SD3 = Layout("SD3", families.SD3.name, (
    Part("transformer", (UNET, ""), "mmdit"), _VAE,
    Part("text_encoder", ("text_encoders.clip_l.transformer.",), "clip_unprojected"),
    Part("text_encoder_2", ("text_encoders.clip_g.transformer.",), "clip"),
    Part("text_encoder_3", ("text_encoders.t5xxl.transformer.",), "t5")))
FLUX = Layout("Flux.1", families.FLUX.name, (
    Part("transformer", (UNET, ""), "bfl"), Part("vae", ("vae.", "first_stage_model."), "vae"),
    Part("text_encoder", ("text_encoders.clip_l.transformer.",), "clip"),
    Part("text_encoder_2", ("text_encoders.t5xxl.transformer.",), "t5")))
LAYOUTS: tuple[Layout, ...] = (SDXL, SD1, SD2, SD3, FLUX)
# every prefix a layout names, longest first: how an unknown file's keys are summed up
_KNOWN_PREFIXES = sorted({p for lay in LAYOUTS for part in lay.parts for p in part.prefixes if p}
                         | {"conditioner.embedders.", "cond_stage_model.", "text_encoders."}, key=len, reverse=True)


# -- the file ----------------------------------------------------------------------------------------------------

def is_checkpoint_file(path: Path) -> bool:
    """Whether ``path`` is a file SOURCE names as a single-file checkpoint (a safetensors file or a pickle, which
    ``read_shapes`` refuses with the reason)."""
    return path.is_file() and (path.suffix in (".safetensors", ".sft") or path.suffix in PICKLE_SUFFIXES)


def read_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The file's tensors' shapes by key, read from its header alone (no tensor is read)."""
    if path.suffix in PICKLE_SUFFIXES:
        raise SdnpuError(
            f"{path.name} is a pickle checkpoint: sdnpu reads single files as safetensors only, as loading a "
            "pickle runs code from the file",
            hint="convert it once, where you trust it, to a .safetensors file (with safetensors.torch.save_file "
            "of torch.load(FILE, weights_only=True)['state_dict']), or use the model's .safetensors release")

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 -- no iteration
    except (SafetensorError, OSError) as e:
        raise SdnpuError(f"{path} is not a readable safetensors file: {e}",
                         hint="give a whole .safetensors checkpoint (a download that stopped leaves a short file)"
                         ) from e


def read_tensors(path: Path, keys: list[str]) -> dict[str, Any]:
    """The file's tensors ``keys`` (a part's, or a group of them), in fp32, each read alone."""
    import torch  # torch at first use: the CLI starts without it (about 1 s)

    out = {}
    with safe_open(str(path), framework="pt") as f:
        for k in keys:
            out[k] = f.get_tensor(k).to(torch.float32)
    return out


def part_keys(shapes: Mapping[str, Any], layout: Layout, prefix: str) -> list[str]:
    """The keys of the part under ``prefix`` (``""``: those under no other part's prefix)."""
    if prefix:
        return [k for k in shapes if k.startswith(prefix)]
    named = tuple(p for part in layout.parts for p in part.prefixes if p)
    return [k for k in shapes if not k.startswith(named)]


# -- what the file is --------------------------------------------------------------------------------------------

def detect(shapes: Mapping[str, Any], name: str) -> Layout:
    """The layout of a file's keys, by its denoiser and text encoders; else one line naming what it holds."""
    def has(prefix: str) -> bool:
        return any(k.startswith(prefix) for k in shapes)

    def denoiser(block: str) -> bool:
        return has(f"{UNET}{block}") or has(block)

    if has(f"{UNET}input_blocks."):
        if has("conditioner.embedders.") or f"{UNET}label_emb.0.0.weight" in shapes:
            return SDXL
        return SD2 if has("cond_stage_model.model.") else SD1
    if denoiser("joint_blocks."):
        return SD3
    if denoiser("double_blocks."):
        return FLUX
    raise SdnpuError(
        f"{name} holds no model sdnpu reads: {summary(shapes)}",
        hint="sdnpu reads single-file SDXL, SD 1.x/2.x, SD3/3.5 and Flux.1 checkpoints in their original "
        "layout, with their denoiser (a UNet under model.diffusion_model.input_blocks, an MMDiT's joint_blocks, "
        "Flux.1's double_blocks); a VAE or a text encoder alone converts from a diffusers folder")


def summary(shapes: Mapping[str, Any], most: int = 6) -> str:
    """What a file's keys begin with, the most common first: ``"first_stage_model. (248 tensors), ..."``."""
    if not shapes:
        return "no tensors"
    counts: Counter[str] = Counter()
    for k in shapes:
        known = next((p for p in _KNOWN_PREFIXES if k.startswith(p)), None)
        counts[known or k.split(".")[0] + "."] += 1
    named = [f"{p} ({n} tensor{'s' if n != 1 else ''})" for p, n in counts.most_common(most)]
    rest = len(counts) - most
    return ", ".join(named) + (f" and {rest} other prefixes" if rest > 0 else "")


# -- converting a part -------------------------------------------------------------------------------------------

def _unet(tensors: dict[str, Any], prefix: str, config: dict[str, Any], module: Any) -> dict[str, Any]:
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint  # diffusers at first use (with torch)

    return dict(convert_ldm_unet_checkpoint(tensors, config))


def _vae(tensors: dict[str, Any], prefix: str, config: dict[str, Any], module: Any) -> dict[str, Any]:
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint  # diffusers at first use (with torch)

    return dict(convert_ldm_vae_checkpoint(tensors, config))


def _clip(tensors: dict[str, Any], prefix: str, config: dict[str, Any], module: Any) -> dict[str, Any]:
    """A CLIP text model saved with transformers' names under a prefix (SD 1.x's, SDXL's CLIP-L, SD3's)."""
    from diffusers.loaders.single_file_utils import convert_ldm_clip_checkpoint  # diffusers at first use (with torch)

    return _flat(module, convert_ldm_clip_checkpoint(tensors, remove_prefix=prefix))


def _clip_unprojected(tensors: dict[str, Any], prefix: str, config: dict[str, Any], module: Any
                      ) -> dict[str, Any]:
    """SD3's CLIP-L: its pooled output is read unprojected, so its projection is the identity (diffusers'
    ``create_diffusers_clip_model_from_ldm`` gives it so too)."""
    import torch  # torch at first use: the CLI starts without it (about 1 s)

    state = _clip(tensors, prefix, config, module)
    if "text_projection.weight" in module.state_dict():
        hidden = int(config["hidden_size"])
        state["text_projection.weight"] = torch.eye(hidden, device=_device(tensors))
    return state


def _open_clip(tensors: dict[str, Any], prefix: str, config: dict[str, Any], module: Any) -> dict[str, Any]:
    """OpenCLIP's text tower (SDXL's bigG, SD 2.x's ViT-H): fused attention projections, its own names."""
    from diffusers.loaders.single_file_utils import convert_open_clip_checkpoint  # diffusers at first use (with torch)

    return _flat(module, convert_open_clip_checkpoint(module, tensors, prefix=prefix))


def _t5(tensors: dict[str, Any], prefix: str, config: dict[str, Any], module: Any) -> dict[str, Any]:
    return {k[len(prefix):]: v for k, v in tensors.items()}


def _mmdit(tensors: dict[str, Any], prefix: str, config: dict[str, Any], module: Any) -> dict[str, Any]:
    # diffusers at first use (with torch)
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    return dict(convert_sd3_transformer_checkpoint_to_diffusers(dict(tensors)))  # it pops what it reads


def _swap_halves(t: Any) -> Any:
    """The original code's (shift, scale) as diffusers' (scale, shift): the two halves swapped."""
    import torch  # torch at first use: the CLI starts without it (about 1 s)

    shift, scale = t.chunk(2, dim=0)
    return torch.cat([scale, shift], dim=0)


def _bfl(tensors: dict[str, Any], prefix: str, config: dict[str, Any], module: Any) -> dict[str, Any]:
    """Flux.1's transformer in BFL's layout -> diffusers' names: diffusers'
    ``convert_flux_transformer_checkpoint_to_diffusers`` with the width from the config (there it is FLUX.1's,
    3072, whatever the file holds). A tensor no rule reads is kept under its own name (reported as unexpected).
    Block by block reads it a group at a time (``_flux_group``)."""
    sd = {k[len(prefix):]: v for k, v in tensors.items()}
    out = _flux_edges(sd)
    for i in sorted({int(k.split(".")[1]) for k in sd if k.startswith("double_blocks.")}):
        out.update(_flux_double(sd, i))
    for i in sorted({int(k.split(".")[1]) for k in sd if k.startswith("single_blocks.")}):
        out.update(_flux_single(sd, i, config))
    out.update(sd)
    return out


def _take(sd: dict[str, Any], out: dict[str, Any], new: str, old: str) -> None:
    for leaf in ("weight", "bias"):
        out[f"{new}.{leaf}"] = sd.pop(f"{old}.{leaf}")


def _split(sd: dict[str, Any], out: dict[str, Any], new: tuple[str, ...], old: str,
           sizes: tuple[int, ...] | None = None) -> None:
    """``old``'s weight and bias cut along the rows into ``new`` (equal parts, or ``sizes``)."""
    import torch  # torch at first use: the CLI starts without it (about 1 s)

    for leaf in ("weight", "bias"):
        t = sd.pop(f"{old}.{leaf}")
        parts = torch.split(t, list(sizes), dim=0) if sizes else torch.chunk(t, len(new), dim=0)
        for name, part in zip(new, parts, strict=True):
            out[f"{name}.{leaf}"] = part


def _flux_edges(sd: dict[str, Any]) -> dict[str, Any]:
    """The embeddings and the output layers (what is not a block), popped from ``sd``."""
    out: dict[str, Any] = {}
    for new, old in (("timestep_embedder", "time_in"), ("text_embedder", "vector_in"),
                     ("guidance_embedder", "guidance_in")):
        if f"{old}.in_layer.weight" in sd:
            _take(sd, out, f"time_text_embed.{new}.linear_1", f"{old}.in_layer")
            _take(sd, out, f"time_text_embed.{new}.linear_2", f"{old}.out_layer")
    _take(sd, out, "context_embedder", "txt_in")
    _take(sd, out, "x_embedder", "img_in")
    _take(sd, out, "proj_out", "final_layer.linear")
    for leaf in ("weight", "bias"):
        out[f"norm_out.linear.{leaf}"] = _swap_halves(sd.pop(f"final_layer.adaLN_modulation.1.{leaf}"))
    return out


def _flux_double(sd: dict[str, Any], i: int) -> dict[str, Any]:
    """Double-stream block ``i``, popped from ``sd``."""
    out: dict[str, Any] = {}
    new, old = f"transformer_blocks.{i}.", f"double_blocks.{i}."
    _take(sd, out, f"{new}norm1.linear", f"{old}img_mod.lin")
    _take(sd, out, f"{new}norm1_context.linear", f"{old}txt_mod.lin")
    _split(sd, out, (f"{new}attn.to_q", f"{new}attn.to_k", f"{new}attn.to_v"), f"{old}img_attn.qkv")
    _split(sd, out, (f"{new}attn.add_q_proj", f"{new}attn.add_k_proj", f"{new}attn.add_v_proj"),
           f"{old}txt_attn.qkv")
    for norm, stream, which in (("norm_q", "img", "query"), ("norm_k", "img", "key"),
                                ("norm_added_q", "txt", "query"), ("norm_added_k", "txt", "key")):
        out[f"{new}attn.{norm}.weight"] = sd.pop(f"{old}{stream}_attn.norm.{which}_norm.scale")
    _take(sd, out, f"{new}ff.net.0.proj", f"{old}img_mlp.0")
    _take(sd, out, f"{new}ff.net.2", f"{old}img_mlp.2")
    _take(sd, out, f"{new}ff_context.net.0.proj", f"{old}txt_mlp.0")
    _take(sd, out, f"{new}ff_context.net.2", f"{old}txt_mlp.2")
    _take(sd, out, f"{new}attn.to_out.0", f"{old}img_attn.proj")
    _take(sd, out, f"{new}attn.to_add_out", f"{old}txt_attn.proj")
    return out


def _flux_single(sd: dict[str, Any], i: int, config: dict[str, Any]) -> dict[str, Any]:
    """Single-stream block ``i``, popped from ``sd``: its ``linear1`` is q, k, v and the MLP's input, cut at the
    config's width."""
    out: dict[str, Any] = {}
    inner = int(config.get("num_attention_heads", 24)) * int(config.get("attention_head_dim", 128))
    new, old = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
    _take(sd, out, f"{new}norm.linear", f"{old}modulation.lin")
    mlp = sd[f"{old}linear1.weight"].shape[0] - 3 * inner
    _split(sd, out, (f"{new}attn.to_q", f"{new}attn.to_k", f"{new}attn.to_v", f"{new}proj_mlp"), f"{old}linear1",
           (inner, inner, inner, mlp))
    out[f"{new}attn.norm_q.weight"] = sd.pop(f"{old}norm.query_norm.scale")
    out[f"{new}attn.norm_k.weight"] = sd.pop(f"{old}norm.key_norm.scale")
    _take(sd, out, f"{new}proj_out", f"{old}linear2")
    return out


CONVERTERS: dict[str, Callable[[dict[str, Any], str, dict[str, Any], Any], dict[str, Any]]] = {
    "unet": _unet, "vae": _vae, "clip": _clip, "clip_unprojected": _clip_unprojected, "open_clip": _open_clip,
    "t5": _t5, "mmdit": _mmdit, "bfl": _bfl}


def _flat(module: Any, state: dict[str, Any]) -> dict[str, Any]:
    """transformers >= 5.6 holds CLIPTextModel's layers without the ``text_model`` wrapper."""
    if hasattr(module, "text_model"):
        return dict(state)
    return {k.removeprefix("text_model."): v for k, v in state.items()}


def _device(tensors: Mapping[str, Any]) -> Any:
    return next(iter(tensors.values())).device if tensors else "cpu"


def convert_part(part: Part, tensors: dict[str, Any], prefix: str, config: dict[str, Any], module: Any
                 ) -> dict[str, Any]:
    """``tensors`` (one part's, under ``prefix``, real or on the meta device) in diffusers' names for
    ``module`` (built from ``config``); a converter's error is the file's shapes not fitting."""
    try:
        return CONVERTERS[part.converter](tensors, prefix, config, module)
    except (KeyError, IndexError, ValueError, RuntimeError) as e:
        raise _Misfit(f"its {part.module} does not read as the config's: {type(e).__name__}: {e}") from e


class _Misfit(Exception):
    """The file's part does not fit a config (the reason is the message)."""


def mismatch(state: Mapping[str, Any], module: Any) -> str | None:
    """Why ``state`` (diffusers' names -> tensors or shapes) does not fill ``module`` exactly, or None: a
    parameter it lacks, a tensor the module has no place for, a shape that differs."""
    own = module.state_dict(keep_vars=True)
    params = {n for n, _ in module.named_parameters()}  # tied parameters once (T5's shared embedding)
    missing = sorted(n for n in params if n not in state)
    if missing:
        return f"lacks {len(missing)} of its tensors ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
    extra = sorted(n for n in state if n not in own and not n.endswith(IGNORED))
    if extra:
        return (f"has {len(extra)} tensors it has no place for ({', '.join(extra[:3])}"
                f"{', ...' if len(extra) > 3 else ''})")
    for n, t in state.items():
        if n in own and tuple(t.shape) != tuple(own[n].shape):
            return f"{n} is {list(t.shape)} in the file and {list(own[n].shape)} in the config"
    return None


def fits(shapes: Mapping[str, tuple[int, ...]], layout: Layout, part: Part, prefix: str,
         config: dict[str, Any], module: Any) -> str | None:
    """Why the file's part (its shapes alone, no tensor read) does not fill ``module``, or None."""
    import torch  # torch at first use: the CLI starts without it (about 1 s)

    keys = part_keys(shapes, layout, prefix)
    meta = {k: torch.empty(shapes[k], device="meta") for k in keys}
    try:
        state = convert_part(part, meta, prefix, config, module)
    except _Misfit as e:
        return str(e)
    reason = mismatch(state, module)
    return None if reason is None else f"its {part.module} {reason}"


def load_part(path: Path, layout: Layout, part: Part, prefix: str, config: dict[str, Any], module: Any) -> Any:
    """``module`` (built with its parameters on the meta device) holding the file's part, in fp32."""
    import torch  # torch at first use: the CLI starts without it (about 1 s)

    shapes = read_shapes(path)
    keys = part_keys(shapes, layout, prefix)
    tensors = read_tensors(path, keys)
    try:
        state = convert_part(part, tensors, prefix, config, module)
    except _Misfit as e:
        raise SdnpuError(f"{path.name}: {e}") from e
    del tensors
    reason = mismatch(state, module)
    if reason is not None:
        raise SdnpuError(f"{path.name}: its {part.module} {reason}")
    own = module.state_dict()
    seen: set[int] = set()
    kept = {}
    for n, t in state.items():
        if n not in own:
            continue  # a tensor no module reads (IGNORED)
        # a converter's split leaves views of one tensor (a fused qkv): each parameter gets its own storage
        ptr = t.untyped_storage().data_ptr()
        kept[n] = t.clone() if ptr in seen or not t.is_contiguous() else t
        seen.add(ptr)
    with torch.no_grad():
        module.load_state_dict(kept, strict=False, assign=True)
    left = [n for n, p in module.named_parameters() if p.is_meta]
    if left:  # not reached where ``mismatch`` passed; kept as the last word on a half-loaded module
        raise SdnpuError(f"{path.name}: its {part.module} left {len(left)} parameters unset ({left[0]})")
    return module


# -- block by block: a part read a group of tensors at a time ----------------------------------------------------

def _group(converter: str, name: str, keys: list[str], prefix: str, config: dict[str, Any]
           ) -> tuple[list[str], Callable[[dict[str, Any]], dict[str, Any]]]:
    """The file's keys that diffusers' tensor ``name`` (or the names under it) is made of, and what makes them:
    T5's are renamed one by one, Flux.1's a block (or the embeddings and output layers) at a time."""
    if converter == "t5":
        return [k for k in keys if k[len(prefix):].startswith(name)], lambda t: _t5(t, prefix, config, None)
    if converter != "bfl":
        raise SdnpuError(f"a single file's {converter} part does not convert block by block")
    parts = name.split(".")
    if parts[0] in ("transformer_blocks", "single_transformer_blocks") and len(parts) > 1 and parts[1].isdigit():
        i = int(parts[1])
        old = f"{'double' if parts[0] == 'transformer_blocks' else 'single'}_blocks.{i}."
        chosen = [k for k in keys if k[len(prefix):].startswith(old)]

        def block(t: dict[str, Any]) -> dict[str, Any]:
            sd = {k[len(prefix):]: v for k, v in t.items()}
            return _flux_double(sd, i) if old.startswith("double") else _flux_single(sd, i, config)
        return chosen, block
    chosen = [k for k in keys if not k[len(prefix):].startswith(("double_blocks.", "single_blocks."))]
    return chosen, lambda t: _flux_edges({k[len(prefix):]: v for k, v in t.items()})


class PartReader:
    """A single file's part in diffusers' names, read a group of tensors at a time (block by block: a module
    larger than this machine's memory; ``sdnpu.convert.blockwise.piece.Weights`` asks it)."""

    def __init__(self, path: Path, layout: Layout, part: Part, prefix: str, config: dict[str, Any]) -> None:
        import torch  # torch at first use: the CLI starts without it (about 1 s)

        self.path, self.part, self.prefix, self.config = path, part, prefix, config
        shapes = read_shapes(path)
        self.keys = part_keys(shapes, layout, prefix)
        meta = {k: torch.empty(shapes[k], device="meta") for k in self.keys}
        self.names = frozenset(CONVERTERS[part.converter](meta, prefix, config, None))

    def tensors(self, prefix: str) -> dict[str, Any]:
        """diffusers' tensors under ``prefix`` (a name: that tensor alone), the prefix taken off, each with its
        own storage."""
        keys, make = _group(self.part.converter, prefix, self.keys, self.prefix, self.config)
        state = make(read_tensors(self.path, keys))
        return {k[len(prefix):]: v.clone() for k, v in state.items() if k.startswith(prefix)}
