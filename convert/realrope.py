"""Complex-valued rotary embeddings in real arithmetic, for the exporters (which have no complex type).

Lumina 2, Z-Image and Qwen-Image keep their rotary tables as complex numbers (``torch.polar``) and rotate the
queries and keys as diffusers' ``apply_rotary_emb(use_real=False)`` does:

    x_c = torch.view_as_complex(x.reshape(..., D // 2, 2));  out = torch.view_as_real(x_c * table).flatten(-2)

Neither torch exporter takes it (dynamo: no complex type in ONNX; TorchScript: "ScalarType ComplexFloat is an
unexpected tensor scalar type"). ``real_rotary(module)`` is a context in which it exports:

- every complex tensor the module's submodules (or plain objects they hold) keep as an attribute, alone or
  in a list or tuple (the rotary tables: not parameters or buffers, which a state dict would carry; a table
  made on the first call, as Z-Image's, must have been made: run the module once before) is replaced by its
  real view with the pairs flattened, ``[..., n] complex -> [..., 2n] real`` ((re, im) interleaved);
- while the module's forward runs, a torch function mode follows the tables and what is cut from them
  (``_TableMode``): an op that only moves or selects entries (indexing, splitting, viewing, expanding,
  concatenating, padding, copying) gives a table again, and where it counts along the last axis (Qwen-Image
  splits its table per rotary axis: ``split([8, 28, 28], dim=1)`` in complex numbers) its counts are doubled,
  so every op reads the real view as it reads the complex table; one complex number stays two adjacent
  reals. An op that would part a pair (an integer index, a step, a flip, a roll, a transpose or a new axis
  at the last axis) is refused with its name. A cut of constants alone (the tables, and Python numbers such
  as the image's size and the text's length) is computed right there, recorded by neither exporter
  (``_untraced``), once however often the model repeats it (each layer's queries and keys): the graph holds
  the rotations for the size it is exported at, each a constant, and no table arithmetic (the 4096-row tables
  would otherwise stay, with Split / Slice / Expand / Concat on them, larger than sdnpu's folder folds). A cut
  that reads the module's inputs (Lumina 2 gathers rows by position ids) is traced as it is;
- ``torch.view_as_complex`` of a real ``[..., n, 2]`` tensor gives a pair holder, whose product with such a
  table is the rotation in real arithmetic, written as the rotary rule family knows it (interleaved pairs):
  ``x * cos + rot(x) * sin`` with ``rot(x) = (-x_odd, x_even)`` and ``cos``, ``sin`` repeated per pair; and
  ``torch.view_as_real`` of the holder gives the ``[..., n, 2]`` result back (the ``cos`` and ``sin`` of a
  constant table are constants too, one pair a table);
- the memo caches of the tables' holders' methods (diffusers' ``lru_cache_unless_export``: Qwen-Image keeps
  the tables it cut for a size) are emptied on entry and on exit: a complex table cut before must not be
  read inside, nor a real view cut inside outlive it.

The product is the complex one exactly in exact arithmetic ((a + ib)(c + is) = (ac - bs) + i(as + bc)); in
float32 it differs by rounding only (``tests/test_realrope.py`` checks Qwen-Image's export against PyTorch's
complex run, ``tests/test_zoo.py`` Lumina 2's and Z-Image's). Anything else the model does with a complex
value (a ``torch.polar`` at run time, a complex op on a holder) raises an error that names it. Outside the
context nothing is changed; the tables and the module's forward are put back on exit.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

from sdnpu.errors import SdnpuError

log = logging.getLogger(__name__)

def _real_view(t: Any) -> Any:
    return torch.view_as_real(t).flatten(-2).to(torch.float32)


# --- the tables' own arithmetic: ops that move or select entries, counted in complex numbers -------------

# ops whose result is the table's entries moved, selected or copied: a table again
_STRUCTURAL = frozenset({
    "__getitem__", "split", "split_with_sizes", "narrow", "view", "reshape", "expand", "expand_as", "unflatten",
    "flatten", "unsqueeze", "squeeze", "cat", "concat", "concatenate", "pad", "pad_sequence", "repeat", "clone",
    "contiguous", "detach", "to", "float", "type_as", "cpu", "index_select", "chunk", "unbind",
})
# ops that would part a (re, im) pair where they act on the last axis: where their axes are (the argument's
# position after the tensor, its keyword, its default; ``_ALL``: every axis, as a flattening op does)
_ALL = object()
_REQUIRED = object()
_PARTS_PAIRS: dict[str, tuple[tuple[int, str, Any], ...]] = {
    "flip": ((1, "dims", _REQUIRED),), "roll": ((2, "dims", _ALL),),
    "transpose": ((1, "dim0", _REQUIRED), (2, "dim1", _REQUIRED)),
    "swapaxes": ((1, "axis0", _REQUIRED), (2, "axis1", _REQUIRED)),
    "movedim": ((1, "source", _REQUIRED), (2, "destination", _REQUIRED)),
    "stack": ((1, "dim", 0),), "gather": ((1, "dim", _REQUIRED),), "take_along_dim": ((2, "dim", _ALL),),
    "repeat_interleave": ((2, "dim", _ALL),), "tensor_split": ((2, "dim", 0),), "diff": ((2, "dim", -1),),
    "cumsum": ((1, "dim", _REQUIRED),), "sum": ((1, "dim", _ALL),), "mean": ((1, "dim", _ALL),),
    "permute": (),  # its own check: the last axis must stay last
}


def _dim(d: Any, ndim: int) -> int:
    return int(d) + ndim if int(d) < 0 else int(d)


def _refuse(op: str, why: str) -> SdnpuError:
    return SdnpuError(f"this model's rotary table is {why} ({op}) while exporting; sdnpu's real-valued rotary "
                      "embedding keeps each complex number as two adjacent reals and cannot do that",
                      hint="export the model with its rotary embedding in real arithmetic "
                           "(diffusers' apply_rotary_emb(use_real=True))")


@contextlib.contextmanager
def _untraced() -> Iterator[None]:
    """Ops run eagerly on real tensors, recorded by neither exporter's tracer: torch.export's fake and proxy
    dispatch modes set aside (non-strict export runs the module's Python with them), TorchScript's tracing
    state cleared. What they compute from constants is then a constant of the graph. (Private torch APIs:
    ``tests/test_realrope.py`` holds both exporters to a graph whose tables are constants.)"""
    state = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)
    try:
        with _disable_current_modes():
            yield
    finally:
        torch._C._set_tracing_state(state)


def _sizes(args: tuple[Any, ...]) -> tuple[list[Any], bool]:
    """``view(2, 3)`` / ``view((2, 3))``: the sizes, and whether they came as one sequence."""
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return list(args[0]), True
    return list(args), False


def _double_last(sizes: list[Any]) -> list[Any]:
    """Sizes with the last one counted in reals (-1 stays -1)."""
    if sizes and not (isinstance(sizes[-1], int) and sizes[-1] == -1):
        sizes[-1] = sizes[-1] * 2
    return sizes


def _last_axis_entry(index: tuple[Any, ...], ndim: int) -> int | None:
    """Which entry of an index tuple addresses the last axis, if one does."""
    axes = [i for i, e in enumerate(index) if e is not None and e is not Ellipsis and not isinstance(e, bool)]
    if Ellipsis in index:
        after = [i for i in axes if i > index.index(Ellipsis)]
        if after:
            return after[-1]
        return axes[-1] if axes and len(axes) == ndim else None
    return axes[-1] if axes and len(axes) == ndim else None


def _getitem(t: Any, index: Any) -> Any:
    entries = index if isinstance(index, tuple) else (index,)
    at = _last_axis_entry(entries, t.dim())
    if at is None:
        return index
    e = entries[at]
    if isinstance(e, slice):
        if e.step not in (None, 1):
            raise _refuse("__getitem__", "indexed with a step along its complex axis")
        doubled = slice(None if e.start is None else e.start * 2, None if e.stop is None else e.stop * 2)
        entries = entries[:at] + (doubled,) + entries[at + 1:]
        return entries if isinstance(index, tuple) else entries[0]
    raise _refuse("__getitem__", "indexed by single entries along its complex axis")


class _TableMode(TorchFunctionMode):
    """Follows the real views of complex tables through the module's forward (the context's second point)."""

    def __init__(self, tables: list[Any]) -> None:
        super().__init__()
        self.tables: dict[int, Any] = {id(t): t for t in tables}  # strong references: ids stay unique
        # the tables computed from constants alone (eagerly, see ``_untraced``): constants of the graph
        self.constants: dict[int, Any] = dict(self.tables)
        self.rotations: dict[int, tuple[Any, Any]] = {}  # a constant table's (cos, sin), by the table's id
        self.cuts: dict[tuple[Any, str], Any] = {}  # a cut of constants, by the op and its arguments
        self.paused = False
        self.translated: list[str] = []  # the ops whose counts along the last axis were doubled

    def is_table(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor) and id(x) in self.tables

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self.paused or not any(self.is_table(x) for x in tree_leaves((args, kwargs))):
            return func(*args, **kwargs)
        if name == "__setitem__":  # a table written into rows of another tensor (Lumina 2): that tensor is one
            out = func(*args, **kwargs)
            self.tables[id(args[0])] = args[0]
            return out
        if name not in _STRUCTURAL:
            if name in _PARTS_PAIRS:
                self._refuse_on_last_axis(name, args, kwargs)
            return func(*args, **kwargs)  # arithmetic, metadata: the result is no table
        if args and self.is_table(args[0]):
            args, kwargs = self._counted_in_reals(name, args, kwargs)
        constant = self.all_constant((args, kwargs))
        if constant:  # a cut of constants: computed here, a constant of the graph (the exporter folds nothing)
            key = _call_key(func, args, kwargs)  # the same cut again (each layer's queries and keys): the same one
            if key not in self.cuts:
                with _untraced():
                    self.cuts[key] = func(*args, **kwargs)
            out = self.cuts[key]
        else:  # a cut that reads the module's inputs (Lumina 2 gathers rows by position ids): traced
            out = func(*args, **kwargs)
        for o in tree_leaves(out):
            if isinstance(o, torch.Tensor):
                self.tables[id(o)] = o
                if constant:
                    self.constants[id(o)] = o
        return out

    def cos_sin(self, table: Any) -> tuple[Any, Any]:
        """``cos`` and ``sin`` of a table, each repeated per pair; of a constant table once (the queries and
        the keys rotate by the same table: one constant each in the graph)."""
        if not self.all_constant(table):
            return _cos_sin(table)
        if id(table) not in self.rotations:
            with _untraced():
                self.rotations[id(table)] = _cos_sin(table)
        return self.rotations[id(table)]  # type: ignore[no-any-return]

    def all_constant(self, tree: Any) -> bool:
        """Whether every tensor in ``tree`` is a table computed from constants alone."""
        return all(id(x) in self.constants for x in tree_leaves(tree) if isinstance(x, torch.Tensor))

    def _refuse_on_last_axis(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        first = args[0][0] if name == "stack" else args[0]
        ndim = first.dim() + (1 if name == "stack" else 0)  # stack's axis counts in its result
        if name == "permute":
            order = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
            order = kwargs.get("dims", order)
            if _dim(order[-1], ndim) != ndim - 1:
                raise _refuse(name, "permuted off its complex axis")
            return
        for position, keyword, default in _PARTS_PAIRS[name]:
            value = args[position] if len(args) > position else kwargs.get(keyword, default)
            if value is _REQUIRED:  # torch itself says what is missing
                continue
            dims = value if isinstance(value, (tuple, list)) else (value,)
            if value is _ALL or value is None or any(_dim(d, ndim) == ndim - 1 for d in dims):
                raise _refuse(name, "cut or reordered along its complex axis")

    def _counted_in_reals(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
                          ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The op's arguments with its counts along the last axis doubled (a complex number is two reals);
        records the op in ``translated`` where it changed one."""
        t, rest, kwargs = args[0], list(args[1:]), dict(kwargs)
        ndim = t.dim()
        last = ndim - 1

        def at_last(position: int, keyword: str = "dim", default: Any = 0) -> bool:
            value = rest[position] if len(rest) > position else kwargs.get(keyword, default)
            dims = value if isinstance(value, (tuple, list)) else (value,)
            return any(_dim(d, ndim) == last for d in dims)

        def doubled(position: int, keyword: str, double: Callable[[Any], Any]) -> None:
            if len(rest) > position:
                rest[position] = double(rest[position])
            else:
                kwargs[keyword] = double(kwargs[keyword])

        changed = False
        if name == "__getitem__":
            index = _getitem(t, rest[0])
            changed, rest[0] = index is not rest[0], index
        elif name in ("split", "split_with_sizes") and at_last(1):
            keyword = next((k for k in ("split_size", "split_size_or_sections", "split_sizes") if k in kwargs), "")
            doubled(0, keyword, lambda size: size * 2 if isinstance(size, int) else [n * 2 for n in size])
            changed = True
        elif name == "narrow" and at_last(0):
            doubled(1, "start", lambda n: n * 2)
            doubled(2, "length", lambda n: n * 2)
            changed = True
        elif name in ("view", "reshape", "expand"):
            if rest and isinstance(rest[0], torch.dtype):
                raise _refuse(name, "viewed as another dtype")
            sizes, _ = _sizes(tuple(rest) if rest else (kwargs.pop("shape", None) or kwargs.pop("size", ()),))
            changed = bool(sizes) and not (isinstance(sizes[-1], int) and sizes[-1] == -1)
            rest = [tuple(_double_last(sizes))]
        elif name == "unflatten" and at_last(0):
            sizes = list(rest[1] if len(rest) > 1 else kwargs.pop("sizes"))
            changed = not (isinstance(sizes[-1], int) and sizes[-1] == -1)
            rest = [rest[0], tuple(_double_last(sizes))]
        elif name == "pad":
            pad = list(rest[0] if rest else kwargs.pop("pad"))
            changed = len(pad) >= 2 and (pad[0], pad[1]) != (0, 0)
            rest = [[p * 2 if i < 2 else p for i, p in enumerate(pad)], *rest[1:]]
        elif name == "chunk" and at_last(1) and (t.shape[-1] // 2) % int(rest[0] if rest else kwargs["chunks"]):
            raise _refuse(name, "chunked into parts that part its pairs along its complex axis")
        elif name == "unbind" and at_last(0):
            raise _refuse(name, "unbound along its complex axis")
        elif name == "index_select" and at_last(0):
            raise _refuse(name, "indexed by single entries along its complex axis")
        elif name == "unsqueeze" and _dim(rest[0] if rest else kwargs["dim"], ndim + 1) == ndim:
            raise _refuse(name, "given a new axis after its complex axis")
        elif name == "squeeze" and (rest or "dim" in kwargs) and at_last(0):
            raise _refuse(name, "squeezed along its complex axis")
        if changed:
            self.translated.append(name)
        return (t, *rest), kwargs


def _call_key(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, str]:
    """An op and its arguments, tensors by identity (the key of a cut of constants)."""
    return func, repr(tree_map(lambda x: ("tensor", id(x)) if isinstance(x, torch.Tensor) else x, (args, kwargs)))


def _cos_sin(table: Any) -> tuple[Any, Any]:
    cs = table.reshape(*table.shape[:-1], -1, 2)  # (cos, sin) per pair
    return (torch.stack([cs[..., 0], cs[..., 0]], dim=-1).flatten(-2),
            torch.stack([cs[..., 1], cs[..., 1]], dim=-1).flatten(-2))


class _Pairs:
    """A complex tensor held as its real view ``[..., n, 2]`` (re, im)."""

    def __init__(self, pairs: Any, mode: _TableMode) -> None:
        self.pairs = pairs
        self.mode = mode

    def __mul__(self, table: Any) -> _Pairs:
        if isinstance(table, _Pairs) or not isinstance(table, torch.Tensor) or table.is_complex():
            raise SdnpuError("this model multiplies two complex values while exporting; sdnpu's real-valued "
                             "rotary embedding handles a complex activation times a rotary table only",
                             hint="export the model with its rotary embedding in real arithmetic "
                                  "(diffusers' apply_rotary_emb(use_real=True))")
        self.mode.paused = True  # the rotation's own reshapes count in reals
        try:
            x = self.pairs
            cos, sin = self.mode.cos_sin(table)
            flat = x.flatten(-2)
            rot = torch.stack([-x[..., 1], x[..., 0]], dim=-1).flatten(-2)
            out = flat * cos + rot * sin
            return _Pairs(out.reshape(*out.shape[:-1], -1, 2), self.mode)
        finally:
            self.mode.paused = False

    __rmul__ = __mul__

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise SdnpuError(f"this model uses a complex value's .{name} while exporting; sdnpu's real-valued rotary "
                         "embedding handles view_as_complex, a product with a rotary table and view_as_real only",
                         hint="export the model with its rotary embedding in real arithmetic")


def _holders(module: Any) -> list[Any]:
    """The submodules, and plain objects they hold (Z-Image's rotary embedder)."""
    holders: list[Any] = []
    for sub in module.modules():
        holders.append(sub)
        holders += [v for k, v in vars(sub).items() if not k.startswith("_") and not isinstance(v, torch.nn.Module)
                    and hasattr(v, "__dict__") and not isinstance(v, (type, torch.Tensor))]
    return holders


def _complex_attributes(module: Any) -> list[tuple[Any, str, Any]]:
    """(submodule, attribute, value) for every complex tensor held as a plain attribute, alone or in a list or
    tuple."""
    found = []
    for sub in _holders(module):
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


def _clear_method_caches(holders: list[Any]) -> int:
    """Empty the memo caches (``functools.lru_cache``, alone or inside a wrapper such as diffusers'
    ``lru_cache_unless_export``) of the holders' classes' methods; how many."""
    caches: dict[int, Any] = {}
    for cls in {type(h) for h in holders}:
        for klass in cls.__mro__:
            for value in vars(klass).values():
                for candidate in (value, *_closure(value)):
                    if callable(getattr(candidate, "cache_clear", None)):
                        caches[id(candidate)] = candidate
    for cache in caches.values():
        cache.cache_clear()
    return len(caches)


def _closure(value: Any) -> list[Any]:
    """What a function's closure holds (an empty cell holds nothing)."""
    held = []
    for cell in getattr(value, "__closure__", None) or ():
        try:
            held.append(cell.cell_contents)
        except ValueError:
            continue
    return held


@contextlib.contextmanager
def real_rotary(module: Any) -> Iterator[int]:
    """The context above; yields how many tables were replaced."""
    tables = _complex_attributes(module)
    holders = list({id(sub): sub for sub, _, _ in tables}.values())
    original_complex, original_real = torch.view_as_complex, torch.view_as_real
    real = [(sub, name, type(value)(_real_view(v) for v in value) if isinstance(value, (list, tuple))
             else _real_view(value)) for sub, name, value in tables]
    mode = _TableMode([t for _, _, v in real for t in (v if isinstance(v, (list, tuple)) else (v,))])
    forward = module.__dict__.get("forward")  # an instance's own forward, if it has one, is put back

    def followed(*args: Any, **kwargs: Any) -> Any:
        with mode:
            return type(module).forward(module, *args, **kwargs) if forward is None else forward(*args, **kwargs)

    def view_as_complex(t: Any) -> Any:
        return _Pairs(t, mode)

    def view_as_real(t: Any) -> Any:
        return t.pairs if isinstance(t, _Pairs) else original_real(t)

    _clear_method_caches(holders)
    for sub, name, value in real:
        setattr(sub, name, value)
    if tables:  # without tables there is nothing to follow (and every op of a large export would pay for it)
        module.forward = followed
    torch.view_as_complex, torch.view_as_real = view_as_complex, view_as_real  # type: ignore[assignment]
    try:
        yield len(tables)
    finally:
        torch.view_as_complex, torch.view_as_real = original_complex, original_real  # type: ignore[assignment]
        if not tables:
            pass
        elif forward is None:
            del module.forward
        else:
            module.forward = forward
        for sub, name, value in tables:
            setattr(sub, name, value)
        _clear_method_caches(holders)
        if tables:
            log.info("%d complex rotary table(s) in real arithmetic; ops counted in complex numbers along their "
                     "last axis: %s", len(tables), ", ".join(mode.translated) or "none")
