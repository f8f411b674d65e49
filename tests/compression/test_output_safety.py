"""Hardening (issue 11, data loss): squeeze deletes only what an old manifest lists, swaps atomically, and
recovers from a kill at any step; output checks (writable, context length) come before any work."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import squeeze.compression.output as output_module
import squeeze.compression.workarea as workarea
from squeeze import api
from squeeze.cli.app import app
from squeeze.cli.compress import resume_command
from squeeze.compression import calibrate_kv as calibrate_kv_module
from squeeze.compression import sensitivity
from squeeze.compression.output import check_output_dir, foreign_entries, remove_owned
from squeeze.compression.pipelines import plain
from squeeze.compression.workarea import WORK_NAME
from squeeze.errors import ConfigError, Interrupted
from squeeze.format import swap
from squeeze.format.manifest import MANIFEST_NAME

runner = CliRunner()
CALIB = ["--num-samples", "2", "--seq-len", "32"]


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every regular file below ``directory`` (hidden ones too), by relative path."""
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def user_directory(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "thesis.txt").write_text("four years of work")
    (path / "sub").mkdir()
    (path / "sub" / "photo.jpg").write_bytes(b"\xff\xd8 jpeg")
    (path / ".env").write_text("TOKEN=secret")
    return path


def compress(stories_dir: Path, out: Path, *extra: str):
    return runner.invoke(app, ["compress", str(stories_dir), "-o", str(out), "--recipe", "rtn-w4", "--json", *extra])


