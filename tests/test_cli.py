import os
import subprocess
import sys
from pathlib import Path

import pytest

from sdnpu.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["convert", "--source", "tiny-sdxl", "--model", "unte"], "unknown component 'unte'"),
        (["convert", "--source", "no/such/dir"], "neither a preset nor an existing folder"),
        (["convert", "--source", "tiny-sdxl", "--model", "unet", "--res", "100"], "multiple of 32"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(argv, message, capsys, tmp_path):
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "hint:" in err


def test_convert_prints_a_summary(tmp_path, capsys):
    assert main(["-q", "convert", "--source", "tiny-sdxl", "--model", "vae_encoder", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "vae_encoder" in out and "max abs / rel error" in out


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "sdnpu"
    assert script.is_file() and os.access(script, os.X_OK)
    done = subprocess.run([str(script), "--version"], capture_output=True, text=True, check=True)
    assert done.stdout.startswith("sdnpu ")
