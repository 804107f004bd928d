"""`sdnpu lora apply` on a converted folder: time and peak memory, the two namings, stacking, removal.

    python bench/bench_lora.py [--models models/sdxl-base] [--rank 32] [--out DIR] [--cold]

Without --models, tiny-sdxl is converted (UNet and text encoders) into a temporary folder first.
--cold drops the page cache before each command (root only), so the base weights come from the disk.

Writes seeded rank-R LoRAs in the real SDXL key layout (``sdnpu.lora.seeded``: every attention and
feed-forward projection of the UNet and both text encoders), in diffusers and in kohya naming, then, each
`sdnpu lora apply` in its own process (wall time and that process's peak RSS, from wait4):

- apply the diffusers file; against the UNet's bf16 weight bytes (its dd/replaced.onnx.data);
- apply the kohya file: the overlay must be byte-identical to the diffusers file's;
- apply three LoRAs stacked;
- remove: every file of the folder must hash as before the first apply.

Prints one table; the folder is left as it was found (it must have no LoRA applied to begin with).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

COMPONENTS = ("unet", "text_encoder", "text_encoder_2")


def _digest(folder: Path) -> dict[str, str]:
    out = {}
    for comp in COMPONENTS:
        for path in sorted((folder / comp).rglob("*")):
            if path.is_file():
                h = hashlib.sha256()
                with open(path, "rb") as f:
                    while chunk := f.read(1 << 24):
                        h.update(chunk)
                out[str(path.relative_to(folder))] = h.hexdigest()
    return out


def _run(args: list[str], cold: bool = False) -> tuple[float, int]:
    """Wall seconds and peak RSS bytes of one sdnpu command (this process stays small: a child's peak
    counts what its parent held when it forked)."""
    exe = Path(sys.executable).with_name("sdnpu")
    if cold:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    start = time.perf_counter()
    proc = subprocess.Popen([str(exe), "-q", *args], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"sdnpu {' '.join(args)} failed")
    return seconds, usage.ru_maxrss * 1024


def _bf16_bytes(model: Path) -> int:
    """The bf16 weight bytes of a dispatch model (read from its protobuf, without the data)."""
    import onnx

    graph = onnx.load(str(model), load_external_data=False).graph
    return sum(2 * int(np.prod(t.dims)) for t in graph.initializer if t.data_type == onnx.TensorProto.BFLOAT16)


def _overlay_hash(folder: Path) -> str:
    h = hashlib.sha256()
    for comp in COMPONENTS:
        data = folder / comp / "dd" / "lora" / "weights.data"
        if data.is_file():
            with open(data, "rb") as f:  # in chunks: this process must stay small (see _run)
                while chunk := f.read(1 << 24):
                    h.update(chunk)
    return h.hexdigest()


def _write_loras(folder: Path, work: Path, rank: int) -> dict[str, Path]:
    """(In a child process: building skeletons and drawing weights would grow this one.)"""
    files = {"diffusers": work / f"seeded-r{rank}-diffusers.safetensors",
             "kohya": work / f"seeded-r{rank}-kohya.safetensors",
             "s1": work / f"seeded-r{rank}-s1.safetensors", "s2": work / f"seeded-r{rank}-s2.safetensors"}
    code = ("import sys; from pathlib import Path; from sdnpu.lora.seeded import write_seeded_lora as w; "
            "f, work, r = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]); "
            "print('modules per component:', w(f, work / f'seeded-r{r}-diffusers.safetensors', rank=r)); "
            "w(f, work / f'seeded-r{r}-kohya.safetensors', rank=r, naming='kohya'); "
            "[w(f, work / f'seeded-r{r}-s{s}.safetensors', rank=r, seed=s) for s in (1, 2)]")
    subprocess.run([sys.executable, "-c", code, str(folder), str(work), str(rank)], check=True)
    return files


def compare_stacked_with_sum(folder: Path, files: list[Path], scales: list[float], work: Path) -> str:
    """(In a child process.) Apply the three LoRAs stacked, set the overlays aside, apply one LoRA holding
    their sum, and compare every replaced weight: bf16 steps apart, and how many values differ."""
    import ml_dtypes

    from sdnpu.formats.overlay import overlay_initializers
    from sdnpu.lora import LoraSpec, overlay
    from sdnpu.lora.seeded import write_summed_lora

    total = work / "sum.safetensors"
    write_summed_lora(files, scales, total)
    overlay.apply(folder, [LoraSpec(f, sc) for f, sc in zip(files, scales, strict=True)])
    aside = {}
    for comp in COMPONENTS:
        if (folder / comp / "dd" / "lora").is_dir():
            aside[comp] = work / f"stacked-{comp}"
            shutil.move(folder / comp / "dd" / "lora", aside[comp])
    overlay.apply(folder, [LoraSpec(total)])
    lines = []
    for comp, stacked_dir in aside.items():
        summed, manifest = overlay_initializers(folder / comp / "dd")
        stacked = json.loads((stacked_dir / "lora.json").read_text())
        raw = np.memmap(stacked_dir / "weights.data", dtype=np.uint8, mode="r")
        values = differing = 0
        worst = 0.0
        for name, t in stacked["tensors"].items():
            got = raw[t["offset"]:t["offset"] + t["length"]].view(ml_dtypes.bfloat16).astype(np.float32)
            want = np.asarray(summed[name]).reshape(-1).astype(np.float32)
            ulp = np.maximum(np.abs(want), np.abs(got)) * 2.0 ** -7 + 1e-6 * np.abs(want).max()
            worst = max(worst, float(np.max(np.abs(got - want) / ulp)))
            values += want.size
            differing += int(np.count_nonzero(got != want))
        lines.append(f"{comp}: {len(stacked['tensors'])} weights, {differing:,} of {values:,} values differ "
                     f"({100 * differing / values:.4f}%), at most {worst:.2f} bf16 steps (at the larger value)")
        shutil.rmtree(stacked_dir)
    overlay.remove(folder)
    return "; ".join(lines)


def main() -> None:
    from bench_export import write_section

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=None, help="a converted folder (default: tiny-sdxl, converted now)")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--out", default=None, help="where the LoRA files go (default: a temporary folder)")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each command (root)")
    args = p.parse_args()
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="sdnpu-lora-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.models is None:
        folder = work / "tiny-sdxl"
        subprocess.run([str(Path(sys.executable).with_name("sdnpu")), "-q", "convert", "--source", "tiny-sdxl",
                        "--model", "unet,text_encoder,text_encoder_2", "--out", str(folder)], check=True,
                       stdout=subprocess.DEVNULL)
    else:
        folder = Path(args.models)
        if not (folder / "unet" / "dd" / "weights.json").is_file():
            raise SystemExit(f"{folder} has no compiled UNet with a weight record: make convert MODEL=all first")
    if any((folder / comp / "dd" / "lora").is_dir() for comp in COMPONENTS):
        raise SystemExit(f"{folder} has LoRAs applied: `sdnpu lora remove {folder}` first (the benchmark "
                         "checks that remove returns the folder to its bytes from before)")
    start = time.perf_counter()
    files = _write_loras(folder, work, args.rank)
    written = time.perf_counter() - start
    before = _digest(folder)
    unet_bf16 = _bf16_bytes(folder / "unet" / "dd" / "replaced.onnx")
    rows = []
    s, rss = _run(["lora", "apply", str(folder), "--lora", str(files["diffusers"])], args.cold)
    rows.append(("apply (diffusers naming)", s, rss))
    diffusers_overlay = _overlay_hash(folder)
    s, rss = _run(["lora", "apply", str(folder), "--lora", str(files["kohya"])], args.cold)
    rows.append(("apply (kohya naming)", s, rss))
    same = _overlay_hash(folder) == diffusers_overlay
    s, rss = _run(["lora", "apply", str(folder), "--lora", f"{files['diffusers']}:0.5", "--lora",
                   f"{files['s1']}:0.5", "--lora", f"{files['s2']}:0.5"], args.cold)
    rows.append(("apply (3 stacked)", s, rss))
    s, rss = _run(["lora", "remove", str(folder)], args.cold)
    rows.append(("remove", s, rss))
    after = _digest(folder)
    code = ("import sys, json; sys.path.insert(0, sys.argv[1]); from pathlib import Path; import bench_lora as b; "
            "print(b.compare_stacked_with_sum(Path(sys.argv[2]), [Path(p) for p in sys.argv[3:6]], [0.5, 0.5, 0.5], "
            "Path(sys.argv[6])))")
    stacking = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(folder),
                               str(files["diffusers"]), str(files["s1"]), str(files["s2"]), str(work)],
                              check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    name = folder.name if args.models else "tiny-sdxl"
    lines = [f"Seeded rank-{args.rank} LoRAs over every attention and feed-forward projection of the UNet and "
             f"both text encoders (`sdnpu.lora.seeded`, written in {written:.1f} s); each command in its own "
             f"process, peak RSS from wait4; page cache {'dropped before each command' if args.cold else 'warm'}."
             f" UNet bf16 weights: {unet_bf16 / 1e9:.3f} GB.", "",
             "| step | wall s | peak GB | peak / UNet bf16 bytes |", "|---|---|---|---|"]
    lines += [f"| {step} | {s:.1f} | {rss / 1e9:.2f} | {rss / unet_bf16:.2f} |" for step, s, rss in rows]
    lines += ["", f"kohya overlay byte-identical to the diffusers file's: {same}. After `lora remove`, files "
              f"differing from before the first apply: {len(changed)} of {len(before)}"
              + (f" ({', '.join(changed[:5])})" if changed else "") + ".",
              "", f"Three stacked at 0.5 against one LoRA holding their sum (rank {3 * args.rank}): {stacking}."]
    body = "\n".join(lines)
    print(body)
    write_section(f"LoRA apply: {name}{' (cold page cache)' if args.cold else ''}", body)
    if not args.out:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
