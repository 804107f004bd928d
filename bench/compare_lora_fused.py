"""An applied LoRA against the same LoRA fused before export: every dispatch-model weight, byte for byte.

    make convert MODEL=unet OUT=/tmp/fused LORA=style.safetensors       # diffusers' fuse_lora, then export
    sdnpu lora apply models/sdxl-base --lora style.safetensors         # the overlay on the base folder
    python bench/compare_lora_fused.py /tmp/fused/unet models/sdxl-base/unet

Reads both dispatch models' initializers (the applied one through its overlay) a tensor at a time, and their
graphs and report summaries; prints what differs. Results go to bench/results.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _initializers(comp: Path) -> tuple[dict[str, tuple], list[tuple[str, str]]]:
    import onnx

    graph = onnx.load(str(comp / "dd" / "replaced.onnx"), load_external_data=False).graph
    out = {}
    for t in graph.initializer:
        info = {e.key: e.value for e in t.external_data}
        out[t.name] = (info.get("location"), int(info.get("offset", 0)), int(info.get("length", 0)), t)
    return out, [(n.op_type, n.domain) for n in graph.node]


def _bytes(comp: Path, entry: tuple) -> bytes:
    from onnx import numpy_helper

    location, offset, length, tensor = entry
    if not location:
        return numpy_helper.to_array(tensor).tobytes()
    with open(comp / "dd" / location, "rb") as f:
        f.seek(offset)
        return f.read(length)


def compare(fused: Path, applied: Path) -> str:
    from sdnpu.formats.overlay import DATA, OVERLAY_DIR, read_manifest

    manifest = read_manifest(applied / "dd")
    if manifest is None:
        raise SystemExit(f"{applied} has no LoRA applied: sdnpu lora apply first")
    ft, fops = _initializers(fused)
    at, aops = _initializers(applied)
    if ft.keys() != at.keys() or fops != aops:
        return "the two dispatch models differ in their graphs"
    same = changed = nbytes = 0
    differ = []
    with open(applied / "dd" / OVERLAY_DIR / DATA, "rb") as overlay:
        for name, entry in ft.items():
            want = _bytes(fused, entry)
            base = _bytes(applied, at[name])
            if name in manifest["tensors"]:
                t = manifest["tensors"][name]
                overlay.seek(t["offset"])
                got = overlay.read(t["length"])
            else:
                got = base
            changed += want != base
            nbytes += len(want)
            if got == want:
                same += 1
            else:
                differ.append(name)
    summaries = [json.loads((c / "dd" / "report.json").read_text())["summary"] for c in (fused, applied)]
    keys = ("offload_rate", "offloaded_nodes", "cpu_nodes", "npu_regions")
    listed = f" ({', '.join(differ[:5])})" if differ else ""
    return (f"{len(fops)} nodes, the same ops in both; initializers: {same} of {len(ft)} byte-identical "
            f"({nbytes / 1e9:.2f} GB compared), {len(differ)} differ{listed}; "
            f"{changed} differ from the base weights, {len(manifest['tensors'])} are in the overlay; offload "
            + ("identical: " if all(summaries[0][k] == summaries[1][k] for k in keys) else "DIFFERS: ")
            + ", ".join(f"{k} {summaries[0][k]:.4g} / {summaries[1][k]:.4g}" for k in keys))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("fused", help="the component folder converted with the LoRA fused")
    p.add_argument("applied", help="the component folder with the LoRA applied")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_export import write_section  # type: ignore[import-not-found]

    line = compare(Path(args.fused), Path(args.applied))
    print(line)
    write_section(f"LoRA applied vs fused at conversion: {Path(args.applied).name}", line)


if __name__ == "__main__":
    main()
