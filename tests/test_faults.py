"""Faults: a convert killed at random points, a full or read-only disk, broken inputs.

A fault ends in one clear error (``sdnpu: error: ...`` with a hint, exit code 2, no traceback) or, for a kill,
in nothing at all; either way the previous output is byte for byte as it was, nothing half-written is left
in sight, and the next run succeeds and sweeps what the dead run left.

Covered elsewhere, not repeated here: SIGKILL during the export (test_convert.
test_sigkill_during_export_keeps_previous_output), an exporter crash and a PyTorch mismatch keeping the
previous output (test_convert), the library errors for a model_index.json that lists a missing module and a
preset whose config has an unknown block type (test_sources), staged_dir / recover_staging (test_fileio).

The kill points are random but reproducible: delays and tensor indices come from ``random.Random`` seeded
with SDNPU_FAULT_SEED (default 0), and the assertion messages print them.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from sdnpu.passes.modelfile import EXTERNAL_DATA_ENV
from tests.conftest import once

SEED = int(os.environ.get("SDNPU_FAULT_SEED", "0"))
CONVERT = ["convert", "--source", "tiny-sdxl", "--model", "vae_decoder"]
TIMINGS = ("export.json", "report.json", "onnx_report.txt")  # hold seconds and memory: differ between equal runs

# A real `sdnpu` process that SIGKILLs itself half-way through one tensor of one external-data file: the only
# way to land a kill inside a write that takes a millisecond. argv: FILE_NAME TENSOR_INDEX SDNPU_ARGS...
KILL_WHILE_WRITING = """
import os, signal, sys
from onnx_ir import external_data

target, index = sys.argv[1], int(sys.argv[2])
real_write = external_data._write_tensor_at
seen = 0

