"""``squeeze compress`` flags for interrupted jobs: --resume, --restart, --force, the lock, the resume command."""

from __future__ import annotations

import os

from typer.testing import CliRunner

import squeeze.compression.pipelines.plain as plain
from squeeze.cli.app import app
from squeeze.cli.compress import resume_command
from squeeze.compression import preflight
from squeeze.compression.lock import OutputLock
from squeeze.compression.workarea import WORK_NAME

runner = CliRunner()


def rtn(stories_dir, out, *extra):
    return runner.invoke(app, ["compress", str(stories_dir), "-o", str(out), "--recipe", "rtn-w4", "--json", *extra])


def test_resume_with_nothing_to_resume_is_refused(tmp_path, stories_dir):
    out = tmp_path / "out"
    result = rtn(stories_dir, out, "--resume")
    assert result.exit_code == 2 and result.stderr.startswith("Error: nothing to resume"), result.output
    assert not out.exists()


def test_resume_and_restart_contradict(tmp_path, stories_dir):
    result = rtn(stories_dir, tmp_path / "out", "--resume", "--restart")
    assert result.exit_code == 2 and "contradict" in result.stderr


def test_a_second_run_into_a_locked_output_refuses_at_once(tmp_path, stories_dir, monkeypatch):
    out = tmp_path / "out"
    (out / WORK_NAME).mkdir(parents=True)
    loads = []
    monkeypatch.setattr(plain, "load_model", lambda *a, **k: loads.append(1))
    with OutputLock(out / WORK_NAME):  # what a first, running compress holds
        before = sorted(p.name for p in (out / WORK_NAME).iterdir())
        result = rtn(stories_dir, out)
        assert result.exit_code == 2, result.output
        assert result.stderr.startswith(f"Error: another squeeze compress (pid {os.getpid()}) is writing into {out}")
        assert "Traceback" not in result.output and loads == []
        assert sorted(p.name for p in (out / WORK_NAME).iterdir()) == before  # the first run's files untouched
    # the lock dies with its holder: the next run takes it and completes
    monkeypatch.undo()
    assert rtn(stories_dir, out).exit_code == 0
    assert not (out / WORK_NAME).exists()


def test_not_enough_memory_is_refused_before_loading_unless_force(tmp_path, stories_dir, monkeypatch):
    monkeypatch.setattr(preflight, "available_memory_bytes", lambda: 1000)
    out = tmp_path / "out"
    result = rtn(stories_dir, out)
    assert result.exit_code == 2 and result.stderr.startswith("Error: not enough memory"), result.output
    assert "--force" in result.stderr
    assert not out.exists()
    forced = rtn(stories_dir, out, "--force")
    assert forced.exit_code == 0, forced.output


def test_force_also_overrides_the_disk_estimate(tmp_path, stories_dir, monkeypatch):
    monkeypatch.setattr(preflight, "free_disk_bytes", lambda path: 1000)
    out = tmp_path / "out"
    assert rtn(stories_dir, out).exit_code == 2
    assert rtn(stories_dir, out, "--force").exit_code == 0


def test_memory_estimate_is_plausible(stories_dir):
    from squeeze.config import load_recipe
    from squeeze.models import resolve_model

    skeleton = preflight.meta_model(resolve_model(str(stories_dir)))
    with_fisher = preflight.estimate_peak_memory(skeleton, load_recipe("w4"), 512)
    without = preflight.estimate_peak_memory(skeleton, load_recipe("rtn-w4"), None)
    assert preflight.BASE_PROCESS_BYTES < without < with_fisher < 2 * 2**30


def test_resume_command_adds_resume_keeps_inputs_and_quotes():
    command = resume_command(
        "my model", {"--output": "out dir", "--recipe": "w3", "--seed": None, "--bits": 3}, overwrite=True
    )
    assert command == "squeeze compress 'my model' --output 'out dir' --recipe w3 --bits 3 --overwrite --resume"
    assert "--restart" not in command
