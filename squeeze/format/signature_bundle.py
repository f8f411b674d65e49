"""Reading a ``model.sig`` Sigstore bundle, checking its signature and comparing its signed digests with a manifest.

Split from ``squeeze.format.signature`` (which signs and checks artifacts): the bundle's parsing (key and
certificate bundles), the signature check by a public key, and the digest comparison that names what differs.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import tempfile
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from squeeze.errors import FormatError, IntegrityError
from squeeze.format.manifest import MANIFEST_NAME, SIGNATURE_NAME, Manifest
from squeeze.format.paths import short_path
from squeeze.format.signing_keys import ModelSigning, key_sha256, one_line, public_pem
from squeeze.format.strict_json import strict_json_loads

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePublicKey


def compare_digests(signed: dict[str, str], ignored: tuple[str, ...], manifest: Manifest, manifest_sha256: str) -> None:
    """The signed digests must be the manifest's (its own bytes' digest included), less the ignored paths."""
    if is_ignored(MANIFEST_NAME, ignored):
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
    expected = {entry.path: entry.sha256 for entry in manifest.files if not is_ignored(entry.path, ignored)}
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


def is_ignored(path: str, ignore_paths: tuple[str, ...]) -> bool:
    """Whether model_signing leaves ``path`` out: it lies at or under one of ``ignore_paths``."""
    pure = PurePosixPath(path)
    return any(pure.is_relative_to(PurePosixPath(p)) for p in ignore_paths)


def parse_bundle(
    data: bytes, ms: ModelSigning, public: EllipticCurvePublicKey, key_path: str | os.PathLike[str]
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
        raise IntegrityError(f"{SIGNATURE_NAME} is not a Sigstore bundle: {one_line(exc)}") from None


def _leaf_key_hint(chain: Any, public: EllipticCurvePublicKey, key_path: str | os.PathLike[str]) -> str:
    """The key hint of the chain's leaf certificate, which must hold ``public`` (IntegrityError otherwise)."""
    from cryptography import x509

    leaf = x509.load_der_x509_certificate(base64.b64decode(chain["certificates"][0]["rawBytes"]))
    if leaf.public_key() != public:
        raise IntegrityError(
            f"{SIGNATURE_NAME} was signed with a certificate for another key than {short_path(key_path)}",
            hint="pass the public key of the signing certificate (openssl x509 -in cert.pem -pubkey -noout)",
        )
    return key_sha256(public)


def verified_manifest(
    ms: ModelSigning, bundle: Any, public: EllipticCurvePublicKey, public_key: str | os.PathLike[str]
) -> Any:
    """The model_signing manifest ``bundle`` signs, once its signature checks with ``public`` (IntegrityError)."""
    try:
        # the key as already read (model_signing would open the path again: a FIFO swapped in since would hang)
        with tempfile.TemporaryDirectory(prefix="squeeze-key-") as private:
            key_copy = Path(private) / "key.pub.pem"
            key_copy.write_bytes(public_pem(public))
            verifier = ms.ec_key.Verifier(key_copy)
            # a bundle without a key hint makes the verifier print a warning on stdout: squeeze's output is its own
            with contextlib.redirect_stdout(io.StringIO()):
                return verifier.verify(ms.sigstore_pb.Signature(bundle))
    except ms.InvalidSignature:
        raise IntegrityError(
            f"{SIGNATURE_NAME} was not made with the key {short_path(public_key)} (signature check failed)",
            hint="pass the public key of whoever signed the artifact; if it is the right one, model.sig was altered",
        ) from None
    except Exception as exc:  # noqa: BLE001 - the library raises ValueError, KeyError, TypeError, binascii.Error...
        text = one_line(exc)
        if text.startswith("Key mismatch"):
            raise IntegrityError(
                f"{SIGNATURE_NAME} was signed by another key than {short_path(public_key)}",
                hint="pass the public key of whoever signed the artifact",
            ) from None
        raise IntegrityError(f"{SIGNATURE_NAME} is not a valid model signature: {text}") from None
