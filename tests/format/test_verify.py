import hashlib
import json
import os
import struct

import pytest

from squeeze import verify_model_integrity
from squeeze.errors import FormatError
from squeeze.format.manifest import MANIFEST_NAME, SIGNATURE_NAME, root_digest_v2
from squeeze.format.shards import INDEX_NAME
from squeeze.format.verify import seal_artifact

SHARD = "model-00001-of-00002.safetensors"


def failures(report):
    return {r.path: r.error for r in report.files if not r.ok}


def rewrite_manifest(artifact, mutate):
    path = artifact / MANIFEST_NAME
    data = json.loads(path.read_text())
    mutate(data)
    path.write_text(json.dumps(data))


def test_fresh_artifact_is_intact(artifact):
    report = verify_model_integrity(artifact)
    assert report.ok, report.to_dict()
    assert {r.path for r in report.files} == {
        "config.json",
        "extra/notes.txt",
        INDEX_NAME,
        SHARD,
        "model-00002-of-00002.safetensors",
    }
    assert report.bytes_hashed == sum((artifact / r.path).stat().st_size for r in report.files)


def test_manifest_path_works_as_well_as_the_directory(artifact):
    assert verify_model_integrity(artifact / MANIFEST_NAME).ok


def test_progress_reports_all_bytes(artifact):
    seen = []
    report = verify_model_integrity(artifact, progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (report.bytes_hashed, report.bytes_hashed)


@pytest.mark.parametrize("offset", [0, 5, 8, 40, -1, -20])  # length bytes, header JSON, data region
def test_a_flipped_bit_anywhere_in_a_shard_fails(artifact, offset):
    path = artifact / SHARD
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    report = verify_model_integrity(artifact)
    assert not report.ok
    assert "SHA-256 mismatch" in failures(report)[SHARD]


def test_truncated_shard_fails(artifact):
    path = artifact / SHARD
    path.write_bytes(path.read_bytes()[:-3])
    assert "truncated" in failures(verify_model_integrity(artifact))[SHARD]


def test_missing_shard_fails(artifact):
    (artifact / SHARD).unlink()
    assert failures(verify_model_integrity(artifact))[SHARD] == "missing"


def test_extra_file_fails(artifact):
    (artifact / "surprise.bin").write_bytes(b"x")
    assert "extra file" in failures(verify_model_integrity(artifact))["surprise.bin"]


def test_leftover_partial_file_counts_as_extra(artifact):
    (artifact / ".model.safetensors.abc.partial").write_bytes(b"x")
    assert not verify_model_integrity(artifact).ok


def test_symlink_inside_the_artifact_fails(artifact):
    (artifact / "link.json").symlink_to(artifact / "config.json")
    assert "symbolic link" in failures(verify_model_integrity(artifact))["link.json"]


def test_listed_file_replaced_by_symlink_outside_is_never_read(artifact, tmp_path):
    outside = tmp_path / "outside.json"
    outside.write_bytes((artifact / "config.json").read_bytes())  # same bytes: only the link is wrong
    (artifact / "config.json").unlink()
    (artifact / "config.json").symlink_to(outside)
    report = verify_model_integrity(artifact)
    assert "symbolic link" in failures(report)["config.json"]
    [result] = [r for r in report.files if r.path == "config.json"]
    assert result.sha256 is None  # reported once, never read


def test_symlinked_directory_is_refused(artifact, tmp_path):
    os.rename(artifact / "extra", tmp_path / "moved")
    (artifact / "extra").symlink_to(tmp_path / "moved", target_is_directory=True)
    assert "symbolic link" in failures(verify_model_integrity(artifact))["extra"]


def test_manifest_entry_with_dotdot_never_opens_outside(artifact, tmp_path):
    (tmp_path / "secret").write_text("x")

    def mutate(d):
        d["files"][0]["path"] = "../secret"

    rewrite_manifest(artifact, mutate)
    with pytest.raises(FormatError, match=r"'\.\.'"):
        verify_model_integrity(artifact)


def test_root_digest_not_matching_entries_fails(artifact):
    rewrite_manifest(artifact, lambda d: d.update(root_digest="0" * 64))
    report = verify_model_integrity(artifact)
    assert not report.ok and "root digest" in report.problems[0]


def test_consistent_edit_of_an_entry_is_caught_by_the_hash(artifact):
    # an attacker edits a hash and recomputes the root digest: the file hash still fails
    def mutate(d):
        d["files"][0]["sha256"] = "0" * 64
        d["root_digest"] = root_digest_v2(d)

    rewrite_manifest(artifact, mutate)
    report = verify_model_integrity(artifact)
    assert not report.problems and not report.ok


def test_manifest_that_is_not_json(artifact):
    (artifact / MANIFEST_NAME).write_text("{oops")
    with pytest.raises(FormatError, match="not valid JSON"):
        verify_model_integrity(artifact)


def test_missing_manifest(tmp_path):
    with pytest.raises(FormatError, match="no manifest"):
        verify_model_integrity(tmp_path)


def test_manifest_symlink_is_refused(artifact, tmp_path):
    os.rename(artifact / MANIFEST_NAME, tmp_path / "m.json")
    (artifact / MANIFEST_NAME).symlink_to(tmp_path / "m.json")
    with pytest.raises(FormatError, match="symbolic link"):
        verify_model_integrity(artifact)


def _resign(artifact, relative):
    """Re-hash one file into the manifest, as a careless tool would after editing it."""
    import hashlib

    data = (artifact / relative).read_bytes()

    def mutate(d):
        for entry in d["files"]:
            if entry["path"] == relative:
                entry["size"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
        d["root_digest"] = root_digest_v2(d)

    rewrite_manifest(artifact, mutate)


def test_safetensors_header_longer_than_the_file_fails_even_when_signed(artifact):
    path = artifact / SHARD
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", len(data) * 2)
    path.write_bytes(bytes(data))
    _resign(artifact, SHARD)
    error = failures(verify_model_integrity(artifact))[SHARD]
    assert "header declares" in error and "but the file has only" in error


def test_index_naming_a_shard_outside_the_manifest_fails(artifact):
    index = json.loads((artifact / INDEX_NAME).read_text())
    index["weight_map"]["codes"] = "../elsewhere.safetensors"
    (artifact / INDEX_NAME).write_text(json.dumps(index))
    _resign(artifact, INDEX_NAME)
    report = verify_model_integrity(artifact)
    assert not report.ok and "not a file of the manifest" in report.problems[0]


def test_index_disagreeing_with_shard_contents_fails(artifact):
    index = json.loads((artifact / INDEX_NAME).read_text())
    index["weight_map"]["ghost"] = SHARD
    (artifact / INDEX_NAME).write_text(json.dumps(index))
    _resign(artifact, INDEX_NAME)
    report = verify_model_integrity(artifact)
    assert not report.ok and "does not hold what the index says" in report.problems[0]


def test_parallel_and_serial_agree(artifact):
    one = verify_model_integrity(artifact, workers=1).to_dict()
    many = verify_model_integrity(artifact, workers=8).to_dict()
    for report in (one, many):
        report.pop("seconds")
    assert one == many


def test_a_signature_file_is_allowed_beside_the_list_and_never_listed(artifact):
    (artifact / SIGNATURE_NAME).write_text("{}")
    report = verify_model_integrity(artifact)
    assert report.ok, report.to_dict()
    assert SIGNATURE_NAME not in {r.path for r in report.files}
    assert SIGNATURE_NAME not in {e.path for e in seal_artifact(artifact).files}


def test_a_signature_that_is_a_link_is_refused(artifact, tmp_path):
    (tmp_path / "elsewhere.sig").write_text("{}")
    (artifact / SIGNATURE_NAME).symlink_to(tmp_path / "elsewhere.sig")
    assert "symbolic link" in failures(verify_model_integrity(artifact))[SIGNATURE_NAME]


def test_the_report_holds_the_manifest_and_the_digest_of_its_bytes(artifact):
    report = verify_model_integrity(artifact)
    assert report.manifest is not None and report.manifest.root_digest == report.root_digest
    assert report.manifest_sha256 == hashlib.sha256((artifact / MANIFEST_NAME).read_bytes()).hexdigest()
