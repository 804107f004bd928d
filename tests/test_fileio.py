import os

import pytest

from sdnpu.fileio import atomic_write_bytes, recover_staging, staged_dir


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path):
    target = tmp_path / "a.json"
    atomic_write_bytes(target, b"one")
    atomic_write_bytes(target, b"two")
    assert target.read_bytes() == b"two"
    assert os.listdir(tmp_path) == ["a.json"]


def test_staged_dir_swaps_in_complete_folder(tmp_path):
    target = tmp_path / "unet"
    target.mkdir()
    (target / "model.onnx").write_bytes(b"old")
    with staged_dir(target) as stage:
        (stage / "model.onnx").write_bytes(b"new")
        assert (target / "model.onnx").read_bytes() == b"old"  # untouched until the end
    assert (target / "model.onnx").read_bytes() == b"new"
    assert sorted(os.listdir(tmp_path)) == ["unet"]


def test_failed_staging_keeps_previous_output(tmp_path):
    target = tmp_path / "unet"
    target.mkdir()
    (target / "model.onnx").write_bytes(b"old")
    with pytest.raises(RuntimeError), staged_dir(target) as stage:
        (stage / "model.onnx").write_bytes(b"half")
        raise RuntimeError("export failed")
    assert (target / "model.onnx").read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["unet"]


def test_recover_staging_sweeps_dead_runs_and_restores_set_aside_output(tmp_path):
    dead_pid = 2**22 + 12345  # above the default pid_max: never a live process
    (tmp_path / f".unet.staging-{dead_pid}").mkdir()
    (tmp_path / f".vae_decoder.old-{dead_pid}").mkdir()  # crash between the two renames of a swap
    (tmp_path / f".vae_decoder.old-{dead_pid}" / "model.onnx").write_bytes(b"previous")
    (tmp_path / f".model_index.json.tmp-{dead_pid}").write_bytes(b"half")
    live = tmp_path / f".text_encoder.staging-{os.getpid()}"
    live.mkdir()
    recover_staging(tmp_path)
    assert sorted(os.listdir(tmp_path)) == [live.name, "vae_decoder"]
    assert (tmp_path / "vae_decoder" / "model.onnx").read_bytes() == b"previous"
