"""Complex-valued rotary embeddings in real arithmetic, for the exporters (which have no complex type).

Lumina 2 and Z-Image keep their rotary tables as complex numbers (``torch.polar``) and rotate the queries and
keys as diffusers' ``apply_rotary_emb(use_real=False)`` does:

    x_c = torch.view_as_complex(x.reshape(..., D // 2, 2));  out = torch.view_as_real(x_c * table).flatten(-2)

Neither torch exporter takes it (dynamo: no complex type in ONNX; TorchScript: "ScalarType ComplexFloat is an
unexpected tensor scalar type"). ``real_rotary(module)`` is a context in which it exports:

- every complex tensor the module's submodules (or plain objects they hold) keep as an attribute, alone or
  in a list or tuple (the rotary tables: not parameters or buffers, which a state dict would carry; a table
  made on the first call, as Z-Image's, must have been made: run the module once before) is replaced by its
  real view with the pairs flattened, ``[..., n] complex -> [..., 2n] real`` ((re, im) interleaved). Everything the model does
  with the table along its rows (indexing, gathering, padding, concatenating along the last axis: one
  complex number stays two adjacent reals) is the same on the real view;
- ``torch.view_as_complex`` of a real ``[..., n, 2]`` tensor gives a pair holder, whose product with such a
  table is the rotation in real arithmetic, written as the rotary rule family knows it (interleaved pairs):
  ``x * cos + rot(x) * sin`` with ``rot(x) = (-x_odd, x_even)`` and ``cos``, ``sin`` repeated per pair; and
  ``torch.view_as_real`` of the holder gives the ``[..., n, 2]`` result back.

The product is the complex one exactly in exact arithmetic ((a + ib)(c + is) = (ac - bs) + i(as + bc)); in
float32 it differs by rounding only (``tests/test_zoo.py`` checks the export against PyTorch's complex run).
Anything else the model does with a complex value (a ``torch.polar`` at run time, a complex op on a holder)
raises an error that names it. Outside the context nothing is changed; the tables are put back on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from sdnpu.errors import SdnpuError


def _real_view(t: Any) -> Any:
    return torch.view_as_real(t).flatten(-2).to(torch.float32)


class _Pairs:
    """A complex tensor held as its real view ``[..., n, 2]`` (re, im)."""

    def __init__(self, pairs: Any) -> None:
        self.pairs = pairs

    def __mul__(self, table: Any) -> _Pairs:
        if isinstance(table, _Pairs) or not isinstance(table, torch.Tensor) or table.is_complex():
            raise SdnpuError("this model multiplies two complex values while exporting; sdnpu's real-valued "
                             "rotary embedding handles a complex activation times a rotary table only",
                             hint="export the model with its rotary embedding in real arithmetic "
                                  "(diffusers' apply_rotary_emb(use_real=True))")
        x = self.pairs
        cs = table.reshape(*table.shape[:-1], -1, 2)  # (cos, sin) per pair
        cos = torch.stack([cs[..., 0], cs[..., 0]], dim=-1).flatten(-2)
        sin = torch.stack([cs[..., 1], cs[..., 1]], dim=-1).flatten(-2)
        flat = x.flatten(-2)
        rot = torch.stack([-x[..., 1], x[..., 0]], dim=-1).flatten(-2)
        out = flat * cos + rot * sin
        return _Pairs(out.reshape(*out.shape[:-1], -1, 2))

    __rmul__ = __mul__

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise SdnpuError(f"this model uses a complex value's .{name} while exporting; sdnpu's real-valued rotary "
                         "embedding handles view_as_complex, a product with a rotary table and view_as_real only",
                         hint="export the model with its rotary embedding in real arithmetic")


def _complex_attributes(module: Any) -> list[tuple[Any, str, Any]]:
    """(submodule, attribute, value) for every complex tensor held as a plain attribute, alone or in a list or
    tuple."""
    found = []
    holders: list[Any] = []
    for sub in module.modules():  # the submodules, and plain objects they hold (Z-Image's rotary embedder)
        holders.append(sub)
        holders += [v for k, v in vars(sub).items() if not k.startswith("_") and not isinstance(v, torch.nn.Module)
                    and hasattr(v, "__dict__") and not isinstance(v, (type, torch.Tensor))]
    for sub in holders:
        for name, value in list(vars(sub).items()):
            if name.startswith("_"):
                continue
            if isinstance(value, torch.Tensor) and value.is_complex():
                found.append((sub, name, value))
            elif isinstance(value, (list, tuple)) and value and all(
                    isinstance(v, torch.Tensor) and v.is_complex() for v in value):
                found.append((sub, name, value))
    return found


def has_complex_tables(module: Any) -> bool:
    return bool(_complex_attributes(module))


@contextlib.contextmanager
def real_rotary(module: Any) -> Iterator[int]:
    """The context above; yields how many tables were replaced."""
    tables = _complex_attributes(module)
    original_complex, original_real = torch.view_as_complex, torch.view_as_real

    def view_as_complex(t: Any) -> Any:
        return _Pairs(t)

    def view_as_real(t: Any) -> Any:
        return t.pairs if isinstance(t, _Pairs) else original_real(t)

    for sub, name, value in tables:
        setattr(sub, name, type(value)(_real_view(v) for v in value) if isinstance(value, (list, tuple))
                else _real_view(value))
    torch.view_as_complex, torch.view_as_real = view_as_complex, view_as_real  # type: ignore[assignment]
    try:
        yield len(tables)
    finally:
        torch.view_as_complex, torch.view_as_real = original_complex, original_real  # type: ignore[assignment]
        for sub, name, value in tables:
            setattr(sub, name, value)
