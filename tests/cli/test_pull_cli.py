"""squeeze pull / squeeze push on the command line: JSON reports, exit codes, one-line errors (local server,
mocked Hub API; no network)."""

from __future__ import annotations

import functools
import json
import socket
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from squeeze.cli.app import app
from squeeze.format.manifest import MANIFEST_NAME
from squeeze.format.verify import seal_artifact, verify_artifact

runner = CliRunner()
SHARD = "model.safetensors"


class QuietHandler(SimpleHTTPRequestHandler):
    timeout = 5  # a socket timeout: a stuck client cannot hold the server thread

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


@pytest.fixture
def served(tmp_path: Path) -> Path:
    directory = tmp_path / "served"
    directory.mkdir()
    save_file({"w": torch.arange(3000, dtype=torch.float32)}, directory / SHARD)
    (directory / "config.json").write_text('{"model_type": "llama"}\n')
    seal_artifact(directory, chunk_bytes=4096)
    return directory


@pytest.fixture
def url(served: Path) -> Iterator[str]:
    """The plain standard-library file server (HTTP/1.0, no Range support) serving ``served``."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(served)))
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=5)


def test_pull_json_report(url, served, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["pull", url, "-o", str(out), "--json", "--workers", "2"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["output"] == str(out) and report["files"] == 2 and report["already_present"] is False
    assert report["bytes_downloaded"] == (served / SHARD).stat().st_size + (served / "config.json").stat().st_size
    assert verify_artifact(out).ok
    again = runner.invoke(app, ["pull", url, "-o", str(out)])
    assert again.exit_code == 0 and "up to date" in again.stderr


def test_corrupted_file_exits_1_with_one_line(url, served, tmp_path):
    data = bytearray((served / SHARD).read_bytes())
    data[5000] ^= 0xFF
    (served / SHARD).write_bytes(bytes(data))
    out = tmp_path / "out"
    result = runner.invoke(app, ["pull", url, "-o", str(out)])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith(f"Error: {SHARD} from ") and "SHA-256" in lines[0] and lines[1].startswith("Hint:")
    assert not out.exists()


def test_not_an_artifact_exits_2(url, tmp_path):
    result = runner.invoke(app, ["pull", url + "nothing/", "-o", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert result.stderr.startswith("Error: no squeeze.manifest.json at ")


def test_refused_connection_exits_2_with_the_way_forward(tmp_path):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = runner.invoke(app, ["pull", f"http://127.0.0.1:{port}/a/", "-o", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"Error: cannot download http://127.0.0.1:{port}/a/{MANIFEST_NAME}")


def test_bad_source_exits_2(tmp_path):
    result = runner.invoke(app, ["pull", "ftp://example.org/x/", "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "only https:// and http://" in result.stderr


def test_push_json_and_refusal(served, monkeypatch):
    sent: list[str] = []

    class FakeApi:
        def __init__(self, **kwargs: object) -> None:
            pass

        def create_repo(self, *args: object, **kwargs: object) -> None:
            pass

        def model_info(self, *args: object, **kwargs: object) -> object:  # the repo already has its README
            return SimpleNamespace(sha="0" * 40, siblings=[SimpleNamespace(rfilename="README.md")])

        def create_commit(self, repo_id: str, operations: list, **kwargs: object) -> None:
            sent.extend(op.path_in_repo for op in operations)

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    result = runner.invoke(app, ["push", str(served), "org/model", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["files"] == 3 and sorted(sent) == sorted([SHARD, "config.json", MANIFEST_NAME])
    assert report["model_card"] == "repo_has_one"  # theirs is kept: no card sent
    (served / "config.json").write_text('{"model_type": "other"}\n')
    sent.clear()
    refused = runner.invoke(app, ["push", str(served), "org/model"])
    assert refused.exit_code == 1 and "does not verify" in refused.stderr and sent == []


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--min-rate", "-1"], {}, "min_rate (--min-rate) must be a finite number >= 0"),
        (["--min-rate", "nan"], {}, "min_rate (--min-rate) must be a finite number >= 0"),
        (["--deadline", "-5"], {}, "deadline (--deadline) must be a finite number >= 0"),
        ([], {"SQUEEZE_PULL_MIN_RATE": "fast"}, "$SQUEEZE_PULL_MIN_RATE must be a number, found 'fast'"),
        ([], {"SQUEEZE_PULL_DEADLINE": "-1"}, "$SQUEEZE_PULL_DEADLINE must be a finite number >= 0"),
        ([], {"SQUEEZE_PULL_RATE_WINDOW": "0"}, "$SQUEEZE_PULL_RATE_WINDOW must be a finite number > 0"),
    ],
)
def test_pace_limit_refusals_are_one_error_and_a_hint(tmp_path, monkeypatch, args, env, message) -> None:
    """Issue 50 item 12: these refusals had no Hint line. Refused before any request (the port is closed)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = runner.invoke(app, ["pull", "http://127.0.0.1:9/artifact", "-o", str(tmp_path / "out"), *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[0].startswith(f"Error: {message}"), lines
    assert len(lines) == 2 and lines[1].startswith(("Hint: e.g. ", "Hint: set it to a number")), lines


def test_a_redirect_loop_is_one_error_and_a_hint(tmp_path) -> None:
    class Loop(QuietHandler):
        def do_GET(self) -> None:  # noqa: N802 - the base class's name
            self.send_response(302)
            self.send_header("Location", self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Loop)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/artifact"
        result = runner.invoke(app, ["pull", url, "-o", str(tmp_path / "out")])
    finally:
        server.shutdown()
        server.server_close()
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "more than 5 redirects" in lines[0], lines
    assert len(lines) == 2 and lines[1].startswith("Hint: the server redirects in a loop"), lines


def test_a_server_that_is_not_there_is_one_error_and_a_hint(tmp_path) -> None:
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    result = runner.invoke(app, ["pull", f"http://127.0.0.1:{port}/artifact", "-o", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[0].startswith(f"Error: cannot download http://127.0.0.1:{port}/artifact"), lines
    assert len(lines) == 2 and lines[1] == "Hint: check the URL and that the server is up, then rerun", lines
