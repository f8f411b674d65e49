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

import base64
import contextlib
import hashlib
import io
import os
import stat
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path, PurePosixPath
from types import ModuleType
from typing import TYPE_CHECKING, Any

from squeeze.errors import ConfigError, FormatError, IntegrityError
from squeeze.format.atomic import atomic_write_text
from squeeze.format.hashing import ProgressFn
from squeeze.format.manifest import MANIFEST_NAME, SIGNATURE_NAME, Manifest, strict_json_loads
from squeeze.format.paths import read_inside, read_user_file, short_path
from squeeze.format.verify import VerifyReport, verify_artifact

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePrivateKey, EllipticCurvePublicKey

#: A real signature is a few hundred bytes per file (one digest each); anything larger is refused unread.
MAX_SIGNATURE_BYTES = 16 * 2**20
#: Key, certificate and chain files are PEM text of a few KB.
MAX_KEY_BYTES = 1 * 2**20
#: What ``model_signing``'s hashing config ignores by default (its CLI records them in every signature).
GIT_PATHS = (".git", ".gitattributes", ".github", ".gitignore")
#: The curves model_signing 1.1 signs and verifies with (Sigstore's protobuf specs allow these).
SUPPORTED_CURVES = ("secp256r1", "secp384r1", "secp521r1")
INSTALL_HINT = "pip install 'squeeze[sign]'  (model-signing>=1.1.1,<1.2 and pyopenssl)"
KEY_HINT = "make one with: openssl ecparam -genkey -name prime256v1 -noout -out key.pem"


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
    _model_signing()
    return _key_sha256(_load_public_key(public_key))


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
    ms = _model_signing()
    key = _load_private_key(private_key, password)
    if signing_certificate is None and certificate_chain:
        raise ConfigError("a certificate chain needs a signing certificate", hint="add --signing-certificate CERT.pem")
    if signing_certificate is not None:
        if password is not None:
            raise ConfigError(
                "model_signing's certificate signer takes no key password",
                hint="sign with an unencrypted key (openssl ec -in key.pem -out plain.pem), or without a certificate",
            )
        _check_certificate(signing_certificate, key)
        for chain_file in certificate_chain:
            _read_small(chain_file, "certificate chain file")
    report = verify_artifact(path, workers=workers, progress=progress)
    directory = Path(report.artifact_dir)
    if not report.ok:
        raise IntegrityError(
            f"refusing to sign {short_path(directory)}: {report.first_error()}",
            hint="a damaged artifact is never signed; run `squeeze verify` for the full report",
        )
    manifest = report.manifest
    if manifest is None:  # verify_artifact always sets it; a broken contract, not the user's mistake
        raise ValueError("verify_artifact returned no manifest")
    digests = {entry.path: entry.sha256 for entry in manifest.files}
    digests[MANIFEST_NAME] = report.manifest_sha256
    # what model_signing's CLI records. Its verifier skips the git paths whatever a signature says, so a git
    # file the manifest lists (.gitattributes) is left out here too: the signed manifest's digest covers it
    ignore = tuple(sorted([SIGNATURE_NAME, *GIT_PATHS]))
    digests = {path: digest for path, digest in digests.items() if not _ignored(path, ignore)}
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
    try:
        if signing_certificate is None:
            # model_signing 1.1.1 hands its password (typed str) to cryptography, which takes bytes only
            secret: Any = password.encode("utf-8") if password is not None else None
            signer: Any = ms.ec_key.Signer(Path(private_key), secret)
        else:
            signer = ms.certificate.Signer(
                Path(private_key), Path(signing_certificate), [Path(c) for c in certificate_chain]
            )
        signature = signer.sign(ms.signing_internal.Payload(model_manifest))
    except (ValueError, TypeError, OSError) as exc:  # read again by the library: changed since checked above
        raise ConfigError(f"cannot sign with {short_path(private_key)}: {_one_line(exc)}", hint=KEY_HINT) from None
    target = directory / SIGNATURE_NAME
    atomic_write_text(target, signature.bundle.to_json())
    return SignResult(
        artifact_dir=str(directory),
        signature_path=str(target),
        key_sha256=_key_sha256(key.public_key()),
        files=len(items),
        bytes_hashed=report.bytes_hashed,
        seconds=time.perf_counter() - started,
        certificate=signing_certificate is not None,
        ignore_paths=ignore,
    )


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
    _model_signing()
    _load_public_key(public_key)  # a bad key is the user's mistake (exit 2), whatever model.sig holds
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
    ms = _model_signing()
    public = _load_public_key(public_key)
    bundle, certificate = _parse_bundle(signature, ms, public, public_key)
    try:
        # the key as already read (model_signing would open the path again: a FIFO swapped in since would hang)
        with tempfile.TemporaryDirectory(prefix="squeeze-key-") as private:
            key_copy = Path(private) / "key.pub.pem"
            key_copy.write_bytes(_public_pem(public))
            verifier = ms.ec_key.Verifier(key_copy)
            # a bundle without a key hint makes the verifier print a warning on stdout: squeeze's output is its own
            with contextlib.redirect_stdout(io.StringIO()):
                signed = verifier.verify(ms.sigstore_pb.Signature(bundle))
    except ms.InvalidSignature:
        raise IntegrityError(
            f"{SIGNATURE_NAME} was not made with the key {short_path(public_key)} (signature check failed)",
            hint="pass the public key of whoever signed the artifact; if it is the right one, model.sig was altered",
        ) from None
    except Exception as exc:  # noqa: BLE001 - the library raises ValueError, KeyError, TypeError, binascii.Error...
        text = _one_line(exc)
        if text.startswith("Key mismatch"):
            raise IntegrityError(
                f"{SIGNATURE_NAME} was signed by another key than {short_path(public_key)}",
                hint="pass the public key of whoever signed the artifact",
            ) from None
        raise IntegrityError(f"{SIGNATURE_NAME} is not a valid model signature: {text}") from None
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
    _compare(signed_digests, ignored, manifest, manifest_sha256)
    return SignatureInfo(
        path="",
        key_sha256=_key_sha256(public),
        model_name=str(signed.model_name),
        files=len(signed_digests),
        ignore_paths=ignored,
        certificate=certificate,
    )


