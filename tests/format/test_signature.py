"""Artifact signatures (squeeze.format.signature): sign and check, interop with the model_signing CLI both ways,
every bad input with its error, and the load path hashing each file once."""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import NameOID

from squeeze import api
from squeeze.errors import ConfigError, IntegrityError
from squeeze.format import hashing as hashing_module
from squeeze.format import signature as signature_module
from squeeze.format import signing_keys as signing_keys_module
from squeeze.format.manifest import MANIFEST_NAME, SIGNATURE_NAME, parse_manifest
from squeeze.format.signature import (
    SignatureWarning,
    SignedVerifyReport,
    check_signature,
    sign_artifact,
    verify_signature_bytes,
    verify_with_signature,
    warn_signature_dropped,
)
from squeeze.format.verify import seal_artifact, verify_artifact

pytest.importorskip("model_signing")

SHARD = "model-00001-of-00002.safetensors"
MODEL_SIGNING = [sys.executable, "-m", "model_signing"]


def write_key(directory: Path, name: str, key, password: bytes | None = None) -> tuple[Path, Path]:
    """(private PEM, public PEM) of ``key`` under ``directory``."""
    encryption = serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    private = directory / f"{name}.pem"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption))
    public = directory / f"{name}.pub.pem"
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return private, public


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("keys")
    out: dict[str, Path] = {}
    for name, key in (
        ("p256", ec.generate_private_key(ec.SECP256R1())),
        ("other", ec.generate_private_key(ec.SECP256R1())),
        ("p384", ec.generate_private_key(ec.SECP384R1())),
        ("k256", ec.generate_private_key(ec.SECP256K1())),
        ("rsa", rsa.generate_private_key(public_exponent=65537, key_size=2048)),
        ("ed25519", ed25519.Ed25519PrivateKey.generate()),
    ):
        out[name], out[name + ".pub"] = write_key(directory, name, key)
    out["locked"], out["locked.pub"] = write_key(
        directory, "locked", ec.generate_private_key(ec.SECP256R1()), b"s3cret"
    )
    return out


def sig_payload(artifact: Path) -> dict:
    """The in-toto statement inside the artifact's model.sig."""
    bundle = json.loads((artifact / SIGNATURE_NAME).read_text())
    return json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))


def key_hint(public: Path) -> str:
    key = serialization.load_pem_public_key(public.read_bytes())
    pem = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(pem).hexdigest()


# ------------------------------------------------------------------------------------------------------
# Signing and checking


def test_sign_then_check_lists_every_file_and_the_manifest_digest(artifact: Path, keys) -> None:
    result = sign_artifact(artifact, keys["p256"])
    assert Path(result.signature_path) == artifact / SIGNATURE_NAME and result.certificate is False
    manifest_bytes = (artifact / MANIFEST_NAME).read_bytes()
    manifest = parse_manifest(manifest_bytes)
    payload = sig_payload(artifact)
    resources = {r["name"]: (r["algorithm"], r["digest"]) for r in payload["predicate"]["resources"]}
    expected = {e.path: ("sha256", e.sha256) for e in manifest.files}
    expected[MANIFEST_NAME] = ("sha256", hashlib.sha256(manifest_bytes).hexdigest())
    assert resources == expected  # every file, the manifest (and so its provenance) included
    serialization_args = payload["predicate"]["serialization"]
    assert serialization_args["method"] == "files" and serialization_args["hash_type"] == "sha256"
    assert set(serialization_args["ignore_paths"]) == {".git", ".gitattributes", ".github", ".gitignore", "model.sig"}
    assert payload["subject"][0]["name"] == artifact.name
    assert result.files == len(expected) and result.bytes_hashed == manifest.total_size
    assert result.key_sha256 == key_hint(keys["p256.pub"])

    report = verify_artifact(artifact)  # model.sig beside the manifest's list is allowed
    assert report.ok
    info = check_signature(report, keys["p256.pub"])
    assert info.key_sha256 == key_hint(keys["p256.pub"]) and info.files == len(expected)
    assert info.path == str(artifact / SIGNATURE_NAME) and info.model_name == artifact.name


