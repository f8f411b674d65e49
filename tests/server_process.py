"""A ``squeeze serve --json`` process for tests: started, waited for until /health answers, always killed."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx


@contextmanager
def running_server(
    argv: Sequence[str], *, cwd: Path | None = None, startup_seconds: float = 60
) -> Iterator[tuple[subprocess.Popen, str]]:
    """Run ``argv`` (a ``squeeze serve ... --json`` command); yield (the process, its ``/v1`` URL) once its
    /health answers 200, within ``startup_seconds`` for the startup line and 60 s more for uvicorn. The process
    is killed on exit if it still runs."""
    process = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
    try:
        url = json.loads(_read_line(process, startup_seconds))["url"]
        deadline = time.monotonic() + 60
        while True:  # the JSON line comes before uvicorn is up: wait for /health
            try:
                if httpx.get(url.removesuffix("/v1") + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
            time.sleep(0.05)
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
        for pipe in (process.stdout, process.stderr):
            pipe.close()


def _read_line(process: subprocess.Popen, seconds: float) -> str:
    """The first stdout line of ``process``, read in a thread so that a hung child fails the test."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(seconds)
    assert lines and lines[0], f"no startup line; stderr: {process.stderr.read() if process.poll() is not None else ''}"
    return lines[0]


__all__ = ["running_server"]
