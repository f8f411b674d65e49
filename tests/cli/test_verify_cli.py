import json

from typer.testing import CliRunner

from squeeze.cli.app import app
from squeeze.format.manifest import MANIFEST_NAME

runner = CliRunner()
SHARD = "model-00001-of-00002.safetensors"


def test_intact_artifact_exits_0_with_a_table(artifact):
    result = runner.invoke(app, ["verify", str(artifact)])
    assert result.exit_code == 0, result.output
    assert "intact" in result.stdout and SHARD in result.stdout


def test_json_output_parses_and_holds_only_json(artifact):
    result = runner.invoke(app, ["verify", str(artifact / MANIFEST_NAME), "--json"])
    assert result.exit_code == 0
    report = json.loads(result.stdout)
    assert report["ok"] is True
    assert {"path", "ok", "error"} <= set(report["files"][0])


def test_tampered_shard_exits_1_naming_the_file(artifact):
    path = artifact / SHARD
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    result = runner.invoke(app, ["verify", str(artifact)])
    assert result.exit_code == 1
    assert "FAILED" in result.stdout
    assert result.stderr.count("\n") == 1 and f"Error: integrity check failed: {SHARD}" in result.stderr
    as_json = runner.invoke(app, ["verify", str(artifact), "--json"])
    assert as_json.exit_code == 1
    report = json.loads(as_json.stdout)
    assert report["ok"] is False
    assert [f["path"] for f in report["files"] if not f["ok"]] == [SHARD]


def test_missing_file_exits_1(artifact):
    (artifact / "config.json").unlink()
    assert runner.invoke(app, ["verify", str(artifact)]).exit_code == 1


def test_malformed_manifest_exits_2_with_one_line_and_no_traceback(artifact):
    (artifact / MANIFEST_NAME).write_text("[]")
    result = runner.invoke(app, ["verify", str(artifact)])
    assert result.exit_code == 2
    assert result.stderr.startswith("Error: ") and "Traceback" not in result.output
    assert MANIFEST_NAME in result.stderr


def test_missing_artifact_exits_2_with_a_hint(tmp_path):
    result = runner.invoke(app, ["verify", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "Error: no manifest" in result.stderr and "Hint:" in result.stderr


def test_traceback_only_with_squeeze_debug(artifact, monkeypatch):
    (artifact / MANIFEST_NAME).write_text("{")
    monkeypatch.setenv("SQUEEZE_DEBUG", "1")
    result = runner.invoke(app, ["verify", str(artifact)])
    assert result.exit_code != 0 and result.exception is not None
    assert type(result.exception).__name__ == "FormatError"


def test_unknown_option_is_a_usage_error():
    assert runner.invoke(app, ["verify", "--bogus", "x"]).exit_code == 2


def test_help_documents_exit_codes():
    result = runner.invoke(app, ["verify", "--help"])
    assert "Exit codes" in result.stdout


def test_inspect_reports_files_roles_and_manifest(artifact):
    result = runner.invoke(app, ["inspect", str(artifact), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["tensors"] == 4
    assert {r["role"] for r in info["roles"]} == {"weight", "codes"}
    assert info["manifest"]["status"].startswith("sizes match")
    table = runner.invoke(app, ["inspect", str(artifact)])
    assert table.exit_code == 0 and "weight" in table.stdout


def test_inspect_flags_an_unlisted_file(artifact):
    (artifact / "new.txt").write_text("x")
    info = json.loads(runner.invoke(app, ["inspect", str(artifact), "--json"]).stdout)
    assert info["manifest"]["status"] == "MISMATCH"
    assert {"path": "new.txt", "size": 1, "listed": False} in info["files"]


def test_inspect_of_a_missing_directory_exits_2(tmp_path):
    result = runner.invoke(app, ["inspect", str(tmp_path / "nope")])
    assert result.exit_code == 2 and result.stderr.startswith("Error:")


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.startswith("squeeze ")
