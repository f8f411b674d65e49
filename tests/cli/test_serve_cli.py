"""``squeeze serve``: options checked before anything binds or loads, a port in use, the startup line, and a
real process that serves until SIGTERM / SIGINT and exits 0 after letting its open request finish."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

import squeeze.serve.types
from server_process import running_server
from squeeze import api
from squeeze.cli import serve as serve_cmd
from squeeze.cli.app import app
from squeeze.cli.run import UNVERIFIED_WARNING
from squeeze.runtime.options import KVOptions

runner = CliRunner()
SERVE_TESTS = Path(__file__).resolve().parent.parent / "serve"


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """api.serve_engine replaced by a fake engine builder; the calls it got. uvicorn is not started."""
    monkeypatch.syspath_prepend(str(SERVE_TESTS))
    from fake_engine import FakeEngine

    calls: list[dict[str, Any]] = []

    def serve_engine(path: Any, **options: Any) -> FakeEngine:
        calls.append({"path": path, **options})
        return FakeEngine(model_name="stories", kv_bits=options["config"].kv.kv_bits or 8)

    monkeypatch.setattr(api, "serve_engine", serve_engine, raising=False)
    return calls


CONTENTION_HINT = serve_cmd.contention_hint


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """No busy-machine note on stderr, whatever else runs where the tests do."""
    monkeypatch.setattr(serve_cmd, "contention_hint", lambda threads: None)


@pytest.fixture
def no_server(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, socket.socket, float]]:
    served: list[tuple[Any, socket.socket, float]] = []

    def run_server(app: Any, sock: socket.socket, grace: float, **_: Any) -> bool:
        served.append((app, sock, grace))
        return True

    monkeypatch.setattr(serve_cmd, "run_server", run_server)
    return served


def serve(*args: str) -> Any:
    return runner.invoke(app, ["serve", "artifact-dir", *args])


def error_lines(result: Any) -> list[str]:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and lines[0].startswith("Error: "), result.stderr
    assert all(line.startswith(("Error: ", "Hint: ")) for line in lines), result.stderr
    assert sum(line.startswith("Error: ") for line in lines) == 1
    return lines


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kv-bits", "5"], "--kv-bits must be 4, 8 or 16 (no KV quantization), found 5"),
        (["--kv-dynamic"], "--kv-dynamic needs --kv-bits 8 or 4"),
        (["--kv-bits", "16", "--kv-dynamic"], "--kv-dynamic needs --kv-bits 8 or 4"),
        (["--kv-memory", "0"], "--kv-memory: a size must be positive"),
        (["--kv-memory", "lots"], "--kv-memory: cannot read size 'lots'"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be a positive integer, found 0"),
        (["--block-size", "-1"], "--block-size must be a positive integer"),
        (["--max-batch-tokens", "0"], "--max-batch-tokens must be a positive integer"),
        (["--max-model-len", "0"], "--max-model-len must be a positive integer"),
        (["--max-queue", "0"], "--max-queue must be a positive integer"),
        (["--port", "70000"], "--port must be in 0-65535"),
        (["--shutdown-grace", "-1"], "--shutdown-grace must be a finite number"),
        (["--api-key", " "], "the API key (--api-key or SQUEEZE_API_KEY) is empty"),
        (["--dense", "--low-memory"], "--dense and --low-memory contradict each other"),
        (["--host", "no.such.host.invalid"], "cannot listen on host 'no.such.host.invalid'"),
        (["--idle-timeout", "0"], "--idle-timeout must be a finite number of seconds > 0"),
        (["--idle-timeout", "inf"], "--idle-timeout must be a finite number of seconds > 0"),
        (["--max-connections", "0"], "--max-connections must be at least 1"),
        (["--max-connections", "100000000"], "--max-connections 100000000 is more than this process can open"),
        (["--shutdown-grace", "nan"], "--shutdown-grace must be a finite number"),
        (["--threads", "0"], "--threads must be at least 1"),
        (["--max-request-bytes", "10"], "--max-request-bytes must be at least 1KB"),
    ],
)
def test_bad_options_fail_in_one_line_before_loading(built: list, args: list[str], message: str) -> None:
    """Each refusal is one Error line and a Hint line (issue 50 item 12: seven of them had no hint)."""
    result = serve(*args, "--port", "0") if "--port" not in args else serve(*args)
    assert result.exit_code == 2, result.output
    lines = error_lines(result)
    assert message in lines[0]
    assert len(lines) == 2 and lines[1].startswith("Hint: "), lines
    assert built == []


def test_port_in_use_fails_fast(built: list) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = serve("--port", str(port))
    assert result.exit_code == 2, result.output
    lines = error_lines(result)
    assert lines[0] == f"Error: port {port} on 127.0.0.1 is already in use" and lines[1].startswith("Hint: ")
    assert built == []


def test_missing_serve_dependencies(built: list, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fastapi", None)  # `import fastapi` raises ImportError
    result = serve("--port", "0")
    assert result.exit_code == 2
    lines = error_lines(result)
    assert lines[0] == "Error: squeeze serve needs fastapi, uvicorn and prometheus-client"
    assert 'pip install "squeeze[serve]"' in lines[1] and built == []


def test_the_engine_is_built_from_the_options_and_the_startup_line(built: list, no_server: list) -> None:
    result = serve(
        "--port", "0", "--kv-bits", "4", "--kv-dynamic", "--kv-memory", "64MiB", "--block-size", "8",
        "--max-num-seqs", "3", "--max-batch-tokens", "128", "--max-model-len", "256", "--max-queue", "5",
        "--shutdown-grace", "2.5", "--dense", "--served-model-name", "tiny", "--no-prefix-cache",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    [call] = built
    assert call == {
        "path": Path("artifact-dir"),
        "config": squeeze.serve.types.EngineConfig(
            kv=KVOptions(4, True),
            kv_memory_bytes=64 * 2**20,
            block_size=8,
            max_num_seqs=3,
            max_batch_tokens=128,
            max_model_len=256,
            max_queue=5,
            prefix_cache=False,
        ),
        "load": api.LoadOptions(verify=True, dense_cache=True, low_memory=False),  # built once, by the CLI
    }
    [(served_app, sock, grace)] = no_server
    assert grace == 2.5 and sock.fileno() == -1  # closed once the server returned
    assert served_app.state.metrics is not None
    [line] = [line for line in result.stderr.splitlines() if line.strip()]
    assert line.startswith("Serving tiny on http://127.0.0.1:") and "/v1 |" in line
    for part in ("KV cache int4 dynamic", "512 blocks x 16 tokens", "8.0 MiB", "context 4096", "API key off"):
        assert part in line, line
    assert result.stdout == ""


def test_defaults_no_verify_and_json(built: list, no_server: list, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SQUEEZE_API_KEY", "from-env")
    result = serve("--port", "0", "--no-verify", "--json")
    assert result.exit_code == 0, result.output
    [call] = built
    assert call["config"] == squeeze.serve.types.EngineConfig(kv_memory_bytes=2**30)
    assert call["load"] == api.LoadOptions(verify=False, dense_cache=False, low_memory=False)
    assert UNVERIFIED_WARNING in result.stderr
    info = json.loads(result.stdout)
    assert info["model"] == "stories" and info["verified"] is False and info["kv_bits"] == 8
    assert info["url"].startswith("http://127.0.0.1:") and info["kv_blocks"] == 512
    # the key came from the environment: the app asks for it
    from starlette.testclient import TestClient

    [(served_app, _, grace)] = no_server
    assert grace == 10.0
    assert TestClient(served_app).get("/v1/models").status_code == 401
    assert TestClient(served_app).get("/v1/models", headers={"Authorization": "Bearer from-env"}).status_code == 200


def test_an_engine_that_fails_to_build_closes_the_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    from squeeze.errors import IntegrityError

    port = _free_port()

    def tampered(*args: Any, **kwargs: Any) -> Any:
        raise IntegrityError("weights.safetensors: sha256 mismatch")

    monkeypatch.setattr(api, "serve_engine", tampered, raising=False)
    result = serve("--port", str(port))
    assert result.exit_code == 1 and "sha256 mismatch" in error_lines(result)[0]
    with socket.socket() as again:  # the port is free again
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))


def test_a_server_that_did_not_start_exits_1(built: list, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve_cmd, "run_server", lambda app, sock, grace, **_: False)
    result = serve("--port", "0")
    assert result.exit_code == 1 and "the server did not start" in result.stderr


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# -- a real process -------------------------------------------------------------------------------------------

RUNNER = """
import sys
sys.path.insert(0, {serve_tests!r})
from squeeze import api
from fake_engine import FakeEngine


