"""Can an onnxruntime run fit? A lower bound of its peak from the graph's static shapes, checked before the
run, so that a run that cannot fit stops with one line naming the tensor and the fix instead of being killed.

    peak >= weights + 2 x the largest activation

The weights are resident, and the op that writes the largest activation holds it beside its input of that
size at least (attention's score matrix [B, H, M, N] beside its softmax). A dispatch op's reference body
computes its attention in fp32 inside the function, so its [B, H, M, N] comes from the op's attributes.
Where even the bound exceeds the memory available, the run is refused; below it, it runs (a bound that
promised more would refuse runs that fit). Measured on sdxl-base at 1024 px against real peaks: UNet fp32
graph 13.0 GB bound, 14.0 GB peak; VAE decoder fp32 2.4 GB bound, 6.4 GB peak (its convolutions at 1024 x 1024
add up); an SD 1.5-style UNet at 128 x 128 latents has scores of 17 GB each, a bound of 35 GB and more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import onnx

from sdnpu.errors import SdnpuError

ACTIVATION_COPIES = 2

_BYTES = {1: 4, 10: 2, 16: 2, 11: 8, 7: 8, 6: 4, 9: 1, 2: 1, 3: 1, 4: 2, 5: 2, 12: 4, 13: 8}  # TensorProto types


@dataclass(frozen=True)
class Estimate:
    bytes: int
    weights: int
    largest: int
    tensor: str  # what the largest activation is, for the message


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def estimate(path: Path) -> Estimate:
    """A lower bound of the peak of running the model at ``path`` (weight file sizes, static shapes)."""
    model = onnx.load(str(path), load_external_data=False)
    weights = path.stat().st_size + sum(f.stat().st_size for f in path.parent.glob(f"{path.name}.data*"))
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception:  # shape inference can refuse odd graphs; estimate from the shapes the file declares
        pass
    largest, tensor = 0, "no activation"
    initializers = {t.name for t in model.graph.initializer}
    for vi in [*model.graph.value_info, *model.graph.output]:
        if vi.name in initializers:
            continue
        dims = vi.type.tensor_type.shape.dim
        if not dims or any(not d.HasField("dim_value") for d in dims):
            continue
        shape = [d.dim_value for d in dims]
        size = math.prod(shape) * _BYTES.get(vi.type.tensor_type.elem_type, 4)
        if size > largest:
            largest, tensor = size, f"{vi.name} {shape}"
    for node in model.graph.node:  # attention inside a dispatch op's body: [B, H, M, N] fp32 scores
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if "MHA" in node.op_type and "input_shape" in attrs and "num_heads" in attrs:
            b, m, _, n = attrs["input_shape"]
            size = b * int(attrs["num_heads"]) * m * n * 4
            if size > largest:
                largest = size
                tensor = f"the attention scores of {node.name or node.op_type} [{b}, {attrs['num_heads']}, {m}, {n}]"
    return Estimate(weights + ACTIVATION_COPIES * largest, weights, largest, tensor)


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def check_fits(path: Path, what: str, hint: str) -> Estimate:
    """Raise an SdnpuError (one line and ``hint``) where running the model at ``path`` for ``what`` would not
    fit in the memory available now; return the estimate otherwise."""
    est = estimate(path)
    available = available_bytes()
    if available is not None and est.bytes > available:
        raise SdnpuError(f"{what} needs at least {_gb(est.bytes)} ({_gb(est.weights)} of weights and "
                         f"{ACTIVATION_COPIES} x {_gb(est.largest)} for {est.tensor}); {_gb(available)} is available",
                         hint=hint)
    return est
