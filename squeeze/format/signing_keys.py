"""Key and certificate files for model signatures, and ``model_signing`` imported on first use.

Split from ``squeeze.format.signature``: reading the user's PEM keys and certificates (capped, non-blocking,
EC keys on the curves model_signing supports only), the key hint a bundle carries, and the lazily imported
library, so ``import squeeze`` works without the ``sign`` extra (the signing features then raise ConfigError).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

from squeeze.errors import ConfigError
from squeeze.format.paths import read_user_file, short_path

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePrivateKey, EllipticCurvePublicKey

#: Key, certificate and chain files are PEM text of a few KB.
MAX_KEY_BYTES = 1 * 2**20
#: The curves model_signing 1.1 signs and verifies with (Sigstore's protobuf specs allow these).
SUPPORTED_CURVES = ("secp256r1", "secp384r1", "secp521r1")
INSTALL_HINT = "pip install 'squeeze[sign]'  (model-signing>=1.1.1,<1.2 and pyopenssl)"
KEY_HINT = "make one with: openssl ecparam -genkey -name prime256v1 -noout -out key.pem"


# ----------------------------------------------------------------------------------------------------------
# Keys


def read_key_file(path: str | os.PathLike[str], what: str) -> bytes:
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


def public_pem(key: EllipticCurvePublicKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def load_public_key(path: str | os.PathLike[str]) -> EllipticCurvePublicKey:
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    data = read_key_file(path, "public key")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise ConfigError(
            f"{short_path(path)} is not a PEM public key ({one_line(exc)})",
            hint="export it from the private key: openssl ec -in key.pem -pubout -out pub.pem",
        ) from None
    return check_ec_key(key, path)


def load_private_key(path: str | os.PathLike[str], password: str | None) -> EllipticCurvePrivateKey:
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    data = read_key_file(path, "private key")
    secret = password.encode("utf-8") if password is not None else None
    try:
        key = serialization.load_pem_private_key(data, secret)
    except TypeError as exc:  # cryptography: a password given for a plain key, or none for an encrypted one
        raise ConfigError(f"cannot open the private key {short_path(path)}: {one_line(exc)}") from None
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise ConfigError(
            f"cannot open the private key {short_path(path)}: not a PEM private key, or a wrong password "
            f"({one_line(exc)})",
            hint=KEY_HINT,
        ) from None
    check_ec_key(key.public_key(), path)
    return key  # type: ignore[return-value]  # check_ec_key proved it is an EC key


def check_ec_key(key: object, path: str | os.PathLike[str]) -> EllipticCurvePublicKey:
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


def check_certificate(path: str | os.PathLike[str], key: EllipticCurvePrivateKey) -> None:
    from cryptography import x509

    data = read_key_file(path, "signing certificate")
    try:
        cert = x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise ConfigError(f"{short_path(path)} is not a PEM certificate ({one_line(exc)})") from None
    if cert.public_key() != key.public_key():
        raise ConfigError(
            f"the signing certificate {short_path(path)} is for another key than the private key given",
            hint="pass the certificate issued for this private key",
        )


def checked_signing_key(
    private_key: str | os.PathLike[str],
    password: str | None,
    signing_certificate: str | os.PathLike[str] | None,
    certificate_chain: Sequence[str | os.PathLike[str]],
) -> EllipticCurvePrivateKey:
    """The private key, once it and the certificate options that go with it are checked (ConfigError)."""
    key = load_private_key(private_key, password)
    if signing_certificate is None and certificate_chain:
        raise ConfigError("a certificate chain needs a signing certificate", hint="add --signing-certificate CERT.pem")
    if signing_certificate is not None:
        if password is not None:
            raise ConfigError(
                "model_signing's certificate signer takes no key password",
                hint="sign with an unencrypted key (openssl ec -in key.pem -out plain.pem), or without a certificate",
            )
        check_certificate(signing_certificate, key)
        for chain_file in certificate_chain:
            read_key_file(chain_file, "certificate chain file")
    return key


def key_sha256(key: EllipticCurvePublicKey) -> str:
    """SHA-256 of the PEM SubjectPublicKeyInfo: the key hint model_signing puts in a bundle."""
    from cryptography.hazmat.primitives import serialization

    pem = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(pem).hexdigest()


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


# ----------------------------------------------------------------------------------------------------------
# The library, imported on first use


class ModelSigning:
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


_LOADED: list[ModelSigning] = []


def load_model_signing() -> ModelSigning:
    """model_signing's modules; ConfigError with the install command when the ``sign`` extra is missing."""
    if not _LOADED:
        try:
            _LOADED.append(ModelSigning())
        except ImportError as exc:
            raise ConfigError(f"signing needs the model-signing package ({one_line(exc)})", hint=INSTALL_HINT) from None
    return _LOADED[0]
