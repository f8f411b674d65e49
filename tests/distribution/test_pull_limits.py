"""squeeze pull against slow, lying and stale states (issue 41 items 5, 6, 13, 15): a drip-feeding server trips
the minimum rate or the deadline; a same-size corrupted earlier pull is re-hashed and repaired; an output that
is a symbolic link is resolved before any download; a wrong Content-Length is named and not retried.
Only against the test's own 127.0.0.1 server, every wait bounded."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
from pull_server import SHARD, ArtifactServer, build_artifact

from squeeze.distribution.pull import pull_artifact
from squeeze.distribution.staging import staging_path
from squeeze.distribution.watch import TransferWatch
from squeeze.errors import ConfigError, TransferError
from squeeze.format.verify import verify_artifact


@pytest.fixture
def served(tmp_path: Path) -> Path:
    return build_artifact(tmp_path / "served")


@pytest.fixture
def server(served: Path):
    with ArtifactServer(served) as running:
        yield running


def test_a_drip_fed_file_trips_the_minimum_rate(server, tmp_path, monkeypatch):
    """A byte every 20 ms never trips the per-read timeout; the rate over the window does."""
    monkeypatch.setenv("SQUEEZE_PULL_RATE_WINDOW", "0.5")
    server.faults.drip_s[SHARD] = 0.02
    started = time.monotonic()
    with pytest.raises(TransferError, match="bytes/s over the last .* below the minimum of 1,000 bytes/s") as info:
        pull_artifact(server.url, tmp_path / "out", min_rate=1000, timeout=5)
    assert time.monotonic() - started < 10
    assert "--min-rate" in (info.value.hint or "")
    assert not (tmp_path / "out").exists()


def test_the_deadline_stops_a_pull_that_keeps_going(server, tmp_path):
    server.faults.drip_s[SHARD] = 0.02
    started = time.monotonic()
    with pytest.raises(TransferError, match="passed its deadline of 0.5 s"):
        pull_artifact(server.url, tmp_path / "out", min_rate=0, deadline=0.5, timeout=5)
    assert time.monotonic() - started < 10


def test_the_deadline_cuts_a_stalled_read_short(server, tmp_path):
    """Issue 50 item 11: a server that stops sending held the pull a whole read timeout (30 s) past its
    deadline (``--deadline 1`` failed after 32.5 s); each read now waits at most the time left."""
    server.faults.delay_s = 4.0  # every body starts 4 s after its headers
    started = time.monotonic()
    with pytest.raises(TransferError, match="passed its deadline of 0.5 s") as info:
        pull_artifact(server.url, tmp_path / "out", min_rate=0, deadline=0.5, timeout=30)
    assert time.monotonic() - started < 2.0
    assert not info.value.retryable and "--deadline" in (info.value.hint or "")


def test_the_deadline_cuts_a_server_that_never_answers_short(tmp_path):
    """Connected, the request sent, and no status line ever comes (a listening socket nobody accepts on)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/model"
        started = time.monotonic()
        with pytest.raises(TransferError, match="passed its deadline of 0.5 s"):
            pull_artifact(url, tmp_path / "out", min_rate=0, deadline=0.5, timeout=30)
        assert time.monotonic() - started < 2.0


def test_the_limits_come_from_the_environment_and_are_checked(monkeypatch):
    monkeypatch.setenv("SQUEEZE_PULL_MIN_RATE", "123")
    monkeypatch.setenv("SQUEEZE_PULL_DEADLINE", "9")
    watch = TransferWatch()
    assert (watch.min_rate, watch.deadline) == (123, 9)
    monkeypatch.setenv("SQUEEZE_PULL_DEADLINE", "soon")
    with pytest.raises(ConfigError, match=r"\$SQUEEZE_PULL_DEADLINE must be a number"):
        TransferWatch()
    with pytest.raises(ConfigError, match="min_rate"):
        TransferWatch(min_rate=float("nan"), deadline=0)


def test_a_healthy_pull_passes_the_default_limits(server, served, tmp_path):
    out = tmp_path / "out"
    pull_artifact(server.url, out)
    assert verify_artifact(out).ok


def test_a_same_size_corrupted_copy_is_rehashed_and_repaired(server, served, tmp_path):
    """Issue 41 item 6: it was reported "already_present" without hashing."""
    out = tmp_path / "out"
    pull_artifact(server.url, out)
    shard = out / SHARD
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    server.requests.clear()
    result = pull_artifact(server.url, out)
    assert result.extra["already_present"] is False
    assert 0 < result.bytes_downloaded < len(data)  # only the damaged chunk came again
    assert verify_artifact(out).ok
    assert not staging_path(out).exists()
    again = pull_artifact(server.url, out)  # intact now: nothing is downloaded
    assert again.extra["already_present"] is True and again.bytes_downloaded == 0


def test_a_symlinked_output_is_resolved_before_the_download(server, served, tmp_path):
    """Issue 41 item 13: the pull downloaded everything, then failed "appeared while pulling"."""
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    result = pull_artifact(server.url, link)
    assert result.output == real
    assert verify_artifact(link).ok and link.is_symlink()
    assert not staging_path(link).exists() and not staging_path(real).exists()


def test_a_dangling_output_link_is_refused_before_any_request(server, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="symbolic link to a directory that does not exist"):
        pull_artifact(server.url, link)
    assert server.requests == []
    assert not os.path.exists(tmp_path / "nowhere")


def test_a_wrong_content_length_is_named_and_not_retried(server, tmp_path):
    """Issue 41 item 15: it was "another range", retried 4 times."""
    server.faults.length_off[SHARD] = 7
    with pytest.raises(TransferError, match=r"Content-Length \(\d+\) disagrees with its Content-Range") as info:
        pull_artifact(server.url, tmp_path / "out", workers=1)
    assert "1 attempt(s)" in info.value.message
