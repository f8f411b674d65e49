"""``squeeze sign``: verify an artifact, then write its signature (``model.sig``, OpenSSF model signing)."""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from squeeze import api
from squeeze.api.support import short_path
from squeeze.cli.common import cli_errors, err_console, print_json, progress_bar
from squeeze.errors import ConfigError

EXIT_HELP = """

Exit codes: 0 signed; 1 the artifact does not verify (nothing is signed); 2 usage error (unreadable or
unsupported key or certificate, wrong password, the sign extra missing, malformed manifest).
"""

Artifact = Annotated[Path, typer.Argument(help="The artifact directory (or its squeeze.manifest.json).")]
PrivateKey = Annotated[
    Path, typer.Option("--private-key", help="PEM EC private key (P-256, P-384 or P-521), e.g. from openssl ecparam.")
]
PasswordEnv = Annotated[
    Optional[str],
    typer.Option("--password-env", help="Name of the environment variable holding the private key's password."),
]
SigningCertificate = Annotated[
    Optional[Path],
    typer.Option("--signing-certificate", help="PEM X.509 certificate of the key: embedded in the signature."),
]
CertificateChain = Annotated[
    Optional[list[Path]],
    typer.Option("--certificate-chain", help="PEM certificates of the chain above it (repeatable)."),
]
Workers = Annotated[int, typer.Option("--workers", min=0, help="Hashing threads (0 = automatic).")]
JsonOut = Annotated[bool, typer.Option("--json", help="Print only a JSON summary to stdout.")]


def password_from_env(name: str | None) -> str | None:
    """The password held by the environment variable ``name`` (never a command-line argument: ``ps`` shows
    those); ConfigError when it is not set."""
    if name is None:
        return None
    value = os.environ.get(name)
    if value is None:
        raise ConfigError(f"--password-env {name}: no such environment variable", hint=f"export {name}=... first")
    return value


def sign(
    path: Artifact,
    private_key: PrivateKey,
    password_env: PasswordEnv = None,
    signing_certificate: SigningCertificate = None,
    certificate_chain: CertificateChain = None,
    workers: Workers = 0,
    json_out: JsonOut = False,
) -> None:
    """Sign an artifact: verify every file, then write model.sig over those digests (manifest included).

    The signature is a Sigstore bundle in the OpenSSF model signing format: `model_signing verify key`
    accepts it, and `squeeze verify/run/serve/eval --public-key PUB.pem` check it. Keyless Sigstore
    signing is not offered (it needs the network and an OIDC identity): use `model_signing sign sigstore`.
    """
    with cli_errors():
        password = password_from_env(password_env)
        with progress_bar("Hashing", not json_out, bytes_=True) as progress:
            result = api.sign(
                path,
                private_key,
                password=password,
                signing_certificate=signing_certificate,
                certificate_chain=certificate_chain or (),
                workers=workers or None,
                progress=progress,
            )
    if json_out:
        print_json(result.to_dict())
        return
    how = "certificate" if result.certificate else "key"
    err_console.print(
        f"[bold green]signed[/] {escape(short_path(result.signature_path))}: {result.files} files "
        f"({result.bytes_hashed:,} bytes verified) with {how} sha256:{result.key_sha256[:16]}... "
        f"in {result.seconds:.2f} s",
        soft_wrap=True,
    )


sign.__doc__ = inspect.cleandoc(sign.__doc__ or "") + EXIT_HELP
