"""A compiled unseen entry (``bench/bench_qnn_unseen.py --target=amd-xdna2``) against PyTorch's own bf16 run: the
dispatch model's error against PyTorch fp32 over PyTorch bf16's, in max abs and in 1 - cosine (the target: at
most 1.2x), on the entry's example inputs; beside them the error of the export with every op's output rounded
to bf16 (``op_by_op``: what bf16 costs the graph where no op keeps fp32, as PyTorch's bf16 run keeps some).

    python bench/bench_unseen_bf16.py NAME OUT/NAME DD [DD ...]
    python bench/bench_unseen_bf16.py --draws=0,2,3 NAME OUT/NAME DD [DD ...]   # also other inputs: draw d > 0
                                                      # redraws the float inputs of rank >= 3 from seed d

OUT/NAME is the entry's folder (its ``test_data_set_0``: the graph's inputs as the bench wrote them); each DD a
compiled folder of its ``model.onnx`` (``replaced.onnx`` inside). The module is built as the bench builds it
(``torch.manual_seed(0)``, the entry's config, the zoo's ``seeded``), so PyTorch's runs are of the exported
module. One JSON line per DD.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import onnx
import torch
from onnx import numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_qnn_unseen import REGISTRY, Wrapper  # noqa: E402 -- the entries, built as the bench builds them
from tests.zoo import seeded  # noqa: E402

from sdnpu.onnxrun import run_onnx  # noqa: E402


def errors(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    a, b = got.astype(np.float64).ravel(), want.astype(np.float64).ravel()
    cos = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    return float(np.abs(a - b).max()), 1.0 - cos


def _rounded_op_by_op(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The export run with its weights, inputs and every node's float output rounded to bf16 (the graph's own
    op-by-op bf16 rounding, ``bench_zoo.py``'s measure): what bf16 costs where no op keeps fp32."""
    import onnxruntime as ort

    from sdnpu.reports.bf16 import rounded, rounded_feeds

    exported = onnx.load(str(path))
    session = ort.InferenceSession(rounded(exported).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, rounded_feeds(exported, feeds))[0]


def main(argv: list[str]) -> int:
    draws = [0]
    if argv and argv[0].startswith("--draws="):
        draws = [int(d) for d in argv[0].partition("=")[2].split(",")]
        argv = argv[1:]
    name, folder, dds = argv[0], Path(argv[1]), [Path(d) for d in argv[2:]]
    data = folder / "test_data_set_0"
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    names = [vi.name for vi in model.graph.input if vi.name not in inits]
    _, build = REGISTRY[name]
    torch.manual_seed(0)
    m, call, inputs, input_names = build()
    seeded(m)
    wrapper = Wrapper(m, call).eval()
    for draw in draws:
        if draw:  # other inputs of the same shapes (the sample, latents; a timestep or ids stay as they are)
            g = torch.Generator().manual_seed(draw)
            drawn = tuple(torch.randn(x.shape, generator=g) if x.is_floating_point() and x.dim() >= 3 else x
                          for x in inputs)
            by_name = dict(zip(input_names, drawn, strict=True))
            feeds = {n: by_name[n].numpy() for n in names}
        else:
            drawn = inputs
            feeds = {n: numpy_helper.to_array(onnx.load_tensor(str(data / f"input_{i}.pb")))
                     for i, n in enumerate(names)}
        with torch.no_grad():
            ref = wrapper(*drawn).float().numpy().copy()
            low = copy.deepcopy(wrapper).to(torch.bfloat16)(*[a.to(torch.bfloat16) if a.is_floating_point() else a
                                                              for a in drawn]).float().numpy()
        m_pt, c_pt = errors(low, ref)
        try:
            m_op, c_op = errors(_rounded_op_by_op(folder / "model.onnx", feeds), ref)
        except Exception as e:  # noqa: BLE001 - onnxruntime refuses the export itself (HunyuanVideo's bool Where)
            print(f"op by op: onnxruntime cannot run the export: {str(e).splitlines()[0][:160]}", file=sys.stderr)
            m_op = c_op = None
        for dd in dds:
            got = next(iter(run_onnx(dd / "replaced.onnx", feeds).values()))
            m_ours, c_ours = errors(got, ref)
            print(json.dumps({"name": name, "dd": str(dd), "draw": draw, "ours_max_abs": m_ours,
                              "torch_bf16_max_abs": m_pt, "ratio_max_abs": m_ours / m_pt, "ours_1mcos": c_ours,
                              "torch_bf16_1mcos": c_pt, "ratio_1mcos": c_ours / c_pt,
                              "op_by_op_max_abs": m_op, "op_by_op_1mcos": c_op}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