def _compare(signed: dict[str, str], ignored: tuple[str, ...], manifest: Manifest, manifest_sha256: str) -> None:
    """The signed digests must be the manifest's (its own bytes' digest included), less the ignored paths."""
    if _ignored(MANIFEST_NAME, ignored):
        raise IntegrityError(f"{SIGNATURE_NAME} does not cover {MANIFEST_NAME} (its ignore_paths exclude it)")
    theirs = signed.get(MANIFEST_NAME)
    if theirs is None:
        raise IntegrityError(
            f"{SIGNATURE_NAME} does not list {MANIFEST_NAME}: it was made over another directory",
            hint="sign the sealed artifact (squeeze sign), manifest included",
        )
    if theirs != manifest_sha256:
        raise IntegrityError(
            f"{SIGNATURE_NAME} signs another artifact: {MANIFEST_NAME} has SHA-256 {manifest_sha256[:16]}..., "
            f"the signature's is {theirs[:16]}... (the artifact changed after signing, or the signature is another's)",
            hint="re-sign the artifact with `squeeze sign` if this version is the one to trust",
        )
    expected = {entry.path: entry.sha256 for entry in manifest.files if not _ignored(entry.path, ignored)}
    expected[MANIFEST_NAME] = manifest_sha256
    missing = sorted(set(expected) - set(signed))
    extra = sorted(set(signed) - set(expected))
    changed = sorted(p for p in set(expected) & set(signed) if expected[p] != signed[p])
    if missing or extra or changed:
        parts = []
        if changed:
            parts.append(f"digest differs for {_names(changed)}")
        if missing:
            parts.append(f"unsigned: {_names(missing)}")
        if extra:
            parts.append(f"signed but not in the manifest: {_names(extra)}")
        raise IntegrityError(f"{SIGNATURE_NAME} signs another artifact: {'; '.join(parts)}")


def _names(paths: list[str], keep: int = 3) -> str:
    shown = ", ".join(short_path(p, 60) for p in paths[:keep])
    return shown + (f" and {len(paths) - keep} more" if len(paths) > keep else "")


def _ignored(path: str, ignore_paths: tuple[str, ...]) -> bool:
    """Whether model_signing leaves ``path`` out: it lies at or under one of ``ignore_paths``."""
    pure = PurePosixPath(path)
    return any(pure.is_relative_to(PurePosixPath(p)) for p in ignore_paths)