def test_p384_and_password_protected_keys_sign(artifact: Path, keys) -> None:
    sign_artifact(artifact, keys["p384"])
    check_signature(verify_artifact(artifact), keys["p384.pub"])
    sign_artifact(artifact, keys["locked"], password="s3cret")
    check_signature(verify_artifact(artifact), keys["locked.pub"])
    for password, words in ((None, "encrypted"), ("wrong", "wrong password")):
        with pytest.raises(ConfigError, match=words):
            sign_artifact(artifact, keys["locked"], password=password)


def test_squeeze_signature_passes_model_signing_verify_key(artifact: Path, keys) -> None:
    sign_artifact(artifact, keys["p256"])
    command = ["verify", "key", str(artifact), "--signature", str(artifact / SIGNATURE_NAME)]
    ok = subprocess.run(
        [*MODEL_SIGNING, *command, "--public_key", str(keys["p256.pub"])], capture_output=True, text=True
    )
    assert ok.returncode == 0 and "Verification succeeded" in ok.stdout, ok.stdout + ok.stderr
    other = subprocess.run(
        [*MODEL_SIGNING, *command, "--public_key", str(keys["other.pub"])], capture_output=True, text=True
    )
    assert other.returncode != 0  # the reference verifier is not a rubber stamp either


def test_model_signing_sign_key_signature_passes_squeeze(artifact: Path, keys) -> None:
    done = subprocess.run(
        [
            *MODEL_SIGNING,
            "sign",
            "key",
            str(artifact),
            "--private_key",
            str(keys["p256"]),
            "--signature",
            str(artifact / SIGNATURE_NAME),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    info = check_signature(verify_artifact(artifact), keys["p256.pub"])
    assert (
        SIGNATURE_NAME in info.ignore_paths
        and info.files == len(parse_manifest((artifact / MANIFEST_NAME).read_bytes()).files) + 1
    )
    with pytest.raises(IntegrityError, match="another key"):
        check_signature(verify_artifact(artifact), keys["other.pub"])


def test_certificate_signing_embeds_the_chain(artifact: Path, keys, tmp_path: Path) -> None:
    key = serialization.load_pem_private_key(keys["p256"].read_bytes(), None)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "squeeze test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    cert_path = tmp_path / "cert.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    result = sign_artifact(artifact, keys["p256"], signing_certificate=cert_path, certificate_chain=[cert_path])
    assert result.certificate is True
    bundle = json.loads((artifact / SIGNATURE_NAME).read_text())
    assert len(bundle["verificationMaterial"]["x509CertificateChain"]["certificates"]) == 2
    info = check_signature(verify_artifact(artifact), keys["p256.pub"])  # the leaf's public key checks it
    assert info.certificate is True
    with pytest.raises(IntegrityError, match="certificate for another key"):
        check_signature(verify_artifact(artifact), keys["other.pub"])
    with pytest.raises(ConfigError, match="another key"):
        sign_artifact(artifact, keys["other"], signing_certificate=cert_path)
    with pytest.raises(ConfigError, match="no key password"):
        sign_artifact(artifact, keys["locked"], password="s3cret", signing_certificate=cert_path)
    with pytest.raises(ConfigError, match="needs a signing certificate"):
        sign_artifact(artifact, keys["p256"], certificate_chain=[cert_path])


def test_verify_signature_bytes_checks_a_manifest_before_any_file(artifact: Path, keys) -> None:
    sign_artifact(artifact, keys["p256"])
    data = (artifact / SIGNATURE_NAME).read_bytes()
    manifest_bytes = (artifact / MANIFEST_NAME).read_bytes()
    manifest = parse_manifest(manifest_bytes)
    digest = hashlib.sha256(manifest_bytes).hexdigest()
    info = verify_signature_bytes(data, manifest, digest, keys["p256.pub"])
    assert info.path == "" and info.key_sha256 == key_hint(keys["p256.pub"])
    with pytest.raises(IntegrityError, match="signs another artifact: squeeze.manifest.json"):
        verify_signature_bytes(data, manifest, "0" * 64, keys["p256.pub"])


def test_verify_with_signature_adds_a_section_to_the_report(artifact: Path, keys) -> None:
    sign_artifact(artifact, keys["p256"])
    report = api.verify_model_integrity(artifact, public_key=keys["p256.pub"])
    assert isinstance(report, SignedVerifyReport) and report.ok
    section = report.to_dict()["signature"]
    assert section["ok"] is True and section["key_sha256"] == key_hint(keys["p256.pub"])
    wrong = verify_with_signature(artifact, keys["other.pub"])
    assert not wrong.ok and wrong.signature is None
    assert wrong.to_dict()["signature"] == {"ok": False, "error": wrong.signature_error}
    assert wrong.problems == [wrong.signature_error] and "another key" in (wrong.signature_error or "")
    assert "signature" not in api.verify_model_integrity(artifact).to_dict()  # no key: the report as before


# ------------------------------------------------------------------------------------------------------
# Bad input: exit 1 (IntegrityError) or 2 (ConfigError), one line, nothing checked further


def test_signature_from_another_key_is_refused(artifact: Path, keys) -> None:
    sign_artifact(artifact, keys["other"])
    with pytest.raises(IntegrityError, match="signed by another key than .*p256.pub.pem"):
        check_signature(verify_artifact(artifact), keys["p256.pub"])


def test_altered_signature_value_is_refused(artifact: Path, keys) -> None:
    sign_artifact(artifact, keys["p256"])
    bundle = json.loads((artifact / SIGNATURE_NAME).read_text())
    raw = bytearray(base64.b64decode(bundle["dsseEnvelope"]["signatures"][0]["sig"]))
    raw[-1] ^= 1
    bundle["dsseEnvelope"]["signatures"][0]["sig"] = base64.b64encode(bytes(raw)).decode()
    (artifact / SIGNATURE_NAME).write_text(json.dumps(bundle))
    with pytest.raises(IntegrityError, match="signature check failed"):
        check_signature(verify_artifact(artifact), keys["p256.pub"])


def test_signature_over_another_artifact_is_refused(artifact: Path, keys, tmp_path: Path) -> None:
    other = shutil.copytree(artifact, tmp_path / "other")
    (other / "config.json").write_text('{"model_type": "mistral"}\n')
    seal_artifact(other)
    sign_artifact(other, keys["p256"])
    shutil.copyfile(other / SIGNATURE_NAME, artifact / SIGNATURE_NAME)
    with pytest.raises(IntegrityError, match="signs another artifact: squeeze.manifest.json has SHA-256"):
        check_signature(verify_artifact(artifact), keys["p256.pub"])


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "model.sig is empty"),
        (b"not json at all", "model.sig is not valid JSON"),
        (b"[1, 2]", "not a Sigstore bundle"),
        (b'{"mediaType": "x"}', "not a Sigstore bundle"),
    ],
)
def test_malformed_signature_files_are_refused(artifact: Path, keys, content: bytes, message: str) -> None:
    (artifact / SIGNATURE_NAME).write_bytes(content)
    with pytest.raises(IntegrityError, match=message):
        check_signature(verify_artifact(artifact), keys["p256.pub"])


