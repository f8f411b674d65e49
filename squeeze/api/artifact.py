"""The artifact verbs: verify, sign, inspect, pull, push, and ``local_artifact`` (a source as a local path).

Cheap at import: verification and inspection read headers and hashes only; signing, downloads and uploads
import what they need inside the verb.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from squeeze.format.inspect import ArtifactInfo, inspect_artifact
from squeeze.format.verify import VerifyReport, verify_artifact

if TYPE_CHECKING:
    from squeeze.distribution.pull import PullResult
    from squeeze.distribution.push import PushResult
    from squeeze.format.signature import SignResult

ProgressFn = Callable[[int, int], None]


def verify_model_integrity(
    path: str | os.PathLike[str],
    *,
    workers: int | None = None,
    progress: ProgressFn | None = None,
    public_key: str | os.PathLike[str] | None = None,
) -> VerifyReport:
    """Check every file of an artifact against its manifest (size and SHA-256, streamed, in parallel).

    ``path`` is the artifact directory or its ``squeeze.manifest.json``. Returns a VerifyReport whose
    ``ok`` is True only if the artifact is intact. Raises FormatError when the manifest is missing or
    malformed (nothing can be checked). ``progress(done_bytes, total_bytes)`` is called from worker threads.
    ``public_key`` (PEM, EC): also check the artifact's ``model.sig`` against the digests just verified (no
    second read); the report is then a SignedVerifyReport (``signature``, and a "signature" section in
    ``to_dict``), and a missing, foreign or stale signature is one of its problems. ConfigError for a key
    that cannot check signatures (or without the ``sign`` extra), before anything is hashed.
    """
    if public_key is not None:
        from squeeze.format.signature import verify_with_signature

        return verify_with_signature(path, public_key, workers=workers, progress=progress)
    return verify_artifact(path, workers=workers, progress=progress)


def sign(
    path: str | os.PathLike[str],
    private_key: str | os.PathLike[str],
    *,
    password: str | None = None,
    signing_certificate: str | os.PathLike[str] | None = None,
    certificate_chain: Sequence[str | os.PathLike[str]] = (),
    workers: int | None = None,
    progress: ProgressFn | None = None,
) -> SignResult:
    """Sign an artifact: verify it, then write ``model.sig`` (an OpenSSF model signing bundle) into it.

    The signature lists every file with its SHA-256, the manifest (and so the provenance) included, as
    ``model_signing sign key`` would: ``model_signing verify key`` accepts it, and :func:`verify_model_integrity`
    / :func:`load` with ``public_key`` check it. The digests are the ones verification computed (one pass
    over the bytes). ``private_key``: PEM EC key (P-256/384/521), decrypted with ``password`` if given;
    ``signing_certificate`` (+ ``certificate_chain``) embeds an X.509 chain (model_signing's certificate
    signer). Raises IntegrityError when the artifact does not verify (nothing is signed), ConfigError for
    an unusable key or certificate or without the ``sign`` extra (``pip install 'squeeze[sign]'``).
    """
    from squeeze.format.signature import sign_artifact

    return sign_artifact(
        path,
        private_key,
        password=password,
        signing_certificate=signing_certificate,
        certificate_chain=certificate_chain,
        workers=workers,
        progress=progress,
    )


def inspect(path: str | os.PathLike[str]) -> ArtifactInfo:
    """Summarise an artifact (files, tensors by role, bits per weight, KV bytes per token, manifest status).

    Reads headers and config.json only (config.json once, through the hardened size-capped read).
    """
    from squeeze.quant.kv_bytes import kv_bytes_table

    info = inspect_artifact(path)
    try:
        kv = info.quantization.kv_cache if info.quantization is not None else None
        info.kv_bytes_per_token = kv_bytes_table(info.config, kv) if info.config is not None else None
    except (ValueError, TypeError, AttributeError, ArithmeticError, KeyError):  # no decoder config: nothing to size
        info.kv_bytes_per_token = None
    return info


def pull(
    source: str,
    output: str | os.PathLike[str] | None = None,
    *,
    public_key: str | os.PathLike[str] | None = None,
    workers: int | None = None,
    progress: ProgressFn | None = None,
    min_rate: float | None = None,
    deadline: float | None = None,
) -> PullResult:
    """Download an artifact and verify every byte against its manifest before keeping it.

    ``source``: an ``https://`` / ``http://`` URL of an artifact directory, or a Hugging Face Hub repo id.
    ``output`` (default: the local artifact cache) appears only once every file is complete and verified;
    an interrupted pull resumes from its partial files. ``public_key``: the artifact must carry a signature
    by that key. ``progress(done_bytes, total_bytes)`` is called from worker threads. ``min_rate``: bytes/s
    the transfer must average over a minute (default ``$SQUEEZE_PULL_MIN_RATE``, else 4096; 0: off);
    ``deadline``: seconds the whole pull may take (default ``$SQUEEZE_PULL_DEADLINE``, else none); passing
    either raises TransferError (rerun to resume).
    """
    from squeeze.distribution.pull import pull_artifact

    return pull_artifact(
        source,
        output,
        public_key=public_key,
        workers=workers,
        progress=progress,
        min_rate=min_rate,
        deadline=deadline,
    )


def push(
    path: str | os.PathLike[str],
    repo_id: str,
    *,
    token: str | None = None,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    card: bool = True,
    base_model: str | None = None,
    eval_reports: Sequence[str | os.PathLike[str]] = (),
) -> PushResult:
    """Verify the artifact at ``path`` and upload it to the Hugging Face Hub repo ``repo_id``, with a model card
    (``README.md``) when ``card`` and neither the artifact nor the repo has one: ``base_model`` (a Hub id; default
    the manifest's source when it is one) in its front matter, and the table of the ``squeeze eval --json``
    reports ``eval_reports`` (files, read and checked before anything is sent)."""
    from squeeze.distribution.model_card import read_eval_report
    from squeeze.distribution.push import push_artifact

    evals = [row for report in eval_reports for row in read_eval_report(report)]
    return push_artifact(
        path,
        repo_id,
        token=token,
        private=private,
        revision=revision,
        commit_message=commit_message,
        card=card,
        base_model=base_model,
        evals=evals,
    )


def local_artifact(
    source: str | os.PathLike[str],
    *,
    public_key: str | os.PathLike[str] | None = None,
    progress: ProgressFn | None = None,
) -> str:
    """``source`` as a local artifact path: a local path as it is (ConfigError "no such artifact directory"
    when it does not exist); an ``https://`` / ``http://`` URL or ``hf://org/name[@revision]`` pulled
    (:func:`pull`) into the artifact cache first, or found there complete
    (``${SQUEEZE_CACHE:-~/.cache/squeeze}/artifacts``). A bare ``org/name`` is a local path: only ``hf://``
    (or :func:`pull`) downloads from the Hub, and never while ``HF_HUB_OFFLINE`` is set. What :func:`load` and
    ``squeeze run -m`` do with such a source; the loader then verifies the directory as always."""
    from squeeze.distribution.pull import existing_artifact_dir, resolve_source
    from squeeze.distribution.remote import is_remote

    text = os.fspath(source)
    if not is_remote(text):
        existing_artifact_dir(text)
        return text

    return os.fspath(resolve_source(text, public_key=public_key, progress=progress))


__all__ = ["verify_model_integrity", "sign", "inspect", "pull", "push", "local_artifact", "ProgressFn"]