def _parse_bundle(
    data: bytes, ms: _ModelSigning, public: EllipticCurvePublicKey, key_path: str | os.PathLike[str]
) -> tuple[Any, bool]:
    """(the Sigstore bundle in ``data``, as model_signing's ``Signature.read`` builds it from a file; whether it
    carried a certificate chain).

    A certificate bundle is checked by the key too: its leaf certificate must hold ``public``, and the bundle
    is then read as a key bundle (the DSSE envelope, which is what is signed, stays as it is). The chain's
    trust is not judged here: the key the user named is the trust anchor (``model_signing verify
    certificate`` validates chains).
    """
    if not data.strip():
        raise IntegrityError(f"{SIGNATURE_NAME} is empty", hint="sign the artifact again with `squeeze sign`")
    try:
        parsed = strict_json_loads(data, SIGNATURE_NAME)
    except FormatError as exc:
        raise IntegrityError(exc.message, hint="model.sig is truncated or not a signature; sign again") from None
    try:
        if not isinstance(parsed, dict):
            raise ValueError(f"a JSON object is expected, found {type(parsed).__name__}")
        material = parsed["verificationMaterial"]
        certificate = "x509CertificateChain" in material
        if not certificate and not isinstance(material.get("publicKey"), dict):
            kinds = ", ".join(sorted(material)) if isinstance(material, dict) else type(material).__name__
            raise IntegrityError(
                f"{SIGNATURE_NAME} is not a key or certificate signature (its verification material holds: {kinds})",
                hint="a Sigstore keyless signature is checked with `model_signing verify sigstore`, not --public-key",
            )
        if certificate:
            parsed["verificationMaterial"] = material = {
                "publicKey": {"hint": _leaf_key_hint(material["x509CertificateChain"], public, key_path)},
                "tlogEntries": [],
            }
        # the same adjustments as model_signing's Signature.read (bundles written by older protobuf code)
        material.setdefault("tlogEntries", [])
        if isinstance(material.get("publicKey"), dict):
            material["publicKey"].setdefault("hint", None)
            for key in ("rawBytes", "keyDetails"):
                material["publicKey"].pop(key, None)
        return ms.bundle_pb.Bundle.from_dict(parsed), certificate
    except IntegrityError:
        raise
    except Exception as exc:  # noqa: BLE001 - KeyError, TypeError, AttributeError, pydantic's ValidationError
        raise IntegrityError(f"{SIGNATURE_NAME} is not a Sigstore bundle: {_one_line(exc)}") from None


def _leaf_key_hint(chain: Any, public: EllipticCurvePublicKey, key_path: str | os.PathLike[str]) -> str:
    """The key hint of the chain's leaf certificate, which must hold ``public`` (IntegrityError otherwise)."""
    from cryptography import x509

    leaf = x509.load_der_x509_certificate(base64.b64decode(chain["certificates"][0]["rawBytes"]))
    if leaf.public_key() != public:
        raise IntegrityError(
            f"{SIGNATURE_NAME} was signed with a certificate for another key than {short_path(key_path)}",
            hint="pass the public key of the signing certificate (openssl x509 -in cert.pem -pubkey -noout)",
        )
    return _key_sha256(public)


# ----------------------------------------------------------------------------------------------------------
# Keys


def _read_small(path: str | os.PathLike[str], what: str) -> bytes:
    """A key or certificate file the user named (outside the artifact): read like the artifact's small files
    (non-blocking open, so a FIFO cannot hang it; regular files only; size capped), ConfigError if unreadable."""
    shown = short_path(path)
    try:
        return read_user_file(path, MAX_KEY_BYTES, what)
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {shown}: {exc.strerror or exc}") from None
    except ConfigError as exc:
        if "larger than" in exc.message:
            raise ConfigError(f"{exc.message}; a PEM key is a few hundred") from None
        raise