class LoggedEngine(FakeEngine):
    def shutdown(self, grace_seconds):
        super().shutdown(grace_seconds)
        print(f"engine shut down, grace {{grace_seconds}}, cancelled {{len(self.cancelled)}}", file=sys.stderr)


def serve_engine(path, *, config, load):
    return LoggedEngine(model_name="stories", step_seconds=0.02)


api.serve_engine = serve_engine
from squeeze.cli.app import main

sys.argv = ["squeeze", "serve", "artifact", "--port", "0", "--json", "--shutdown-grace", "20"]
main()
"""


@pytest.fixture
def server_process(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    script = tmp_path / "serve_fake.py"
    script.write_text(textwrap.dedent(RUNNER.format(serve_tests=str(SERVE_TESTS))))
    with running_server([sys.executable, str(script)], cwd=tmp_path) as running:
        yield running


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_server_gracefully_with_exit_0(
    server_process: tuple[subprocess.Popen, str], signum: int
) -> None:
    process, url = server_process
    events: list[str] = []

    def stream() -> None:
        request = {"prompt": "a b", "max_tokens": 25, "stream": True}
        with httpx.stream("POST", f"{url}/completions", json=request, timeout=30) as response:
            events.extend(line for line in response.iter_lines() if line)

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 30
    while not events:  # the request is running
        assert time.monotonic() < deadline and reader.is_alive()
        time.sleep(0.01)
    process.send_signal(signum)
    reader.join(timeout=30)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
    # the open request ran to its end within the grace; the engine got the grace, with nothing left to cancel
    assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2]
    assert "engine shut down, grace 20.0, cancelled 0" in stderr
    assert "Traceback" not in stderr


def test_the_startup_line_names_an_fp8_cache_as_fp8() -> None:
    from squeeze.cli.server import startup_line

    info = {
        "model": "m", "url": "http://127.0.0.1:1/v1", "kv_bits": 8, "kv_cache": "fp8", "kv_dynamic": False,
        "kv_blocks": 4, "block_size": 16, "kv_pool_bytes": 2**20, "max_model_len": 64, "kv_bytes_per_token": 640,
    }  # fmt: skip
    assert "| KV cache fp8 (640 B/token), 4 blocks x 16 tokens (1.0 MiB) |" in startup_line(info, api_key=False)


def test_a_busy_machine_gets_the_wait_policy_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.2, 1.0, 1.0), raising=False)
    hint = CONTENTION_HINT(None)
    assert hint is not None and "OMP_WAIT_POLICY=PASSIVE" in hint and "--threads 1" in hint
    assert CONTENTION_HINT(1) is None  # one thread beside one busy core: nothing to stall
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 1.0, 1.0), raising=False)
    assert CONTENTION_HINT(None) is None
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setattr(os, "getloadavg", lambda: (5.0, 1.0, 1.0), raising=False)
    assert CONTENTION_HINT(None) is None


def test_threads_must_be_positive(built: list) -> None:
    result = serve("--port", "0", "--threads", "0")
    assert result.exit_code == 2 and error_lines(result)[0] == "Error: --threads must be at least 1, found 0"
    assert built == []
