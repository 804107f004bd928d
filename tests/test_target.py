"""The target's table against AMD's own signatures, and every dispatch op of every tiny-sdxl component
against the table: attribute names and types, and values that agree with the tensors the node reads and
writes."""

from __future__ import annotations

import pytest
from sdnpu.ops.target import get_target

from .amd_signatures import REGISTRY, TEST_MODELS
from .contract import problems

TARGET = get_target()
COMPONENTS = ["unet", "vae_decoder", "vae_encoder", "text_encoder", "text_encoder_2"]
_ONNX_TYPES = {"bfloat16": "BFLOAT16", "float": "FLOAT", "uint8": "UINT8", "uint16": "UINT16"}


def verify(op: str, dtypes: list[str]) -> bool:
    """DynamicDispatch's ICreatePolicy::verify: type i at position pos[i] of in_dtypes + out_dtypes."""
    types, pos = REGISTRY[op]
    return all(p == -1 or (p < len(dtypes) and dtypes[p] == t) for t, p in zip(types, pos, strict=False))


@pytest.mark.parametrize("op", sorted(TEST_MODELS))
def test_the_table_writes_what_amds_test_models_write(op):
    spec = TARGET.spec(op)
    model = TEST_MODELS[op]
    amd_attrs = {a.name: a.type for a in spec.attrs if a.kind == "amd"}
    assert amd_attrs == model["attrs"]
    if op == "SDConv":
        # DD's test lists a fourth input dtype that no input has; the table writes one per input, as AMD's
        # ONNX pass does (conv_to_sd_conv2d L355): a prefix, and both pass the registry's check.
        assert list(spec.in_dtypes) == model["in_dtypes"][:3]
    else:
        assert list(spec.in_dtypes) == model["in_dtypes"]
    assert list(spec.out_dtypes) == model["out_dtypes"]
    packed = [_ONNX_TYPES[(i.packed.split()[0] if i.packed else i.dtype)] for i in spec.inputs
              if not i.packed.startswith("folded")]
    assert packed == model["inputs"]
    dummies = [list(i.dummy_shape) for i in spec.inputs if i.role == "dummy"]
    assert dummies == ([model["dummy"]] if "dummy" in model else [])


@pytest.mark.parametrize("op", sorted(TARGET.ops))
def test_every_op_passes_the_registrys_dtype_check(op):
    spec = TARGET.spec(op)
    base = op if op in REGISTRY else "SDMHA"  # SDFlatMHA and SDMHA_VAE are AMD's variants of SDMHA
    assert verify(base, [*spec.in_dtypes, *spec.out_dtypes]), op
    assert spec.sources and all(s.split()[0] in TARGET.sources for s in spec.sources)


@pytest.mark.parametrize("component", COMPONENTS)
def test_every_dispatch_op_agrees_with_the_table_and_its_tensors(tiny_conversion, component):
    checked, found = problems(tiny_conversion.out / component / "dd" / "replaced.onnx", TARGET)
    assert checked > 0 and found == []


def test_every_family_names_an_op_of_the_table_and_the_rules_name_none():
    """The rules and the glue ask the target for a family; a second target with other op names takes them."""
    import re
    from pathlib import Path

    from sdnpu.errors import SdnpuError

    assert TARGET.families and all(name in TARGET.ops for name in TARGET.families.values())
    assert TARGET.op("gemm").op_type == TARGET.families["gemm"]
    with pytest.raises(SdnpuError, match="no op of the 'fft' family"):
        TARGET.op("fft")
    passes = Path(__file__).resolve().parent.parent / "passes"
    named = set(TARGET.ops)
    for path in passes.rglob("*.py"):
        literals = set(re.findall(r'"(SD[A-Za-z0-9_]+)"', path.read_text()))
        assert not literals & named, (path.name, literals & named)


def test_the_attention_mask_is_the_targets_length():
    m = TARGET.mha_mask(2, 4096, 640, 77)
    assert m.shape == (TARGET.mha_mask_length(2, 4096, 640, 77),) == (128,)
    assert (m[:77] == 0).all() and (m[77:] == -float("inf")).all()
