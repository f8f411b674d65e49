import json

from typer.testing import CliRunner

from squeeze.cli.app import app

runner = CliRunner()


def test_eval_of_a_plain_model_prints_json(stories_dir, tinystories_file):
    result = runner.invoke(app, ["eval", str(stories_dir), "--text", str(tinystories_file), "--seq-len", "128",
                                 "--max-windows", "3", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["windows"] == 3 and report["tokens"] == 3 * 127
    assert 1.0 < report["perplexity"] < 20.0 and "baseline_perplexity" not in report


def test_eval_table_shows_model_and_baseline(stories_dir, tinystories_file):
    result = runner.invoke(app, ["eval", str(stories_dir), "--text", str(tinystories_file), "--seq-len", "128",
                                 "--max-windows", "2", "--baseline", str(stories_dir)])
    assert result.exit_code == 0, result.output
    assert "(baseline)" in result.stdout and "perplexity" in result.stdout


def test_missing_text_file_exits_2(stories_dir, tmp_path):
    result = runner.invoke(app, ["eval", str(stories_dir), "--text", str(tmp_path / "none.txt")])
    assert result.exit_code == 2 and result.stderr.startswith("Error: ") and "does not exist" in result.stderr


def test_text_shorter_than_one_window_exits_2(stories_dir, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Once upon a time")
    result = runner.invoke(app, ["eval", str(stories_dir), "--text", str(short), "--seq-len", "512"])
    assert result.exit_code == 2 and result.stderr.startswith("Error: ")


def test_tampered_artifact_is_refused_with_exit_1(artifact, tinystories_file):
    (artifact / "config.json").write_text('{"model_type": "llama", "hidden_size": 1}\n')
    result = runner.invoke(app, ["eval", str(artifact), "--text", str(tinystories_file)])
    assert result.exit_code == 1
    assert "failed verification: config.json" in result.stderr
