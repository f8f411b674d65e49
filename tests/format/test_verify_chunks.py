"""Verification of files listed with chunk digests (manifest version 2): chunks hashed on several threads,
a bad chunk named, captured bytes exactly the file's, sizes changing mid-read caught, version 1 unchanged."""

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import squeeze.format.hashing as hashing
from squeeze.format.manifest import MANIFEST_NAME, root_digest_v2
from squeeze.format.paths import open_root
from squeeze.format.safetensors_header import parse_safetensors_header
from squeeze.format.shards import INDEX_NAME, write_shards
from squeeze.format.verify import read_manifest, seal_artifact, verify_artifact

CHUNK = 4096
SHARD = "model-00001-of-00002.safetensors"


def failures(report):
    return {r.path: r.error for r in report.files if not r.ok}


@pytest.fixture
def chunked(tmp_path: Path) -> Path:
    """Two shards of ~10 chunks each, headers longer than a chunk (240 tensors), a chunked index."""
    directory = tmp_path / "chunked"
    directory.mkdir()
    generator = torch.Generator().manual_seed(0)
    tensors = {f"model.layers.{i}.mlp.weight": torch.randn(7, 11 + i % 5, generator=generator) for i in range(240)}
    write_shards(directory, tensors, 45_000)
    (directory / "config.json").write_text('{"model_type": "llama"}\n')
    seal_artifact(directory, chunk_bytes=CHUNK)
    return directory


def test_seal_writes_chunk_digests_of_consecutive_pieces(chunked):
    manifest = read_manifest(chunked)
    assert manifest.format_version == 2 and manifest.chunk_bytes == CHUNK
    listed = {entry.path: entry for entry in manifest.files}
    assert set(listed) == {SHARD, "model-00002-of-00002.safetensors", INDEX_NAME, "config.json"}
    for path, entry in listed.items():
        data = (chunked / path).read_bytes()
        assert entry.sha256 == hashlib.sha256(data).hexdigest()  # the whole file's, sha256sum-compatible
        expected = [hashlib.sha256(data[i : i + CHUNK]).hexdigest() for i in range(0, len(data), CHUNK)]
        assert list(entry.chunks) == (expected if len(data) > CHUNK else [])
    assert len(listed[SHARD].chunks) >= 8 and listed[INDEX_NAME].chunks  # the index is chunked too
    assert int.from_bytes((chunked / SHARD).read_bytes()[:8], "little") > 2 * CHUNK