def write_then_die(tensor, file, offset):
    global seen
    if os.path.basename(file.name) == target:
        if seen == index:
            data = tensor.tobytes()
            file.seek(offset)
            file.write(data[: len(data) // 2])
            file.flush()
            print(f"fault: SIGKILL half-way through tensor {index} of {file.name}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        seen += 1
    real_write(tensor, file, offset)

external_data._write_tensor_at = write_then_die
from sdnpu.cli import main
sys.exit(main(sys.argv[3:]))
"""

# Runs a command with $1 a fresh tmpfs of $2 KB in a private mount namespace (`unshare -rm`: root, or any
# user where user namespaces are allowed), after copying $4 (if given) to $1/out and, with $5 = 1, making the
# tmpfs read-only; then copies what is on the tmpfs to $3, since the tmpfs goes away with the namespace.
IN_TMPFS = """
mnt=$1 size=$2 keep=$3 seed=$4 ro=$5
shift 5
mount -t tmpfs -o "size=${size}k" sdnpu-faults "$mnt" || exit 97
if [ -n "$seed" ]; then cp -a "$seed" "$mnt/out" || exit 98; fi
if [ "$ro" = 1 ]; then mount -o remount,ro "$mnt" || exit 99; fi
"$@"
rc=$?
cp -a "$mnt/." "$keep/"
exit $rc
"""


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", **extra}


def _external_env() -> dict[str, str]:
    """Tiny models write model.onnx.data and dd/replaced.onnx.data, as full-size ones do."""
    return _env(**{EXTERNAL_DATA_ENV: "0"})


def _sdnpu(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sdnpu", "-q", *args], check=False, capture_output=True,
                          text=True, env=env or _external_env(), timeout=300)


def _in_process(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``sdnpu -q ARGS`` run by this process, where torch is imported already (seconds saved); an exception
    other than the CLI's clear errors fails the test with its traceback."""
    from sdnpu.cli import main

    import logging

    capsys.readouterr()
    # Libraries' own log handlers (diffusers', transformers') keep the stderr of the test that first used
    # them, which pytest has closed since; writing a record there prints "--- Logging error ---" and a
    # traceback that a real `sdnpu` process never shows. Records to such handlers are dropped here.
    raise_exceptions, logging.raiseExceptions = logging.raiseExceptions, False
    try:
        code = main(["-q", *args])
    finally:
        logging.raiseExceptions = raise_exceptions
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, captured.out, captured.err)


def _tree(root: Path, hidden: bool = True) -> dict[str, str]:
    """Every file under ``root`` -> its sha256 (``hidden=False``: outside dot-named entries)."""
    files = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if p.is_file() and (hidden or not any(part.startswith(".") for part in rel.parts)):
            files[rel.as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return files


def _leftovers(root: Path) -> list[str]:
    """Dot-named entries: only an unfinished write leaves them (staging folders, set-aside outputs, temp files;
    onnx_ir's temporary external-data folders live inside the staging folder)."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob(".*"))


def _without_timings(tree: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in tree.items() if Path(k).name not in TIMINGS}


def _kb(root: Path) -> int:
    """What ``root`` takes on a tmpfs, in KB (whole 4 KB pages per file)."""
    return sum(-(-p.stat().st_size // 4096) * 4 for p in root.rglob("*") if p.is_file())


def _assert_clear_error(done: subprocess.CompletedProcess[str], *phrases: str) -> None:
    """Exit code 2, one ``sdnpu: error:`` with a hint, every phrase in it, and no traceback."""
    err = done.stderr
    assert done.returncode == 2, f"exit code {done.returncode}, stderr:\n{err[-4000:]}"
    assert "Traceback" not in err, err[-4000:]
    assert err.count("sdnpu: error: ") == 1 and "\n  hint: " in err, err[-4000:]
    for phrase in phrases:
        assert phrase in err, f"{phrase!r} not in:\n{err[-4000:]}"


@pytest.fixture(scope="module")
def previous(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished `convert` of tiny-sdxl's vae_decoder, weights in external data: the previous output that
    every fault must leave as it was. Tests copy it and never change it."""
    from sdnpu.convert import convert

    def make(out: Path) -> Path:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(EXTERNAL_DATA_ENV, "0")
            convert("tiny-sdxl", "vae_decoder", out=out)
        assert {"vae_decoder/model.onnx.data", "vae_decoder/dd/replaced.onnx.data"} <= set(_tree(out))
        return out

    return once(tmp_path_factory, "previous", make)


@pytest.fixture(scope="module")
def tmpfs(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Skip where this user may not mount a tmpfs in a private namespace (no unshare, no user namespaces)."""
    mnt = tmp_path_factory.mktemp("probe")
    try:
        done = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k probe {mnt}"],
                              check=False, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("needs unshare (util-linux) to mount a small tmpfs")
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {done.stderr.strip()}")


def _in_tmpfs(tmp_path: Path, size_kb: int, seed: Path | None, args: list[str], read_only: bool = False
              ) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Run ``sdnpu ARGS`` (``{out}`` in them: the tmpfs's ``out`` folder) with a tmpfs of ``size_kb`` that
    holds a copy of ``seed`` as ``out``. Returns the run and the folder where the tmpfs's content was kept."""
    mnt, keep = tmp_path / "mnt", tmp_path / "kept"
    mnt.mkdir()
    keep.mkdir()
    argv = [a.replace("{out}", str(mnt / "out")) for a in args]
    done = subprocess.run(["unshare", "-rm", "sh", "-c", IN_TMPFS, "sh", str(mnt), str(size_kb), str(keep),
                           str(seed or ""), "1" if read_only else "0", sys.executable, "-m", "sdnpu", "-q", *argv],
                          check=False, capture_output=True, text=True, env=_external_env(), timeout=300)
    assert done.returncode not in (97, 98, 99), f"tmpfs setup failed: {done.stderr}"
    return done, keep


def _rerun_succeeds_and_sweeps(out: Path, previous: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next run succeeds, leaves no dot-named entry, and writes what the previous run wrote."""
    from sdnpu.convert import convert

    monkeypatch.setenv(EXTERNAL_DATA_ENV, "0")
    result = convert("tiny-sdxl", "vae_decoder", out=out)
    assert result.components[0].report is not None
    assert _leftovers(out) == []
    assert _without_timings(_tree(out)) == _without_timings(_tree(previous))


def _killed_run_left(out: Path, before: dict[str, str], pid: int) -> Path:
    """After the kill: the previous files are byte-identical, and the one new entry is the dead run's
    staging folder (which the next run sweeps). Returns that folder."""
    staging = out / f".vae_decoder.staging-{pid}"
    assert staging.is_dir(), f"the kill did not land while vae_decoder was staged: {sorted(os.listdir(out))}"
    assert _tree(out, hidden=False) == before
    assert _leftovers(out)[0] == staging.name and all(x.startswith(staging.name) for x in _leftovers(out))
    return staging


def test_sigkill_at_a_random_point_of_the_compile_stage(previous: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL at a seeded-random point of a convert's compile stage (as one of its steps begins: the stage,
    the passes, writing dd/replaced.onnx and its data, validating it, the fidelity run; plus up to 50 ms)
    leaves the previous output intact, and the next run succeeds and sweeps the leftovers."""
    out = tmp_path / "out"
    shutil.copytree(previous, out)
    before = _tree(out)
    rng = random.Random(f"{SEED}:compile")
    nth, delay = rng.randrange(5), rng.uniform(0, 0.05)
    stage = "[vae_decoder] compile stage"
    proc = subprocess.Popen([sys.executable, "-m", "sdnpu", *CONVERT, "--out", str(out)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=_external_env())
    watchdog = threading.Timer(300, proc.kill)
    watchdog.start()
    log: list[str] = []
    begun = 0  # steps of the stage begun so far
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            log.append(line)
            if line.startswith(f"{stage} ...") or (begun and line.startswith("[vae_decoder] ")
                                                   and line.rstrip().endswith(" ...")):
                if begun == nth:
                    time.sleep(delay)
                    proc.send_signal(signal.SIGKILL)
                    break
                begun += 1
        log.append(proc.stderr.read())
        proc.wait()
    finally:
        watchdog.cancel()
    text = "".join(log)
    where = f"step {nth} + {1000 * delay:.0f} ms (seed {SEED})"
    assert proc.returncode == -signal.SIGKILL, f"no kill at {where}, exit {proc.returncode}:\n{text[-4000:]}"
    assert f"{stage}: done" not in text, f"the kill at {where} came after the compile stage:\n{text[-4000:]}"
    _killed_run_left(out, before, proc.pid)
    _rerun_succeeds_and_sweeps(out, previous, monkeypatch)


@pytest.mark.parametrize("data_file", ["model.onnx.data", "dd/replaced.onnx.data"])
def test_sigkill_half_way_through_writing_external_data(data_file: str, previous: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL in the middle of a seeded-random tensor of the external-data file (the export's model.onnx.data,
    the compile's dd/replaced.onnx.data): the half-written file stays inside the dead run's staging folder,
    the previous output is intact, and the next run succeeds and sweeps it."""
    import onnx

    name = Path(data_file).name
    full = previous / "vae_decoder" / data_file
    graph = onnx.load(str(full.with_suffix("")), load_external_data=False).graph
    n_tensors = sum(1 for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    index = random.Random(f"{SEED}:{data_file}").randrange(n_tensors)
    out = tmp_path / "out"
    shutil.copytree(previous, out)
    before = _tree(out)
    proc = subprocess.Popen([sys.executable, "-c", KILL_WHILE_WRITING, name, str(index), "-q", *CONVERT,
                             "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=_external_env())
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL and f"half-way through tensor {index} of" in err, err[-4000:]
    staging = _killed_run_left(out, before, proc.pid)
    (half,) = staging.rglob(name)  # onnx_ir's temporary file, inside a dot-named folder of the staging folder
    assert 0 < half.stat().st_size < full.stat().st_size, f"tensor {index} of {n_tensors} (seed {SEED})"
    _rerun_succeeds_and_sweeps(out, previous, monkeypatch)


@pytest.mark.parametrize("command", ["convert", "compile"])
def test_full_disk_is_one_clear_error_and_keeps_the_previous_output(command: str, previous: Path, tmp_path: Path,
                                                                    tmpfs: None) -> None:
    """A disk too small for the job: `convert` refuses before any export (its estimate of the folder's size
    against the free space); `sdnpu compile`, which has no estimate, fills the disk while its external data is
    written and gives "no space left". Both: exit 2, the previous output kept, no half file."""
    seed = tmp_path / "seed"  # the tmpfs's out folder starts as a copy of it
    component = previous / "vae_decoder"
    if command == "convert":
        shutil.copytree(component, seed / "vae_decoder")
        too_big = component / "model.onnx.data"
        args = [*CONVERT, "--out", "{out}"]
    else:
        shutil.copytree(component / "dd", seed / "dd")
        too_big = component / "dd" / "replaced.onnx.data"
        args = ["compile", str(component / "model.onnx"), "--out", "{out}/dd"]
    before = _tree(seed)
    done, kept = _in_tmpfs(tmp_path, _kb(seed) + too_big.stat().st_size // 2048, seed, args)
    if command == "convert":
        _assert_clear_error(done, "vae_decoder need about", "free", "--out DIR")
        assert "exporting" not in done.stderr
    else:
        _assert_clear_error(done, "no space left on the device")
    assert _tree(kept / "out") == before
    assert _leftovers(kept) == []


@pytest.mark.parametrize("command", ["convert", "compile"])
def test_read_only_output_folder_is_one_clear_error(command: str, previous: Path, tmp_path: Path,
                                                    tmpfs: None) -> None:
    """An output folder on a read-only file system: exit 2, "read-only file system", nothing changed there."""
    seed = tmp_path / "seed"
    shutil.copytree(previous / "vae_decoder", seed / "vae_decoder")
    model = previous / "vae_decoder" / "model.onnx"
    args = [*CONVERT, "--out", "{out}"] if command == "convert" else ["compile", str(model), "--out", "{out}/dd"]
    done, kept = _in_tmpfs(tmp_path, 4096, seed, args, read_only=True)
    _assert_clear_error(done, "read-only file system")
    assert _tree(kept / "out") == _tree(seed)


def test_output_folder_without_write_permission_is_one_clear_error(previous: Path, tmp_path: Path) -> None:
    """A chmod 0o555 output folder: exit 2, "permission denied", before any module is loaded. Root ignores
    the mode, so as root the run goes into a user namespace where the file owner (root) is unmapped."""
    out = tmp_path / "out"
    shutil.copytree(previous / "vae_decoder", out / "vae_decoder")
    before = _tree(out)
    out.chmod(0o555)
    argv = [sys.executable, "-m", "sdnpu", *CONVERT, "--out", str(out)]  # with the log: what ran before the error
    if os.geteuid() == 0:
        if shutil.which("unshare") is None:
            pytest.skip("running as root, and no unshare to drop the root's power to ignore file modes")
        argv = ["unshare", "-U", *argv]
    try:
        done = subprocess.run(argv, check=False, capture_output=True, text=True, env=_env(), timeout=300)
    finally:
        out.chmod(0o755)
    if done.returncode != 2 and done.stderr.startswith("unshare:"):
        pytest.skip(f"cannot create a user namespace here: {done.stderr.strip()}")
    _assert_clear_error(done, "permission denied", str(out))
    assert "drawing seeded weights" not in done.stderr  # it failed before loading the module
    assert _tree(out) == before


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: _truncate(d / "model.onnx"), "model.onnx is not a readable ONNX model"),
        (lambda d: (d / "model.onnx").write_bytes(random.Random(SEED).randbytes(20_000)),
         "model.onnx is not a readable ONNX model"),
        (lambda d: (d / "model.onnx.data").unlink(), "keeps its weights in model.onnx.data, which is missing"),
        (lambda d: _truncate(d / "model.onnx.data"), "model.onnx.data is truncated"),
    ],
    ids=["truncated-model", "random-bytes", "missing-external-data", "truncated-external-data"],
)
def test_broken_model_is_one_clear_error_and_writes_nothing(damage: Callable[[Path], object], message: str,
                                                            previous: Path, tmp_path: Path) -> None:
    """`sdnpu compile` on a damaged model: exit 2 and a message naming the damage, and the folder (with the
    previous dd/) exactly as it was: no new dd/, no half file, no staging folder."""
    folder = tmp_path / "vae_decoder"
    shutil.copytree(previous / "vae_decoder", folder)
    damage(folder)
    before = _tree(folder)
    done = _sdnpu("compile", str(folder / "model.onnx"))
    _assert_clear_error(done, message)
    assert _tree(folder) == before


def test_model_index_naming_a_missing_component_fails_before_writing(previous: Path, tmp_path: Path) -> None:
    """A pipeline folder whose model_index.json lists a module with no folder: exit 2 naming it, and the
    output folder untouched (the library error itself: test_sources.test_pipeline_listing_a_missing_module)."""
    from sdnpu.convert.sources import PRESETS_DIR

    source = tmp_path / "my-sdxl"
    shutil.copytree(PRESETS_DIR / "tiny-sdxl", source)
    shutil.rmtree(source / "vae")
    out = tmp_path / "out"
    shutil.copytree(previous, out)
    before = _tree(out)
    done = _sdnpu("convert", "--source", str(source), "--model", "vae_decoder", "--out", str(out), env=_env())
    _assert_clear_error(done, "lists 'vae' (AutoencoderKL)", f"{source / 'vae'}/config.json is missing")
    assert _tree(out) == before


def test_config_with_an_unknown_block_type_fails_before_writing(previous: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A local VAE folder (real weights) whose config.json names a block type diffusers lacks: exit 2 naming
    the block and the folder, the previous output intact, no leftovers."""
    from sdnpu.convert import resolve_source

    vae = tmp_path / "vae"
    resolve_source("tiny-sdxl").load_module("vae").save_pretrained(vae)
    config = json.loads((vae / "config.json").read_text())
    config["down_block_types"][-1] = "MysteryBlock2D"
    (vae / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    shutil.copytree(previous / "vae_decoder", out / "vae_decoder")
    before = _tree(out)
    done = _in_process(capsys, "convert", "--source", str(vae), "--model", "vae_decoder", "--out", str(out))
    _assert_clear_error(done, "MysteryBlock2D", str(vae))
    assert _tree(out) == before
