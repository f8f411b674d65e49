"""``eval`` checks the text, the model and the baseline before any model loads or any window is scored."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import squeeze.eval.compare as compare
from squeeze import api
from squeeze.cli.app import app
from squeeze.errors import ConfigError, ModelError

runner = CliRunner()


@pytest.fixture(scope="module")
def rtn_artifact(tmp_path_factory: pytest.TempPathFactory, compress_tiny) -> Path:
    return compress_tiny(tmp_path_factory.mktemp("compare") / "tiny-rtn-w4", "rtn-w4")


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records (and forbids) every model load and every perplexity run inside eval."""
    calls: list[str] = []

    def forbidden(what: str):
        def record(*args, **kwargs):
            calls.append(what)
            raise AssertionError(f"{what} ran before the inputs were checked")

        return record

    monkeypatch.setattr("squeeze.models.source.load_model", forbidden("load_model"))
    monkeypatch.setattr("squeeze.runtime.loader.load_artifact", forbidden("load_artifact"))
    monkeypatch.setattr(compare, "perplexity", forbidden("perplexity"))
    return calls


def test_a_mistyped_baseline_is_found_before_the_model_is_evaluated(
    rtn_artifact, tiny_text_file, tmp_path, no_loading
) -> None:
    with pytest.raises(ModelError) as info:
        api.evaluate(rtn_artifact, tiny_text_file, baseline=tmp_path / "tiny-typo", seq_len=64)
    assert info.value.message.startswith("--baseline: ") and "does not exist" in info.value.message
    assert no_loading == []


def test_a_mistyped_model_is_named_without_the_baseline_prefix(
    tiny_llama_dir, tiny_text_file, tmp_path, no_loading
) -> None:
    with pytest.raises(ModelError, match="^model path .* does not exist"):
        api.evaluate(tmp_path / "typo", tiny_text_file, baseline=tiny_llama_dir, seq_len=64)
    assert no_loading == []


def test_the_text_is_checked_first(tmp_path, no_loading) -> None:
    with pytest.raises(ConfigError, match="evaluation text .* does not exist"):
        api.evaluate(tmp_path / "typo-model", tmp_path / "none.txt", baseline=tmp_path / "typo-baseline")
    assert no_loading == []


@pytest.mark.parametrize("unfinished", [False, True])
def test_a_squeeze_output_without_its_manifest_is_refused_up_front(
    rtn_artifact, tiny_text_file, tmp_path, no_loading, unfinished
) -> None:
    partial = tmp_path / "partial"
    shutil.copytree(rtn_artifact, partial)
    (partial / "squeeze.manifest.json").unlink()
    if unfinished:
        (partial / ".squeeze-work").mkdir()
    with pytest.raises(ModelError) as info:
        api.evaluate(rtn_artifact, tiny_text_file, baseline=partial, seq_len=64)
    assert info.value.message.startswith(f"--baseline: {partial} is a squeeze output without its manifest")
    assert ("--resume" in (info.value.hint or "")) == unfinished
    assert no_loading == []


def test_a_baseline_that_needs_remote_code_is_refused_up_front(
    rtn_artifact, tiny_llama_dir, tiny_text_file, tmp_path, no_loading
) -> None:
    model = tmp_path / "custom"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="x-custom", auto_map={"AutoConfig": "configuration_x.XConfig"})
    (model / "config.json").chmod(0o644)
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="^--baseline: model .* needs its own Python code"):
        api.evaluate(rtn_artifact, tiny_text_file, baseline=model, seq_len=64)
    assert no_loading == []


def test_cli_mistyped_baseline_is_one_error_line_and_nothing_is_evaluated(
    rtn_artifact, tiny_text_file, tmp_path, no_loading
) -> None:
    result = runner.invoke(
        app,
        [
            "eval",
            str(rtn_artifact),
            "--text",
            str(tiny_text_file),
            "--seq-len",
            "64",
            "--baseline",
            str(tmp_path / "tiny-typo"),
            "--json",
        ],
    )
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr.startswith(f"Error: --baseline: model path '{tmp_path / 'tiny-typo'}' does not exist")
    assert no_loading == []


def test_valid_model_and_baseline_still_evaluate(rtn_artifact, tiny_llama_dir, tiny_text_file) -> None:
    result = api.evaluate(rtn_artifact, tiny_text_file, baseline=tiny_llama_dir, seq_len=64, max_windows=2)
    assert result.result.n_windows == result.baseline_result.n_windows == 2
    assert result.baseline == str(tiny_llama_dir)
