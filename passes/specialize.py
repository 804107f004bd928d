"""Size specialization: a compiled dispatch model re-derived for other input shapes, without the passes.

A dispatch model's structure does not depend on the image size: the same nodes, in the same order, read the
same weights. What does depend on it is written on the graph: the shape attributes of the dispatch ops
(``input_shape``, ``a_shape``, ... what AMD's runtime keys its kernels on), the shapes of the values, the
views recorded on the nodes (``sdnpu.views``) and the attention masks, whose length follows the key count.
``specialize`` walks the compiled graph of one size (the *primary*) in order with another size's input
shapes and recomputes all of them from the target's op table:

- a view attribute (the shape an op reads an input as) is the same reshape of the input's new shape: dims
  merged stay merged; a dim split in two takes its parts from the op's other operand (an SDAdd reading a
  ``[B, M, C]`` tensor as ``[B, H, W, C]`` beside a ``[B, H, W, C]`` one);
- an exact attribute (``output_shape``, ``c_shape``) and the output's shape come from ``OpSpec.output``, the
  op's output shape as a function of its attributes; a weight's attribute must not change;
- attention: ``input_shape`` from Q and K, the variant checked (``Target.mha_variant``), the mask made again
  at its new length (``Target.mha_mask``);
- a node on the CPU (plain ONNX) goes through onnx's shape inference, node by node.

It proves its rules on the primary first: specialized to the primary's own shapes, every attribute, value
shape and mask must come out as the compiler wrote them. Anything it cannot account for (an op without an
output rule, a split view with no operand to take its parts from, a dimension that is 1 at one size and not at
the other, where the passes may have decided differently, a different attention variant) raises
``CannotSpecialize`` with the reason; ``sdnpu convert`` then compiles that size in full.

The tests hold the result against a full compile of the same size, graph for graph.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import onnx

from sdnpu.formats.keys import SIZED_CONSTANTS_KEY, VIEWS_TAG
from sdnpu.ops.target import DispatchTarget, attention_mask, prod

__all__ = ["CannotSpecialize", "Specialized", "specialize"]

log = logging.getLogger(__name__)

Shape = list[int]


class CannotSpecialize(Exception):
    """The graph has something the specializer cannot re-derive for the new shapes (the reason)."""


@dataclass
class Specialized:
    """The specialized graph (an onnx ModelProto sharing nothing with the primary's), the masks it made
    (initializer name -> the name it replaces), and the initializers of the primary it no longer reads."""

    model: Any
    new_masks: dict[str, str] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    reshaped: int = 0  # nodes whose attributes changed


def _groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """``b`` as a reshape of ``a``: the runs of consecutive dims with equal products, ((a from, to), (b from,
    to)) each. Raises where no such grouping exists (not a reshape)."""
    groups = []
    i = j = 0
    while i < len(a) or j < len(b):
        i0, j0, pa, pb = i, j, 1, 1
        if i < len(a):
            pa, i = pa * a[i], i + 1
        if j < len(b):
            pb, j = pb * b[j], j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                pa, i = pa * a[i], i + 1
            elif pb < pa and j < len(b):
                pb, j = pb * b[j], j + 1
            else:
                raise CannotSpecialize(f"{list(b)} is not a reshape of {list(a)}")
        groups.append(((i0, i), (j0, j)))
    return groups


def regroup(src_a: Sequence[int], dst_a: Sequence[int], src_b: Sequence[int],
            hint: Sequence[int] | None = None, same_as_hint: bool = False) -> Shape:
    """``dst_a`` is a view (reshape) of ``src_a``: the same view of ``src_b``. Merged dims multiply; a dim
    split into several parts keeps them where it did not change, puts its product on its only part above
    1, or takes the parts from ``hint`` (a shape of ``dst_a``'s rank that agrees there: the other operand);
    otherwise CannotSpecialize. ``same_as_hint``: the view is known to be ``hint``'s (two operands the
    primary read through one view), so a split whose product did not change takes ``hint``'s parts too: a
    flattened [B, H*W, C] of 24x32 and of 32x24 have one shape, and only the other operand says which."""
    src_a, dst_a, src_b = list(src_a), list(dst_a), list(src_b)
    if src_a == dst_a:
        return src_b
    if len(src_a) != len(src_b):
        raise CannotSpecialize(f"rank changed: {src_a} -> {src_b}")

    def hinted(j0: int, j1: int, p: int, view: Sequence[int]) -> list[int] | None:
        if hint is None or len(hint) != len(dst_a):
            return None
        parts = list(hint[j0:j1])
        return parts if prod(parts) == p and all((x == 1) == (y == 1) for x, y in zip(parts, view, strict=True)) \
            else None

    out: Shape = []
    for (i0, i1), (j0, j1) in _groups(src_a, dst_a):
        part_a, part_b, view = src_a[i0:i1], src_b[i0:i1], dst_a[j0:j1]
        p = prod(part_b)
        if part_a == part_b:
            out += (hinted(j0, j1, p, view) if same_as_hint else None) or view
            continue
        if j1 - j0 == 1:
            out.append(p)
            continue
        big = [k for k, d in enumerate(view) if d != 1]
        if len(big) == 1:
            out += [p if k == big[0] else 1 for k in range(len(view))]
            continue
        parts = hinted(j0, j1, p, view)
        if parts is not None:
            out += parts
            continue
        raise CannotSpecialize(f"the view {dst_a} of {src_a} splits {part_a} into {view}, and nothing says how "
                               f"{part_b} splits")
    return out


def _shape_of(vi: Any) -> Shape:
    return [int(d.dim_value) for d in vi.type.tensor_type.shape.dim]


def _set_shape(vi: Any, shape: Sequence[int]) -> None:
    dims = vi.type.tensor_type.shape.dim
    if len(dims) != len(shape):
        raise CannotSpecialize(f"{vi.name}: rank {len(dims)} -> {len(shape)}")
    for d, n in zip(dims, shape, strict=True):
        d.dim_value = int(n)


def _attrs(node: Any) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _mask(length: int, n: int, data_type: int) -> bytes:
    """The attention mask (0 for the ``n`` keys, -inf up to ``length``) as bytes of ``data_type``."""
    mask = attention_mask(length, n)
    if data_type == onnx.TensorProto.BFLOAT16:
        return mask.astype(ml_dtypes.bfloat16).tobytes()
    return mask.astype(onnx.helper.tensor_dtype_to_np_dtype(data_type)).tobytes()


class _Walk:
    """One pass over the primary's graph with new input shapes: ``new`` (every value's new shape; ``old``:
    the primary's), ``attrs`` (node index -> its attributes that change), ``views`` (node index -> its
    ``sdnpu.views`` record), the masks to make and the mask inputs they replace."""

    def __init__(self, model: Any, target: DispatchTarget, inputs: Mapping[str, Shape],
                 read: Callable[[Any], bytes]) -> None:
        g = model.graph
        self.g, self.target, self.read = g, target, read
        self.opsets = [o for o in model.opset_import if o.domain in ("", "ai.onnx")]
        self.types = {vi.name: vi.type.tensor_type.elem_type for vi in [*g.input, *g.value_info, *g.output]}
        self.old: dict[str, Shape] = {}
        for vi in [*g.input, *g.output, *g.value_info]:
            self.old[vi.name] = _shape_of(vi)
        self.inits = {t.name: t for t in g.initializer}
        for t in g.initializer:
            self.old[t.name] = [int(d) for d in t.dims]
        self.new: dict[str, Shape] = {name: list(self.old[name]) for name in self.inits}
        for vi in g.input:
            if vi.name in self.inits:
                continue
            if vi.name not in inputs:
                raise CannotSpecialize(f"no shape given for the graph input {vi.name}")
            self.new[vi.name] = list(inputs[vi.name])
        self.attrs: dict[int, dict[str, Any]] = {}
        self.views: dict[int, str] = {}
        self.masks: dict[str, tuple[str, int, int]] = {}  # new name -> (old name, length, n)
        self.mask_inputs: dict[tuple[int, int], str] = {}  # (node, input) -> new mask name

    def run(self) -> None:
        for k, node in enumerate(self.g.node):
            try:
                if node.domain == self.target.domain and self.target.is_boundary(node.domain, node.op_type):
                    self._same(node)
                elif self.target.is_dispatch(node.domain, node.op_type):
                    self._dispatch(k, node)
                else:
                    self._onnx(node)
            except CannotSpecialize as e:
                raise CannotSpecialize(f"node {node.name or k} ({node.op_type}): {e}") from None
            for o in node.output:
                if o and o in self.old:
                    a, b = self.old[o], self.new.get(o)
                    if b is None:
                        raise CannotSpecialize(f"no shape for {o}")
                    if len(a) != len(b) or any((x == 1) != (y == 1) for x, y in zip(a, b, strict=True)):
                        raise CannotSpecialize(f"{o} is {a} at the primary's size and {b} at this one: a "
                                               "dimension of 1 where the other has more, so the passes may "
                                               "decide differently")

    def _in(self, name: str) -> Shape:
        if name not in self.new:
            raise CannotSpecialize(f"no shape for its input {name}")
        return self.new[name]

    def _same(self, node: Any) -> None:
        self.new[node.output[0]] = list(self._in(node.input[0]))

    @staticmethod
    def _output(spec: Any, attrs: dict[str, Any]) -> Shape:
        """The op's output shape from its attributes by the table's rule; operands it refuses (views re-derived
        that no longer broadcast: height and width swapped) are a size this cannot re-derive."""
        try:
            return list(spec.output(attrs))
        except (ValueError, IndexError, KeyError, TypeError) as e:
            shapes = {k: v for k, v in attrs.items() if k.endswith("_shape")}
            raise CannotSpecialize(f"the table's shape rule refuses {shapes}: {e}") from None

    def _dispatch(self, k: int, node: Any) -> None:
        spec = self.target.base_spec(node.op_type)
        if spec.output is None:
            raise CannotSpecialize("the op table gives no output shape for it")
        attrs = _attrs(node)
        views_a = spec.input_views(attrs)
        views_b: dict[int, Shape] = {}
        pending = []
        for i, view in views_a.items():
            try:
                views_b[i] = regroup(self.old[node.input[i]], view, self._in(node.input[i]))
            except CannotSpecialize:
                pending.append(i)
        for i in pending:  # a split view: its parts from the other operand's view
            hints = [views_b[j] for j in views_b if j != i]
            views_b[i] = regroup(self.old[node.input[i]], views_a[i], self._in(node.input[i]),
                                 hints[0] if hints else None)
        for i, view in views_a.items():  # operands the primary read through one view keep reading one
            for j, other in views_b.items():
                if j != i and list(views_a[j]) == list(view) and other != views_b[i]:
                    with contextlib.suppress(CannotSpecialize):
                        alt = regroup(self.old[node.input[i]], view, self._in(node.input[i]), other, True)
                        if alt == other:
                            views_b[i] = alt
                            break
        new = spec.with_views(attrs, views_b)
        for a, i in spec.exact_inputs:
            if a in new and list(new[a]) != self._in(node.input[i]):
                raise CannotSpecialize(f"{a} {new[a]} is not its input's shape {self._in(node.input[i])}")
        out = self._output(spec, new)
        for a, _ in spec.exact_outputs:
            if a in new:
                new[a] = out
        is_mha = "input_shape" in attrs and len(spec.inputs) >= 4 and spec.inputs[3].role == "mask"
        if is_mha:
            self._mha(k, node, spec.op_type, new)
        # the output tensor: the same view of the op's output as at the primary's size
        if node.output[0] not in self.old:
            raise CannotSpecialize(f"its output {node.output[0]} has no recorded shape")
        out_attr = self._output(spec, attrs)
        self.new[node.output[0]] = regroup(out_attr, self.old[node.output[0]], out)
        changed = {a: v for a, v in new.items() if v != attrs[a]}
        if changed:
            self.attrs[k] = changed
        records = []
        for i, view in sorted(views_b.items()):
            shape = self._in(node.input[i])
            if shape != list(view):
                records.append(f"{i}:{'x'.join(map(str, shape))}>{'x'.join(map(str, view))}")
        self.views[k] = ";".join(records)

    def _mha(self, k: int, node: Any, base: str, new: dict[str, Any]) -> None:
        b, m, c, n = new["input_shape"]
        heads = int(new["num_heads"])
        assert self.target.mha_variant is not None and self.target.mha_mask_length is not None
        variant = self.target.mha_variant(m, n, heads)
        if variant != base:
            raise CannotSpecialize(f"Q length {m} and K length {n} take {variant}, not {base}")
        name = node.input[3]
        t = self.inits.get(name)
        if t is None or len(t.dims) != 1:
            raise CannotSpecialize(f"its mask {name} is not a 1-D initializer")
        length = self.target.mha_mask_length(b, m, c, n)
        old_b, old_m, old_c, old_n = _attrs(node)["input_shape"]
        old_length = self.target.mha_mask_length(old_b, old_m, old_c, old_n)
        if int(t.dims[0]) != old_length or self.read(t) != _mask(old_length, old_n, t.data_type):
            raise CannotSpecialize(f"its mask {name} is not the {old_length}-long mask of {old_n} keys")
        if (length, n) == (old_length, old_n):
            return
        tag = f"_{old_length}_{old_n}"
        new_name = name.replace(tag, f"_{length}_{n}", 1) if tag in name else f"{name}_{length}_{n}"
        known = self.masks.get(new_name)
        if known is not None and known[1:] != (length, n):
            raise CannotSpecialize(f"two masks would be called {new_name}")
        self.masks[new_name] = (name, length, n)
        self.mask_inputs[(k, 3)] = new_name
        self.new[new_name] = [length]

    def _onnx(self, node: Any) -> None:
        """A plain ONNX node: onnx's shape inference on the node alone, its small constants given."""
        known = self.types
        inputs, inits = [], []
        for name in node.input:
            if not name:
                continue
            t = self.inits.get(name)
            if t is not None and prod(t.dims) <= 64 and t.data_location != onnx.TensorProto.EXTERNAL:
                inits.append(t)
                continue
            elem = t.data_type if t is not None else known.get(name)
            if elem is None:
                raise CannotSpecialize(f"no type for its input {name}")
            inputs.append(onnx.helper.make_tensor_value_info(name, elem, self._in(name)))
        outputs = [onnx.helper.make_tensor_value_info(o, known.get(o, 0), None) for o in node.output if o]
        graph = onnx.helper.make_graph([node], "node", inputs, outputs, initializer=inits)
        model = onnx.helper.make_model(graph, opset_imports=self.opsets)
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
        except Exception as e:  # noqa: BLE001 - onnx raises several kinds here
            raise CannotSpecialize(f"onnx's shape inference: {str(e)[:200]}") from None
        got = {vi.name: vi for vi in [*inferred.graph.value_info, *inferred.graph.output]}
        for o in node.output:
            vi = got.get(o)
            if not o:
                continue
            if vi is None or not vi.type.tensor_type.HasField("shape") or any(
                    not d.HasField("dim_value") for d in vi.type.tensor_type.shape.dim):
                raise CannotSpecialize(f"onnx's shape inference gives no static shape for {o}")
            self.new[o] = _shape_of(vi)