def test_truncated_signature_is_refused(artifact: Path, keys) -> None:
    sign_artifact(artifact, keys["p256"])
    data = (artifact / SIGNATURE_NAME).read_bytes()
    (artifact / SIGNATURE_NAME).write_bytes(data[: len(data) // 2])
    with pytest.raises(IntegrityError, match="model.sig is not valid JSON"):
        check_signature(verify_artifact(artifact), keys["p256.pub"])


def test_unsigned_artifact_with_a_public_key_is_refused(artifact: Path, keys) -> None:
    with pytest.raises(IntegrityError, match=r"is not signed \(no model.sig\)") as caught:
        check_signature(verify_artifact(artifact), keys["p256.pub"])
    assert "squeeze sign" in (caught.value.hint or "")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("rsa.pub", "key of type RSA"),
        ("ed25519.pub", "key of type Ed25519"),
        ("k256.pub", "EC key on secp256k1"),
        ("p256", "not a PEM public key"),  # a private key where the public one goes
        ("missing", "cannot read the public key"),
    ],
)
def test_unusable_public_keys_are_config_errors(artifact: Path, keys, name: str, message: str) -> None:
    sign_artifact(artifact, keys["p256"])
    path = keys.get(name, artifact / "no-such-key.pem")
    with pytest.raises(ConfigError, match=message):
        check_signature(verify_artifact(artifact), path)


