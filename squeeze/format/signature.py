"""Detached artifact signatures in the OpenSSF model signing format (``model.sig``, a Sigstore bundle).

The signature is a DSSE envelope over an in-toto statement listing every file of the artifact with its
SHA-256 ("files" serialization, as ``model_signing sign key`` writes it), the manifest included, so it
covers the provenance too. Git files (``.gitattributes``...), which model_signing always skips, are left out
of the list and covered through the manifest's digests. Signing reuses the digests ``verify_artifact`` just
checked, and checking a signature reuses the digests of a ``VerifyReport`` (or a downloaded manifest): no
file is hashed twice.
The two directions interoperate with the ``model_signing`` CLI (package ``model-signing`` 1.1.x):
``model_signing verify key`` accepts squeeze's signature and squeeze accepts ``model_signing sign key``'s.

``model_signing`` (and ``cryptography``, which it brings) is imported inside the functions that need it:
``import squeeze`` works without the ``sign`` extra, and the signing features then raise ConfigError.
"""

from __future__ import annotations

import os
import stat
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path, PurePosixPath
from typing import Any

from squeeze.errors import ConfigError, FormatError, IntegrityError
from squeeze.format.atomic import atomic_write_text
from squeeze.format.hashing import ProgressFn
from squeeze.format.manifest import MANIFEST_NAME, SIGNATURE_NAME, Manifest
from squeeze.format.paths import read_inside, short_path
from squeeze.format.signature_bundle import compare_digests, is_ignored, parse_bundle, verified_manifest
from squeeze.format.signing_keys import (
    KEY_HINT,
    ModelSigning,
    checked_signing_key,
    key_sha256,
    load_model_signing,
    load_public_key,
    one_line,
)
from squeeze.format.verify import VerifyReport, verify_artifact

#: A real signature is a few hundred bytes per file (one digest each); anything larger is refused unread.
MAX_SIGNATURE_BYTES = 16 * 2**20
#: What ``model_signing``'s hashing config ignores by default (its CLI records them in every signature).
GIT_PATHS = (".git", ".gitattributes", ".github", ".gitignore")


class SignatureWarning(UserWarning):
    """An artifact's signature stops applying (its bytes are replaced): the CLI prints it as one line."""


def warn_signature_dropped(directory: str | os.PathLike[str], why: str) -> bool:
    """Warn (SignatureWarning) when ``directory`` holds a ``model.sig`` that ``why`` (e.g. "calibrate-kv
    rewrites the artifact in place") makes stale; True when it did. Reads nothing but the directory entry."""
    if not os.path.lexists(Path(directory) / SIGNATURE_NAME):
        return False
    warnings.warn(
        SignatureWarning(
            f"{short_path(directory)} is signed, and {why}: the new artifact is written without {SIGNATURE_NAME} "
            "(the old signature would not match it); sign it again with `squeeze sign`"
        ),
        stacklevel=2,
    )
    return True


@dataclass(frozen=True)
class SignatureInfo:
    """A signature that checked out: who signed (the public key's digest) and what it covers."""

    #: Where the signature was read from (the artifact's model.sig), or "" for bytes given directly.
    path: str
    #: SHA-256 of the public key (PEM SubjectPublicKeyInfo bytes): the key hint model_signing records.
    key_sha256: str
    #: The model name recorded in the signature (informative only: the directory name when signed).
    model_name: str
    #: Files the signature lists with their digests, the manifest included.
    files: int
    #: Paths the signature leaves out (its serialization's ignore_paths), sorted.
    ignore_paths: tuple[str, ...] = ()
    #: True when the bundle carries an X.509 certificate chain (signed with a certificate).
    certificate: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": True,
            "path": self.path,
            "key_sha256": self.key_sha256,
            "model_name": self.model_name,
            "files": self.files,
            "ignore_paths": list(self.ignore_paths),
            "certificate": self.certificate,
        }