@pytest.fixture(scope="module")
def rtn_artifact(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("safety") / "rtn"
    api.compress(str(stories_dir), out, recipe="rtn-w4", overrides={"output.max_shard_size": "20KB"})
    return out


@pytest.fixture
def model_copy(tmp_path: Path, stories_dir: Path) -> Path:
    return Path(shutil.copytree(stories_dir, tmp_path / "model"))


# -- 1. --overwrite never deletes what squeeze did not write


def test_overwrite_refuses_a_directory_of_user_files(tmp_path, stories_dir):
    out = user_directory(tmp_path / "home")
    before = snapshot(out)
    result = compress(stories_dir, out, "--overwrite")
    assert result.exit_code == 2, result.output
    assert "no squeeze manifest" in result.stderr and "thesis.txt" in result.stderr and "sub/" in result.stderr
    assert snapshot(out) == before and sorted(p.name for p in out.iterdir()) == [".env", "sub", "thesis.txt"]


def test_overwrite_of_the_working_directory_is_refused(tmp_path, stories_dir, monkeypatch):
    home = user_directory(tmp_path / "cwd")
    before = snapshot(home)
    monkeypatch.chdir(home)
    result = compress(stories_dir, Path("."), "--overwrite")
    assert result.exit_code == 2 and snapshot(home) == before


@pytest.mark.parametrize("where", ["same", "inside", "ancestor"])
def test_output_over_the_model_is_refused_even_with_overwrite(model_copy, where):
    out = {"same": model_copy, "inside": model_copy / "w4", "ancestor": model_copy.parent}[where]
    before = snapshot(model_copy)
    result = compress(model_copy, out, "--overwrite")
    assert result.exit_code == 2, result.output
    assert "never writes over its input" in result.stderr
    assert snapshot(model_copy) == before and not (model_copy / "w4").exists()


def test_overwrite_replaces_only_the_files_the_old_manifest_lists(tmp_path, stories_dir, rtn_artifact):
    out = tmp_path / "out"
    shutil.copytree(rtn_artifact, out)
    old_shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(old_shards) > 2
    (out / "notes.txt").write_text("mine")
    refused = compress(stories_dir, out, "--overwrite")
    assert refused.exit_code == 2 and "files squeeze did not write" in refused.stderr and "notes.txt" in refused.stderr
    assert api.verify_model_integrity.__name__ and (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    assert api.verify_model_integrity(out).ok  # the refusal touched nothing
    result = compress(stories_dir, out, "--overwrite")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.glob("model-*.safetensors")) == ["model-00001-of-00001.safetensors"]
    assert api.verify_model_integrity(out).ok


def test_a_file_that_appears_during_the_run_is_never_overwritten_or_deleted(tmp_path, stories_dir, rtn_artifact):
    out = tmp_path / "out"
    shutil.copytree(rtn_artifact, out)
    before = snapshot(out)

    def meddle(stage, done, total):
        if stage == "quantize" and done == total:
            (out / "config.json.orig").write_text("the user's")

    with pytest.raises(ConfigError) as caught:
        api.compress(str(stories_dir), out, "rtn-w4", overwrite=True, progress=meddle)
    assert "config.json.orig" in caught.value.hint
    assert {k: v for k, v in snapshot(out).items() if not k.startswith(WORK_NAME)} == {
        **before,
        "config.json.orig": b"the user's",
    }
    (out / "config.json.orig").unlink()
    api.compress(str(stories_dir), out, "rtn-w4", overwrite=True)  # resumes from the checkpoints
    assert api.verify_model_integrity(out).ok and not (out / WORK_NAME).exists()


def test_calibrate_kv_overwrite_refuses_user_files_and_the_model(tmp_path, rtn_artifact, model_copy, tinystories_file):
    home = user_directory(tmp_path / "home")
    before = snapshot(home)
    args = ["calibrate-kv", str(rtn_artifact), "-c", str(tinystories_file), *CALIB, "--overwrite", "--json"]
    result = runner.invoke(app, [*args, "--output", str(home)])
    assert result.exit_code == 2 and "no squeeze manifest" in result.stderr and snapshot(home) == before
    model_before = snapshot(model_copy)
    for out in (model_copy, model_copy / "kv", model_copy.parent):
        result = runner.invoke(
            app,
            ["calibrate-kv", str(model_copy), "-c", str(tinystories_file), *CALIB, "--overwrite", "--output", str(out)],
        )
        assert result.exit_code == 2 and "never writes over its input" in result.stderr, result.output
    assert snapshot(model_copy) == model_before


def test_foreign_entries_descends_only_towards_owned_paths(tmp_path):
    root = tmp_path / "a"
    (root / "keep" / "deep").mkdir(parents=True)
    (root / "keep" / "deep" / "x.json").write_text("{}")
    (root / "keep" / "deep" / "mine.txt").write_text("user")
    (root / "other").mkdir()
    (root / "link").symlink_to(root / "keep" / "deep" / "x.json")
    owned = {"keep/deep/x.json", "link", MANIFEST_NAME}
    assert sorted(foreign_entries(root, owned)) == ["keep/deep/mine.txt", "link", "other/"]
    remove_owned(root, owned)
    assert (root / "keep" / "deep" / "mine.txt").exists() and (root / "link").is_symlink()
    (root / "keep" / "deep" / "mine.txt").unlink()
    remove_owned(root, {"keep/deep/x.json"})
    assert not (root / "keep").exists()  # the directories it emptied go too


# -- 2. calibrate-kv's swap: the path always holds a complete artifact


def test_swap_exchanges_directories_atomically(tmp_path):
    old, new = tmp_path / "art", tmp_path / ".art.kv-1.partial"
    old.mkdir(), new.mkdir()
    (old / "v").write_text("old")
    (new / "v").write_text("new")
    previous = swap.swap_in(new, old)
    if previous is None or previous != new:
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available here")
    assert (old / "v").read_text() == "new" and (new / "v").read_text() == "old"


def test_swap_fallback_killed_between_renames_is_restored(tmp_path, monkeypatch):
    target, new = tmp_path / "art", tmp_path / ".art.kv-1.partial"
    target.mkdir(), new.mkdir()
    (target / "v").write_text("old")
    (new / "v").write_text("new")
    monkeypatch.setattr(swap, "exchange", lambda a, b: False)
    real_rename = os.rename
    calls = []

    class Killed(BaseException):
        pass

    def dying_rename(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise Killed
        return real_rename(src, dst)

    monkeypatch.setattr(swap.os, "rename", dying_rename)
    with pytest.raises(Killed):
        swap.swap_in(new, target)
    monkeypatch.setattr(swap.os, "rename", real_rename)
    assert not target.exists()
    assert swap.restore_aside(target) == target and (target / "v").read_text() == "old"


def test_calibrate_kv_killed_between_fallback_renames_is_repaired_by_the_next_run(
    tmp_path, rtn_artifact, tinystories_file, monkeypatch
):
    art = tmp_path / "art"
    shutil.copytree(rtn_artifact, art)
    monkeypatch.setattr(swap, "exchange", lambda a, b: False)
    real_rename = os.rename

    class Killed(BaseException):
        pass

    def dying_rename(src, dst):
        if Path(dst) == art:
            raise Killed  # the old artifact is aside, the new one not yet in
        return real_rename(src, dst)

    monkeypatch.setattr(swap.os, "rename", dying_rename)
    with pytest.raises(Killed):
        api.calibrate_kv(art, tinystories_file, bits=8, calibration_overrides={"num_samples": 2, "seq_len": 32})
    monkeypatch.setattr(swap.os, "rename", real_rename)
    assert not art.exists()
    api.calibrate_kv(art, tinystories_file, bits=8, calibration_overrides={"num_samples": 2, "seq_len": 32})
    assert api.verify_model_integrity(art).ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # nothing aside, no staging left


KILLER = """
import sys
from squeeze import api
api.calibrate_kv(sys.argv[1], sys.argv[2], bits=8, calibration_overrides={"num_samples": 64, "seq_len": 128})
"""


def test_sigkill_during_calibrate_kv_leaves_the_artifact_and_the_next_run_cleans_up(
    tmp_path, rtn_artifact, tinystories_file
):
    art = tmp_path / "art"
    shutil.copytree(rtn_artifact, art)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLER, str(art), str(tinystories_file)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline and not list(tmp_path.glob(".art.kv-*.partial")):
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert api.verify_model_integrity(art).ok  # the path holds a complete artifact whatever the moment
    leftover = list(tmp_path.glob(".art.kv-*.partial"))
    assert leftover, "the run ended before its staging directory appeared"
    api.calibrate_kv(art, tinystories_file, bits=8, calibration_overrides={"num_samples": 2, "seq_len": 32})
    assert api.verify_model_integrity(art).ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_a_staging_dir_in_use_is_not_cleaned(tmp_path, rtn_artifact, tinystories_file):
    import fcntl

    art = tmp_path / "art"
    shutil.copytree(rtn_artifact, art)
    busy = tmp_path / ".art.kv-busy.partial"
    busy.mkdir()
    (busy / "config.json").write_text("{}")
    fd = os.open(busy, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        api.calibrate_kv(art, tinystories_file, bits=8, calibration_overrides={"num_samples": 2, "seq_len": 32})
    finally:
        os.close(fd)
    assert (busy / "config.json").exists() and api.verify_model_integrity(art).ok


# -- 3. a kill during the publish clean-up is finished by the rerun


def test_kill_during_publish_cleanup_is_finished_by_the_rerun(tmp_path, stories_dir, monkeypatch):
    out = tmp_path / "out"
    real_rmtree = shutil.rmtree

    class Killed(BaseException):
        pass

    def dying_rmtree(path, *args, **kwargs):
        if Path(path).name == "groups":
            raise Killed  # the artifact is complete; its checkpoints are still in the work area
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(workarea.shutil, "rmtree", dying_rmtree)
    with pytest.raises(Killed):
        api.compress(str(stories_dir), out, "rtn-w4")
    monkeypatch.setattr(workarea.shutil, "rmtree", real_rmtree)
    assert (out / MANIFEST_NAME).is_file() and (out / WORK_NAME / "groups").is_dir()
    assert not (out / WORK_NAME / "fingerprint.json").exists()  # removed before the marker
    result = compress(stories_dir, out)  # the documented recovery: the same command again
    assert result.exit_code == 0, result.output
    assert api.verify_model_integrity(out).ok and not (out / WORK_NAME).exists()


def test_a_leftover_work_area_next_to_a_sealed_artifact_is_removed(tmp_path, stories_dir, rtn_artifact):
    """What an older squeeze left when killed during its clean-up: checkpoints, no fingerprint, no marker."""
    out = tmp_path / "art"
    shutil.copytree(rtn_artifact, out)
    groups = out / WORK_NAME / "groups"
    groups.mkdir(parents=True)
    shutil.copy(next(out.glob("model-*.safetensors")), groups / "00000.safetensors")
    assert api.verify_model_integrity(out).ok  # the work area is not part of the artifact
    result = compress(stories_dir, out)
    assert result.exit_code == 2 and "already holds a squeeze artifact" in result.stderr
    assert not (out / WORK_NAME).exists() and api.verify_model_integrity(out).ok


def test_overwrite_keeps_the_old_artifact_usable_while_it_runs_and_after_a_kill(
    tmp_path, stories_dir, rtn_artifact, monkeypatch
):
    """Issue 41 item 2: the work area of ``compress --overwrite`` lives in the old artifact's directory, and the
    old artifact still verifies, loads and runs, during the run and after a kill, until the new one replaces it."""
    out = tmp_path / "art"
    shutil.copytree(rtn_artifact, out)
    before = snapshot(out)
    real_save = workarea.WorkArea.save_group
    seen: list[bool] = []

    class Killed(BaseException):
        pass

    def save_then_check(self, index, tensors, meta):
        real_save(self, index, tensors, meta)
        seen.append(api.verify_model_integrity(out).ok)  # mid-run: a checkpoint is in the work area
        raise Killed

    monkeypatch.setattr(workarea.WorkArea, "save_group", save_then_check)
    with pytest.raises(Killed):
        api.compress(str(stories_dir), out, "rtn-w4", overwrite=True, seed=1)
    monkeypatch.setattr(workarea.WorkArea, "save_group", real_save)
    assert seen == [True] and (out / WORK_NAME / "groups").is_dir()
    assert {k: v for k, v in snapshot(out).items() if not k.startswith(WORK_NAME)} == before  # untouched
    assert api.verify_model_integrity(out).ok
    assert api.generate(str(out), ["Once"], max_new_tokens=2).new_tokens  # loads and runs
    result = runner.invoke(app, ["verify", str(out), "--json"])
    assert result.exit_code == 0, result.output
    # a manifest may never list a file in the work area
    from squeeze.errors import FormatError
    from squeeze.format.paths import check_relative_path

    with pytest.raises(FormatError, match="work area"):
        check_relative_path(f"{WORK_NAME}/x.safetensors", "manifest entry")
    resumed = compress(stories_dir, out, "--overwrite", "--seed", "1")  # the rerun finishes and replaces it
    assert resumed.exit_code == 0, resumed.output
    assert api.verify_model_integrity(out).ok and not (out / WORK_NAME).exists()


def test_a_live_run_without_a_fingerprint_yet_is_not_taken_for_a_leftover(tmp_path, stories_dir, rtn_artifact):
    from squeeze.compression.lock import OutputLock
    from squeeze.errors import LockError

    out = tmp_path / "art"
    shutil.copytree(rtn_artifact, out)
    (out / WORK_NAME).mkdir()
    with OutputLock(out / WORK_NAME), pytest.raises(LockError):
        api.compress(str(stories_dir), out, "rtn-w4", overwrite=True)
    assert (out / WORK_NAME / "lock").exists()


# -- 9, 10, 11: preflight refusals before any work


def test_unwritable_output_is_refused_before_any_work(
    tmp_path, stories_dir, rtn_artifact, tinystories_file, monkeypatch
):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(output_module, "_probe", read_only)
    monkeypatch.setattr(plain, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    result = compress(stories_dir, tmp_path / "out")
    assert result.exit_code == 2 and "read-only file system" in result.stderr and not (tmp_path / "out").exists()
    monkeypatch.setattr(calibrate_kv_module, "calibrate_kv", lambda *a, **k: pytest.fail("calibrated"))
    result = runner.invoke(app, ["calibrate-kv", str(rtn_artifact), "-c", str(tinystories_file), *CALIB])
    assert result.exit_code == 2 and "read-only file system" in result.stderr


def test_the_write_probe_leaves_nothing_behind(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    output_module.check_writable(out)  # O_TMPFILE: never has a name
    assert list(out.iterdir()) == []
    monkeypatch.delattr(os, "O_TMPFILE", raising=False)  # the named fallback cleans a killed run's leftover
    (out / f"{output_module.PROBE_PREFIX}stale").write_text("")
    output_module.check_writable(out)
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("shape", ["long_name", "long_path"])
def test_output_paths_too_long_are_one_line_errors(tmp_path, stories_dir, rtn_artifact, tinystories_file, shape):
    out = tmp_path / ("c" * 240) if shape == "long_name" else tmp_path.joinpath(*["b" * 200] * 25)
    result = compress(stories_dir, out)
    assert result.exit_code == 2 and "too long" in result.stderr and "internal error" not in result.stderr
    result = runner.invoke(
        app, ["calibrate-kv", str(rtn_artifact), "-c", str(tinystories_file), *CALIB, "--output", str(out)]
    )
    assert result.exit_code == 2 and "too long" in result.stderr and "internal error" not in result.stderr
    assert len(result.stderr) < 600
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_output_below_a_file_is_refused(tmp_path, stories_dir):
    (tmp_path / "file").write_text("x")
    result = compress(stories_dir, tmp_path / "file" / "out")
    assert result.exit_code == 2 and "not a directory" in result.stderr


def test_calibrate_kv_on_dot_updates_the_artifact_in_place(tmp_path, rtn_artifact, tinystories_file, monkeypatch):
    art = tmp_path / "art"
    shutil.copytree(rtn_artifact, art)
    monkeypatch.chdir(art)
    result = runner.invoke(app, ["calibrate-kv", ".", "-c", str(tinystories_file), *CALIB, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["output"] == str(art)
    assert api.verify_model_integrity(art).ok and (art / "kv_cache.safetensors").is_file()


def test_symlinked_artifact_is_updated_at_its_target(tmp_path, rtn_artifact, tinystories_file):
    real = tmp_path / "v3"
    shutil.copytree(rtn_artifact, real)
    (tmp_path / "current").symlink_to("v3")
    api.calibrate_kv(
        tmp_path / "current", tinystories_file, bits=8, calibration_overrides={"num_samples": 2, "seq_len": 32}
    )
    assert (tmp_path / "current").is_symlink() and (real / "kv_cache.safetensors").is_file()
    assert api.verify_model_integrity(real).ok


@pytest.mark.parametrize("seq_len", ["1024", "100000"])
def test_seq_len_beyond_the_context_is_refused_before_any_work(
    tmp_path, stories_dir, rtn_artifact, tinystories_file, monkeypatch, seq_len
):
    monkeypatch.setattr(sensitivity, "fisher_information", lambda *a, **k: pytest.fail("computed the Fisher"))
    result = runner.invoke(
        app,
        [
            "compress",
            str(stories_dir),
            "-o",
            str(tmp_path / "out"),
            "--recipe",
            "w4",
            "-c",
            str(tinystories_file),
            "--seq-len",
            seq_len,
        ],
    )
    assert result.exit_code == 2 and "exceeds the model's context of 512" in result.stderr, result.output
    assert not (tmp_path / "out").exists()
    monkeypatch.setattr(calibrate_kv_module, "calibrate_kv", lambda *a, **k: pytest.fail("calibrated"))
    result = runner.invoke(app, ["calibrate-kv", str(rtn_artifact), "-c", str(tinystories_file), "--seq-len", seq_len])
    assert result.exit_code == 2 and "exceeds the model's context of 512" in result.stderr, result.output


# -- 12. an interrupt before any commit does not advertise --resume


def test_interrupt_before_any_commit_says_start_again(tmp_path, stories_dir, tinystories_file):
    out = tmp_path / "out"

    def stop(stage, done, total):
        os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(Interrupted) as caught:
        api.compress(
            str(stories_dir),
            out,
            "w4",
            str(tinystories_file),
            calibration_overrides={"num_samples": 2, "seq_len": 32},
            progress=stop,
        )
    assert caught.value.resumable is False and "nothing to resume" in caught.value.hint
    assert not out.exists()
    command = resume_command(str(stories_dir), {"--output": out}, overwrite=False, resume=caught.value.resumable)
    assert not command.endswith("--resume")


# -- 13. files follow the umask


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_artifact_files_follow_the_umask(tmp_path, stories_dir, tinystories_file, umask):
    previous = os.umask(umask)
    try:
        out = tmp_path / "out"
        api.compress(str(stories_dir), out, "rtn-w4")
        api.calibrate_kv(out, tinystories_file, bits=8, calibration_overrides={"num_samples": 2, "seq_len": 32})
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert set(modes.values()) == {0o666 & ~umask}, modes
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask


def test_check_output_dir_accepts_empty_and_work_area_only(tmp_path):
    out = tmp_path / "out"
    assert check_output_dir(out, False) == frozenset()
    (out / WORK_NAME).mkdir(parents=True)
    assert check_output_dir(out, False, ignore=(WORK_NAME,)) == frozenset()
