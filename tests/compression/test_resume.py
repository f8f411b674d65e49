"""Fault injection on stories260K: SIGKILL at random points, SIGTERM/SIGINT, ENOSPC, a cut-short publish.

Every interrupted job is resumed to an artifact byte-identical to an uninterrupted run (every file but the
manifest, whose ``created`` time differs; equal root digests cover the rest).
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import squeeze.compression.runner as runner
import squeeze.compression.workarea as workarea
import squeeze.format.shards as shards
from log_lines import without_progress
from squeeze import api
from squeeze.compression.workarea import WORK_NAME
from squeeze.errors import Interrupted, ResourceError, ResumeError
from squeeze.format.manifest import MANIFEST_NAME

# The CLI, with every layer-group commit followed by 0.1 s: stories260K quantizes all five groups in about
# 0.1 s on a fast machine, so a kill aimed "after group k" (or after the Fisher, plus a random delay) would
# often find the job already finished. The delay makes the kill points reachable on any machine.
SLOW_COMMITS = """
import time
from squeeze.compression.workarea import WorkArea
_save = WorkArea.save_group
def save_group(self, *args, **kwargs):
    _save(self, *args, **kwargs)
    time.sleep(0.1)
WorkArea.save_group = save_group
from squeeze.cli.app import main
main()
"""
CLI = [sys.executable, "-c", SLOW_COMMITS]
CALIB = {"num_samples": 4, "seq_len": 64}
N_GROUPS = 5  # stories260K: 5 decoder blocks, 7 target linears each


def artifact_files(directory: Path) -> dict[str, bytes]:
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }


def manifest_content(directory: Path) -> dict:
    """The manifest without its creation time and the root digest over it (manifest v2's digest covers the
    time, which differs between two runs): every entry, chunk digest and the provenance."""
    import json

    data = json.loads((directory / MANIFEST_NAME).read_text())
    return {key: value for key, value in data.items() if key not in ("created", "root_digest")}


def assert_same_artifact(out: Path, reference: Path) -> None:
    assert not (out / WORK_NAME).exists(), "the work area must be removed once the artifact is published"
    assert artifact_files(out) == artifact_files(reference)
    assert manifest_content(out) == manifest_content(reference)
    assert api.verify_model_integrity(out).ok


def compress(stories_dir, tinystories_file, out, **kwargs):
    return api.compress(str(stories_dir), out, "w3", str(tinystories_file), calibration_overrides=CALIB, **kwargs)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, stories_dir, tinystories_file) -> Path:
    out = tmp_path_factory.mktemp("ref") / "ref"
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        compress(stories_dir, tinystories_file, out)
    finally:
        torch.set_num_threads(before)
    return out


def cli_command(stories_dir, tinystories_file, out) -> list[str]:
    return [
        *CLI,
        "compress",
        str(stories_dir),
        "-o",
        str(out),
        "--recipe",
        "w3",
        "--calibration",
        str(tinystories_file),
        "--num-samples",
        "4",
        "--seq-len",
        "64",
        "--json",
    ]


def child_env() -> dict[str, str]:
    # One thread: the tiny model's ops are faster that way on a shared machine (see conftest.py)
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def committed_groups(out: Path) -> int:
    groups = out / WORK_NAME / "groups"
    return sum(1 for p in groups.iterdir() if not p.name.startswith(".")) if groups.is_dir() else 0


def wait_until(proc: subprocess.Popen, condition, timeout: float = 120.0) -> bool:
    """Poll ``condition()`` until it holds (True) or the process ends (False)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def check_work_area_after_kill(out: Path) -> None:
    """Nothing partial under a final name: every committed checkpoint reads back whole."""
    work = out / WORK_NAME
    names = {p.name for p in out.iterdir()} if out.exists() else set()
    if (work / "publishing.json").exists() or MANIFEST_NAME in names:
        return  # killed while publishing (finished on rerun) or after
    assert names <= {WORK_NAME}, names  # no artifact file appears before the artifact is complete
    for path in [work / "fisher.safetensors", *sorted((work / "groups").glob("*.safetensors"))]:
        if path.exists() and not path.name.startswith("."):
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118
                    handle.get_tensor(name)


def test_sigkill_at_random_points_then_sigterm_resume_to_identical_bytes(
    tmp_path, stories_dir, tinystories_file, reference
):
    """Two SIGKILLs at random points, a SIGTERM (exit 143, resume command printed), then that command.

    Before the SIGTERM run, checkpoints of groups 2+ are dropped (as if never committed): its signal must
    arrive after a commit in the quantize stage, once the handlers are surely installed.
    """
    out = tmp_path / "out"
    command = cli_command(stories_dir, tinystories_file, out)
    rng = random.Random(20240606)
    for _ in range(2):
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env())
        point = rng.choice(["fisher", "group", "group", "any"])
        if point == "fisher":
            reached = wait_until(proc, lambda: (out / WORK_NAME / "fisher.safetensors").exists())
        elif point == "group":
            k = rng.randint(1, N_GROUPS - 1)
            reached = wait_until(proc, lambda: committed_groups(out) >= k)
        else:
            reached = wait_until(proc, lambda: (out / WORK_NAME / "lock").exists())
        time.sleep(rng.uniform(0, 0.2))
        proc.kill()
        proc.wait()
        assert reached, f"the run ended before the kill point {point}"
        check_work_area_after_kill(out)

    for late in range(2, N_GROUPS):  # leave groups to quantize, so that SIGTERM lands after a commit
        (out / WORK_NAME / "groups" / f"{late:05d}.safetensors").unlink(missing_ok=True)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    before = committed_groups(out)
    assert wait_until(proc, lambda: committed_groups(out) > before)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.fail("the run finished before SIGTERM arrived")
    assert proc.returncode == 143, stderr
    message = without_progress(stderr)  # stderr is a pipe: a log's progress lines come first, then the error
    assert message.startswith("Error: interrupted by SIGTERM") and "Traceback" not in stderr, stderr
    check_work_area_after_kill(out)
    resume = stderr.split("resume with: ", 1)[1].strip()
    assert resume.startswith("squeeze compress ") and resume.endswith("--resume")
    done = subprocess.run([*CLI, *shlex.split(resume)[1:]], capture_output=True, text=True, env=child_env())
    assert done.returncode == 0, done.stderr
    assert_same_artifact(out, reference)