@dataclass(frozen=True)
class SignResult:
    """What ``sign_artifact`` wrote."""

    artifact_dir: str
    signature_path: str
    #: SHA-256 of the signer's public key (the hint in the bundle; ``squeeze verify --json`` shows the same).
    key_sha256: str
    #: Files signed, the manifest included.
    files: int
    #: Bytes read to verify the artifact before signing (the only pass over its files).
    bytes_hashed: int
    seconds: float
    certificate: bool = False
    ignore_paths: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {
            "artifact_dir": self.artifact_dir,
            "signature": self.signature_path,
            "key_sha256": self.key_sha256,
            "files": self.files,
            "bytes_hashed": self.bytes_hashed,
            "seconds": round(self.seconds, 4),
            "certificate": self.certificate,
            "ignore_paths": list(self.ignore_paths),
        }


@dataclass
class SignedVerifyReport(VerifyReport):
    """A VerifyReport with the outcome of the signature check (``squeeze verify --public-key``).

    A failed check is also one of ``problems`` (so ``ok`` is False); ``signature_error`` repeats it.
    """

    signature: SignatureInfo | None = None
    signature_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        section = (
            self.signature.to_dict() if self.signature is not None else {"ok": False, "error": self.signature_error}
        )
        return {**super().to_dict(), "signature": section}


def verify_with_signature(
    path: str | os.PathLike[str],
    public_key: str | os.PathLike[str],
    *,
    workers: int | None = None,
    progress: ProgressFn | None = None,
) -> SignedVerifyReport:
    """``verify_artifact``, then (when the files verify) ``check_signature`` on its report: one pass over the bytes.

    The key is checked first (ConfigError before anything is hashed). A signature that does not check out is
    a problem of the report (``ok`` False, exit 1 in the CLI), like any other integrity failure.
    """
    check_public_key(public_key)
    plain = verify_artifact(path, workers=workers, progress=progress)
    report = SignedVerifyReport(**{f.name: getattr(plain, f.name) for f in fields(plain)})
    if not report.ok:
        report.signature_error = "not checked: the artifact's files do not verify"
        return report
    try:
        report.signature = check_signature(report, public_key)
    except IntegrityError as exc:
        report.signature_error = exc.message
        report.problems.append(exc.message)
    return report


def check_public_key(public_key: str | os.PathLike[str]) -> str:
    """The SHA-256 of ``public_key`` (see SignatureInfo.key_sha256) if it can check signatures: a readable PEM EC
    key on a supported curve, with the ``sign`` extra installed. ConfigError otherwise. Reads no artifact."""
    load_model_signing()
    return key_sha256(load_public_key(public_key))


# ----------------------------------------------------------------------------------------------------------
# Signing


