"""``squeeze run -m URL`` and ``squeeze.load(URL)``: the artifact is pulled into the artifact cache (verified) and
run from there; the second run reuses the cached copy."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from pull_server import ArtifactServer
from typer.testing import CliRunner

from squeeze import api
from squeeze.cli.app import app
from squeeze.format.manifest import MANIFEST_NAME

runner = CliRunner()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, compress_tiny: Callable[..., Path]) -> Path:
    root = tmp_path_factory.mktemp("served")
    compress_tiny(root / "tiny-w4")
    return root


def _run(model: str) -> dict:
    result = runner.invoke(app, ["run", "Once upon a time", "-m", model, "-n", "6", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_run_pulls_a_url_into_the_cache_and_gives_the_local_text(
    served: Path, server: ArtifactServer, cache: Path
) -> None:
    url = server.url + "tiny-w4/"
    remote = _run(url)
    pulled = [p.parent for p in cache.rglob(MANIFEST_NAME)]
    assert len(pulled) == 1  # one verified copy in the cache
    assert (pulled[0] / MANIFEST_NAME).read_bytes() == (served / "tiny-w4" / MANIFEST_NAME).read_bytes()
    assert remote["texts"] == _run(str(served / "tiny-w4"))["texts"]
    fetched = len(server.requests)
    assert _run(url)["texts"] == remote["texts"]  # the second run reuses the cache: no weight fetched again
    assert {path for _, path, _ in server.requests[fetched:]} == {f"/tiny-w4/{MANIFEST_NAME}", "/tiny-w4/model.sig"}


def test_load_refuses_a_tampered_server_file_and_keeps_nothing(served: Path, cache: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in (served / "tiny-w4").iterdir():
        data = bytearray(path.read_bytes())
        if path.suffix == ".safetensors":
            data[-1] ^= 0x01
        (copy / path.name).write_bytes(bytes(data))
    with ArtifactServer(tmp_path, timeout=5.0) as server:
        result = runner.invoke(app, ["run", "hi", "-m", server.url + "copy/", "-n", "2"])
    assert result.exit_code == 1, result.output
    assert "Error:" in result.output and "SHA-256" in result.output
    assert not list(cache.rglob(MANIFEST_NAME))  # nothing under a final name


def test_a_local_directory_named_like_a_repo_id_is_loaded_not_pulled(
    served: Path, monkeypatch: pytest.MonkeyPatch, cache: Path
) -> None:
    monkeypatch.chdir(served.parent)
    local = f"{served.name}/tiny-w4"  # "org/name"-shaped, and a local directory: no network
    assert api.local_artifact(local) == local
    assert api.load(local).tokenizer is not None
