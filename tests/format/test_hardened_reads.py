"""Reading an artifact never follows a link inside it, never blocks, never reads past a bound (issue 11).

Each test is a probe that failed before the fix: a FIFO or link in place of a small file, a huge sparse
manifest, a tensor shape of [0, 2**64], a symlinked artifact path, links seen by ``inspect``, and paths
too long for the OS or for one line of output.
"""

from __future__ import annotations

import json
import os
import struct
import tracemalloc
from pathlib import Path

import pytest
from typer.testing import CliRunner

from blocking import within
from squeeze import verify_model_integrity
from squeeze.cli.app import app
from squeeze.errors import ConfigError, FormatError
from squeeze.format.manifest import MANIFEST_NAME
from squeeze.format.paths import MAX_DEPTH, read_inside, read_user_file, short_path
from squeeze.format.safetensors_header import parse_safetensors_header
from squeeze.format.verify import read_manifest, seal_artifact
from squeeze.models.remote_code import read_small_json

runner = CliRunner()
SHARD = "model-00001-of-00002.safetensors"


# ------------------------------------------------------------------------------------------------------
# read_inside: the one hardened reader


def test_read_inside_reads_a_small_regular_file(artifact):
    assert read_inside(artifact, "extra/notes.txt", 100) == b"hello\n"
    fd = os.open(artifact, os.O_RDONLY)
    try:
        assert read_inside(fd, "config.json", 100) == (artifact / "config.json").read_bytes()
    finally:
        os.close(fd)


def test_read_inside_refuses_a_fifo_without_blocking(artifact):
    fifo = artifact / "config.json"
    fifo.unlink()
    os.mkfifo(fifo)
    with pytest.raises(FormatError, match="config.json is not a regular file"):
        within(10, lambda: read_inside(artifact, "config.json", 100), unblock=fifo)


@pytest.mark.parametrize("relative", ["config.json", "extra/notes.txt"])
def test_read_inside_follows_no_link_at_any_component(artifact, tmp_path, relative):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "notes.txt").write_text("secret")
    (outside / "config.json").write_text("secret")
    if relative == "config.json":
        (artifact / "config.json").unlink()
        os.symlink(outside / "config.json", artifact / "config.json")
    else:  # the directory on the way is the link
        (artifact / "extra" / "notes.txt").unlink()
        (artifact / "extra").rmdir()
        os.symlink(outside, artifact / "extra")
    with pytest.raises(FormatError, match="symbolic link"):
        read_inside(artifact, relative, 100)


def test_read_inside_caps_the_size_before_reading(artifact):
    with open(artifact / "config.json", "r+b") as handle:
        handle.truncate(2**30)  # sparse: no disk, but a plain read() would allocate 1 GiB
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match="1073741824 bytes, larger than the 4096 byte limit"):
            read_inside(artifact, "config.json", 4096)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20


def test_read_inside_stops_at_the_limit_when_the_file_is_longer_than_it_said():
    # /proc files report size 0 and then deliver bytes: what a file growing after fstat looks like
    with pytest.raises(FormatError, match="grew past the 10 byte limit"):
        read_inside(os.path.realpath("/proc/self"), "status", 10)


# ------------------------------------------------------------------------------------------------------
# read_user_file and read_small_json: the same capped read (read_capped), the user's own links followed


def test_a_user_file_follows_links_and_refuses_a_fifo_without_blocking(tmp_path):
    (tmp_path / "key.pem").write_bytes(b"pem")
    os.symlink(tmp_path / "key.pem", tmp_path / "link.pem")
    assert read_user_file(tmp_path / "link.pem", 3, "public key") == b"pem"
    os.mkfifo(tmp_path / "fifo.pem")
    with pytest.raises(ConfigError, match=r"the public key .*fifo.pem is a FIFO \(named pipe\), not a regular"):
        within(10, lambda: read_user_file(tmp_path / "fifo.pem", 100, "public key"), unblock=tmp_path / "fifo.pem")
    with pytest.raises(FileNotFoundError):
        read_user_file(tmp_path / "missing.pem", 100, "public key")


