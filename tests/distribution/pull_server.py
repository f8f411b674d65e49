"""Small sealed artifacts, and a local HTTP server for pull tests and scripts/bench/bench_pull.py: static files with
Range support and faults.

``ArtifactServer(root)`` serves ``root`` on 127.0.0.1 (an ephemeral port) from a daemon thread until
``close()``; every socket has a timeout, so nothing it does can hang a test. ``faults`` changes what it
sends: a flipped byte, a 404, a connection dropped after N bytes (once), extra bytes past the file with a
Content-Length that admits them, a redirect to another base URL, no Range support. A Hub-style layout
``/{org}/{name}/resolve/{revision}/{path}`` is served for the repos in ``hub``.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import torch
from safetensors.torch import save_file

from squeeze.format.manifest import MANIFEST_NAME, FileEntry, parse_manifest, root_digest
from squeeze.format.verify import seal_artifact

CHUNK = 4096
SHARD = "model-00001-of-00001.safetensors"


def build_artifact(directory: Path, chunk_bytes: int = CHUNK) -> Path:
    """A sealed artifact: one safetensors shard of ~40 KB (10 chunks of 4 KiB), a config, a nested file whose
    name needs URL quoting, and an empty file."""
    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    save_file({"w": torch.randn(100, 100, generator=generator)}, directory / SHARD)
    (directory / "config.json").write_text('{"model_type": "llama"}\n')
    (directory / "tok").mkdir()
    (directory / "tok" / "a b%#?.json").write_text('{"x": 1}\n')
    (directory / "empty.txt").write_bytes(b"")
    seal_artifact(directory, chunk_bytes=chunk_bytes)
    return directory


def make_v1(directory: Path) -> None:
    """Rewrite ``directory``'s manifest as format version 1 (no chunks: every file streams whole)."""
    manifest = parse_manifest((directory / MANIFEST_NAME).read_bytes())
    obj = manifest.to_dict()
    obj["format_version"] = 1
    obj.pop("chunk_bytes")
    for entry in obj["files"]:
        entry.pop("chunks", None)
    plain = [FileEntry(e.path, e.size, e.sha256) for e in manifest.files]
    obj["root_digest"] = root_digest(plain)
    (directory / MANIFEST_NAME).write_text(json.dumps(obj, indent=2))


_RANGE = re.compile(r"bytes=(\d+)-(\d*)")
_HUB = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<revision>[^/]+)/(?P<path>.+)")


@dataclass
class Faults:
    flip: dict[str, int] = field(default_factory=dict)  # path -> offset of a byte sent XOR 0xFF
    missing: set[str] = field(default_factory=set)  # paths answered with 404
    drop_after: dict[str, int] = field(default_factory=dict)  # path -> close after N body bytes (once)
    drop_from: dict[str, int] = field(default_factory=dict)  # path -> drop only a request starting here or later
    extra: dict[str, bytes] = field(default_factory=dict)  # path -> bytes sent after the file (counted)
    redirect_to: str | None = None  # base URL every request is redirected to (302), path kept
    no_range: bool = False  # ignore Range headers (answer 200 with the whole file)
    delay_s: float = 0.0  # sleep before each body (a slow server)
    link_bytes_per_s: float = 0.0  # > 0: every body shares one link of this speed (benchmarks)
    no_length: set[str] = field(default_factory=set)  # paths sent without Content-Length (to the end, then close)
    drip_s: dict[str, float] = field(default_factory=dict)  # path -> send its body one byte every this many s
    length_off: dict[str, int] = field(default_factory=dict)  # path -> added to a 206's Content-Length (a lie)


@dataclass
class HubRepo:
    directory: Path
    commit: str = "0123456789abcdef0123456789abcdef01234567"


