"""Export forms: for a module class whose own forward torch's exporters cannot trace, a forward that computes the
same function in ops they do, put on every submodule of that class while the graph is exported.

``export_module`` exports inside ``export_forms(module, exporter)`` (beside ``real_rotary``): the form is chosen
by the submodule's class, named by its qualified name so that this table imports no diffusers, and the exact
class only (a subclass may have a forward of its own). Each row says why the class's forward does not export
and why its form is the same function.

| class | exporters | why its own forward fails | the form |
|---|---|---|---|
| diffusers' HiDream ``MOEFeedForwardSwiGLU`` | both | its ``moe_infer`` sorts the tokens by expert and runs each expert on its own tokens, with sizes read from the data (``bincount().cpu().numpy()``): torch.export refuses (".numpy() is not supported for tensor subclasses"); TorchScript's trace would keep the example input's routing as constants | dense routing (``_dense_moe``) |
| ``torch.nn.RMSNorm`` | TorchScript | TorchScript has no ONNX symbolic for ``aten::rms_norm`` below opset 23 | the norm written out (``_rms_norm``) |
| diffusers' HiDream ``HiDreamImageEmbedND`` | TorchScript | its ``rope`` takes ``einsum`` of float32 positions and float64 frequencies; TorchScript writes the Einsum with both, which ONNX refuses ("Inputs has inconsistent type") | the positions cast to the frequencies' dtype first (``_hidream_rope``) |

**Dense routing** runs every routed expert on every token and weights expert ``i``'s output by
``w_i = sum_k topk_weight_k [topk_idx_k == i]``: the gate's weight where the gate picked ``i``, 0 where it did not.
That is ``moe_infer``'s sum (each token's picked experts, each times its gate weight, added in expert order from
zero, plus the shared experts), each unpicked expert adding an exact 0; the two differ only by the rounding of a
matmul over more rows (and where an unpicked expert's output were inf or NaN, which 0 would not cancel). Its
cost: ``num_routed_experts / num_activated_experts`` times the routed experts' multiply-accumulates (HiDream-I1:
4 / 2 = 2x), each expert a static matmul the NPU takes.

**HiDream's positions cast first**: torch's einsum promotes the float32 positions to float64 before it
multiplies, exactly as the cast does; the form calls diffusers' own ``rope`` (from the class's module) on the cast
positions, so it computes what the class does, bit for bit.

**The RMS norm written out** is ATen's own composite ``rms_norm``: ``x * rsqrt(mean(x^2) + eps)`` over the
normalized axes, in float32 for a half input (ATen's ``opmath``), cast back, times the weight; ``eps`` None is the
dtype's epsilon, as ATen takes it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)


def _dense_moe(self: Any, x: torch.Tensor) -> torch.Tensor:
    """HiDream's ``MOEFeedForwardSwiGLU.forward`` with every routed expert run on every token (see above)."""
    topk_idx, topk_weight, _ = self.gate(x)  # [T, k] each
    flat = x.reshape(-1, x.shape[-1])
    experts = torch.arange(len(self.experts), device=x.device)
    picked = (topk_idx.unsqueeze(-1) == experts).to(topk_weight.dtype)  # [T, k, E]
    weights = (topk_weight.unsqueeze(-1) * picked).sum(dim=1)  # [T, E]: w_i per token
    y = torch.zeros_like(flat)
    for i, expert in enumerate(self.experts):
        y = y + expert(flat) * weights[:, i:i + 1].to(flat.dtype)
    return y.view(*x.shape) + self.shared_experts(x)


def _rms_norm(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``torch.nn.RMSNorm.forward`` in the ops of ATen's composite ``rms_norm`` (see above)."""
    axes = tuple(range(-len(self.normalized_shape), 0))
    eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
    up = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    y = (up * torch.rsqrt(up.pow(2).mean(axes, keepdim=True) + eps)).type_as(x)
    return y * self.weight if self.weight is not None else y


def _hidream_rope(self: Any, ids: torch.Tensor) -> torch.Tensor:
    """``HiDreamImageEmbedND.forward`` with each axis' positions cast to the frequencies' dtype (see above)."""
    module = sys.modules[type(self).__module__]  # diffusers' own rope and dtype rule, not a copy
    dtype = module.maybe_adjust_dtype_for_device(torch.float64, ids.device)
    emb = torch.cat([module.rope(ids[..., i].to(dtype), self.axes_dim[i], self.theta) for i in range(ids.shape[-1])],
                    dim=-3)
    return emb.unsqueeze(2)


@dataclass(frozen=True)
class Form:
    """One row of the table: the class (``module.QualName``), the exporters that need the form, the form."""

    cls: str
    exporters: tuple[str, ...]
    forward: Callable[..., Any]


FORMS: tuple[Form, ...] = (
    Form("diffusers.models.transformers.transformer_hidream_image.MOEFeedForwardSwiGLU", ("dynamo", "torchscript"),
         _dense_moe),
    Form("torch.nn.modules.normalization.RMSNorm", ("torchscript",), _rms_norm),
    Form("diffusers.models.transformers.transformer_hidream_image.HiDreamImageEmbedND", ("torchscript",),
         _hidream_rope),
)


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def forms_for(module: Any, exporter: str) -> dict[str, int]:
    """The forms ``export_forms`` would put on ``module``'s submodules: class name -> how many submodules."""
    by_class = {f.cls for f in FORMS if exporter in f.exporters}
    found: dict[str, int] = {}
    for sub in module.modules():
        name = _qualified(type(sub))
        if name in by_class:
            found[name] = found.get(name, 0) + 1
    return found


@contextlib.contextmanager
def export_forms(module: Any, exporter: str) -> Iterator[dict[str, int]]:
    """Every submodule of a class in ``FORMS`` (for ``exporter``) runs its form inside; yields what
    ``forms_for`` says. Each submodule's forward is put back on exit."""
    by_class = {f.cls: f for f in FORMS if exporter in f.exporters}
    put: list[tuple[Any, Any]] = []  # (submodule, its own instance forward or None)
    try:
        for sub in module.modules():
            form = by_class.get(_qualified(type(sub)))
            if form is not None:
                put.append((sub, sub.__dict__.get("forward")))
                sub.forward = types.MethodType(form.forward, sub)
        used = forms_for(module, exporter)
        for name, n in sorted(used.items()):
            log.info("exporting %d %s in its export form (sdnpu.convert.exportforms)", n, name.rsplit(".", 1)[-1])
        yield used
    finally:
        for sub, own in put:
            if own is None:
                del sub.forward
            else:
                sub.forward = own
