"""The package as users install it: a wheel built from the checkout, installed into a fresh virtual environment
(not the editable install the tests run from) that sees only what the wheel declares, converts a preset and
draws from it, run from another directory.

Earlier wheels failed twice this way: one lacked sdnpu.passes.rules (not listed in pyproject.toml), so `sdnpu
compile` failed on import; one converted all five components of tiny-sdxl and then stopped, because CLIP's
merges came from a package only `make venv` installed."""

from __future__ import annotations

import email.parser
import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent


def _declared(wheel: Path) -> list[Requirement]:
    """The wheel's own Requires-Dist (no extras)."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        meta = email.parser.Parser().parsestr(z.read(name).decode())
    reqs = [Requirement(r) for r in meta.get_all("Requires-Dist") or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def _closure(requirements: list[Requirement]) -> dict[str, metadata.Distribution]:
    """Every installed distribution the requirements reach (with the extras they ask for), by name. A
    requirement this environment does not satisfy fails the test: the wheel would not install here."""
    found: dict[str, metadata.Distribution] = {}
    todo = [(r, frozenset(r.extras)) for r in requirements]
    while todo:
        req, extras = todo.pop()
        key = canonicalize_name(req.name)
        if key in found and not extras:
            continue
        dist = metadata.distribution(req.name)
        assert req.specifier.contains(dist.version, prereleases=True), f"{req} but {dist.version} is installed"
        found[key] = dist
        for sub in dist.requires or []:
            r = Requirement(sub)
            wanted = [{"extra": e} for e in extras] or [{"extra": ""}]
            if r.marker is None or any(r.marker.evaluate(env) for env in wanted):
                todo.append((r, frozenset(r.extras)))
    return found


def _site_of(dists: dict[str, metadata.Distribution], into: Path) -> None:
    """A site directory holding only ``dists``: each one's top-level files and folders, linked."""
    into.mkdir()
    for dist in dists.values():
        base = Path(dist.locate_file(""))
        for top in {Path(str(f)).parts[0] for f in dist.files or []}:
            src = base / top
            if top != ".." and src.exists() and not (into / top).exists():
                (into / top).symlink_to(src)


@pytest.mark.slow
def test_the_wheel_installs_alone_converts_and_draws(tmp_path):
    # built from a copy: setuptools leaves build/ in the tree it builds, and a stale build/lib would put
    # modules deleted since into the next wheel
    tree = tmp_path / "tree"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".git", ".venv", "build", "models", "__pycache__",
                                                              "*.egg-info", "out", "fuzz-failures", ".pytest_cache"))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(tree)], check=True, capture_output=True, cwd=tmp_path)
    wheel = next(wheels.glob("sdnpu-*.whl"))
    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # the declared dependencies, and nothing else, from the test's environment (no hub, no download here)
    deps = _closure(_declared(wheel))
    assert "sdnpu" not in deps and "open-clip-torch" not in deps
    _site_of(deps, tmp_path / "deps")
    (site / "deps.pth").write_text(str(tmp_path / "deps") + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    clean["HF_HUB_OFFLINE"] = "1"

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), capture_output=True, text=True, cwd=elsewhere, env=clean)

    probe = run(str(python), "-c", "import importlib.util, sdnpu, sdnpu.passes.rules.conv; "
                "print(sdnpu.__file__, importlib.util.find_spec('open_clip'))")
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.startswith(str(site)) and probe.stdout.split()[-1] == "None", probe.stdout
    sdnpu = str(env_dir / "bin" / "sdnpu")
    converted = run(sdnpu, "-q", "convert", "--source", "tiny-sdxl", "--model", "all", "--out", "tiny")
    assert converted.returncode == 0, converted.stderr[-2000:]
    assert (elsewhere / "tiny" / "tokenizer_2" / "merges.txt").is_file()
    drawn = run(sdnpu, "generate", "--models", "tiny", "--prompt", "a cat", "--steps", "1", "--out", "cat.png")
    assert drawn.returncode == 0, drawn.stderr[-2000:]
    assert (elsewhere / "cat.png").is_file() and "wrote cat.png" in drawn.stdout
    compiled = run(sdnpu, "-q", "compile", "tiny/vae_decoder/model.onnx", "--out", "dd")
    assert compiled.returncode == 0, compiled.stderr[-2000:]
    assert "offload rate" in compiled.stdout and (elsewhere / "dd" / "replaced.onnx").is_file()
