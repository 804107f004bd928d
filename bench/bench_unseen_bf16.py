"""A compiled unseen entry's bf16 error against PyTorch's own bf16 run of the same module, on the entry's inputs
(seed 0) or inputs drawn from other seeds: max abs error and 1 - cosine against the fp32 module, each ours over
PyTorch's (the target: at most 1.2x).

    python bench/bench_unseen_bf16.py NAME DISPATCH.onnx [SEED ...]

NAME is an entry of bench/bench_qnn_unseen.py (built, seeded and perturbed as there); DISPATCH.onnx the dispatch
model ``sdnpu compile`` wrote for its export (out/NAME/amd-xdna2/replaced.onnx); it runs on onnxruntime's CPU
through its reference bodies.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_qnn_unseen as unseen  # noqa: E402
from tests.zoo import seeded  # noqa: E402


def errors(got: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    a, r = got.astype(np.float64).ravel(), ref.astype(np.float64).ravel()
    return float(np.abs(a - r).max()), 1.0 - float(a @ r / np.linalg.norm(a) / np.linalg.norm(r))


def compare(name: str, path: str, seed: int) -> str:
    torch.manual_seed(0)
    module, call, inputs, names = unseen.REGISTRY[name][1]()
    seeded(module)
    if seed:  # other inputs of the same shapes (the sample, latents; a timestep or ids stay as they are)
        g = torch.Generator().manual_seed(seed)
        inputs = tuple(torch.randn(x.shape, generator=g) if x.is_floating_point() and x.dim() >= 3 else x
                       for x in inputs)
    with torch.no_grad():
        ref = unseen.Wrapper(module, call).eval()(*inputs).float().numpy()
        low = [x.to(torch.bfloat16) if x.is_floating_point() else x for x in inputs]
        theirs = unseen.Wrapper(module.to(torch.bfloat16), call).eval()(*low).float().numpy()
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    by_name = dict(zip(names, inputs, strict=True))
    ours = session.run(None, {i.name: by_name[i.name].numpy() for i in session.get_inputs()})[0]
    (oa, oc), (ta, tc) = errors(ours, ref), errors(theirs, ref)
    return (f"{name} seed {seed}: ours max abs {oa:.4g}, 1-cos {oc:.3g}; PyTorch bf16 max abs {ta:.4g}, 1-cos "
            f"{tc:.3g}; ratio {oa / ta:.2f}x, {oc / tc:.2f}x")


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    for seed in [int(s) for s in argv[2:]] or [0]:
        print(compare(argv[0], argv[1], seed), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
