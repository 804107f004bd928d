"""AMD's loading format written for a converted folder's dispatch models, measured: per component its
DynamicDispatch nodes, the ops inside them, the nodes left on the CPU, the constant files' bytes, the time
and the peak memory of writing it, and a round trip: the package read back as DD reads it
(``ddpackage.unpackage``) compared with the dispatch model op for op (type, arguments, attributes) and
constant for constant (bytes). The weights are packaged as the dispatch model stores them (AMD's packer,
which ``sdnpu pack`` runs first, is not installed here), so this measures the format, not AMD's blobs.

    python bench/bench_package.py --models /work/runs/sdxl-full [--components unet,vae_decoder] [--out DIR]
"""

from __future__ import annotations

import argparse
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _compare(dispatch, back) -> tuple[int, int]:
    """(ops compared, constants compared); raises on the first difference."""
    import onnx
    from onnx import numpy_helper

    def ops(model):
        return {n.name: n for n in model.graph.node if n.domain == "com.amd" and n.op_type != "CastAvx"}

    want, got = ops(dispatch), ops(back)
    if set(want) != set(got):
        raise SystemExit(f"ops differ: {sorted(set(want) ^ set(got))[:5]}")
    inits = {t.name: t for t in dispatch.graph.initializer}
    back_inits = {t.name: t for t in back.graph.initializer}
    consts = 0
    for name, n in want.items():
        m = got[name]
        if (n.op_type, list(n.input), list(n.output)) != (m.op_type, list(m.input), list(m.output)):
            raise SystemExit(f"{name}: arguments differ")
        a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
        b = {x.name: onnx.helper.get_attribute_value(x) for x in m.attribute}
        if a != b:
            raise SystemExit(f"{name}: attributes differ: {a} vs {b}")
        for x in n.input:
            if x in inits:
                if numpy_helper.to_array(inits[x]).tobytes() != numpy_helper.to_array(back_inits[x]).tobytes():
                    raise SystemExit(f"{name}: constant {x} differs")
                consts += 1
    return len(want), consts


def main() -> int:
    import onnx

    from sdnpu.runtime import ddpackage
    from sdnpu.runtime.pack import _family, _height

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", required=True, help="a converted folder")
    ap.add_argument("--components", default="unet,transformer,vae_decoder,vae_encoder")
    ap.add_argument("--out", default=None, help="where to write the packages (default: a temporary folder)")
    args = ap.parse_args()
    folder = Path(args.models)
    family = _family(folder)
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="sdnpu-package-"))
    print(f"{'component':<14}{'class':<12}{'DD nodes':>9}{'ops':>6}{'CPU':>5}{'const GB':>9}{'write s':>8}"
          f"{'peak GB':>8}  round trip")
    for comp in args.components.split(","):
        src = folder / comp / "dd" / "replaced.onnx"
        if not src.is_file():
            continue
        kernels = ddpackage.kernels_for(family, comp, _height(src, comp))
        if isinstance(kernels, str):
            print(f"{comp:<14}not packaged: {kernels}")
            continue
        out = root / comp
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        t = time.perf_counter()
        model = onnx.load(str(src))
        result = ddpackage.package_model(model, out, src.name, kernels)
        onnx.save(model, str(out / src.name))
        seconds = time.perf_counter() - t
        del model
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        onnx.checker.check_model(str(out / src.name), full_check=True)
        back = ddpackage.unpackage(out / src.name)
        ops, consts = _compare(onnx.load(str(src)), back)
        print(f"{comp:<14}{kernels.model_type:<12}{len(result.nodes):>9}{sum(result.nodes.values()):>6}"
              f"{result.cpu_nodes:>5}{result.const_bytes / 1e9:>9.2f}{seconds:>8.1f}{peak / 1e9:>8.2f}  "
              f"{ops} ops and {consts} constants equal")
    print(f"packages in {root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
