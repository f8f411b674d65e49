"""calibrate-kv's guards (issue 41 items 9, 15): one run per output at a time, a signed artifact refused before
any work unless --drop-signature (which then works), and a missing target named as such."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from squeeze import api
from squeeze.cli.app import app
from squeeze.compression.calibrate_kv import KV_LOCK_SUFFIX
from squeeze.compression.lock import OutputLock
from squeeze.errors import LockError
from squeeze.format.manifest import SIGNATURE_NAME

runner = CliRunner()
CALIB = {"num_samples": 2, "seq_len": 64}


@pytest.fixture(scope="module")
def rtn_artifact(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("kvguard") / "stories-rtn-w4"
    api.compress(str(stories_dir), out, recipe="rtn-w4")
    return out


@pytest.fixture
def copy(rtn_artifact: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(rtn_artifact, tmp_path / "art"))


def test_a_second_run_on_the_same_artifact_is_refused(copy: Path, tinystories_file: Path) -> None:
    """Two in-place runs both exited 0, the second swapping its artifact over the first's."""
    holder = OutputLock(copy.parent, name=f".{copy.name}{KV_LOCK_SUFFIX}", holder="squeeze calibrate-kv", target=copy)
    with holder:  # a live run holds it
        with pytest.raises(LockError, match="another squeeze calibrate-kv .* is writing into"):
            api.calibrate_kv(copy, tinystories_file, bits=8, calibration_overrides=CALIB)
    api.calibrate_kv(copy, tinystories_file, bits=8, calibration_overrides=CALIB)  # free again: runs
    assert not (copy.parent / f".{copy.name}{KV_LOCK_SUFFIX}").exists()  # no lock file left beside it
    assert api.verify_model_integrity(copy).ok


def test_a_signed_artifact_is_refused_first_and_drop_signature_works(
    copy: Path, tinystories_file: Path, tmp_path: Path
) -> None:
    pytest.importorskip("model_signing")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = tmp_path / "key.pem"
    key.write_bytes(
        ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    api.sign(copy, key)
    args = ["calibrate-kv", str(copy), "--bits", "8", "-c", str(tinystories_file), "--num-samples", "2"]
    args += ["--seq-len", "64"]
    refused = runner.invoke(app, args)
    assert refused.exit_code == 2, refused.output
    assert "is signed" in refused.stderr and "--drop-signature" in refused.stderr
    assert (copy / SIGNATURE_NAME).exists()
    done = runner.invoke(app, [*args, "--drop-signature"])
    assert done.exit_code == 0, done.output
    assert not (copy / SIGNATURE_NAME).exists()
    assert api.verify_model_integrity(copy).ok
    assert not [p for p in copy.parent.iterdir() if "leftover" in p.name]


def test_a_missing_target_is_no_such_artifact(tmp_path: Path) -> None:
    result = runner.invoke(app, ["calibrate-kv", str(tmp_path / "t" / "nope")])
    assert result.exit_code == 2
    assert "no such artifact" in result.stderr and "no calibration text" not in result.stderr