def test_sigint_in_process_raises_interrupted_130_and_restores_handlers(
    tmp_path, stories_dir, tinystories_file, reference
):
    out = tmp_path / "out"
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def progress(stage, done, total):
        if stage == "quantize" and done == 14:  # two layer groups done: the second one is being committed
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(Interrupted) as caught:
        compress(stories_dir, tinystories_file, out, progress=progress)
    assert caught.value.exit_code == 130 and "SIGINT" in caught.value.message
    assert {sig: signal.getsignal(sig) for sig in before} == before
    assert committed_groups(out) == 2
    compress(stories_dir, tinystories_file, out, resume=True)
    assert_same_artifact(out, reference)


@pytest.mark.parametrize("where", ["checkpoint", "shard"])
def test_disk_full_is_a_resource_error_and_the_rerun_resumes(
    tmp_path, stories_dir, tinystories_file, reference, monkeypatch, where
):
    out = tmp_path / "out"
    source_before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in stories_dir.iterdir() if p.is_file()}
    module = workarea if where == "checkpoint" else shards
    real_save = module.save_file
    calls = []

    def full_disk(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 3:  # checkpoints: Fisher, group 0, then group 1 fails; shards: the first one fails
            Path(filename).write_bytes(b"partial")  # what a real ENOSPC leaves: a truncated temp file
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        return real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(module, "save_file", full_disk)
    if where == "shard":
        calls.extend(["pretend", "pretend"])
    with pytest.raises(ResourceError) as caught:
        compress(stories_dir, tinystories_file, out)
    assert "no space left" in caught.value.message and "rerun the same command" in caught.value.hint
    monkeypatch.setattr(module, "save_file", real_save)
    work = out / WORK_NAME
    assert not [p for p in work.rglob("*") if p.name.endswith(".partial")]
    assert committed_groups(out) == (1 if where == "checkpoint" else N_GROUPS)
    assert {p.name for p in out.iterdir()} == {WORK_NAME}
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in stories_dir.iterdir() if p.is_file()}
    assert after == source_before  # the source is only ever read
    compress(stories_dir, tinystories_file, out)
    assert_same_artifact(out, reference)


def test_a_publish_cut_short_is_finished_by_the_rerun(tmp_path, stories_dir, tinystories_file, reference, monkeypatch):
    out = tmp_path / "out"
    real_replace = os.replace
    moved = []

    class Killed(BaseException):
        pass

    def dying_replace(src, dst):
        if Path(dst).parent == out:
            moved.append(dst)
            if len(moved) == 3:
                raise Killed  # like a SIGKILL between two renames
        return real_replace(src, dst)

    monkeypatch.setattr(runner.os, "replace", dying_replace)
    with pytest.raises(Killed):
        compress(stories_dir, tinystories_file, out)
    monkeypatch.setattr(runner.os, "replace", real_replace)
    names = {p.name for p in out.iterdir()}
    assert MANIFEST_NAME not in names and len(names) == 3  # two files moved, and the work area
    compress(stories_dir, tinystories_file, out)
    assert_same_artifact(out, reference)


def test_a_different_job_refuses_to_resume_and_restart_starts_over(tmp_path, stories_dir, tinystories_file):
    out = tmp_path / "out"

    def stop(stage, done, total):
        if stage == "quantize" and done == 7:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Interrupted) as caught:
        compress(stories_dir, tinystories_file, out, progress=stop)
    assert caught.value.exit_code == 143
    with pytest.raises(ResumeError) as refused:
        compress(stories_dir, tinystories_file, out, overrides={"weights.bits": 4}, seed=1)
    message = refused.value.message
    assert "recipe.weights.bits: 3 in the work area, 4 now" in message and "seed: 0 in the work area, 1 now" in message
    assert "--restart" in refused.value.hint
    assert committed_groups(out) == 1  # the refusal touched nothing
    result = compress(stories_dir, tinystories_file, out, overrides={"weights.bits": 4}, seed=1, restart=True)
    assert result.recipe == "w3" and api.verify_model_integrity(out).ok
    assert not (out / WORK_NAME).exists()


def test_a_corrupt_checkpoint_is_recomputed_not_trusted(tmp_path, stories_dir, tinystories_file, reference):
    out = tmp_path / "out"

    def stop(stage, done, total):
        if stage == "quantize" and done == 21:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Interrupted):
        compress(stories_dir, tinystories_file, out, progress=stop)
    group = out / WORK_NAME / "groups" / "00001.safetensors"
    group.write_bytes(group.read_bytes()[:100])  # damaged on disk after its commit
    compress(stories_dir, tinystories_file, out)
    assert_same_artifact(out, reference)
