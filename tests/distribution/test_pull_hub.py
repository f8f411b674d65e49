"""squeeze pull from a Hub repo id, against a local server that serves the Hub's resolve layout (no network):
HF_ENDPOINT honoured, the token sent to the Hub only, files pinned to the manifest's commit, the Hub cache used."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pull_server import SHARD, ArtifactServer, HubRepo, build_artifact

from squeeze import api
from squeeze.distribution.pull import pull_artifact
from squeeze.distribution.remote import parse_source
from squeeze.errors import ConfigError, FormatError
from squeeze.format.manifest import MANIFEST_NAME
from squeeze.format.verify import verify_artifact

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def source_dir(tmp_path: Path) -> Path:
    return build_artifact(tmp_path / "served")


@pytest.fixture
def hub(source_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ArtifactServer]:
    with ArtifactServer(timeout=5.0) as server:
        server.hub["org/model"] = HubRepo(source_dir, COMMIT)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the suite's default; this "Hub" is local
        monkeypatch.setenv("HF_ENDPOINT", server.url.rstrip("/"))
        monkeypatch.setenv("HF_TOKEN", "hf_squeeze_test_token")
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        yield server


def test_repo_id_pulls_through_the_endpoint_pinned_to_the_manifest_commit(hub, source_dir, tmp_path):
    out = tmp_path / "out"
    result = pull_artifact("org/model", out)
    assert verify_artifact(out).ok and result.bytes_downloaded > 0
    paths = [r[1] for r in hub.requests]
    assert paths[0] == f"/org/model/resolve/main/{MANIFEST_NAME}"
    assert all(p.startswith(f"/org/model/resolve/{COMMIT}/") for p in paths[1:])  # a moving branch cannot mix
    assert f"/org/model/resolve/{COMMIT}/{SHARD}" in paths
    assert all(h.get("authorization") == "Bearer hf_squeeze_test_token" for h in hub.headers_seen)
    assert all("squeeze/" in h.get("user-agent", "") for h in hub.headers_seen)


def test_token_is_not_sent_to_another_host_after_a_redirect(hub, source_dir, tmp_path):
    with ArtifactServer(host="127.0.0.1") as cdn:
        cdn.hub["org/model"] = HubRepo(source_dir, COMMIT)
        hub.faults.redirect_to = f"http://localhost:{cdn.port}"
        pull_artifact("org/model", tmp_path / "out")
    assert cdn.headers_seen and not any("authorization" in h for h in cdn.headers_seen)
    assert all("authorization" in h for h in hub.headers_seen)


def test_files_in_the_hub_cache_are_rehashed_and_reused(hub, source_dir, tmp_path):
    snapshot = tmp_path / "hf-cache" / "models--org--model" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    shutil.copy(source_dir / SHARD, snapshot / SHARD)  # what huggingface_hub's own download left
    (snapshot / "config.json").write_bytes(b"x" * (source_dir / "config.json").stat().st_size)  # stale, same size
    out = tmp_path / "out"
    result = pull_artifact("org/model", out)
    assert verify_artifact(out).ok
    fetched = {r[1].rsplit("/", 1)[-1] for r in hub.requests}
    assert SHARD not in fetched and "config.json" in fetched
    assert result.bytes_reused == (source_dir / SHARD).stat().st_size


def test_unknown_repo_is_not_an_artifact(hub, tmp_path):
    with pytest.raises(FormatError, match="not a squeeze artifact"):
        pull_artifact("org/other", tmp_path / "out")


def test_repo_id_forms():
    assert parse_source("org/name").repo_id == "org/name"
    pinned = parse_source("org/name@v1.0")
    assert (pinned.repo_id, pinned.revision) == ("org/name", "v1.0")
    for bad in ("org", "org/../x", "/abs/path", "org/name/extra", "-org/name"):
        with pytest.raises(ConfigError):
            parse_source(bad)


def test_hf_scheme_names_the_same_repo(hub, tmp_path):
    explicit = parse_source("hf://org/name@v1.0")
    assert (explicit.repo_id, explicit.revision) == ("org/name", "v1.0")
    out = tmp_path / "out"
    pull_artifact("hf://org/model", out)
    assert verify_artifact(out).ok


def test_a_bare_repo_id_is_a_local_path_everywhere_but_pull(hub, tmp_path, monkeypatch):
    """``run -m org/name`` / ``load("org/name")`` never reach the Hub: a missing directory is an error that shows
    the explicit form; ``hf://org/name`` downloads."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SQUEEZE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match="no such artifact directory: org/model") as caught:
        api.local_artifact("org/model")
    assert "hf://org/model" in (caught.value.hint or "")
    assert not hub.requests
    pulled = api.local_artifact("hf://org/model")
    assert verify_artifact(pulled).ok and hub.requests


def test_nothing_is_downloaded_from_the_hub_while_offline(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("SQUEEZE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for call in (lambda: api.local_artifact("hf://org/model"), lambda: pull_artifact("org/model", tmp_path / "o")):
        with pytest.raises(ConfigError, match="HF_HUB_OFFLINE"):
            call()
    assert not hub.requests and not (tmp_path / "o").exists()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    pulled = api.local_artifact("hf://org/model")  # a complete pull in the cache ...
    hub.requests.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert api.local_artifact("hf://org/model") == str(pulled)  # ... is what offline use finds, with no request
    assert not hub.requests


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) for a network namespace")
def test_cli_typo_never_reaches_the_network(tmp_path):
    """``squeeze run Hello -m t/nope`` in a process with no network at all (its own network namespace): a
    regression that tried the Hub would fail differently ("cannot download")."""
    if subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare --net is not permitted here")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "SQUEEZE_CACHE": str(tmp_path / "cache")}
    for argv in (["run", "Hello", "-m", "t/nope"], ["serve", "t/nope"]):
        done = subprocess.run(
            ["unshare", "--net", sys.executable, "-m", "squeeze", *argv],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, done.stderr
        assert "no such artifact directory: t/nope" in done.stderr and "hf://t/nope" in done.stderr
        assert "download" not in done.stderr.split("Hint")[0]
