"""resolve_source: local paths as they are, URLs and repo ids pulled into the artifact cache once per version."""

from __future__ import annotations

import pytest
from pull_server import ArtifactServer, build_artifact

from squeeze.distribution.cache import cache_root
from squeeze.distribution.pull import resolve_source
from squeeze.errors import ConfigError, TransferError
from squeeze.format.manifest import MANIFEST_NAME
from squeeze.format.verify import verify_artifact


def test_cache_root_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("SQUEEZE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "squeeze"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "squeeze"
    monkeypatch.setenv("SQUEEZE_CACHE", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"


def test_local_path_is_returned_as_is(tmp_path, cache):
    local = build_artifact(tmp_path / "org" / "model")
    assert resolve_source(str(local)) == local
    assert not cache.exists()


def test_url_is_pulled_into_the_cache_once(server, served, cache):
    first = resolve_source(server.url)
    assert first.is_relative_to(cache / "artifacts") and verify_artifact(first).ok
    assert (first / MANIFEST_NAME).read_bytes() == (served / MANIFEST_NAME).read_bytes()
    server.requests.clear()
    assert resolve_source(server.url) == first
    assert all(r[1].endswith((MANIFEST_NAME, "model.sig")) for r in server.requests)  # nothing downloaded again


def test_a_new_version_at_the_source_gets_its_own_directory(server, served, cache):
    first = resolve_source(server.url)
    (served / "config.json").write_text('{"model_type": "llama", "v": 2}\n')
    (served / MANIFEST_NAME).unlink()
    from squeeze.format.verify import seal_artifact

    seal_artifact(served, chunk_bytes=4096)
    second = resolve_source(server.url)
    assert second != first and second.parent == first.parent
    assert verify_artifact(first).ok and verify_artifact(second).ok


def test_a_missing_local_path_is_no_such_artifact_directory(cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="no such artifact directory: no such thing here") as plain:
        resolve_source("no such thing here")
    assert "hf://" not in (plain.value.hint or "")
    with pytest.raises(ConfigError, match="no such artifact directory: t/nope") as shaped:
        resolve_source("t/nope")  # a repo id's shape, yet a local path: never the Hub
    assert "hf://t/nope" in (shaped.value.hint or "")
    assert not cache.exists()


def test_offline_falls_back_to_the_latest_complete_pull(served, cache, monkeypatch):
    monkeypatch.setattr("squeeze.distribution.pull.time.sleep", lambda _s: None)  # no backoff between retries
    with ArtifactServer(served) as server:
        url = server.url
        pulled = resolve_source(url)
    # the server is gone: the cached pull is used (load verifies it), unless a signature was asked for
    assert resolve_source(url) == pulled
    with pytest.raises(TransferError):
        resolve_source(url, public_key="unused.pem")
    with pytest.raises(TransferError):
        resolve_source(url + "other/")  # another source: nothing cached for it