def sign_artifact(
    path: str | os.PathLike[str],
    private_key: str | os.PathLike[str],
    *,
    password: str | None = None,
    signing_certificate: str | os.PathLike[str] | None = None,
    certificate_chain: Sequence[str | os.PathLike[str]] = (),
    workers: int | None = None,
    progress: ProgressFn | None = None,
) -> SignResult:
    """Verify the artifact at ``path``, then sign the digests just verified and write ``model.sig`` atomically.

    ``private_key``: a PEM EC key (P-256, P-384 or P-521), encrypted with ``password`` if given. With
    ``signing_certificate`` (PEM, holding that key's public half) and optional ``certificate_chain`` the
    bundle carries the certificates (model_signing's certificate signer; it takes no password).
    Raises ConfigError (no ``sign`` extra, unreadable or unsupported key or certificate, wrong password),
    FormatError (unreadable manifest) and IntegrityError (the artifact does not verify: never signed).
    """
    started = time.perf_counter()
    ms = load_model_signing()
    key = checked_signing_key(private_key, password, signing_certificate, certificate_chain)
    report = verify_artifact(path, workers=workers, progress=progress)
    directory = Path(report.artifact_dir)
    if not report.ok:
        raise IntegrityError(
            f"refusing to sign {short_path(directory)}: {report.first_error()}",
            hint="a damaged artifact is never signed; run `squeeze verify` for the full report",
        )
    digests, ignore = _digests_to_sign(report)
    serialization = ms.manifest.SerializationType.from_args(
        {"method": "files", "hash_type": "sha256", "allow_symlinks": False, "ignore_paths": list(ignore)}
    )
    items = [
        ms.manifest.FileManifestItem(
            path=PurePosixPath(name), digest=ms.hashing_internal.Digest("sha256", bytes.fromhex(digest))
        )
        for name, digest in sorted(digests.items())
    ]
    model_manifest = ms.manifest.Manifest(directory.name, items, serialization)
    signature = _sign_manifest(ms, model_manifest, private_key, password, signing_certificate, certificate_chain)
    target = directory / SIGNATURE_NAME
    atomic_write_text(target, signature.bundle.to_json())
    return SignResult(
        artifact_dir=str(directory),
        signature_path=str(target),
        key_sha256=key_sha256(key.public_key()),
        files=len(items),
        bytes_hashed=report.bytes_hashed,
        seconds=time.perf_counter() - started,
        certificate=signing_certificate is not None,
        ignore_paths=ignore,
    )


def _digests_to_sign(report: VerifyReport) -> tuple[dict[str, str], tuple[str, ...]]:
    """(path -> SHA-256 hex of every file to sign, the manifest included; the ignore paths) from a passing report."""
    manifest = report.manifest
    if manifest is None:  # verify_artifact always sets it; a broken contract, not the user's mistake
        raise ValueError("verify_artifact returned no manifest")
    digests = {entry.path: entry.sha256 for entry in manifest.files}
    digests[MANIFEST_NAME] = report.manifest_sha256
    # what model_signing's CLI records. Its verifier skips the git paths whatever a signature says, so a git
    # file the manifest lists (.gitattributes) is left out here too: the signed manifest's digest covers it
    ignore = tuple(sorted([SIGNATURE_NAME, *GIT_PATHS]))
    digests = {path: digest for path, digest in digests.items() if not is_ignored(path, ignore)}
    return digests, ignore


def _sign_manifest(
    ms: ModelSigning,
    model_manifest: Any,
    private_key: str | os.PathLike[str],
    password: str | None,
    signing_certificate: str | os.PathLike[str] | None,
    certificate_chain: Sequence[str | os.PathLike[str]],
) -> Any:
    """model_signing's signature (its ``.bundle``) over ``model_manifest``, by the key or certificate signer."""
    try:
        if signing_certificate is None:
            # model_signing 1.1.1 hands its password (typed str) to cryptography, which takes bytes only
            secret: Any = password.encode("utf-8") if password is not None else None
            signer: Any = ms.ec_key.Signer(Path(private_key), secret)
        else:
            signer = ms.certificate.Signer(
                Path(private_key), Path(signing_certificate), [Path(c) for c in certificate_chain]
            )
        return signer.sign(ms.signing_internal.Payload(model_manifest))
    except (ValueError, TypeError, OSError) as exc:  # read again by the library: changed since checked above
        raise ConfigError(f"cannot sign with {short_path(private_key)}: {one_line(exc)}", hint=KEY_HINT) from None


# ----------------------------------------------------------------------------------------------------------
# Checking


