"""A small HTTP(S) client for downloads: one kept-alive connection per host and thread, ranges, bounded redirects.

The standard library's ``http.client`` is enough here (and keeps squeeze free of another dependency): every
byte is verified against the manifest anyway, so the client's job is only to move bytes and to refuse
responses that cannot be what was asked for. Redirects are followed (at most ``MAX_REDIRECTS``), also to
another host or scheme, because what arrives is checked against the manifest whatever its origin; the
``Authorization`` header is dropped when a redirect leaves the original host (a Hub token must not reach a CDN).
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit

from squeeze.distribution.http_response import Wanted, body_extent
from squeeze.distribution.watch import TransferWatch
from squeeze.errors import IntegrityError, SqueezeError, TransferError
from squeeze.format.paths import short_path

MAX_REDIRECTS = 5
DEFAULT_TIMEOUT = 30.0
_REDIRECTS = {301, 302, 303, 307, 308}
#: Statuses worth another try on a fresh connection (the server is busy or restarting).
_RETRYABLE = {408, 425, 429, 500, 502, 503, 504}


class NotFound(TransferError):
    """The server answered 404 / 410 for a URL."""

    def __init__(self, message: str, url: str) -> None:
        super().__init__(message, retryable=False)
        self.url = url


def show_url(url: str) -> str:
    """``url`` for a message: without its query string (a signed CDN URL carries credentials) and shortened."""
    parts = urlsplit(url)
    return short_path(f"{parts.scheme}://{parts.netloc}{parts.path}")


@dataclass
class Body:
    """An open response body positioned at the requested offset; read at most ``length`` bytes from it."""

    client: HttpClient
    key: tuple[str, str, int]
    connection: http.client.HTTPConnection
    response: http.client.HTTPResponse
    url: str
    length: int
    headers: Mapping[str, str] = field(default_factory=dict)
    remaining: int = 0
    #: True when the response holds exactly ``length`` bytes, so the connection can serve the next request.
    exact: bool = False
    #: No Content-Length: the body ends where the stream does (``length`` is then an upper bound).
    to_eof: bool = False
    #: The response's socket (the connection may have let go of it), whose timeout each read sets.
    sock: socket.socket | None = None

    def readinto(self, view: memoryview) -> int:
        """Read up to ``len(view)`` bytes, never past ``length``; 0 at the end. TransferError on a dropped stream."""
        if self.remaining <= 0:
            return 0
        if len(view) > self.remaining:
            view = view[: self.remaining]
        try:
            wait = self.client.wait_limit()
        except TransferError:
            self.close(reuse=False)
            raise
        if self.sock is not None:
            self.sock.settimeout(wait)
        try:
            # read1: what one socket read brings. readinto would loop until ``view`` is full, so a server sending
            # a byte a second would hold it for days, out of reach of the transfer watch
            data = self.response.read1(len(view))
            count = len(data)
            view[:count] = data
        except (OSError, http.client.HTTPException) as exc:
            self.close(reuse=False)
            self.client.check_deadline()  # a read cut short by the deadline: say so, not "connection lost"
            raise TransferError(f"{show_url(self.url)}: connection lost ({_describe(exc)})") from None
        if count == 0 and self.to_eof:
            self.length -= self.remaining  # the body ended: ``length`` is what it held
            self.remaining = 0
            return 0
        if count == 0:
            self.close(reuse=False)
            raise TransferError(
                f"{show_url(self.url)}: connection closed after {self.length - self.remaining} of {self.length} bytes"
            )
        self.remaining -= count
        if self.client.watch is not None:
            self.client.watch.add(count)  # TransferError when the pull is too slow or past its deadline
        return count

    def read_all(self) -> bytes:
        """The whole body (``length`` bytes; small bodies only: the manifest, the signature)."""
        data = bytearray(self.length)
        view = memoryview(data)
        done = 0
        while done < self.length:
            count = self.readinto(view[done:])
            if not count:  # the end of a body without Content-Length
                break
            done += count
        self.close(reuse=not self.to_eof)
        return bytes(data[:done])

    def close(self, *, reuse: bool = True) -> None:
        """Give the connection back for the next request when the body was read to its exact end, else close it."""
        if reuse and self.exact and self.remaining == 0 and not self.response.will_close:
            self.response.close()  # read to its end (read1 leaves it open): the connection takes the next request
            self.client._release(self.key, self.connection)  # noqa: SLF001 - the client owns the pool
        else:
            self.response.close()
            self.connection.close()


class HttpClient:
    """GET requests over kept-alive connections, one per (scheme, host, port) and thread.

    ``headers`` go with every request (``Authorization`` only to the original hosts); ``timeout`` bounds
    each connect and each read, so a stalled server raises TransferError instead of hanging; ``watch`` sees
    every read and raises TransferError for a pull too slow over its window or past its deadline.
    """

    def __init__(
        self,
        headers: Mapping[str, str] | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        watch: TransferWatch | None = None,
    ) -> None:
        self.headers = dict(headers or {})
        self.timeout = timeout
        self.watch = watch
        self._local = threading.local()
        self._ssl: ssl.SSLContext | None = None  # made on the first https URL (loading CA certificates: ~50 ms)
        self._ssl_lock = threading.Lock()  # guards the context and the list of pools
        self._pools: list[dict[tuple[str, str, int], http.client.HTTPConnection]] = []

    def _pool(self) -> dict[tuple[str, str, int], http.client.HTTPConnection]:
        pool: dict[tuple[str, str, int], http.client.HTTPConnection] | None = getattr(self._local, "pool", None)
        if pool is None:
            pool = self._local.pool = {}
            with self._ssl_lock:
                self._pools.append(pool)
        return pool

    def _connection(self, key: tuple[str, str, int]) -> http.client.HTTPConnection:
        idle = self._pool().pop(key, None)
        if idle is not None:
            return idle
        scheme, host, port = key
        if scheme == "https":
            with self._ssl_lock:
                if self._ssl is None:
                    self._ssl = ssl.create_default_context()
            return http.client.HTTPSConnection(host, port, timeout=self.timeout, context=self._ssl)
        return http.client.HTTPConnection(host, port, timeout=self.timeout)

    def wait_limit(self) -> float:
        """Seconds the next connect or read may wait: ``timeout``, or the time left before the watch's deadline
        when that is less (a stalled server then fails the pull at its deadline, not a read timeout later);
        TransferError once the deadline has passed."""
        left = self.watch.time_left() if self.watch is not None else None
        if left is None:
            return self.timeout
        if left <= 0:
            self.check_deadline()
        return max(0.001, min(self.timeout, left))

    def check_deadline(self) -> None:
        """TransferError (not retryable) when the watch's deadline has passed."""
        if self.watch is not None and (left := self.watch.time_left()) is not None and left <= 0:
            raise self.watch.deadline_error()

    def _release(self, key: tuple[str, str, int], connection: http.client.HTTPConnection) -> None:
        old = self._pool().pop(key, None)
        if old is not None:
            old.close()
        self._pool()[key] = connection

    def close(self) -> None:
        """Close every thread's idle connections (call it once the threads that used this client are done)."""
        with self._ssl_lock:
            pools = list(self._pools)
        for pool in pools:
            for connection in list(pool.values()):
                connection.close()
            pool.clear()

    def get(
        self, url: str, *, start: int = 0, length: int | None = None, total: int | None = None, limit: int | None = None
    ) -> Body:
        """GET ``url`` from byte ``start``; ``length`` bytes (None: to the end, small bodies only).

        ``total``: the file size the manifest lists; a response that says otherwise (Content-Length,
        Content-Range) raises IntegrityError before a byte of it is read. A server that ignores the Range
        header is read from its start, the first ``start`` bytes discarded. ``limit`` (small bodies): a body
        without Content-Length is read to its end, at most ``limit`` + 1 bytes (the caller refuses more).
        Raises NotFound (404 / 410), TransferError (network, other statuses, more than MAX_REDIRECTS redirects).
        """
        origin = urlsplit(url).netloc
        wanted = Wanted(start, length, total, limit)
        current = url
        for _ in range(MAX_REDIRECTS + 1):
            key, target, headers = self._request_parts(current, origin, start, length)
            connection = self._connection(key)
            wait = self.wait_limit()
            connection.timeout = wait  # the connect, if it comes to one
            if connection.sock is not None:
                connection.sock.settimeout(wait)
            try:
                response, sock = _request(connection, target, headers)
            except (OSError, http.client.HTTPException) as exc:
                connection.close()
                self.check_deadline()
                raise TransferError(f"cannot download {show_url(current)}: {_describe(exc)}") from None
            status = response.status
            if status in _REDIRECTS:
                location = response.getheader("Location")
                response.close()
                connection.close()
                if not location:
                    raise TransferError(
                        f"{show_url(current)}: redirect ({status}) without a Location",
                        hint="the server sends malformed redirects; report it to whoever runs it",
                        retryable=False,
                    )
                current = urljoin(current, location)
                continue
            if status in (200, 206):
                return self._body(key, connection, response, current, wanted, sock)
            response.close()
            connection.close()
            raise _status_error(current, status, response.reason, wanted)
        raise TransferError(
            f"{show_url(url)}: more than {MAX_REDIRECTS} redirects (the last to {show_url(current)})",
            hint="the server redirects in a loop or too deep: pull from the address it ends at, or report it",
            retryable=False,
        )

    def _request_parts(
        self, url: str, origin: str, start: int, length: int | None
    ) -> tuple[tuple[str, str, int], str, dict[str, str]]:
        """(connection key, request target, headers) of a GET of ``url``: the Authorization header only to
        ``origin`` (the URL first asked for), a Range header from ``start`` for ``length`` bytes."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise TransferError(f"cannot download {show_url(url)}: only http:// and https:// URLs work")
        key = (parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
        headers = {k: v for k, v in self.headers.items() if parts.netloc == origin or k.lower() != "authorization"}
        if start or length is not None:
            end = "" if length is None else str(start + length - 1)
            headers["Range"] = f"bytes={start}-{end}"
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        return key, target, headers

    def _body(
        self,
        key: tuple[str, str, int],
        connection: http.client.HTTPConnection,
        response: http.client.HTTPResponse,
        url: str,
        wanted: Wanted,
        sock: socket.socket | None = None,
    ) -> Body:
        try:  # a refused response is closed with its connection
            want, skip, to_eof, body_length = body_extent(show_url(url), response, wanted)
        except SqueezeError:
            response.close()
            connection.close()
            raise
        body = Body(
            self, key, connection, response, url, want, dict(response.getheaders()), want, to_eof=to_eof, sock=sock
        )
        body.exact = body_length is not None and body_length == skip + want
        if skip:
            _discard(body, skip)
        return body


def _status_error(url: str, status: int, reason: str, wanted: Wanted) -> SqueezeError:
    """The error for a status other than 200 / 206 or a redirect."""
    if status in (404, 410):
        return NotFound(f"{show_url(url)}: not found (HTTP {status})", url)
    if status == 416 and wanted.total is not None:  # asked for bytes the manifest lists: the server has fewer
        return IntegrityError(
            f"{show_url(url)}: the server has no bytes {wanted.start}- (HTTP 416), the manifest lists {wanted.total}",
            hint="the server holds other bytes than its manifest lists; nothing of this file was kept",
        )
    return TransferError(
        f"cannot download {show_url(url)}: HTTP {status} {reason}",
        hint="check the URL and your access to it" if status in (401, 403) else None,
        retryable=status in _RETRYABLE,
    )


def _request(
    connection: http.client.HTTPConnection, target: str, headers: dict[str, str]
) -> tuple[http.client.HTTPResponse, socket.socket | None]:
    """Send a GET and read the status line and headers; one retry on a kept-alive connection the server closed.
    With the response, its socket (``getresponse`` lets go of it when the server will close the connection)."""
    for attempt in (0, 1):
        try:
            connection.request("GET", target, headers=headers)
            sock = connection.sock
            return connection.getresponse(), sock
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
            connection.close()  # an idle connection the server had closed: reconnect once
            if attempt:
                raise
    raise AssertionError("unreachable")


def _discard(body: Body, count: int) -> None:
    """Read and drop ``count`` bytes before the wanted range (a server without Range support)."""
    wanted, body.remaining = body.remaining, count
    buffer = memoryview(bytearray(min(count, 1 << 20)))
    while body.remaining:
        body.readinto(buffer)
    body.remaining = wanted


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):  # socket.timeout is TimeoutError since Python 3.10
        return "timed out"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text != type(exc).__name__ else text
