"""The family table (``sdnpu.families``): each family detected from its model_index.json, the rows' questions, and
that the family knowledge has one home (no denoiser class name or family name spelled outside it)."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sdnpu import components, families
from sdnpu.convert.sources import PRESETS_DIR
from sdnpu.errors import SdnpuError

ROOT = Path(__file__).resolve().parent.parent
# the families' block-by-block pieces (Flux.1's, Qwen-Image's): the modules their rows name, which build their
# transformers by class
OWN_MODULES = {Path(*f.blockwise.removeprefix("sdnpu.").split(".")).with_suffix(".py")
               for f in families.TABLE if f.blockwise}


def _sources() -> list[Path]:
    """The repository's Python files (relative), outside the tests and the virtual environment."""
    skip = {"tests", ".venv", "build", "models"}
    return sorted(p.relative_to(ROOT) for p in ROOT.rglob("*.py")
                  if not skip & set(p.relative_to(ROOT).parts[:1]) and not p.relative_to(ROOT).parts[0].startswith("."))


def _index(*modules: tuple[str, str], name: str | None = None) -> dict:
    index = {key: ["diffusers", cls] for key, cls in modules}
    return index | ({"_class_name": name} if name else {})


# (what, model_index.json, family): diffusers' own pipelines as save_pretrained writes them, and the edges
DETECTED = [
    ("SDXL", _index(("unet", "UNet2DConditionModel"), ("text_encoder", "CLIPTextModel"),
                    ("text_encoder_2", "CLIPTextModelWithProjection"), name="StableDiffusionXLPipeline"), "sdxl"),
    ("SDXL refiner (no CLIP-L)", _index(("unet", "UNet2DConditionModel"), ("text_encoder_2",
                                         "CLIPTextModelWithProjection")) | {"text_encoder": [None, None]}, "sdxl"),
    ("SD 1.5", _index(("unet", "UNet2DConditionModel"), ("text_encoder", "CLIPTextModel"),
                      name="StableDiffusionPipeline"), "sd"),
    ("SD 1.5, no text_encoder_2 class", _index(("unet", "UNet2DConditionModel")) | {"text_encoder_2": [None, None]},
     "sd"),
    ("SD3", _index(("transformer", "SD3Transformer2DModel"), ("text_encoder_2", "CLIPTextModelWithProjection"),
                   name="StableDiffusion3Pipeline"), "sd3"),
    ("SD3 by its transformer alone", _index(("transformer", "SD3Transformer2DModel")), "sd3"),
    ("SD3 by its pipeline class alone", {"_class_name": "StableDiffusion3Img2ImgPipeline"}, "sd3"),
    ("Flux.1", _index(("transformer", "FluxTransformer2DModel"), ("text_encoder_2", "T5EncoderModel"),
                      name="FluxPipeline"), "flux"),
    ("Flux.1 by its transformer alone", _index(("transformer", "FluxTransformer2DModel")), "flux"),
    ("Flux.1 by its pipeline class alone", {"_class_name": "FluxImg2ImgPipeline"}, "flux"),
    ("Qwen-Image", _index(("transformer", "QwenImageTransformer2DModel"), ("vae", "AutoencoderKLQwenImage"),
                          name="QwenImagePipeline") | {"text_encoder": ["transformers",
                                                                        "Qwen2_5_VLForConditionalGeneration"]},
     "qwen-image"),
    ("Qwen-Image by its transformer alone", _index(("transformer", "QwenImageTransformer2DModel")), "qwen-image"),
    ("Qwen-Image by its pipeline class alone", {"_class_name": "QwenImageImg2ImgPipeline"}, "qwen-image"),
    ("nothing", {}, "sd"),
]


@pytest.mark.parametrize("index, family", [(i, f) for _, i, f in DETECTED], ids=[w for w, _, _ in DETECTED])
def test_each_family_is_detected_from_its_model_index(index, family):
    assert families.detect(index).name == family


def test_every_preset_pipeline_is_of_the_family_its_name_says():
    said = {p.parent.name: families.detect(json.loads(p.read_text())).name
            for p in PRESETS_DIR.glob("*/model_index.json")}
    for name, family in said.items():
        expected = next(f for f in ("qwen-image", "flux", "sd3", "sdxl", "sd") if f in name.replace("sd35", "sd3"))
        assert family == expected, name
    assert set(said.values()) == set(families.NAMES)  # a preset of every family


def test_a_module_folder_says_a_family_by_its_key_alone():
    assert families.marked_by(["text_encoder_2"]) is families.SDXL
    assert families.marked_by(["unet"]) is None and families.marked_by(["transformer"]) is None


def test_named_gives_the_row_and_refuses_an_unknown_name():
    assert all(families.named(f.name) is f for f in families.TABLE)
    assert families.named(None) is families.DEFAULT is families.SD
    with pytest.raises(SdnpuError, match="unknown model family 'sd4'") as e:
        families.named("sd4")
    assert all(f.name in e.value.hint for f in families.TABLE)


def test_the_rows_name_real_components_wrappers_and_modules():
    from sdnpu.signatures import _BY_WRAPPER

    for f in families.TABLE:
        assert set(f.lora) <= set(components.LORA_COMPONENTS), f.name
        assert set(f.text_encoders) <= set(components.TEXT_ENCODERS), f.name
        assert f.denoiser in components.MODULES and f.denoiser in families.DENOISER_MODULES, f.name
        assert set(f.wrappers) <= {r.wrapper for r in components.TABLE} and set(f.wrappers.values()) <= set(_BY_WRAPPER)
        assert f.timestep_divisor >= 1 and f.a_pipeline.startswith(("a ", "an "))


