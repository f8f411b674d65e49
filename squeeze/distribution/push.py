"""``squeeze push``: upload a verified artifact to the Hugging Face Hub.

The artifact is verified first (every listed file hashed against the manifest); a damaged one raises
IntegrityError before anything is sent. Then one Hub commit adds exactly the listed files, the manifest
(its bytes as verified) and ``model.sig`` when present; nothing else in the directory is uploaded. Files
are handed to huggingface_hub as file objects opened through the hardened path (no symlinks, regular files).
Files already in the repo that the artifact does not list are left as they are (``squeeze pull`` reads only
what the manifest lists).

The same commit adds a model card (``README.md``, squeeze.distribution.model_card) when neither the artifact
nor the repo has one: the card is uploaded beside the artifact, never listed in its manifest. A README already
in the repo is never replaced: the commit names the revision it checked as its parent, so a README added in
between makes the Hub refuse the commit rather than lose it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from squeeze.errors import ConfigError, IntegrityError
from squeeze.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, SIGNATURE_NAME
from squeeze.format.paths import open_inside, open_root, read_inside, short_path
from squeeze.version import __version__

if TYPE_CHECKING:
    from huggingface_hub import HfApi

    from squeeze.distribution.model_card import EvalRow
    from squeeze.format.manifest import Manifest

#: What became of the model card: written by this push; not written because the repo already has a README.md,
#: or because the artifact lists one (uploaded as it is); or not asked for.
CardOutcome = Literal["written", "repo_has_one", "artifact_has_one", "off"]

#: A signature is a few hundred bytes per file; anything larger is not one.
MAX_SIGNATURE_BYTES = 16 * 2**20


@dataclass(frozen=True)
class PushResult:
    """What was uploaded where."""

    repo_id: str
    revision: str | None
    files: int
    bytes_uploaded: int
    url: str | None = None
    model_card: CardOutcome = "off"

    def to_dict(self) -> dict[str, Any]:
        return {
            "repo_id": self.repo_id,
            "revision": self.revision,
            "files": self.files,
            "bytes_uploaded": self.bytes_uploaded,
            "url": self.url,
            "model_card": self.model_card,
        }


def push_artifact(
    path: str | os.PathLike[str],
    repo_id: str,
    *,
    token: str | None = None,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    card: bool = True,
    base_model: str | None = None,
    evals: Sequence[EvalRow] = (),
) -> PushResult:
    """Verify the artifact at ``path`` and upload every file it lists (manifest and signature included) to the
    Hub repo ``repo_id`` (created when missing; ``revision``: a branch, created when missing) in one commit.

    ``token``: a Hub token (default: huggingface_hub's own, HF_TOKEN or ``hf auth login``). Raises
    IntegrityError (the artifact does not verify: nothing is uploaded), FormatError (no manifest),
    ConfigError (a malformed repo id); huggingface_hub's errors (auth, network) pass through.

    ``card``: add a model card (``README.md``) when neither the artifact nor the repo has one, rendered by
    :func:`squeeze.distribution.model_card.render_model_card` with ``base_model`` and ``evals`` (rows of
    ``squeeze eval --json`` reports).
    """
    verified = _verified(path, repo_id)
    card_bytes, outcome = _rendered_card(verified, repo_id, card, base_model, evals)

    from huggingface_hub import HfApi

    api = HfApi(token=token, library_name="squeeze", library_version=__version__)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    if revision is not None:
        api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
    parent = None
    if card_bytes is not None:
        from squeeze.distribution.model_card import CARD_NAME

        info = api.model_info(repo_id, revision=revision)
        if any(sibling.rfilename == CARD_NAME for sibling in info.siblings or ()):
            card_bytes, outcome = None, "repo_has_one"
        else:
            parent, outcome = info.sha, "written"
    message = commit_message or f"squeeze push: artifact {verified.manifest.root_digest[:16]}"
    files, commit = _commit(api, repo_id, verified, card_bytes, revision, message, parent)
    uploaded = (
        verified.manifest.total_size
        + len(verified.manifest_bytes)
        + len(verified.signature or b"")
        + len(card_bytes or b"")
    )
    return PushResult(
        repo_id=repo_id,
        revision=revision,
        files=files,
        bytes_uploaded=uploaded,
        url=getattr(commit, "commit_url", None),
        model_card=outcome,
    )


@dataclass(frozen=True)
class _Verified:
    """An artifact that verified: its directory, manifest (and the manifest's bytes as verified), signature."""

    directory: Path
    manifest: Manifest
    manifest_bytes: bytes
    signature: bytes | None


def _verified(path: str | os.PathLike[str], repo_id: str) -> _Verified:
    """The artifact at ``path``, verified before anything is sent (ConfigError for a repo id that is not one,
    IntegrityError for an artifact that does not verify or whose manifest changed meanwhile)."""
    from squeeze.distribution.remote import parse_source
    from squeeze.format.verify import verify_artifact

    if "://" in repo_id or parse_source(repo_id).revision is not None:
        raise ConfigError(f"{repo_id!r} is not a Hub repo id", hint="pass org/name; the branch goes in --revision")
    report = verify_artifact(path)
    if not report.ok or report.manifest is None:
        raise IntegrityError(
            f"{short_path(report.artifact_dir)} does not verify: {report.first_error()}",
            hint="nothing was uploaded; run squeeze verify on it, and push an intact artifact",
        )
    directory = Path(report.artifact_dir)
    manifest_bytes = read_inside(directory, MANIFEST_NAME, MAX_MANIFEST_BYTES)
    if hashlib.sha256(manifest_bytes).hexdigest() != report.manifest_sha256:
        raise IntegrityError(
            f"{short_path(directory / MANIFEST_NAME)} changed while the artifact was being verified",
            hint="nothing was uploaded; push again once nothing writes to the artifact",
        )
    signature = None
    if (directory / SIGNATURE_NAME).exists():
        signature = read_inside(directory, SIGNATURE_NAME, MAX_SIGNATURE_BYTES)
    return _Verified(directory, report.manifest, manifest_bytes, signature)


def _rendered_card(
    verified: _Verified, repo_id: str, card: bool, base_model: str | None, evals: Sequence[EvalRow]
) -> tuple[bytes | None, CardOutcome]:
    """The model card to add (None: none) and the outcome so far; rendered before anything is sent, so a bad
    ``--base-model`` fails here."""
    from squeeze.distribution.model_card import CARD_NAME, render_model_card

    if card and CARD_NAME in verified.manifest.entry_map():
        return None, "artifact_has_one"
    if card:
        rendered = render_model_card(verified.directory, repo_id, base_model=base_model, evals=evals)
        return rendered.encode("utf-8"), "off"
    return None, "off"


def _commit(
    api: HfApi,
    repo_id: str,
    verified: _Verified,
    card_bytes: bytes | None,
    revision: str | None,
    message: str,
    parent: str | None,
) -> tuple[int, Any]:
    """One Hub commit adding every listed file (opened through the hardened path), the manifest, the signature
    and the card: (files in it, huggingface_hub's CommitInfo)."""
    from huggingface_hub import CommitOperationAdd

    from squeeze.distribution.model_card import CARD_NAME

    root_fd = open_root(verified.directory)
    with contextlib.ExitStack() as stack:
        stack.callback(os.close, root_fd)
        operations = []
        for entry in verified.manifest.files:
            handle = stack.enter_context(os.fdopen(open_inside(root_fd, entry.path), "rb"))
            operations.append(CommitOperationAdd(path_in_repo=entry.path, path_or_fileobj=handle))
        operations.append(CommitOperationAdd(path_in_repo=MANIFEST_NAME, path_or_fileobj=verified.manifest_bytes))
        if verified.signature is not None:
            operations.append(CommitOperationAdd(path_in_repo=SIGNATURE_NAME, path_or_fileobj=verified.signature))
        if card_bytes is not None:
            operations.append(CommitOperationAdd(path_in_repo=CARD_NAME, path_or_fileobj=card_bytes))
        commit = api.create_commit(
            repo_id,
            operations,
            commit_message=message,
            revision=revision,
            repo_type="model",
            parent_commit=parent,
        )
    return len(operations), commit
