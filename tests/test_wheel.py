"""The package as users install it: a wheel built from the checkout, installed into a fresh virtual environment
(not the editable install the tests run from), compiles a model. An earlier wheel lacked sdnpu.passes.rules
(not listed in pyproject.toml, no __init__.py), so `sdnpu compile` failed on import."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_wheel_installs_and_compiles(tiny_conversion, tmp_path):
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
    # the dependencies come from the test's environment as a plain path entry: its .pth files (the editable
    # sdnpu among them) are not processed there, so the only sdnpu is the wheel's
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True)
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    where = subprocess.run([str(python), "-c", "import sdnpu, sdnpu.passes.rules.conv; print(sdnpu.__file__)"],
                           check=True, capture_output=True, text=True, cwd=tmp_path, env=clean).stdout
    assert where.startswith(str(site)), where
    out = tmp_path / "dd"
    result = subprocess.run([str(env_dir / "bin" / "sdnpu"), "-q", "compile",
                             str(tiny_conversion.out / "vae_decoder" / "model.onnx"), "--out", str(out)],
                            capture_output=True, text=True, cwd=tmp_path, env=clean)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "offload rate" in result.stdout and (out / "replaced.onnx").is_file()
    presets = subprocess.run([str(python), "-c", "from importlib.resources import files; print(sorted(p.name for p in "
                              "files('sdnpu.convert').joinpath('presets').iterdir()))"],
                             check=True, capture_output=True, text=True, cwd=tmp_path, env=clean).stdout
    assert "sdxl-base" in presets and "tiny-sdxl" in presets
