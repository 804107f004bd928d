"""Seeded LoRA files for a converted folder, in diffusers/PEFT and kohya naming (tests and benchmarks).

There is no model hub here, so the LoRAs sdnpu is measured with are drawn from a seed, in the key layouts
real files use: diffusers/PEFT (``unet.<module>.lora_A.weight``, ``text_encoder.<module>...``,
``transformer.<module>...``) and kohya (``lora_unet_<module>.lora_down.weight`` + ``.alpha``, the SDXL UNet in its
original ``input_blocks`` / ``middle_block`` / ``output_blocks`` layout, ``lora_te1_`` / ``lora_te2_`` for the
text encoders; Flux.1's transformer in its original ``double_blocks`` / ``single_blocks`` layout, q, k and v one
fused projection). Both files of one seed describe the same change (the kohya file stores alpha = rank / 2 and B
doubled), except Flux.1's: its fused projections share one A matrix, so its kohya file is its own change (and a
single block's ``linear1`` is left out below Flux.1's own widths, which diffusers' converter assumes).

``write_seeded_lora(folder, out, rank=32, naming="diffusers", seed=0)`` covers every attention and
feed-forward projection of the UNet and the text encoders the folder has (``convs=True`` adds the UNet
resnets' convolutions, 3x3 LoRAs included). ``write_summed_lora`` writes one LoRA holding the sum of
several: what stacking them must equal.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from sdnpu import families
from sdnpu.components import LORA_MODULES
from sdnpu.errors import SdnpuError
from sdnpu.lora.adapters import _skeleton

# The modules in the order their seeds are drawn (each module's seeds depend on its place here): the UNet first,
# as the seeded LoRAs of bench/results.md were drawn.
SEED_ORDER = ("unet", *(m for m in LORA_MODULES if m != "unet"))

UNET_TARGETS = re.compile(r"(attn[12]\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.0\.proj|ff\.net\.2)$")
# Flux.1's transformer: both streams' attention and feed-forward projections, the single blocks' fused
# projections, and the blocks' modulations (what ai-toolkit and kohya's sd-scripts train)
FLUX_TARGETS = re.compile(r"(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
                          r"|ff(_context)?\.net\.(0\.proj|2)|proj_mlp|proj_out|norm1(_context)?\.linear|norm\.linear)$")
UNET_CONVS = re.compile(r"resnets\.\d+\.(conv1|conv2)$")
TEXT_TARGETS = re.compile(r"(self_attn\.(q_proj|k_proj|v_proj|out_proj)|mlp\.(fc1|fc2))$")
KOHYA_TE = {"text_encoder": "lora_te1", "text_encoder_2": "lora_te2"}
SGM_RESNET = {"conv1": "in_layers_2", "conv2": "out_layers_3"}


def _sgm_name(module: str, layers_per_block: int) -> str:
    """A diffusers SDXL UNet module name in the original (SGM) block layout kohya files use."""
    n = layers_per_block + 1
    m = re.match(r"down_blocks\.(\d+)\.(attentions|resnets)\.(\d+)\.(.+)", module)
    if m:
        b, kind, j, rest = int(m[1]), m[2], int(m[3]), m[4]
        return f"input_blocks.{b * n + j + 1}.{1 if kind == 'attentions' else 0}.{_sgm_rest(kind, rest)}"
    m = re.match(r"up_blocks\.(\d+)\.(attentions|resnets)\.(\d+)\.(.+)", module)
    if m:
        b, kind, j, rest = int(m[1]), m[2], int(m[3]), m[4]
        return f"output_blocks.{b * n + j}.{1 if kind == 'attentions' else 0}.{_sgm_rest(kind, rest)}"
    m = re.match(r"mid_block\.(attentions|resnets)\.(\d+)\.(.+)", module)
    if m:
        kind, j, rest = m[1], int(m[2]), m[3]
        return f"middle_block.{1 if kind == 'attentions' else 2 * j}.{_sgm_rest(kind, rest)}"
    return module


def _sgm_rest(kind: str, rest: str) -> str:
    return SGM_RESNET.get(rest, rest) if kind == "resnets" else rest


def _targets(folder: Path, component: str, convs: bool) -> list[tuple[str, Any]]:
    pattern = {"unet": UNET_TARGETS, "transformer": FLUX_TARGETS}.get(component, TEXT_TARGETS)
    found = []
    for name, m in _skeleton(folder, component).named_modules():
        if component == "transformer" and not name.startswith(("transformer_blocks.", "single_transformer_blocks.")):
            continue
        if isinstance(m, torch.nn.Linear) and pattern.search(name):
            found.append((name, m))
        elif convs and component == "unet" and isinstance(m, torch.nn.Conv2d) and UNET_CONVS.search(name):
            found.append((name, m))
    return found


def write_seeded_lora(folder: str | Path, out: str | Path, rank: int = 32, naming: str = "diffusers",
                      seed: int = 0, convs: bool = False, components: tuple[str, ...] | None = None,
                      strength: float = 0.1) -> dict[str, int]:
    """Write the LoRA to ``out`` (safetensors); returns the modules it covers per component. ``strength``:
    the change's size relative to a unit-variance input projection (each delta is about strength/sqrt(in))."""
    folder = Path(folder)
    if naming not in ("diffusers", "kohya"):
        raise SdnpuError(f"unknown LoRA naming {naming!r}", hint="diffusers or kohya")
    unet_config = json.loads((folder / "unet" / "config.json").read_text()) if (folder / "unet").is_dir() else {}
    index = folder / "model_index.json"
    family = families.detect(json.loads(index.read_text())) if index.is_file() else None
    sdxl = (folder / "text_encoder_2" / "config.json").is_file()  # kohya's lora_te1_ / lora_te2_ (Flux's CLIP too)
    able = family.lora if family else SEED_ORDER
    tensors: dict[str, Any] = {}
    counts: dict[str, int] = {}
    for comp in components or [m for m in SEED_ORDER if m in able]:
        if not (folder / comp / "config.json").is_file():
            continue
        targets = _targets(folder, comp, convs)
        counts[comp] = len(targets)
        if comp == "transformer" and naming == "kohya":  # Flux.1's original (BFL) names, qkv fused
            groups = _flux_groups(dict(targets))
            counts[comp] = sum(len(mods) for _, mods in groups)
            for i, (key, mods) in enumerate(groups):
                g = torch.Generator().manual_seed(seed * 1_000_003 + SEED_ORDER.index(comp) * 100_003 + i)
                fan_in, width = mods[0].in_features, sum(m.out_features for m in mods)
                tensors[f"{key}.lora_down.weight"] = (torch.randn((rank, fan_in), generator=g) / fan_in ** 0.5)
                up = torch.randn((width, rank), generator=g) * strength / rank ** 0.5
                tensors[f"{key}.lora_up.weight"] = (2 * up).contiguous()  # alpha = rank / 2 halves it back
                tensors[f"{key}.alpha"] = torch.tensor(rank / 2)
            continue
        for i, (name, m) in enumerate(targets):
            g = torch.Generator().manual_seed(seed * 1_000_003 + SEED_ORDER.index(comp) * 100_003 + i)
            if isinstance(m, torch.nn.Conv2d):
                a_shape, b_shape = (rank, m.in_channels, *m.kernel_size), (m.out_channels, rank, 1, 1)
                fan_in = m.in_channels * m.kernel_size[0] * m.kernel_size[1]
            else:
                a_shape, b_shape, fan_in = (rank, m.in_features), (m.out_features, rank), m.in_features
            a = torch.randn(a_shape, generator=g) / fan_in ** 0.5
            b = torch.randn(b_shape, generator=g) * strength / rank ** 0.5
            if naming == "diffusers":
                tensors[f"{comp}.{name}.lora_A.weight"] = a.contiguous()
                tensors[f"{comp}.{name}.lora_B.weight"] = b.contiguous()
                continue
            if comp == "unet":
                sgm = _sgm_name(name, unet_config["layers_per_block"]) if sdxl else name
                key = "lora_unet_" + sgm.replace(".", "_")
            else:
                key = (KOHYA_TE[comp] if sdxl else "lora_te") + "_" + name.replace(".", "_")
            tensors[f"{key}.lora_down.weight"] = a.contiguous()
            tensors[f"{key}.lora_up.weight"] = (2 * b).contiguous()  # alpha = rank / 2 halves it back
            tensors[f"{key}.alpha"] = torch.tensor(rank / 2)
    if not tensors:
        raise SdnpuError(f"{folder} has no component a LoRA changes",
                         hint="give a converted SDXL, SD or Flux.1 folder")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out))
    return counts