def _public_pem(key: EllipticCurvePublicKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def _load_public_key(path: str | os.PathLike[str]) -> EllipticCurvePublicKey:
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    data = _read_small(path, "public key")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise ConfigError(
            f"{short_path(path)} is not a PEM public key ({_one_line(exc)})",
            hint="export it from the private key: openssl ec -in key.pem -pubout -out pub.pem",
        ) from None
    return _check_ec(key, path)


def _load_private_key(path: str | os.PathLike[str], password: str | None) -> EllipticCurvePrivateKey:
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    data = _read_small(path, "private key")
    secret = password.encode("utf-8") if password is not None else None
    try:
        key = serialization.load_pem_private_key(data, secret)
    except TypeError as exc:  # cryptography: a password given for a plain key, or none for an encrypted one
        raise ConfigError(f"cannot open the private key {short_path(path)}: {_one_line(exc)}") from None
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise ConfigError(
            f"cannot open the private key {short_path(path)}: not a PEM private key, or a wrong password "
            f"({_one_line(exc)})",
            hint=KEY_HINT,
        ) from None
    _check_ec(key.public_key(), path)
    return key  # type: ignore[return-value]  # _check_ec proved it is an EC key


def _check_ec(key: object, path: str | os.PathLike[str]) -> EllipticCurvePublicKey:
    """``key`` if it is an EC public key on a curve model_signing supports; else ConfigError naming its type."""
    from cryptography.hazmat.primitives.asymmetric import ec

    if not isinstance(key, ec.EllipticCurvePublicKey):
        kind = type(key).__name__.removeprefix("_").replace("PublicKey", "")
        raise ConfigError(
            f"{short_path(path)} holds a key of type {kind}; model signing supports EC keys on P-256, P-384 or P-521",
            hint=KEY_HINT,
        )
    if key.curve.name not in SUPPORTED_CURVES:
        raise ConfigError(
            f"{short_path(path)} is an EC key on {key.curve.name}; model signing supports P-256, P-384 or P-521",
            hint=KEY_HINT,
        )
    return key


def _check_certificate(path: str | os.PathLike[str], key: EllipticCurvePrivateKey) -> None:
    from cryptography import x509

    data = _read_small(path, "signing certificate")
    try:
        cert = x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise ConfigError(f"{short_path(path)} is not a PEM certificate ({_one_line(exc)})") from None
    if cert.public_key() != key.public_key():
        raise ConfigError(
            f"the signing certificate {short_path(path)} is for another key than the private key given",
            hint="pass the certificate issued for this private key",
        )


def _key_sha256(key: EllipticCurvePublicKey) -> str:
    """SHA-256 of the PEM SubjectPublicKeyInfo: the key hint model_signing puts in a bundle."""
    from cryptography.hazmat.primitives import serialization

    pem = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(pem).hexdigest()


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


# ----------------------------------------------------------------------------------------------------------
# The library, imported on first use


class _ModelSigning:
    """The parts of model_signing squeeze uses (its key signer/verifier live in private modules)."""

    def __init__(self) -> None:
        from cryptography.exceptions import InvalidSignature
        from model_signing import manifest
        from model_signing._hashing import hashing as hashing_internal
        from model_signing._signing import sign_certificate as certificate
        from model_signing._signing import sign_ec_key as ec_key
        from model_signing._signing import sign_sigstore_pb as sigstore_pb
        from model_signing._signing import signing as signing_internal
        from sigstore_models.bundle import v1 as bundle_pb

        self.manifest: ModuleType = manifest
        self.hashing_internal: ModuleType = hashing_internal
        self.certificate: ModuleType = certificate
        self.ec_key: ModuleType = ec_key
        self.sigstore_pb: ModuleType = sigstore_pb
        self.signing_internal: ModuleType = signing_internal
        self.bundle_pb: ModuleType = bundle_pb
        self.InvalidSignature: type[Exception] = InvalidSignature


_LOADED: list[_ModelSigning] = []


def _model_signing() -> _ModelSigning:
    """model_signing's modules; ConfigError with the install command when the ``sign`` extra is missing."""
    if not _LOADED:
        try:
            _LOADED.append(_ModelSigning())
        except ImportError as exc:
            raise ConfigError(
                f"signing needs the model-signing package ({_one_line(exc)})", hint=INSTALL_HINT
            ) from None
    return _LOADED[0]


def signing_available() -> bool:
    """Whether the ``sign`` extra is installed (model_signing imports)."""
    try:
        _model_signing()
    except ConfigError:
        return False
    return True