class ArtifactServer:
    """Serves ``root`` at ``url`` (``http://127.0.0.1:<port>/``); ``requests`` logs (method, path, range)."""

    def __init__(self, root: Path | None = None, *, host: str = "127.0.0.1", timeout: float = 10.0) -> None:
        self.root = Path(root) if root is not None else None
        self.faults = Faults()
        self.hub: dict[str, HubRepo] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self.headers_seen: list[dict[str, str]] = []
        self.clients: set[tuple[str, int]] = set()  # (address, port) of every connection that sent a request
        self._lock = threading.Lock()
        self._link_free = 0.0
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                self.timeout = timeout  # applied to the socket by StreamRequestHandler.setup
                super().setup()

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
                pass

            def do_GET(self) -> None:  # noqa: N802 - the base class's name
                server._serve(self)

        self.httpd = ThreadingHTTPServer((host, 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://{host}:{self.port}/"
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> ArtifactServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------------------------------

    def _paced(self, handler: BaseHTTPRequestHandler, handle: Any, offset: int, count: int, rate: float) -> None:
        """Send in 256 KiB slices, each in its own time slot on one shared link of ``rate`` bytes/s."""
        while count > 0:
            size = min(count, 1 << 18)
            with self._lock:
                now = time.monotonic()
                slot = max(now, self._link_free)
                self._link_free = slot + size / rate
            if slot > now:
                time.sleep(slot - now)
            _sendfile(handler, handle, offset, size)
            offset += size
            count -= size

    def _locate(self, url_path: str, handler: BaseHTTPRequestHandler) -> tuple[Path | None, str]:
        """(file on disk or None, artifact-relative path)."""
        match = _HUB.fullmatch(url_path)
        if match and match["repo"] in self.hub:
            repo = self.hub[match["repo"]]
            if match["revision"] not in ("main", repo.commit):
                return None, ""
            relative = unquote(match["path"])
            handler.extra_headers = {"X-Repo-Commit": repo.commit}  # type: ignore[attr-defined]
            return _inside(repo.directory, relative), relative
        if self.root is None:
            return None, ""
        relative = unquote(url_path.lstrip("/"))
        return _inside(self.root, relative), relative

    def _serve(self, handler: BaseHTTPRequestHandler) -> None:
        url_path = urlsplit(handler.path).path
        wanted = handler.headers.get("Range")
        with self._lock:
            self.requests.append(("GET", url_path, wanted))
            self.headers_seen.append({k.lower(): v for k, v in handler.headers.items()})
            self.clients.add(handler.client_address)
        faults = self.faults
        if faults.redirect_to is not None:
            handler.send_response(302)
            handler.send_header("Location", faults.redirect_to.rstrip("/") + handler.path)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        handler.extra_headers = {}  # type: ignore[attr-defined]
        path, relative = self._locate(url_path, handler)
        if path is None or relative in faults.missing or not path.is_file():
            body = b"not found\n"
            handler.send_response(404)
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body)
            return
        size = path.stat().st_size
        start, end = 0, size
        match = _RANGE.fullmatch(wanted or "")
        status = 200
        if match and not faults.no_range:
            start = int(match[1])
            end = min(size, int(match[2]) + 1) if match[2] else size
            if start >= size:
                handler.send_response(416)
                handler.send_header("Content-Range", f"bytes */{size}")
                handler.send_header("Content-Length", "0")
                handler.end_headers()
                return
            status = 206
        extra = faults.extra.get(relative, b"") if end == size else b""
        if relative in faults.no_length and status == 200:
            handler.send_response(200)
            handler.end_headers()
            handler.wfile.write(path.read_bytes() + extra)
            handler.close_connection = True
            return
        handler.send_response(status)
        for key, value in handler.extra_headers.items():  # type: ignore[attr-defined]
            handler.send_header(key, value)
        if status == 206:
            handler.send_header("Content-Range", f"bytes {start}-{end - 1}/{size + len(extra)}")
        lie = faults.length_off.get(relative, 0) if status == 206 else 0
        handler.send_header("Content-Length", str(end - start + len(extra) + lie))
        handler.send_header("Accept-Ranges", "bytes")
        handler.end_headers()
        if faults.delay_s:
            time.sleep(faults.delay_s)
        drop = None
        with self._lock:
            if relative in faults.drop_after and start >= faults.drop_from.get(relative, 0):
                drop = faults.drop_after.pop(relative)
        flip = faults.flip.get(relative)
        drip = faults.drip_s.get(relative)
        if drip:
            with open(path, "rb") as handle:
                handle.seek(start)
                data = handle.read(end - start)
            try:
                for index in range(len(data)):
                    handler.wfile.write(data[index : index + 1])
                    handler.wfile.flush()
                    time.sleep(drip)
            except OSError:  # the client gave up
                handler.close_connection = True
            return
        with open(path, "rb") as handle:
            if flip is None and drop is None and not extra:
                handler.wfile.flush()
                if faults.link_bytes_per_s:
                    self._paced(handler, handle, start, end - start, faults.link_bytes_per_s)
                else:
                    _sendfile(handler, handle, start, end - start)
                return
            handle.seek(start)
            data = bytearray(handle.read(end - start))
        if flip is not None and start <= flip < end:
            data[flip - start] ^= 0xFF
        data += extra
        if drop is not None:
            handler.wfile.write(bytes(data[:drop]))
            handler.wfile.flush()
            handler.close_connection = True
            handler.connection.shutdown(2)
            return
        handler.wfile.write(bytes(data))


def _sendfile(handler: BaseHTTPRequestHandler, handle: Any, offset: int, count: int) -> None:
    if count:  # socket.sendfile: os.sendfile on Linux, and it honours the socket's timeout
        handler.connection.sendfile(handle, offset, count)


def _inside(root: Path, relative: str) -> Path | None:
    if not relative or relative.startswith("/") or ".." in relative.split("/"):
        return None
    return root / relative