def test_a_fifo_public_key_is_refused_without_blocking(artifact: Path, keys, tmp_path: Path) -> None:
    """Issue 41 item 12: a FIFO as --public-key used to block forever waiting for a writer."""
    import os
    import threading

    sign_artifact(artifact, keys["p256"])
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo)
    outcome: list[BaseException] = []

    def check() -> None:
        try:
            api.LoadOptions(public_key=fifo)  # the key is checked where the options are built
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            outcome.append(exc)

    worker = threading.Thread(target=check, daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():
        with open(fifo, "wb"):  # unblock the reader so the thread ends
            pass
        pytest.fail("reading a FIFO public key blocked")
    assert len(outcome) == 1 and isinstance(outcome[0], ConfigError)
    assert "FIFO" in str(outcome[0])


@pytest.mark.parametrize(("name", "message"), [("rsa", "key of type RSA"), ("k256", "EC key on secp256k1")])
def test_unsupported_private_keys_sign_nothing(artifact: Path, keys, name: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        sign_artifact(artifact, keys[name])
    assert not (artifact / SIGNATURE_NAME).exists()


def test_damaged_artifact_is_never_signed(artifact: Path, keys) -> None:
    shard = artifact / SHARD
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=f"refusing to sign .*{SHARD}: SHA-256 mismatch"):
        sign_artifact(artifact, keys["p256"])
    assert not (artifact / SIGNATURE_NAME).exists()


def test_tampering_after_signing_is_caught_by_manifest_or_signature(artifact: Path, keys) -> None:
    sign_artifact(artifact, keys["p256"])
    shard = artifact / SHARD
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    # a shard changed: the manifest catches it (and no signature vouches for a damaged artifact)
    report = verify_artifact(artifact)
    assert not report.ok
    with pytest.raises(IntegrityError, match="does not verify"):
        check_signature(report, keys["p256.pub"])
    # the manifest resealed over the tampered shard: the files verify, the signature does not
    seal_artifact(artifact)
    report = verify_artifact(artifact)
    assert report.ok
    with pytest.raises(IntegrityError, match="signs another artifact"):
        check_signature(report, keys["p256.pub"])


def test_a_signature_leaving_out_the_manifest_is_refused(artifact: Path, keys) -> None:
    from model_signing import hashing, signing

    config = hashing.Config().set_ignored_paths(paths=[MANIFEST_NAME, SIGNATURE_NAME])
    signing.Config().use_elliptic_key_signer(private_key=keys["p256"]).set_hashing_config(config).sign(
        artifact, artifact / SIGNATURE_NAME
    )
    with pytest.raises(IntegrityError, match="does not cover squeeze.manifest.json"):
        check_signature(verify_artifact(artifact), keys["p256.pub"])


def test_shard_serialization_is_named_in_the_error(artifact: Path, keys) -> None:
    from model_signing import hashing, signing

    config = hashing.Config().use_shard_serialization(shard_size=1024).set_ignored_paths(paths=[SIGNATURE_NAME])
    signing.Config().use_elliptic_key_signer(private_key=keys["p256"]).set_hashing_config(config).sign(
        artifact, artifact / SIGNATURE_NAME
    )
    with pytest.raises(IntegrityError, match="uses serialization 'shards' with hash 'sha256'"):
        check_signature(verify_artifact(artifact), keys["p256.pub"])


def test_a_listed_git_file_is_covered_through_the_manifest(artifact: Path, keys) -> None:
    from model_signing import verifying

    (artifact / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    seal_artifact(artifact)
    sign_artifact(artifact, keys["p256"])
    payload = sig_payload(artifact)
    # model_signing's verifier skips git files whatever the signature says: listing one would fail it
    assert ".gitattributes" not in {r["name"] for r in payload["predicate"]["resources"]}
    assert ".gitattributes" in payload["predicate"]["serialization"]["ignore_paths"]
    verifier = verifying.Config().use_elliptic_key_verifier(public_key=keys["p256.pub"])
    verifier.verify(artifact, artifact / SIGNATURE_NAME)
    info = check_signature(verify_artifact(artifact), keys["p256.pub"])
    assert ".gitattributes" in info.ignore_paths
    # the file is still covered: its digest is in the signed manifest, so changing it breaks one or the other
    (artifact / ".gitattributes").write_text("changed\n")
    seal_artifact(artifact)
    with pytest.raises(IntegrityError, match="signs another artifact"):
        check_signature(verify_artifact(artifact), keys["p256.pub"])


def test_an_oversized_signature_is_refused_unread(artifact: Path, keys, monkeypatch) -> None:
    sign_artifact(artifact, keys["p256"])
    monkeypatch.setattr(signature_module, "MAX_SIGNATURE_BYTES", 100)
    with pytest.raises(IntegrityError, match="larger than the 100 byte limit"):
        check_signature(verify_artifact(artifact), keys["p256.pub"])


def test_a_keyless_sigstore_bundle_is_named_as_such(artifact: Path, keys) -> None:
    sign_artifact(artifact, keys["p256"])
    bundle = json.loads((artifact / SIGNATURE_NAME).read_text())
    bundle["verificationMaterial"] = {"certificate": {"rawBytes": "AAAA"}, "tlogEntries": []}  # as sigstore writes
    (artifact / SIGNATURE_NAME).write_text(json.dumps(bundle))
    with pytest.raises(IntegrityError, match="not a key or certificate signature .*certificate, tlogEntries"):
        check_signature(verify_artifact(artifact), keys["p256.pub"])


def test_a_bundle_without_key_hint_still_checks_and_prints_nothing(artifact: Path, keys, capsys) -> None:
    sign_artifact(artifact, keys["p256"])
    bundle = json.loads((artifact / SIGNATURE_NAME).read_text())
    del bundle["verificationMaterial"]["publicKey"]["hint"]  # older signers wrote none; it is not signed
    (artifact / SIGNATURE_NAME).write_text(json.dumps(bundle))
    check_signature(verify_artifact(artifact), keys["p256.pub"])
    assert capsys.readouterr().out == ""  # model_signing's warning on stdout is swallowed


def test_without_the_sign_extra_signing_is_a_config_error(artifact: Path, keys, monkeypatch) -> None:
    monkeypatch.setattr(signing_keys_module, "_LOADED", [])
    monkeypatch.setitem(sys.modules, "model_signing", None)
    with pytest.raises(ConfigError, match="model-signing") as caught:
        sign_artifact(artifact, keys["p256"])
    assert "pip install" in (caught.value.hint or "")
    assert signature_module.signing_available() is False


def test_importing_squeeze_does_not_import_model_signing() -> None:
    """Statically (a subprocess importing squeeze takes seconds): model_signing and its dependencies are imported
    only by squeeze.format.signature and the two modules split from it (signing_keys, signature_bundle), and there
    only inside functions or under TYPE_CHECKING."""
    import ast

    import squeeze

    heavy = ("model_signing", "sigstore", "sigstore_models", "cryptography", "OpenSSL")
    signers = ("signature.py", "signing_keys.py", "signature_bundle.py")
    root = Path(squeeze.__file__).parent
    eager, elsewhere = [], []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        lazy = {
            id(node)
            for outer in ast.walk(tree)
            if isinstance(outer, (ast.FunctionDef, ast.AsyncFunctionDef))
            or (isinstance(outer, ast.If) and "TYPE_CHECKING" in ast.unparse(outer.test))
            for node in ast.walk(outer)
        }
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                if name.split(".")[0] in heavy:
                    where = f"{path.relative_to(root)}:{node.lineno} {name}"
                    (elsewhere if path.name not in signers else eager if id(node) not in lazy else []).append(where)
    assert not eager and not elsewhere, (eager, elsewhere)


def test_calibrate_kv_warning_names_the_dropped_signature(artifact: Path, keys) -> None:
    assert warn_signature_dropped(artifact, "calibrate-kv replaces it") is False  # unsigned: silent
    sign_artifact(artifact, keys["p256"])
    with pytest.warns(SignatureWarning, match="is signed, and calibrate-kv replaces it: .* without model.sig"):
        assert warn_signature_dropped(artifact, "calibrate-kv replaces it") is True


# ------------------------------------------------------------------------------------------------------
# Loading with a public key: the signature is checked from the digests verification computed


@pytest.fixture(scope="module")
def signed_tiny(tmp_path_factory: pytest.TempPathFactory, compress_tiny, keys) -> Path:
    out = compress_tiny(tmp_path_factory.mktemp("signed") / "tiny-rtn", recipe="rtn-w4")
    sign_artifact(out, keys["p256"])
    return out


def test_load_with_public_key_hashes_each_file_once(signed_tiny: Path, keys, monkeypatch) -> None:
    calls: list[str] = []
    real = hashing_module.hash_file

    def counting(root_fd, relative, *args, **kwargs):
        calls.append(relative)
        return real(root_fd, relative, *args, **kwargs)

    monkeypatch.setattr(hashing_module, "hash_file", counting)
    loaded = api.load(signed_tiny, public_key=keys["p256.pub"], check_memory=False)
    listed = sorted(e.path for e in parse_manifest((signed_tiny / MANIFEST_NAME).read_bytes()).files)
    assert sorted(calls) == listed  # each listed file once; the signature check hashed nothing
    assert loaded.signature is not None and loaded.signature.key_sha256 == key_hint(keys["p256.pub"])
    assert api.load(signed_tiny, check_memory=False).signature is None


def test_load_refuses_before_building_anything(signed_tiny: Path, keys, monkeypatch, tmp_path: Path) -> None:
    from squeeze.runtime import loader

    def never(*args, **kwargs):
        raise AssertionError("the model was built before the signature was checked")

    monkeypatch.setattr(loader, "build_skeleton", never)
    with pytest.raises(IntegrityError, match="signed by another key"):
        api.load(signed_tiny, public_key=keys["other.pub"], check_memory=False)
    unsigned = shutil.copytree(signed_tiny, tmp_path / "unsigned")
    (unsigned / SIGNATURE_NAME).unlink()
    with pytest.raises(IntegrityError, match="is not signed"):
        api.load(unsigned, public_key=keys["p256.pub"], check_memory=False)
    with pytest.raises(ConfigError, match="--public-key needs verification"):
        api.load(signed_tiny, verify=False, public_key=keys["p256.pub"])
    with pytest.raises(ConfigError, match="key of type RSA"):
        api.load(signed_tiny, public_key=keys["rsa.pub"])
