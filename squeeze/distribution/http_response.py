"""What a download's HTTP response must be to be read: the bytes a GET asks for (:class:`Wanted`), and the
checks of a 200 / 206 response's encoding, Content-Length and Content-Range against the range asked for and
the size the manifest lists (squeeze.distribution.http_client sends the requests)."""

from __future__ import annotations

import http.client
import re
from dataclasses import dataclass

from squeeze.errors import IntegrityError, TransferError

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


@dataclass(frozen=True)
class Wanted:
    """What a GET asks for: bytes from ``start``, ``length`` of them (None: to the end), of a file the manifest
    lists at ``total`` bytes (None: unknown), a body without Content-Length read to at most ``limit`` + 1."""

    start: int
    length: int | None
    total: int | None
    limit: int | None


def body_extent(shown: str, response: http.client.HTTPResponse, wanted: Wanted) -> tuple[int, int, bool, int | None]:
    """(bytes to read, bytes to discard first, read to the end, the declared Content-Length) of a 200 / 206
    response to ``wanted``; a SqueezeError when the response is not what was asked for."""
    start, length, total, limit = wanted.start, wanted.length, wanted.total, wanted.limit
    encoding = (response.getheader("Content-Encoding") or "identity").lower()
    if encoding != "identity":
        raise TransferError(f"{shown}: the server sent {encoding}-encoded bytes", retryable=False)
    declared = response.getheader("Content-Length")
    body_length = int(declared) if declared and declared.isdigit() else None
    skip = 0
    if response.status == 206:
        available = _range_span(shown, response, wanted, body_length)
    else:  # 200: the whole file, whatever range was asked for
        if total is not None and body_length is not None and body_length != total:
            raise _size_error(shown, body_length, total)
        skip = start
        available = (body_length if body_length is not None else (total or 0)) - start
    want = length if length is not None else available
    to_eof = body_length is None and length is None and total is None
    if to_eof:  # no Content-Length (chunked): read to the end, at most ``limit`` + 1 bytes
        if limit is None:
            raise TransferError(f"{shown}: the server sent no Content-Length", retryable=False)
        want = limit + 1
    return want, skip, to_eof, body_length


def _range_span(shown: str, response: http.client.HTTPResponse, wanted: Wanted, body_length: int | None) -> int:
    """The bytes a 206 response holds, checked against the range asked for and the manifest's size."""
    start = wanted.start
    match = _CONTENT_RANGE.fullmatch((response.getheader("Content-Range") or "").strip())
    if match is None or int(match[1]) != start:
        raise TransferError(f"{shown}: the server answered another range than bytes {start}-")
    if match[3] != "*" and wanted.total is not None and int(match[3]) != wanted.total:
        raise _size_error(shown, int(match[3]), wanted.total)
    span = int(match[2]) - start + 1
    if wanted.length is not None and span != wanted.length:
        raise TransferError(f"{shown}: the server answered another range than bytes {start}-")
    if body_length is not None and body_length != span:
        # a broken server, not a passing fault: asking again gets the same answer
        raise TransferError(
            f"{shown}: the server's Content-Length ({body_length}) disagrees with its Content-Range "
            f"(bytes {start}-{match[2]}: {span} bytes)",
            hint="the server sends malformed responses; report it to whoever runs it",
            retryable=False,
        )
    return span


def _size_error(shown: str, found: int, expected: int) -> IntegrityError:
    word = "more" if found > expected else "fewer"
    return IntegrityError(
        f"{shown}: the server sends {found} bytes, {word} than the {expected} the manifest lists",
        hint="the server holds other bytes than its manifest says; nothing of this file was kept",
    )


__all__ = ["Wanted", "body_extent"]