def check_signature(report: VerifyReport, public_key: str | os.PathLike[str]) -> SignatureInfo:
    """Check the artifact's ``model.sig`` against ``report`` (a passing ``verify_artifact`` report).

    Nothing is hashed again: the signature's digests are compared with the manifest's entries, which the
    report verified, and with ``report.manifest_sha256``. Raises IntegrityError (no or unreadable
    model.sig, wrong key, tampered or over another artifact) and ConfigError (key file unreadable or of an
    unsupported type; no ``sign`` extra).
    """
    if report.manifest is None or not report.manifest_sha256:
        raise ValueError("check_signature needs a report from verify_artifact")
    if not report.ok:  # callers check first; a signature never vouches for a damaged artifact
        raise IntegrityError(f"{short_path(report.artifact_dir)} does not verify: {report.first_error()}")
    load_model_signing()
    load_public_key(public_key)  # a bad key is the user's mistake (exit 2), whatever model.sig holds
    directory = Path(report.artifact_dir)
    shown = short_path(directory / SIGNATURE_NAME)
    try:
        info = os.lstat(directory / SIGNATURE_NAME)
    except FileNotFoundError:
        raise IntegrityError(
            f"{short_path(directory)} is not signed (no {SIGNATURE_NAME})",
            hint="sign it with `squeeze sign ARTIFACT --private-key KEY.pem`, or drop --public-key",
        ) from None
    except OSError as exc:
        raise IntegrityError(f"cannot read {shown}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        raise IntegrityError(f"{shown} is not a regular file (a link or special file); it is refused")
    try:
        data = read_inside(directory, SIGNATURE_NAME, MAX_SIGNATURE_BYTES, name=shown)
    except FormatError as exc:
        raise IntegrityError(exc.message, hint=exc.hint) from None
    result = verify_signature_bytes(data, report.manifest, report.manifest_sha256, public_key)
    return SignatureInfo(
        str(directory / SIGNATURE_NAME),
        result.key_sha256,
        result.model_name,
        result.files,
        result.ignore_paths,
        result.certificate,
    )


def verify_signature_bytes(
    signature: bytes, manifest: Manifest, manifest_sha256: str, public_key: str | os.PathLike[str]
) -> SignatureInfo:
    """Check signature bytes (a ``model.sig``) over ``manifest``, whose exact bytes hash to ``manifest_sha256``.

    Passes when the bundle is signed by ``public_key`` and lists, with the same SHA-256, the manifest and
    every file it lists (less the paths the signature ignores; never the manifest). The files themselves
    are not read: the caller has verified them against ``manifest``, or will before using them (``squeeze
    pull`` checks a downloaded manifest this way before fetching the weights). Raises IntegrityError naming
    what differs (not a bundle, wrong key, tampered, over another artifact) and ConfigError (key file
    unreadable or not a supported EC key; no ``sign`` extra).
    """
    ms = load_model_signing()
    public = load_public_key(public_key)
    bundle, certificate = parse_bundle(signature, ms, public, public_key)
    signed = verified_manifest(ms, bundle, public, public_key)
    params = dict(signed.serialization_type)
    method, hash_type = params.get("method"), params.get("hash_type")
    if method != "files" or hash_type != "sha256":
        raise IntegrityError(
            f"{SIGNATURE_NAME} uses serialization {method!r} with hash {hash_type!r}; squeeze checks 'files' "
            "with 'sha256' (the digests its manifest holds)",
            hint="sign with `squeeze sign`, or `model_signing sign key` with its default hashing",
        )
    ignored = tuple(sorted(str(p) for p in params.get("ignore_paths", ()) or ()))
    signed_digests: dict[str, str] = {}
    for descriptor in signed.resource_descriptors():
        if descriptor.digest.algorithm != "sha256":
            raise IntegrityError(
                f"{SIGNATURE_NAME}: {descriptor.identifier} is signed with {descriptor.digest.algorithm}"
            )
        signed_digests[str(descriptor.identifier)] = descriptor.digest.digest_hex
    compare_digests(signed_digests, ignored, manifest, manifest_sha256)
    return SignatureInfo(
        path="",
        key_sha256=key_sha256(public),
        model_name=str(signed.model_name),
        files=len(signed_digests),
        ignore_paths=ignored,
        certificate=certificate,
    )


def signing_available() -> bool:
    """Whether the ``sign`` extra is installed (model_signing imports)."""
    try:
        load_model_signing()
    except ConfigError:
        return False
    return True