def specialize(model: Any, target: DispatchTarget, inputs: Mapping[str, Sequence[int]],
               read: Callable[[Any], bytes]) -> Specialized:
    """``model`` (a compiled dispatch model, an onnx ModelProto, loaded without its weights) re-derived for
    graph inputs of ``inputs`` (name -> shape); ``read(tensor)``: a small initializer's bytes (the masks are
    checked against what the compiler writes). Raises CannotSpecialize with the reason (see the module doc)."""
    sized = {p.key: p.value for p in model.metadata_props}.get(SIZED_CONSTANTS_KEY)
    if sized:
        raise CannotSpecialize(f"its constants {sized} were cut for the primary's size (SD3's position-embedding "
                               "crop): another size needs its own")
    own = {vi.name: _shape_of(vi) for vi in model.graph.input}
    check = _Walk(model, target, own, read)  # the rules, proved on the primary's own shapes
    check.run()
    for name, shape in check.new.items():
        if name in check.old and check.old[name] != shape:
            raise CannotSpecialize(f"the rules give {name} the shape {shape} at the primary's own size, the "
                                   f"compiler gave it {check.old[name]}")
    if check.attrs:
        k, changed = next(iter(check.attrs.items()))
        raise CannotSpecialize(f"the rules give node {model.graph.node[k].name} {changed} at the primary's own "
                               "size, unlike the compiler")
    for k, node in enumerate(model.graph.node):
        views = {p.key: p.value for p in node.metadata_props}.get(VIEWS_TAG, "")
        if k in check.views and check.views[k] != views:
            raise CannotSpecialize(f"node {node.name}: views {check.views[k]!r}, the compiler recorded {views!r}")

    walk = _Walk(model, target, {k: list(v) for k, v in inputs.items()}, read)
    walk.run()
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    for k, changed in walk.attrs.items():
        for a in g.node[k].attribute:
            if a.name in changed:
                if a.type != onnx.AttributeProto.INTS:
                    raise CannotSpecialize(f"node {g.node[k].name}: {a.name} would change, and it is not a shape")
                a.ints[:] = [int(x) for x in changed[a.name]]
    for (k, i), name in walk.mask_inputs.items():
        g.node[k].input[i] = name
    for k, node in enumerate(g.node):
        if k not in walk.views:
            continue
        at = next((j for j, p in enumerate(node.metadata_props) if p.key == VIEWS_TAG), None)
        if at is not None and walk.views[k]:
            node.metadata_props[at].value = walk.views[k]
        elif at is not None:
            del node.metadata_props[at]
        elif walk.views[k]:
            node.metadata_props.add(key=VIEWS_TAG, value=walk.views[k])
    for vi in [*g.input, *g.output, *g.value_info]:
        if vi.name in walk.new:
            _set_shape(vi, walk.new[vi.name])
    read_names = {i for node in g.node for i in node.input} | {o.name for o in g.output}
    dropped = [t.name for t in g.initializer if t.name not in read_names]
    kept = [t for t in g.initializer if t.name in read_names]
    new_masks: dict[str, str] = {}
    for name, (old, length, n) in walk.masks.items():
        if name in {t.name for t in kept}:
            continue
        t = onnx.TensorProto()
        t.CopyFrom(walk.inits[old])
        del t.external_data[:]
        t.data_location = onnx.TensorProto.DEFAULT
        t.name, t.dims[:] = name, [length]
        t.raw_data = _mask(length, n, t.data_type)
        kept.append(t)
        new_masks[name] = old
    del g.initializer[:]
    g.initializer.extend(kept)
    renamed: dict[str, list[str]] = {}
    for new, old in new_masks.items():
        renamed.setdefault(old, []).append(new)
    infos = []
    for vi in g.value_info:  # an initializer's entry follows it: renamed with its mask, or gone with it
        for new in renamed.get(vi.name, []):
            entry = onnx.ValueInfoProto()
            entry.CopyFrom(vi)
            entry.name = new
            _set_shape(entry, [walk.masks[new][1]])
            infos.append(entry)
        if vi.name not in dropped and vi.name not in renamed:
            infos.append(vi)
    del g.value_info[:]
    g.value_info.extend(infos)
    return Specialized(out, new_masks, dropped, len(walk.attrs))
