"""``squeeze sign`` and ``--public-key`` on verify/run/serve/eval: exit codes, one-line errors, JSON."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from typer.testing import CliRunner

from squeeze.cli.app import app
from squeeze.format.manifest import SIGNATURE_NAME

pytest.importorskip("model_signing")

runner = CliRunner()
SHARD = "model-00001-of-00002.safetensors"


def _write_pair(directory: Path, name: str, key, password: bytes | None = None) -> None:
    encryption = serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    (directory / f"{name}.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
    )
    (directory / f"{name}.pub.pem").write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )


@pytest.fixture(scope="module")
def key_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("cli-keys")
    _write_pair(directory, "ec", ec.generate_private_key(ec.SECP256R1()))
    _write_pair(directory, "other", ec.generate_private_key(ec.SECP256R1()))
    _write_pair(directory, "locked", ec.generate_private_key(ec.SECP256R1()), b"pw")
    _write_pair(directory, "rsa", rsa.generate_private_key(public_exponent=65537, key_size=2048))
    return directory


def one_error_line(result) -> str:
    """The single ``Error: ...`` line of a failed command (a Hint line may follow); nothing on stdout."""
    lines = result.stderr.strip().splitlines()
    assert lines and lines[0].startswith("Error: ") and all(line.startswith("Hint: ") for line in lines[1:]), lines
    assert "Traceback" not in result.output
    return lines[0]


def test_sign_then_verify_with_the_public_key(artifact: Path, key_dir: Path) -> None:
    signed = runner.invoke(app, ["sign", str(artifact), "--private-key", str(key_dir / "ec.pem")])
    assert signed.exit_code == 0, signed.output
    assert "signed" in signed.stderr and (artifact / SIGNATURE_NAME).is_file()
    ok = runner.invoke(app, ["verify", str(artifact), "--public-key", str(key_dir / "ec.pub.pem")])
    assert ok.exit_code == 0, ok.output
    assert "intact" in ok.stdout and "signed" in ok.stdout
    as_json = runner.invoke(app, ["verify", str(artifact), "--public-key", str(key_dir / "ec.pub.pem"), "--json"])
    report = json.loads(as_json.stdout)
    assert report["ok"] is True and report["signature"]["ok"] is True and report["signature"]["files"] == 6


def test_sign_json_and_password_from_the_environment(artifact: Path, key_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv("SQUEEZE_TEST_KEY_PASSWORD", "pw")
    args = ["sign", str(artifact), "--private-key", str(key_dir / "locked.pem"), "--json"]
    result = runner.invoke(app, [*args, "--password-env", "SQUEEZE_TEST_KEY_PASSWORD"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["signature"] == str(artifact / SIGNATURE_NAME) and data["files"] == 6
    missing = runner.invoke(app, [*args, "--password-env", "SQUEEZE_TEST_NO_SUCH_VARIABLE"])
    assert missing.exit_code == 2 and "no such environment variable" in one_error_line(missing)
    no_password = runner.invoke(app, args)
    assert no_password.exit_code == 2 and "cannot open the private key" in one_error_line(no_password)


def test_sign_refuses_a_damaged_artifact_and_an_rsa_key(artifact: Path, key_dir: Path) -> None:
    rsa_key = runner.invoke(app, ["sign", str(artifact), "--private-key", str(key_dir / "rsa.pem")])
    assert rsa_key.exit_code == 2 and "key of type RSA" in one_error_line(rsa_key)
    shard = artifact / SHARD
    shard.write_bytes(shard.read_bytes()[:-1] + b"\x00")
    damaged = runner.invoke(app, ["sign", str(artifact), "--private-key", str(key_dir / "ec.pem")])
    assert damaged.exit_code == 1 and "refusing to sign" in one_error_line(damaged)
    assert not (artifact / SIGNATURE_NAME).exists()


@pytest.mark.parametrize(
    ("signer", "key", "code", "message"),
    [
        (None, "ec.pub.pem", 1, "is not signed (no model.sig)"),
        ("other.pem", "ec.pub.pem", 1, "signed by another key"),
        ("ec.pem", "rsa.pub.pem", 2, "key of type RSA"),
        ("ec.pem", "ec.pem", 2, "not a PEM public key"),
    ],
)
def test_verify_bad_signatures_and_keys(artifact: Path, key_dir: Path, signer, key, code, message) -> None:
    if signer is not None:
        assert runner.invoke(app, ["sign", str(artifact), "--private-key", str(key_dir / signer)]).exit_code == 0
    result = runner.invoke(app, ["verify", str(artifact), "--public-key", str(key_dir / key)])
    assert result.exit_code == code and message in one_error_line(result)


# ------------------------------------------------------------------------------------------------------
# run / serve / eval


@pytest.fixture(scope="module")
def tiny_rtn(tmp_path_factory: pytest.TempPathFactory, compress_tiny, key_dir: Path) -> dict[str, Path]:
    """An unsigned tiny artifact and a signed copy."""
    unsigned = compress_tiny(tmp_path_factory.mktemp("sign-cli") / "tiny-rtn", recipe="rtn-w4")
    signed = shutil.copytree(unsigned, unsigned.parent / "tiny-rtn-signed")
    result = runner.invoke(app, ["sign", str(signed), "--private-key", str(key_dir / "ec.pem")])
    assert result.exit_code == 0, result.output
    return {"unsigned": unsigned, "signed": signed}


def test_run_checks_the_signature(tiny_rtn, key_dir: Path) -> None:
    pub = str(key_dir / "ec.pub.pem")
    ok = runner.invoke(app, ["run", "Once", "-m", str(tiny_rtn["signed"]), "-n", "2", "--json", "--public-key", pub])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["signature_checked"] is True
    refused = runner.invoke(app, ["run", "Once", "-m", str(tiny_rtn["unsigned"]), "-n", "2", "--public-key", pub])
    assert refused.exit_code == 1 and refused.stdout == ""
    assert "is not signed" in one_error_line(refused)
    other = runner.invoke(
        app, ["run", "Once", "-m", str(tiny_rtn["signed"]), "-n", "2", "--public-key", str(key_dir / "other.pub.pem")]
    )
    assert other.exit_code == 1 and "signed by another key" in one_error_line(other)
    no_verify = runner.invoke(app, ["run", "Once", "-m", str(tiny_rtn["signed"]), "--no-verify", "--public-key", pub])
    assert no_verify.exit_code == 2 and "--public-key needs verification" in one_error_line(no_verify)


def test_serve_refuses_an_unsigned_artifact(tiny_rtn, key_dir: Path) -> None:
    pytest.importorskip("fastapi")
    result = runner.invoke(
        app, ["serve", str(tiny_rtn["unsigned"]), "--port", "0", "--public-key", str(key_dir / "ec.pub.pem")]
    )
    assert result.exit_code == 1 and "is not signed" in one_error_line(result)


def test_eval_checks_the_model_not_the_baseline(tiny_rtn, key_dir: Path, tiny_llama_dir, tiny_text_file) -> None:
    pub = str(key_dir / "ec.pub.pem")
    common = ["--text", str(tiny_text_file), "--seq-len", "32", "--max-windows", "1", "--public-key", pub]
    refused = runner.invoke(app, ["eval", str(tiny_rtn["unsigned"]), *common])
    assert refused.exit_code == 1 and "is not signed" in one_error_line(refused)
    plain = runner.invoke(app, ["eval", str(tiny_llama_dir), *common])
    assert plain.exit_code == 2 and "is not a squeeze artifact" in one_error_line(plain)
    ok = runner.invoke(
        app, ["eval", str(tiny_rtn["signed"]), *common, "--baseline", str(tiny_rtn["unsigned"]), "--json"]
    )
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["windows"] == 1
