"""squeeze push against a mocked HfApi: exactly the listed files, the manifest and model.sig, byte for byte;
a damaged artifact is refused before anything is sent."""

from __future__ import annotations

from typing import Any

import huggingface_hub
import pytest
from pull_server import SHARD, build_artifact

from squeeze.distribution.push import push_artifact
from squeeze.errors import ConfigError, IntegrityError
from squeeze.format.manifest import MANIFEST_NAME, parse_manifest


class FakeHfApi:
    """Records what push asks of the Hub (no network)."""

    instances: list[FakeHfApi] = []

    def __init__(self, **kwargs: Any) -> None:
        self.init = kwargs
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.sent: dict[str, bytes] = {}
        FakeHfApi.instances.append(self)

    def create_repo(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("create_repo", args, kwargs))

    def create_branch(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("create_branch", args, kwargs))

    def create_commit(self, repo_id: str, operations: list[Any], **kwargs: Any) -> Any:
        self.calls.append(("create_commit", (repo_id,), kwargs))
        for op in operations:
            data = op.path_or_fileobj
            self.sent[op.path_in_repo] = data if isinstance(data, bytes) else data.read()

        class Info:
            commit_url = f"https://hub.example/{repo_id}/commit/abc"

        return Info()


@pytest.fixture
def fake_api(monkeypatch: pytest.MonkeyPatch) -> type[FakeHfApi]:
    FakeHfApi.instances = []
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHfApi)
    return FakeHfApi


def test_push_sends_exactly_the_listed_files_and_the_manifest(tmp_path, fake_api):
    artifact = build_artifact(tmp_path / "art")
    (artifact / "model.sig").write_bytes(b'{"bundle": "stand-in"}')  # verify allows it; push sends it along
    result = push_artifact(artifact, "org/model", token="hf_x", private=True, revision="v1", commit_message="hi")
    (api,) = fake_api.instances
    manifest = parse_manifest((artifact / MANIFEST_NAME).read_bytes())
    expected = {e.path for e in manifest.files} | {MANIFEST_NAME, "model.sig"}
    assert set(api.sent) == expected
    assert all(api.sent[name] == (artifact / name).read_bytes() for name in expected)
    assert [c[0] for c in api.calls] == ["create_repo", "create_branch", "create_commit"]
    assert api.calls[0][2]["private"] is True and api.calls[0][2]["exist_ok"] is True
    assert api.calls[2][2]["revision"] == "v1" and api.calls[2][2]["commit_message"] == "hi"
    assert api.init["token"] == "hf_x"
    assert (result.files, result.repo_id, result.revision) == (len(expected), "org/model", "v1")
    assert result.bytes_uploaded == sum((artifact / name).stat().st_size for name in expected)
    assert result.url == "https://hub.example/org/model/commit/abc"


def test_damaged_artifact_is_refused_before_any_upload(tmp_path, fake_api):
    artifact = build_artifact(tmp_path / "art")
    data = bytearray((artifact / SHARD).read_bytes())
    data[100] ^= 1
    (artifact / SHARD).write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=f"does not verify: {SHARD}"):
        push_artifact(artifact, "org/model")
    assert fake_api.instances == []


def test_unlisted_file_is_refused(tmp_path, fake_api):
    artifact = build_artifact(tmp_path / "art")
    (artifact / "secret.env").write_text("TOKEN=1")
    with pytest.raises(IntegrityError, match="secret.env"):
        push_artifact(artifact, "org/model")
    assert fake_api.instances == []


def test_bad_repo_ids(tmp_path, fake_api):
    artifact = build_artifact(tmp_path / "art")
    for bad in ("https://hub/x/y", "org/model@main", "just-a-name"):
        with pytest.raises(ConfigError):
            push_artifact(artifact, bad)
    assert fake_api.instances == []
