"""Issue 41 item 8: inputs that ended in an internal error (exit 3) are clean refusals (exit 2, one line)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from squeeze import api
from squeeze.cli.app import app
from squeeze.format.manifest import MANIFEST_NAME, parse_manifest
from squeeze.format.verify import seal_artifact

runner = CliRunner()


@pytest.fixture(scope="module")
def rtn_artifact(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("refusals") / "stories-rtn-w4"
    api.compress(str(stories_dir), out, recipe="rtn-w4")
    return out


def one_error_line(result, code: int, contains: str) -> None:
    assert result.exit_code == code, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("Error")]
    assert len(lines) == 1 and contains in lines[0], result.stderr
    assert "Traceback" not in result.output and "internal error" not in result.stderr.lower()


def test_a_tokenizer_naming_its_own_code_is_the_remote_code_refusal(rtn_artifact: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(rtn_artifact, tmp_path / "custom-tokenizer"))
    config_path = copy / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    config["tokenizer_class"] = "EvilTokenizer"
    config_path.write_text(json.dumps(config))
    provenance = parse_manifest((copy / MANIFEST_NAME).read_bytes()).provenance
    seal_artifact(copy, provenance)  # the manifest resealed: only the code refusal is left to stop it
    result = runner.invoke(app, ["run", "Hello", "-m", str(copy), "-n", "2"])
    one_error_line(result, 2, "own Python code")


def test_a_kv_pool_larger_than_the_memory_is_refused_at_start(tmp_path: Path, monkeypatch) -> None:
    import squeeze.system

    monkeypatch.setattr(squeeze.system, "available_memory_bytes", lambda: 8 * 2**30)
    result = runner.invoke(app, ["serve", str(tmp_path / "not-read"), "--kv-memory", "1TB", "--port", "0"])
    one_error_line(result, 2, "--kv-memory")
    assert "available" in result.stderr


def test_an_absurd_generated_sample_count_is_bounded_before_any_work(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        ["compress", str(tmp_path / "no-model"), "-o", str(out), "--recipe", "w3-ec"]
        + ["--generated-samples", "1000000000"],
    )
    one_error_line(result, 2, "at most 1024")
    assert not out.exists()


def test_a_tiny_max_memory_is_shown_in_bytes() -> None:
    from squeeze.compression.preflight import check_budget
    from squeeze.errors import ResourceError

    with pytest.raises(ResourceError, match=r"--max-memory 1B is below the minimum of 2.00GB"):
        check_budget(2 * 10**9, 1)
    with pytest.raises(ResourceError, match=r"--max-memory 2KB "):
        check_budget(2 * 10**9, 2048)
