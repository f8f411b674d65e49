"""squeeze pull over HTTP against a local server: correct pulls, every fault the issue lists, resume."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest
from pull_server import CHUNK, SHARD, ArtifactServer, build_artifact, make_v1

from squeeze.distribution.download import Downloader
from squeeze.distribution.pull import pull_artifact
from squeeze.distribution.staging import Staging, staging_path
from squeeze.errors import ConfigError, FormatError, IntegrityError, LockError, TransferError
from squeeze.format.manifest import MANIFEST_NAME, parse_manifest
from squeeze.format.verify import verify_artifact


def same_tree(a: Path, b: Path) -> None:
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def file_requests(server: ArtifactServer) -> list[tuple[str, str, str | None]]:
    return [r for r in server.requests if not r[1].endswith((MANIFEST_NAME, "model.sig"))]


def test_pull_is_byte_identical_verifies_and_uses_chunk_ranges(server, served, tmp_path):
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def progress(done: int, total: int) -> None:
        with lock:
            seen.append((done, total))

    out = tmp_path / "out"
    result = pull_artifact(server.url, out, workers=4, progress=progress)
    same_tree(served, out)
    assert verify_artifact(out).ok
    total = sum(p.stat().st_size for p in served.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)
    assert (result.files, result.bytes_downloaded, result.bytes_reused) == (4, total, 0)
    assert result.root_digest == parse_manifest((served / MANIFEST_NAME).read_bytes()).root_digest
    assert result.output == out and not staging_path(out).exists()
    assert max(seen) == (total, total)
    shard_size = (served / SHARD).stat().st_size
    ranges = sorted(r[2] for r in file_requests(server) if r[1] == "/" + SHARD)
    expected = sorted(f"bytes={s}-{min(s + CHUNK, shard_size) - 1}" for s in range(0, shard_size, CHUNK))
    assert ranges == expected  # one range request per chunk, nothing fetched twice
    assert "/tok/a%20b%25%23%3F.json" in {r[1] for r in server.requests}  # each component URL-quoted


def test_one_worker_reuses_one_kept_alive_connection(server, tmp_path):
    pull_artifact(server.url, tmp_path / "out", workers=1)
    assert len(file_requests(server)) == 12  # 10 chunks, 2 small files (the empty one needs no request)
    assert len(server.clients) <= 2  # the manifest and signature on one, all the files on one more at most


def test_manifest_without_content_length_is_read_to_its_end(server, tmp_path, monkeypatch):
    server.faults.no_length.add(MANIFEST_NAME)
    assert verify_artifact(pull_artifact(server.url, tmp_path / "out").output).ok
    monkeypatch.setattr("squeeze.distribution.pull.MAX_MANIFEST_BYTES", 100)  # and never past the limit
    with pytest.raises(FormatError, match="larger than the 100 byte limit"):
        pull_artifact(server.url, tmp_path / "out2")


def test_pull_again_into_the_same_output_downloads_nothing(server, tmp_path):
    out = tmp_path / "out"
    pull_artifact(server.url, out)
    before = len(server.requests)
    again = pull_artifact(server.url + MANIFEST_NAME, out)  # the manifest's own URL names the directory too
    assert again.extra["already_present"] and again.bytes_downloaded == 0
    assert all(r[1].endswith((MANIFEST_NAME, "model.sig")) for r in server.requests[before:])


def test_pull_into_an_empty_directory_or_a_new_nested_one(server, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    pull_artifact(server.url, out)
    assert verify_artifact(out).ok
    nested = tmp_path / "a" / "b" / "c"
    pull_artifact(server.url, nested)
    assert verify_artifact(nested).ok and sorted(p.name for p in nested.parent.iterdir()) == ["c"]


def test_redirect_loop_stops(tmp_path):
    with ArtifactServer() as loop:
        loop.faults.redirect_to = loop.url
        with pytest.raises(TransferError, match="more than 5 redirects"):
            pull_artifact(loop.url, tmp_path / "out")
        assert len(loop.requests) == 6  # the first request and 5 redirects followed, then no retry


@pytest.mark.parametrize("path", [SHARD, "config.json"], ids=["chunked", "whole-file"])
def test_flipped_byte_fails_and_keeps_nothing(server, tmp_path, path):
    server.faults.flip[path] = 5000 if path == SHARD else 3
    out = tmp_path / "out"
    with pytest.raises(IntegrityError, match=f"{path}.*SHA-256") as info:
        pull_artifact(server.url, out, workers=2)
    assert info.value.exit_code == 1
    assert not out.exists()
    assert not (staging_path(out) / path).exists()  # the bad partial file is deleted


def test_missing_file_fails_with_integrity_error(server, tmp_path):
    server.faults.missing.add("config.json")
    out = tmp_path / "out"
    with pytest.raises(IntegrityError, match="config.json is listed in the manifest but missing on the server"):
        pull_artifact(server.url, out)
    assert not out.exists()


def test_dropped_connection_is_retried_from_where_it_stopped(server, served, tmp_path):
    make_v1(served)  # one stream for the whole shard: the retry must continue it, not restart it
    server.faults.drop_after[SHARD] = 10_000
    out = tmp_path / "out"
    result = pull_artifact(server.url, out, workers=1)
    assert verify_artifact(out).ok
    assert result.bytes_downloaded == sum(e.size for e in parse_manifest((out / MANIFEST_NAME).read_bytes()).files)
    last = (served / SHARD).stat().st_size - 1
    assert [r[2] for r in file_requests(server) if r[1] == "/" + SHARD] == [f"bytes=0-{last}", f"bytes=10000-{last}"]


@pytest.mark.parametrize("v1", [False, True], ids=["chunked", "whole-file"])
def test_interrupted_pull_resumes_from_verified_partial_files(server, served, tmp_path, v1):
    if v1:
        make_v1(served)
    server.faults.drop_after[SHARD] = 10_000 if v1 else 2_000
    server.faults.drop_from[SHARD] = 0 if v1 else 3 * CHUNK  # chunks 0-2 complete before the drop
    out = tmp_path / "out"
    with pytest.raises(TransferError, match="rerun") as info:
        pull_artifact(server.url, out, workers=1, retries=0)
    assert info.value.exit_code == 2 and not out.exists()
    assert staging_path(out).is_dir()
    server.requests.clear()
    result = pull_artifact(server.url, out, workers=1)
    assert verify_artifact(out).ok
    same_tree(served, out)
    assert result.bytes_reused > 0 and result.bytes_downloaded < (served / SHARD).stat().st_size + 100
    shard_requests = [r[2] for r in file_requests(server) if r[1] == "/" + SHARD]
    if v1:
        last = (served / SHARD).stat().st_size - 1
        assert shard_requests == [f"bytes=10000-{last}"]  # the 10000 bytes on disk were re-hashed and kept
    else:
        assert len(shard_requests) == 7 and "bytes=0-4095" not in shard_requests  # 3 chunks on disk kept
        assert result.bytes_reused == 3 * CHUNK  # (the small files come after the chunks: none was fetched)


def test_resume_with_a_bad_prefix_downloads_the_file_again(server, served, tmp_path):
    make_v1(served)
    out = tmp_path / "out"
    partial = staging_path(out) / SHARD
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"\x00" * 1000)  # not the file's first bytes
    (staging_path(out) / "leftover.bin").write_bytes(b"from an older version")
    result = pull_artifact(server.url, out)
    assert verify_artifact(out).ok and result.bytes_reused == 0
    assert not (out / "leftover.bin").exists()


def test_manifest_listing_a_path_outside_the_artifact_is_refused(server, served, tmp_path):
    manifest = json.loads((served / MANIFEST_NAME).read_text())
    manifest["files"][0]["path"] = "../escape.txt"
    (served / MANIFEST_NAME).write_text(json.dumps(manifest))
    out = tmp_path / "out"
    with pytest.raises(FormatError, match=r"'\.\.' component"):
        pull_artifact(server.url, out)
    assert not out.exists() and not staging_path(out).exists() and not (tmp_path / "escape.txt").exists()
    assert file_requests(server) == []


def test_tampered_manifest_root_digest_is_refused(server, served, tmp_path):
    manifest = json.loads((served / MANIFEST_NAME).read_text())
    manifest["provenance"]["source_model"] = "someone-else"
    (served / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(IntegrityError, match="root digest"):
        pull_artifact(server.url, tmp_path / "out")
    assert file_requests(server) == []


def test_url_without_a_manifest_is_not_an_artifact(server, tmp_path):
    with pytest.raises(FormatError, match="no squeeze.manifest.json at .*not a squeeze artifact") as info:
        pull_artifact(server.url + "tok/", tmp_path / "out")
    assert info.value.exit_code == 2
    assert not (tmp_path / "out").exists()


def test_redirect_to_another_host_with_the_same_files_verifies(server, tmp_path):
    with ArtifactServer(host="127.0.0.1") as front:
        front.faults.redirect_to = f"http://localhost:{server.port}"
        result = pull_artifact(front.url, tmp_path / "out")
    assert verify_artifact(result.output).ok
    assert len(server.requests) > 2


def test_redirect_to_a_host_with_other_bytes_fails(server, served, tmp_path):
    other = build_artifact(tmp_path / "other")
    (other / MANIFEST_NAME).write_bytes((served / MANIFEST_NAME).read_bytes())
    (other / "config.json").write_text('{"model_type": "evil!"}\n')  # same size, other bytes
    with ArtifactServer(other) as evil:
        server.faults.redirect_to = evil.url
        with pytest.raises(IntegrityError, match="config.json"):
            pull_artifact(server.url, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("path", [SHARD, "config.json"], ids=["chunked", "whole-file"])
def test_server_sending_more_bytes_than_listed_is_refused(server, tmp_path, path):
    server.faults.extra[path] = b"X" * 100
    with pytest.raises(IntegrityError, match="more than the .* the manifest lists"):
        pull_artifact(server.url, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unannounced_extra_bytes_are_never_read(server, served, tmp_path):
    server.faults.no_range = True
    server.faults.no_length.add("config.json")  # no Content-Length: the body runs on past the listed size
    server.faults.extra["config.json"] = b"EXTRA" * 1000
    out = tmp_path / "out"
    pull_artifact(server.url, out)
    assert (out / "config.json").read_bytes() == (served / "config.json").read_bytes()  # cut at its size
    assert verify_artifact(out).ok


@pytest.mark.parametrize("keep", [5 * CHUNK, 0], ids=["content-range-total", "416"])
def test_shorter_file_on_the_server_is_an_integrity_error(server, served, tmp_path, keep):
    data = (served / SHARD).read_bytes()
    (served / SHARD).write_bytes(data[:keep])  # ranges past its end: 416, or a Content-Range of another size
    with pytest.raises(IntegrityError, match=SHARD):
        pull_artifact(server.url, tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists()


def test_server_without_range_support_still_pulls(server, served, tmp_path):
    server.faults.no_range = True
    out = tmp_path / "out"
    pull_artifact(server.url, out, workers=2)
    same_tree(served, out)


def test_stalled_server_times_out(server, tmp_path):
    server.faults.delay_s = 2.0
    with pytest.raises(TransferError, match="timed out"):
        pull_artifact(server.url, tmp_path / "out", timeout=0.3, retries=0)


def test_output_holding_something_else_is_refused(server, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="exists and is not empty"):
        pull_artifact(server.url, out)
    assert (out / "notes.txt").read_text() == "mine" and server.requests == []
    other = build_artifact(tmp_path / "other-artifact", chunk_bytes=8192)
    with pytest.raises(ConfigError, match="holds another artifact"):
        pull_artifact(server.url, other)


def test_concurrent_pull_into_the_same_output_is_refused(server, tmp_path):
    out = tmp_path / "out"
    with Staging(out), pytest.raises(LockError, match="another squeeze pull"):
        pull_artifact(server.url, out)


def test_source_strings_that_are_not_pullable(tmp_path):
    for bad in ("ftp://host/x/", "file:///etc/", "not a repo", "http://user:pw@host/x/", "a/b/c", "http://h/x?y=1"):
        with pytest.raises(ConfigError):
            pull_artifact(bad, tmp_path / "out")
    with pytest.raises(ConfigError, match="workers must be >= 1"):
        pull_artifact("http://127.0.0.1:9/x/", tmp_path / "out", workers=0)
    assert not (tmp_path / "out").exists() and not staging_path(tmp_path / "out").exists()


def test_signed_artifact_checked_before_weights(server, served, tmp_path):
    signature = pytest.importorskip("squeeze.format.signature")
    if not signature.signing_available():
        pytest.skip("model_signing is not installed")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    def key_pair(name: str) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        private, public = tmp_path / f"{name}.pem", tmp_path / f"{name}.pub.pem"
        pkcs8 = serialization.PrivateFormat.PKCS8
        private.write_bytes(key.private_bytes(serialization.Encoding.PEM, pkcs8, serialization.NoEncryption()))
        public.write_bytes(
            key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )
        return private, public

    with pytest.raises(IntegrityError, match="not signed"):
        pull_artifact(server.url, tmp_path / "unsigned", public_key=key_pair("nobody")[1])
    private, public = key_pair("signer")
    signature.sign_artifact(served, private)
    out = tmp_path / "out"
    result = pull_artifact(server.url, out, public_key=public)
    assert result.signed_by is not None and (out / "model.sig").read_bytes() == (served / "model.sig").read_bytes()
    assert verify_artifact(out).ok
    server.requests.clear()
    with pytest.raises(IntegrityError, match="model.sig"):
        pull_artifact(server.url, tmp_path / "wrong-key", public_key=key_pair("other")[1])
    assert file_requests(server) == []  # refused before a single weight byte was fetched


def test_downloader_plans_one_piece_per_chunk_largest_first(server, served, tmp_path):
    from squeeze.distribution.http_client import HttpClient
    from squeeze.distribution.remote import parse_source

    manifest = parse_manifest((served / MANIFEST_NAME).read_bytes())
    with Staging(tmp_path / "out") as staging:
        pieces = Downloader(HttpClient(), parse_source(server.url), manifest, staging).plan()
    shard = next(e for e in manifest.files if e.path == SHARD)
    assert [p.length for p in pieces][:3] == [CHUNK] * 3
    staged = tmp_path / f".out.squeeze-pull/{SHARD}"
    assert sum(p.length for p in pieces if p.entry.path == SHARD) == shard.size == staged.stat().st_size
    assert len([p for p in pieces if p.entry.path == SHARD]) == len(shard.chunks) == 10
    assert hashlib.sha256(b"").hexdigest() == next(p.entry.sha256 for p in pieces if p.entry.path == "empty.txt")
