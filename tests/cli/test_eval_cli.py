import json

import pytest
from typer.testing import CliRunner

from squeeze.cli.app import app
from squeeze.eval.perplexity import perplexity

runner = CliRunner()


def test_eval_of_a_plain_model_prints_json(tiny_llama_dir, tiny_llama, tiny_text_file):
    result = runner.invoke(
        app,
        [
            "eval",
            str(tiny_llama_dir),
            "--text",
            str(tiny_text_file),
            "--seq-len",
            "128",
            "--max-windows",
            "3",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["windows"] == 3 and report["tokens"] == 3 * 127
    model, tokenizer = tiny_llama
    expected = perplexity(model, tokenizer, tiny_text_file.read_text(encoding="utf-8"), seq_len=128, max_windows=3)
    assert report["perplexity"] == pytest.approx(expected.perplexity, rel=1e-6)
    assert "baseline_perplexity" not in report


def test_eval_table_shows_model_and_baseline(tiny_llama_dir, tiny_text_file):
    result = runner.invoke(
        app,
        [
            "eval",
            str(tiny_llama_dir),
            "--text",
            str(tiny_text_file),
            "--seq-len",
            "128",
            "--max-windows",
            "2",
            "--baseline",
            str(tiny_llama_dir),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "(baseline)" in result.stdout and "perplexity" in result.stdout


def test_missing_text_file_exits_2(tiny_llama_dir, tmp_path):
    result = runner.invoke(app, ["eval", str(tiny_llama_dir), "--text", str(tmp_path / "none.txt")])
    assert result.exit_code == 2 and result.stderr.startswith("Error: ") and "does not exist" in result.stderr


def test_text_shorter_than_one_window_exits_2(tiny_llama_dir, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Once upon a time")
    result = runner.invoke(app, ["eval", str(tiny_llama_dir), "--text", str(short), "--seq-len", "512"])
    assert result.exit_code == 2 and result.stderr.startswith("Error: ")


def test_tampered_artifact_is_refused_with_exit_1(artifact, tiny_text_file):
    (artifact / "config.json").write_text('{"model_type": "llama", "hidden_size": 1}\n')
    result = runner.invoke(app, ["eval", str(artifact), "--text", str(tiny_text_file)])
    assert result.exit_code == 1
    assert "failed verification: config.json" in result.stderr
