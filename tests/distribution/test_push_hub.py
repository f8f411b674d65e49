"""squeeze push against a mocked HfApi: exactly the listed files, the manifest and model.sig, byte for byte, and a
model card only when the repo has none; a damaged artifact is refused before anything is sent."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import huggingface_hub
import pytest
from pull_server import SHARD, build_artifact
from typer.testing import CliRunner

from squeeze.cli.app import app
from squeeze.distribution.model_card import read_eval_report, render_model_card
from squeeze.distribution.push import push_artifact
from squeeze.errors import ConfigError, IntegrityError
from squeeze.format import Provenance, seal_artifact
from squeeze.format.manifest import MANIFEST_NAME, parse_manifest


class FakeHfApi:
    """Records what push asks of the Hub (no network)."""

    instances: list[FakeHfApi] = []
    #: The files the repo already holds at the pushed revision (what model_info lists).
    repo_files: tuple[str, ...] = (".gitattributes",)

    def __init__(self, **kwargs: Any) -> None:
        self.init = kwargs
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.sent: dict[str, bytes] = {}
        FakeHfApi.instances.append(self)

    def create_repo(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("create_repo", args, kwargs))

    def create_branch(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("create_branch", args, kwargs))

    def model_info(self, repo_id: str, **kwargs: Any) -> Any:
        self.calls.append(("model_info", (repo_id,), kwargs))
        siblings = [SimpleNamespace(rfilename=name) for name in FakeHfApi.repo_files]
        return SimpleNamespace(sha="c0ffee" * 6 + "c0ff", siblings=siblings)

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
    FakeHfApi.repo_files = (".gitattributes",)
    monkeypatch.setattr(huggingface_hub, "HfApi", FakeHfApi)
    return FakeHfApi


def test_push_sends_exactly_the_listed_files_and_the_manifest(tmp_path, fake_api):
    artifact = build_artifact(tmp_path / "art")
    (artifact / "model.sig").write_bytes(b'{"bundle": "stand-in"}')  # verify allows it; push sends it along
    result = push_artifact(artifact, "org/model", token="hf_x", private=True, revision="v1", commit_message="hi")
    (api,) = fake_api.instances
    manifest = parse_manifest((artifact / MANIFEST_NAME).read_bytes())
    expected = {e.path for e in manifest.files} | {MANIFEST_NAME, "model.sig"}
    assert set(api.sent) == expected | {"README.md"}  # the card: uploaded beside the artifact, not in it
    assert all(api.sent[name] == (artifact / name).read_bytes() for name in expected)
    assert api.sent["README.md"] == render_model_card(artifact, "org/model").encode()
    assert [c[0] for c in api.calls] == ["create_repo", "create_branch", "model_info", "create_commit"]
    assert api.calls[0][2]["private"] is True and api.calls[0][2]["exist_ok"] is True
    assert api.calls[2][2]["revision"] == "v1"  # the README looked for on the branch pushed to
    commit = api.calls[3][2]
    assert commit["revision"] == "v1" and commit["commit_message"] == "hi"
    assert commit["parent_commit"] == "c0ffee" * 6 + "c0ff"  # a README added since makes the Hub refuse it
    assert api.init["token"] == "hf_x"
    assert (result.files, result.repo_id, result.revision) == (len(expected) + 1, "org/model", "v1")
    sent_bytes = sum((artifact / name).stat().st_size for name in expected) + len(api.sent["README.md"])
    assert result.bytes_uploaded == sent_bytes and result.model_card == "written"
    assert result.url == "https://hub.example/org/model/commit/abc"
    # what a pull fetches (the listed files) still verifies: the card is not part of the artifact
    assert "README.md" not in {e.path for e in manifest.files}


def test_a_readme_already_in_the_repo_is_never_replaced(tmp_path, fake_api):
    artifact = build_artifact(tmp_path / "art")
    fake_api.repo_files = (".gitattributes", "README.md", SHARD)
    result = push_artifact(artifact, "org/model")
    (api,) = fake_api.instances
    assert "README.md" not in api.sent and result.model_card == "repo_has_one"
    assert api.calls[-1][2]["parent_commit"] is None  # no card: nothing to guard


def test_the_artifacts_own_readme_is_its_card(tmp_path, fake_api):
    artifact = build_artifact(tmp_path / "art")
    (artifact / "README.md").write_text("# mine\n")
    seal_artifact(artifact, Provenance(source_model="unit-test"))  # listed: part of the artifact
    result = push_artifact(artifact, "org/model")
    (api,) = fake_api.instances
    assert api.sent["README.md"] == b"# mine\n" and result.model_card == "artifact_has_one"
    assert "model_info" not in [c[0] for c in api.calls]


def test_no_card_when_asked_not_to(tmp_path, fake_api):
    artifact = build_artifact(tmp_path / "art")
    result = push_artifact(artifact, "org/model", card=False)
    (api,) = fake_api.instances
    assert "README.md" not in api.sent and result.model_card == "off"
    assert [c[0] for c in api.calls] == ["create_repo", "create_commit"]


def test_the_cli_pushes_a_card_with_the_evaluation_table(tmp_path: Path, fake_api) -> None:
    artifact = build_artifact(tmp_path / "art")
    report = tmp_path / "eval.json"
    report.write_text(json.dumps({"results": {"arc_easy": {"acc,none": 0.5, "acc_stderr,none": 0.125}}}))
    args = ["push", str(artifact), "org/model", "--base-model", "org/base", "--eval-json", str(report), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["model_card"] == "written"
    (api,) = fake_api.instances
    expected = render_model_card(artifact, "org/model", base_model="org/base", evals=read_eval_report(report))
    assert api.sent["README.md"] == expected.encode() and "| arc_easy | acc | 0.5000 ± 0.1250 |" in expected
    # a bad report or base model fails before anything is sent
    FakeHfApi.instances.clear()
    report.write_text('{"accuracy": 1}')
    bad = CliRunner().invoke(app, ["push", str(artifact), "org/model", "--eval-json", str(report)])
    assert bad.exit_code != 0 and "not a squeeze eval --json report" in bad.stderr
    bad = CliRunner().invoke(app, ["push", str(artifact), "org/model", "--base-model", "nope"])
    assert bad.exit_code != 0 and "is not a Hub model id" in bad.stderr
    assert FakeHfApi.instances == []


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