def test_chunked_artifact_verifies_with_headers_and_index(chunked):
    seen = []
    report = verify_artifact(chunked, progress=lambda done, total: seen.append((done, total)))
    assert report.ok, report.to_dict()
    assert report.bytes_hashed == sum((chunked / r.path).stat().st_size for r in report.files)
    assert seen[-1] == (report.bytes_hashed, report.bytes_hashed)
    for path, header in report.headers.items():
        data = (chunked / path).read_bytes()
        assert header == parse_safetensors_header(data[: 8 + int.from_bytes(data[:8], "little")], len(data), path)
    assert {r.path: r.sha256 for r in report.files} == {e.path: e.sha256 for e in read_manifest(chunked).files}


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_byte_names_its_chunk(chunked, where):
    path = chunked / SHARD
    data = bytearray(path.read_bytes())
    n_chunks = -(-len(data) // CHUNK)
    k = {"first": 0, "middle": n_chunks // 2, "last": n_chunks - 1}[where]
    data[k * CHUNK + 5] ^= 0x01
    path.write_bytes(bytes(data))
    error = failures(verify_artifact(chunked))[SHARD]
    end = min((k + 1) * CHUNK, len(data)) - 1
    assert error.startswith(f"chunk {k} of {n_chunks} (bytes {k * CHUNK}-{end}): SHA-256 mismatch")


def test_two_bad_chunks_report_the_first_and_skip_the_rest(chunked, monkeypatch):
    path = chunked / SHARD
    data = bytearray(path.read_bytes())
    data[3 * CHUNK] ^= 0xFF
    data[6 * CHUNK] ^= 0xFF
    path.write_bytes(bytes(data))
    shard_inode = path.stat().st_ino
    reads = []
    real = os.preadv

    def counting(fd, buffers, offset):
        if os.fstat(fd).st_ino == shard_inode:
            reads.append(offset)
        return real(fd, buffers, offset)

    monkeypatch.setattr(hashing.os, "preadv", counting)
    report = verify_artifact(chunked, workers=1)
    assert failures(report)[SHARD].startswith(f"chunk 3 of {-(-len(data) // CHUNK)} (bytes 12288-16383)")
    assert reads == [0, CHUNK, 2 * CHUNK, 3 * CHUNK]  # one thread: the chunks after the bad one were skipped


def test_captured_bytes_are_the_file_bytes(chunked):
    report = verify_artifact(chunked, capture=lambda path: True)
    assert report.ok
    for path in (SHARD, INDEX_NAME, "config.json"):
        data = (chunked / path).read_bytes()
        captured = report.captured[path]
        assert captured.data is not None and bytes(captured.data.numpy()) == data
    from squeeze.runtime.artifact_tensors import tensors_from_captured

    tensors = tensors_from_captured(report)
    reference = {**load_file(chunked / SHARD), **load_file(chunked / "model-00002-of-00002.safetensors")}
    assert tensors.keys() == reference.keys()
    assert all(torch.equal(tensors[k], reference[k]) for k in reference)


def test_serial_and_parallel_agree(chunked):
    path = chunked / "model-00002-of-00002.safetensors"
    data = bytearray(path.read_bytes())
    data[2 * CHUNK + 1] ^= 0x10
    path.write_bytes(bytes(data))
    reports = [verify_artifact(chunked, workers=n).to_dict() for n in (1, 3, 8)]
    for report in reports:
        report.pop("seconds")
    assert reports[0] == reports[1] == reports[2] and not reports[0]["ok"]


def test_chunk_digests_agree_with_whole_file_hashing(chunked):
    manifest = read_manifest(chunked)
    root = open_root(chunked)
    try:
        paths = [e.path for e in manifest.files]
        plain = hashing.hash_files(root, paths, 0, hashing.HashOptions(chunk_bytes=CHUNK))
        plans = {e.path: hashing.ChunkPlan(e.size, e.sha256, CHUNK, e.chunks) for e in manifest.files if e.chunks}
        by_chunks = hashing.hash_files(root, paths, 0, hashing.HashOptions(plans=plans))
    finally:
        os.close(root)
    for path in paths:
        a, b = plain[path], by_chunks[path]
        assert isinstance(a, hashing.HashedFile) and isinstance(b, hashing.HashedFile)
        assert (a.size, a.sha256, a.head) == (b.size, b.sha256, b.head)
        assert a.chunks == b.chunks or not plans.get(path)


@pytest.mark.parametrize("change", ["shrink", "grow"])
def test_a_file_changing_size_during_a_chunked_read_is_caught(chunked, monkeypatch, change):
    path = chunked / SHARD
    size = path.stat().st_size
    real = os.preadv
    done = []

    def read_then_change(fd, buffers, offset):
        count = real(fd, buffers, offset)
        if not done and os.fstat(fd).st_ino == path.stat().st_ino:
            done.append(offset)
            if change == "shrink":
                os.truncate(path, size - CHUNK - 10)
            else:
                with open(path, "ab") as handle:
                    handle.write(b"x")
        return count

    monkeypatch.setattr(hashing.os, "preadv", read_then_change)
    error = failures(verify_artifact(chunked, workers=1))[SHARD]
    if change == "shrink":
        assert "size changed while reading: the file ends at byte" in error and f"says {size} bytes" in error
    else:
        assert "size changed while reading: the file is longer than" in error


def test_a_chunked_file_replaced_by_a_link_or_removed(chunked, tmp_path):
    (tmp_path / "outside.bin").write_bytes((chunked / SHARD).read_bytes())
    os.remove(chunked / SHARD)
    report = verify_artifact(chunked)
    assert failures(report)[SHARD] == "missing"
    (chunked / SHARD).symlink_to(tmp_path / "outside.bin")
    assert "symbolic link" in failures(verify_artifact(chunked))[SHARD]


def _edit_manifest(directory: Path, edit, *, reseal_digest: bool = False) -> None:
    path = directory / MANIFEST_NAME
    data = json.loads(path.read_text())
    edit(data)
    if reseal_digest:
        data["root_digest"] = root_digest_v2(data)
    path.write_text(json.dumps(data, indent=2))


def test_editing_only_the_provenance_fails_verification(chunked):
    _edit_manifest(chunked, lambda d: d["provenance"].update(source_model="someone-else"))
    report = verify_artifact(chunked)
    assert not report.ok and all(r.ok for r in report.files)
    assert "root digest does not match" in report.problems[0] and "provenance" in report.problems[0]


def test_consistently_edited_chunk_digest_is_caught_by_the_chunk(chunked):
    # the root digest recomputed after editing a chunk digest: the chunk itself still fails
    _edit_manifest(chunked, lambda d: d["files"][-1]["chunks"].__setitem__(1, "0" * 64), reseal_digest=True)
    report = verify_artifact(chunked)
    assert not report.problems
    (error,) = failures(report).values()
    assert error.startswith("chunk 1 of ")


def test_the_loader_builds_the_same_model_from_a_chunked_artifact(compress_tiny, tmp_path):
    from squeeze import api

    plain = compress_tiny(tmp_path / "plain", "w4")
    chunked = tmp_path / "chunked"
    chunked.mkdir()
    for item in plain.iterdir():
        if item.is_file() and item.name != MANIFEST_NAME:
            (chunked / item.name).write_bytes(item.read_bytes())
    seal_artifact(chunked, read_manifest(plain).provenance, chunk_bytes=CHUNK)
    assert any(entry.chunks for entry in read_manifest(chunked).files if entry.path.endswith(".safetensors"))
    reference = api.load(plain).model.state_dict()
    loaded = api.load(chunked)
    state = loaded.model.state_dict()
    assert state.keys() == reference.keys() and all(torch.equal(state[k], reference[k]) for k in reference)
    assert loaded.report is not None and all(h.chunks for h in loaded.report.captured.values() if h.size > CHUNK)


@pytest.mark.parametrize("chunk_bytes", [2**20, 2**26])  # chunked (4 chunks, the last short), and whole-file
def test_a_large_capture_holds_the_file_bytes(tmp_path, chunk_bytes):
    # captures of >= 2 MiB are backed by a huge-page-advised anonymous mapping (hashing.private_bytes)
    from squeeze.runtime.artifact_tensors import tensors_from_captured

    generator = torch.Generator().manual_seed(1)
    weight = torch.randint(0, 255, (3 * 2**20 + 77,), dtype=torch.uint8, generator=generator)
    write_shards(tmp_path, {"w": weight}, 2**30)
    seal_artifact(tmp_path, chunk_bytes=chunk_bytes)
    (shard,) = [p for p in tmp_path.iterdir() if p.suffix == ".safetensors"]
    report = verify_artifact(tmp_path, capture=lambda path: True)
    assert report.ok
    captured = report.captured[shard.name]
    assert captured.data is not None and bytes(captured.data.numpy()) == shard.read_bytes()
    assert len(captured.chunks) == (4 if chunk_bytes == 2**20 else 0)
    assert torch.equal(tensors_from_captured(report)["w"], weight)


@pytest.mark.parametrize("capture", [False, True])
def test_the_header_of_a_big_shard_spans_chunks_and_is_kept_alone(tmp_path, capture):
    # larger than hashing.KEEP_BYTES (16 MiB): only the safetensors header is kept, taken from the hashed
    # pieces of several chunks (4 KiB chunks, a ~15 KB header)
    generator = torch.Generator().manual_seed(2)
    tensors = {f"small.{i}": torch.randn(3, generator=generator) for i in range(240)}
    tensors["big"] = torch.randint(0, 255, (17 * 2**20,), dtype=torch.uint8, generator=generator)
    write_shards(tmp_path, tensors, 2**30)
    seal_artifact(tmp_path, chunk_bytes=CHUNK)
    (shard,) = [p for p in tmp_path.iterdir() if p.suffix == ".safetensors"]
    data = shard.read_bytes()
    header = data[: 8 + int.from_bytes(data[:8], "little")]
    assert len(data) > hashing.KEEP_BYTES and len(header) > 3 * CHUNK
    report = verify_artifact(tmp_path, capture=(lambda path: True) if capture else None)
    assert report.ok, report.first_error()
    root = open_root(tmp_path)
    try:
        entry = next(e for e in read_manifest(tmp_path).files if e.path == shard.name)
        plan = hashing.ChunkPlan(entry.size, entry.sha256, CHUNK, entry.chunks)
        by_chunks = hashing.hash_files(root, [shard.name], 0, hashing.HashOptions(plans={shard.name: plan}, workers=4))[
            shard.name
        ]
        whole = hashing.hash_files(root, [shard.name], 0)[shard.name]
    finally:
        os.close(root)
    assert isinstance(by_chunks, hashing.HashedFile) and isinstance(whole, hashing.HashedFile)
    assert by_chunks.head == whole.head == header
    assert report.headers[shard.name] == parse_safetensors_header(header, len(data), shard.name)