# Flux.1's original block layout (BFL's, which kohya's sd-scripts names): a fused projection -> the diffusers
# modules it stands for, in the order diffusers' converter splits it
_FLUX_DOUBLE = (("img_attn_qkv", ("attn.to_q", "attn.to_k", "attn.to_v")), ("img_attn_proj", ("attn.to_out.0",)),
                ("img_mlp_0", ("ff.net.0.proj",)), ("img_mlp_2", ("ff.net.2",)), ("img_mod_lin", ("norm1.linear",)),
                ("txt_attn_qkv", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")),
                ("txt_attn_proj", ("attn.to_add_out",)), ("txt_mlp_0", ("ff_context.net.0.proj",)),
                ("txt_mlp_2", ("ff_context.net.2",)), ("txt_mod_lin", ("norm1_context.linear",)))
_FLUX_SINGLE = (("linear1", ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")), ("linear2", ("proj_out",)),
                ("modulation_lin", ("norm.linear",)))
_FLUX_LINEAR1 = [3072, 3072, 3072, 12288]  # diffusers' converter splits linear1 at Flux.1's own widths only


def _flux_groups(modules: dict[str, Any]) -> list[tuple[str, list[Any]]]:
    """(kohya key, the diffusers modules it fuses) for every fused projection whose modules all are targets. A
    single block's linear1 only where its widths are Flux.1's own (diffusers splits it at fixed widths)."""
    groups = []
    for prefix, layout, kind in (("transformer_blocks", _FLUX_DOUBLE, "double"),
                                 ("single_transformer_blocks", _FLUX_SINGLE, "single")):
        blocks = sorted({int(n.split(".")[1]) for n in modules if n.startswith(prefix + ".")})
        for i in blocks:
            for bfl, names in layout:
                mods = [modules.get(f"{prefix}.{i}.{n}") for n in names]
                if any(m is None for m in mods):
                    continue
                if bfl == "linear1" and [m.out_features for m in mods] != _FLUX_LINEAR1:
                    continue
                groups.append((f"lora_unet_{kind}_blocks_{i}_{bfl}", mods))
    return groups


def write_summed_lora(paths: list[Path], scales: list[float], out: str | Path) -> None:
    """One diffusers-format LoRA whose change is the sum of ``paths``' at ``scales`` (files of the same
    modules, with no alphas: scaling 1): their A matrices stacked, their scaled B matrices side by side."""
    parts = [load_file(str(p)) for p in paths]
    merged = {}
    for key in parts[0]:
        if key.endswith("lora_A.weight"):
            merged[key] = torch.cat([p[key] for p in parts], 0).contiguous()
        elif key.endswith("lora_B.weight"):
            merged[key] = torch.cat([sc * p[key] for sc, p in zip(scales, parts, strict=True)], 1).contiguous()
    save_file(merged, str(out))
