"""Qwen-Image's transformer block by block, what can be measured without a full-size run:

    python bench/bench_qwen_blocks.py --params qwen-image          # parameters per piece, on the meta device
    python bench/bench_qwen_blocks.py --layers 2,3,4 --out DIR      # offload counts as the blocks grow (tiny size)

``--params``: the preset's transformer built on the meta device (no memory for weights): its parameters, those of a
block, of the first and last pieces (``sdnpu.convert.blockwise.qwenimage``), the disk the conversion's check asks
for with and without ``--dispatch-only``. ``--layers``: tiny-qwen-image's transformer with L blocks (seeded,
written by ``save_pretrained`` into a folder beside the preset's other files), converted whole and block by block
at 64 px; one JSON line each with the dispatch ops, CPU nodes, offload, MACs and regions, so that the counts per
block can be read off and carried to the full model's 60 (an estimate: shape limits at full width are not in it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def params(preset: str) -> None:
    import diffusers
    import torch

    from sdnpu import families
    from sdnpu.convert import budget
    from sdnpu.convert.blockwise import qwenimage
    from sdnpu.convert.sources import PRESETS_DIR

    index = json.loads((PRESETS_DIR / preset / "model_index.json").read_text())
    model_class = getattr(diffusers, families.detect(index).denoiser_class)  # the family's row names the class

    config = json.loads((PRESETS_DIR / preset / "transformer" / "config.json").read_text())
    with torch.device("meta"):
        model = model_class.from_config(config)

    def n(name: str) -> int:
        return sum(p.numel() for p in model.get_submodule(name).parameters())

    total = sum(p.numel() for p in model.parameters())
    block = n("transformer_blocks.0")
    first, last = block + sum(map(n, qwenimage.FIRST)), block + sum(map(n, qwenimage.LAST))
    print(json.dumps({"preset": preset, "parameters": total, "fp32_gb": round(4 * total / 1e9, 2),
                      "pieces": int(config["num_layers"]), "block": block, "first_piece": first, "last_piece": last,
                      "disk_check_gb": round(budget.DISK_SHARE * 4 * total / 1e9, 1),
                      "disk_check_dispatch_only_gb": round(budget.DISPATCH_ONLY_DISK_SHARE * 4 * total / 1e9, 1)}))


def layers(counts: list[int], out: Path) -> None:
    import diffusers
    import torch

    from sdnpu import families
    from sdnpu.convert import convert
    from sdnpu.convert.sources import PRESETS_DIR

    index = json.loads((PRESETS_DIR / "tiny-qwen-image" / "model_index.json").read_text())
    model_class = getattr(diffusers, families.detect(index).denoiser_class)  # the family's row names the class

    for blocks in counts:
        folder = out / f"tiny-qwen-image-{blocks}"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(PRESETS_DIR / "tiny-qwen-image", folder)
        config = json.loads((folder / "transformer" / "config.json").read_text())
        config["num_layers"] = blocks
        torch.manual_seed(0)
        model_class.from_config(config).save_pretrained(folder / "transformer")
        for mode, kw in (("whole", {}), ("blocks", {"blockwise": True})):
            done = convert(folder, "transformer", out=out / f"out-{mode}-{blocks}", res=64, **kw)
            report = json.loads((done.out / "transformer" / "dd" / "report.json").read_text())
            s = report["summary"]
            print(json.dumps({"blocks": blocks, "mode": mode, "dispatch": s["offloaded_nodes"], "cpu": s["cpu_nodes"],
                              "offload": round(100 * s["offload_rate"], 2), "macs": s["macs_offloaded_share"],
                              "regions": s["npu_regions"], "transitions": s["transitions"],
                              "cpu_ops": sorted(n["op_type"] for n in report["cpu_nodes"])}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", metavar="PRESET", help="parameters per piece of PRESET's transformer")
    ap.add_argument("--layers", help="block counts, comma-separated: tiny-qwen-image with that many blocks")
    ap.add_argument("--out", type=Path, help="a work folder for --layers")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.params:
        params(args.params)
    if args.layers:
        if args.out is None:
            ap.error("--layers needs --out")
        layers([int(x) for x in args.layers.split(",")], args.out)


if __name__ == "__main__":
    main()