@pytest.mark.parametrize("family", families.TABLE, ids=families.NAMES)
def test_the_modules_a_row_names_load(family):
    loop = families.load(family.runtime)
    assert callable(loop) and hasattr(loop, "generate")
    if family.blockwise:
        pieces = families.load(family.blockwise)
        assert callable(pieces.pieces) and callable(pieces.whole_module)


def test_rows_that_share_a_denoiser_class_agree_on_what_a_class_is_asked():
    """``of_class`` gives the first row of a class: the others with it must answer alike."""
    for f in families.TABLE:
        first = families.of_class(f.denoiser_class)
        assert first is not None
        assert (dict(f.wrappers), f.timestep_divisor, f.denoiser in f.lora, f.blockwise) == (
            dict(first.wrappers), first.timestep_divisor, first.denoiser in first.lora, first.blockwise)
    assert families.of_class("AutoencoderKL") is None and families.of_class(None) is None


def test_the_questions_the_stages_ask():
    from sdnpu.formats.generation import Generation, family_default
    from sdnpu.specs import pipeline_outputs

    assert family_default("flux") == Generation(28, 3.5, embedded_guidance=True)
    assert family_default("sdxl") == family_default("sd3") == family_default(None) == Generation()
    assert components.wrapper_of("transformer", {"_class_name": "FluxTransformer2DModel"}) == "FluxTransformer"
    assert components.wrapper_of("transformer", {"_class_name": "SD3Transformer2DModel"}) == "Transformer"
    clip_l = {"architectures": ["CLIPTextModel"], "num_hidden_layers": 12}
    clip_g = {"architectures": ["CLIPTextModelWithProjection"], "num_hidden_layers": 32}
    assert pipeline_outputs("text_encoder", clip_l, "flux") == ["pooler_output"]
    assert pipeline_outputs("text_encoder", clip_l, "sd") == pipeline_outputs("text_encoder", clip_l, None) == [
        "last_hidden_state"]
    assert pipeline_outputs("text_encoder", clip_l, "sdxl") == ["hidden_states.11"]
    assert pipeline_outputs("text_encoder_2", clip_g, "sd3") == ["text_embeds", "hidden_states.31"]
    assert [f.name for f in families.TABLE if f.lora] == ["flux", "sdxl", "sd"]
    # Qwen-Image: QwenImagePipeline's defaults; its own VAE's wrappers, its Qwen2.5-VL text encoder's one output
    assert family_default("qwen-image") == Generation(50, 4.0)
    assert components.wrapper_of("vae_decoder", {"_class_name": "AutoencoderKLQwenImage"}) == "QwenImageVaeDecoder"
    assert components.wrapper_of("vae_decoder", {"_class_name": "AutoencoderKL"}) == "VaeDecoder"
    qwen_vl = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl"}
    assert components.wrapper_of("text_encoder", qwen_vl) == "QwenTextEncoder"
    assert pipeline_outputs("text_encoder", qwen_vl, "qwen-image") is None


def test_the_family_table_imports_no_stage_and_no_torch():
    """Ground floor: every stage may ask it, so it may import none of them (nor torch) when it loads."""
    code = ("import sys, sdnpu.families; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith(("
            "'sdnpu.convert', 'sdnpu.runtime', 'sdnpu.lora', 'sdnpu.passes', 'sdnpu.reports', 'sdnpu.ops'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_no_denoiser_class_is_spelled_outside_the_table():
    """``FluxTransformer2DModel`` (and every other family's denoiser class that no other row shares) appears in no
    source file but ``sdnpu/families.py`` and the family's own block-by-block module."""
    own = {f.denoiser_class for f in families.TABLE
           if sum(g.denoiser_class == f.denoiser_class for g in families.TABLE) == 1}
    assert "FluxTransformer2DModel" in own
    found = {(str(p), c) for p in _sources() if p != Path("sdnpu/families.py") and p not in OWN_MODULES
             for c in own if c in (ROOT / p).read_text(encoding="utf-8")}
    assert not found, f"family class names outside sdnpu/families.py: {sorted(found)}"
    assert Path("convert/blockwise/qwenimage.py") in OWN_MODULES
    assert any("FluxTransformer2DModel" in (ROOT / p).read_text() for p in OWN_MODULES)  # the scan sees files


def _literals(tree: ast.AST) -> list[ast.Constant]:
    """The string constants of a module that are values: not docstrings, not the attribute name of a
    ``getattr``/``hasattr`` (a Python name: ``getattr(packer, "sd")`` is AMD's module, not a family)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                skip.add(id(first.value))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2):
            skip.add(id(node.args[1]))
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip]


def test_no_family_name_is_spelled_outside_the_table():
    """No source module but ``sdnpu/families.py`` writes a family's name ("sdxl", "sd", "sd3", "flux") as a string
    value: it asks the table (``families.SDXL.name``, a row's field) instead."""
    names = set(families.NAMES)
    found = [f"{p}:{n.lineno}: {n.value!r}" for p in _sources() if p != Path("sdnpu/families.py")
             for n in _literals(ast.parse((ROOT / p).read_text(encoding="utf-8"), str(p))) if n.value in names]
    assert not found, "family names outside sdnpu/families.py:\n" + "\n".join(found)


def test_the_literal_scan_finds_what_it_looks_for():
    """The scan's own check: it sees a family name as a value, not in a docstring or a getattr's name."""
    tree = ast.parse('"""flux"""\nx = "sd3"\ny = getattr(m, "sd")\ndef f():\n    """sdxl"""\n    return "sdxl"\n')
    assert sorted(n.value for n in _literals(tree) if n.value in families.NAMES) == ["sd3", "sdxl"]