def test_a_user_file_is_capped_before_reading_and_while_reading(tmp_path):
    with open(tmp_path / "recipe.yaml", "wb") as handle:
        handle.truncate(2**30)  # sparse
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError, match="recipe .* is 1073741824 bytes, larger than the 4096 byte limit"):
            read_user_file(tmp_path / "recipe.yaml", 4096, "recipe")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20  # before: read_user_file read limit + 1 bytes first
    with pytest.raises(ConfigError, match="grew past the 10 byte limit"):
        read_user_file("/proc/self/status", 10, "status")


def test_a_models_small_json_is_none_unless_small_regular_and_valid(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert read_small_json(tmp_path / "config.json") == {"model_type": "llama"}
    (tmp_path / "bad.json").write_text("{")
    with open(tmp_path / "huge.json", "wb") as handle:
        handle.truncate(2**30)
    os.mkfifo(tmp_path / "fifo.json")
    for name in ("bad.json", "huge.json", "fifo.json", "missing.json"):
        assert within(10, lambda n=name: read_small_json(tmp_path / n), unblock=tmp_path / "fifo.json") is None


def test_a_huge_sparse_manifest_is_refused_without_reading_it(artifact):
    with open(artifact / MANIFEST_NAME, "r+b") as handle:
        handle.truncate(2**30)
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match="larger than the 67108864 byte limit"):
            read_manifest(artifact)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20  # before: the whole GiB was read, then refused


# ------------------------------------------------------------------------------------------------------
# safetensors shapes


def _header_bytes(tensors: dict) -> bytes:
    body = json.dumps(tensors).encode()
    return struct.pack("<Q", len(body)) + body


@pytest.mark.parametrize("shape", [[0, 2**64], [0, 2**53 + 1], [2**30, 0, 2**30]])
def test_a_zero_size_tensor_with_huge_dimensions_is_malformed(shape):
    prefix = _header_bytes({"t": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}})
    with pytest.raises(FormatError, match="multiply past 2\\^53"):
        parse_safetensors_header(prefix, len(prefix), "x.safetensors")


def test_verify_reports_a_resealed_shard_with_a_huge_dimension(artifact):
    path = artifact / SHARD
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8 : 8 + length]), raw[8 + length :]
    header["huge"] = {"dtype": "F32", "shape": [0, 2**64], "data_offsets": [len(data), len(data)]}
    path.write_bytes(_header_bytes(header) + data)
    index = json.loads((artifact / "model.safetensors.index.json").read_text())
    index["weight_map"]["huge"] = SHARD
    (artifact / "model.safetensors.index.json").write_text(json.dumps(index))
    (artifact / MANIFEST_NAME).unlink()
    seal_artifact(artifact)
    report = verify_model_integrity(artifact)
    assert not report.ok and "multiply past 2^53" in report.first_error()


# ------------------------------------------------------------------------------------------------------
# A symlinked artifact path (current -> v3) is resolved; links inside still fail


def _current(artifact: Path) -> Path:
    link = artifact.parent / "current"
    os.symlink(artifact.name, link)
    return link


