"""Issue 50's compress / eval probes against the real CLI, each in a child process (items 1, 8, 9, 13).

A checkpoint that does not match its config.json (stories260K says 5 layers; its safetensors lose layer 4,
or config.json loses num_hidden_layers and transformers would build 32) is refused before any work, in
memory and with --max-memory; hostile layer counts are refused at once instead of building for minutes; a
FIFO named like a task YAML does not block eval; a 1e23 seed is a clean refusal; a directory named like a
built-in recipe does not shadow it. The helpers and the shared fixtures are test_hardening_probes.py's.

Slow (child processes): deselected from the default run, see conftest.py here.
"""

# ruff: noqa: F811 - the shared fixtures (probe, shared) are imported from test_hardening_probes and injected by name
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from test_hardening_probes import Probe, edit_json, probe, refused, shared, succeeded  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow

SOURCE_SHARD = "model.safetensors"


def _model_copy(probe: Probe, name: str) -> Path:
    return Path(shutil.copytree(probe.model, probe.root / name))


@pytest.mark.parametrize("max_memory", [None, "2GB"])
def test_a_checkpoint_missing_a_layer_is_never_sealed(probe: Probe, max_memory: str | None) -> None:
    model = _model_copy(probe, "four-layers")
    tensors = load_file(model / SOURCE_SHARD)
    save_file({k: v for k, v in tensors.items() if ".layers.4." not in k}, model / SOURCE_SHARD)
    out = probe.root / "out"
    extra = ["--max-memory", max_memory] if max_memory else []
    result = probe.cli("compress", model, "-o", out, "--recipe", "rtn-w4", *extra)
    refused(result, 2)
    assert "does not match its config.json" in result.error_line and "model.layers.4." in result.error_line
    assert result.hint and not out.exists()


@pytest.mark.parametrize(("layers", "plan"), [(1e12, True), (10**5, True), (10**4, False), (None, False)], ids=str)
def test_hostile_layer_counts_are_refused_at_once(probe: Probe, layers: float | None, plan: bool) -> None:
    model = _model_copy(probe, "hostile")
    edit_json(
        model / "config.json",
        lambda c: c.pop("num_hidden_layers") if layers is None else c.update(num_hidden_layers=layers),
    )
    out = probe.root / "out"
    result = probe.cli("compress", model, "--recipe", "rtn-w4", *(["--plan"] if plan else ["-o", out]))
    refused(result, 2)
    assert result.wall_s < 60 and result.rss_mb < 2048, result.describe()
    assert result.hint and not out.exists()
    if layers is None:  # transformers' default of 32 layers against the checkpoint's 5
        assert "num_hidden_layers (default 32)" in result.hint


def test_a_fifo_named_like_a_task_yaml_does_not_block_eval(probe: Probe) -> None:
    pytest.importorskip("lm_eval")
    tasks = probe.root / "tasks"
    tasks.mkdir()
    os.mkfifo(tasks / "x.yaml")
    result = probe.cli("eval", probe.base, "--tasks", "x", "--include-path", tasks)
    refused(result, 2)
    assert "x.yaml is not a regular file" in result.error_line and result.hint


def test_a_seed_past_32_bits_is_refused_before_any_work(probe: Probe) -> None:
    out = probe.root / "out"
    result = probe.cli("compress", probe.model, "-o", out, "--recipe", "rtn-w4", "--seed", str(10**23))
    refused(result, 2)
    assert "4294967295" in result.error_line and result.hint and not out.exists()


def test_a_directory_named_like_the_recipe_does_not_shadow_it(probe: Probe) -> None:
    (probe.root / "rtn-w4").mkdir()  # e.g. the output of an earlier `--recipe rtn-w4 --output rtn-w4`
    (probe.root / "rtn-w4" / "notes.txt").write_text("not a recipe\n")
    succeeded(probe.cli("compress", probe.model, "-o", probe.root / "out", "--recipe", "rtn-w4"))