def test_verify_and_inspect_accept_a_symlinked_artifact_path(artifact):
    current = _current(artifact)
    for args in (["verify", str(current)], ["verify", str(current / MANIFEST_NAME)], ["inspect", str(current)]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, (args, result.output)
    report = verify_model_integrity(current)
    assert report.ok and report.artifact_dir == str(artifact.resolve())


def test_a_link_inside_a_symlinked_artifact_still_fails(artifact, tmp_path):
    current = _current(artifact)
    moved = tmp_path / "elsewhere.json"
    (artifact / "config.json").rename(moved)
    os.symlink(moved, artifact / "config.json")
    result = runner.invoke(app, ["verify", str(current)])
    assert result.exit_code == 1 and "config.json: symbolic link" in result.stderr


def test_a_symlinked_manifest_is_refused(artifact, tmp_path):
    moved = tmp_path / MANIFEST_NAME
    (artifact / MANIFEST_NAME).rename(moved)
    os.symlink(moved, artifact / MANIFEST_NAME)
    with pytest.raises(FormatError, match="symbolic link"):
        verify_model_integrity(_current(artifact))


# ------------------------------------------------------------------------------------------------------
# inspect lists links and special files without following them


@pytest.mark.parametrize("name", [SHARD, "config.json"])
def test_inspect_lists_a_symlinked_file_without_following_it(artifact, tmp_path, name):
    moved = tmp_path / name
    (artifact / name).rename(moved)
    os.symlink(moved, artifact / name)
    result = runner.invoke(app, ["inspect", str(artifact), "--json"])
    assert result.exit_code == 0, result.output  # before: internal error, ELOOP
    info = json.loads(result.stdout)
    entry = next(f for f in info["files"] if f["path"] == name)
    assert entry["problem"] == "symbolic link; not read" and entry["listed"]
    assert info["manifest"]["status"] == "MISMATCH"
    table = runner.invoke(app, ["inspect", str(artifact)])
    assert table.exit_code == 0 and "symbolic link; not read" in table.stdout


def test_inspect_does_not_block_on_a_fifo_config(artifact):
    fifo = artifact / "config.json"
    fifo.unlink()
    os.mkfifo(fifo)
    result = within(30, lambda: runner.invoke(app, ["inspect", str(artifact), "--json"]), unblock=fifo)
    assert result.exit_code == 0, result.output
    entry = next(f for f in json.loads(result.stdout)["files"] if f["path"] == "config.json")
    assert entry["problem"] == "not a regular file; not read"


# ------------------------------------------------------------------------------------------------------
# Long paths: clean one-line errors


def _deep(root: Path, levels: int, name: str) -> Path:
    """``levels`` nested directories called ``name`` under ``root``, made relative to fds (no PATH_MAX)."""
    fd = os.open(root, os.O_RDONLY)
    try:
        for _ in range(levels):
            os.mkdir(name, dir_fd=fd)
            inner = os.open(name, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = inner
        os.close(os.open("f.txt", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd))
    finally:
        os.close(fd)
    return root


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_a_path_longer_than_the_os_allows_is_one_short_error_line(tmp_path, command):
    # the probe used 1500 levels; 30 of 200 characters make the same 6 KB path, and stay shallow enough
    # for pytest's recursive cleanup of old temp directories
    _deep(tmp_path, 30, "d" * 200)
    path = str(tmp_path) + ("/" + "d" * 200) * 30
    result = runner.invoke(app, [command, path])
    assert result.exit_code == 2, result.output  # before: internal error with the whole 6 KB path
    assert result.stderr.startswith("Error: ") and "longer than the operating system allows" in result.stderr
    assert max(len(line) for line in result.stderr.splitlines()) < 400


def test_directories_nested_past_path_max_inside_an_artifact_are_reported_not_crashed_on(artifact):
    _deep(artifact / "extra", MAX_DEPTH + 10, "d" * 200)  # > 6 KB of path below the artifact
    result = runner.invoke(app, ["verify", str(artifact)])
    assert result.exit_code == 1, result.output  # before: internal error, ENAMETOOLONG from scandir
    assert f"nested more than {MAX_DEPTH} levels deep" in result.stderr
    assert max(len(line) for line in result.stderr.splitlines()) < 400
    assert runner.invoke(app, ["inspect", str(artifact)]).exit_code == 0


def test_short_path_keeps_the_tail():
    assert short_path("a/b") == "a/b"
    long = "x" * 300 + "/config.json"
    assert short_path(long) == "..." + long[-120:] and short_path(long).endswith("/config.json")
