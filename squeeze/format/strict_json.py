"""Strict JSON reading for every JSON file squeeze reads (manifest, config.json, shard index, safetensors
headers, signatures): duplicate keys, NaN/Infinity, invalid UTF-8 and deep nesting raise FormatError.

Split from ``squeeze.format.manifest``, which reads its manifest with it.
"""

from __future__ import annotations

import json
from typing import Any

from squeeze.errors import FormatError

#: Nesting depth of JSON squeeze reads (manifest, config.json, index, safetensors headers: 5 or less).
MAX_JSON_DEPTH = 64

_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise FormatError(f"duplicate JSON key {key!r}")
        result[key] = value
    return result


def _reject_constant(name: str) -> Any:
    raise FormatError(f"non-standard JSON constant {name}")


def json_depth(data: bytes) -> int:
    """Deepest nesting of arrays / objects in JSON ``data`` (brackets inside strings do not count).

    Cheap when the document opens at most MAX_JSON_DEPTH brackets in all: their count is returned, an
    upper bound. Else one vectorised pass in 4 MiB chunks (about 7 ns a byte, bounded memory).
    """
    opened = data.count(b"[") + data.count(b"{")
    if opened <= MAX_JSON_DEPTH:
        return opened
    import numpy as np

    step = np.zeros(256, dtype=np.int8)
    step[list(b"[{")], step[list(b"]}")] = 1, -1
    # drop escape pairs left to right as JSON reads them (a double backslash first, so that backslash,
    # backslash, quote still ends a string); then a bracket counts where the quotes seen so far are even
    codes = np.frombuffer(data.replace(b"\\\\", b"").replace(b'\\"', b""), dtype=np.uint8)
    depth = deepest = quotes = 0
    for start in range(0, len(codes), 1 << 22):
        chunk = codes[start : start + (1 << 22)]
        seen = np.cumsum(chunk == ord('"'), dtype=np.int64) + quotes
        running = np.cumsum(np.where(seen & 1, 0, step[chunk]), dtype=np.int64) + depth
        deepest, depth, quotes = max(deepest, int(running.max())), int(running[-1]), int(seen[-1])
    return deepest


def strict_json_loads(data: bytes | bytearray | str, what: str) -> Any:
    """json.loads that rejects duplicate keys, NaN/Infinity, invalid UTF-8 and nesting deeper than
    MAX_JSON_DEPTH (checked before parsing: the parser recurses per level), raising FormatError."""
    raw = bytes(data) if not isinstance(data, str) else data.encode("utf-8", "surrogatepass")
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise FormatError(f"{what} nests arrays/objects {depth} levels deep, more than the {MAX_JSON_DEPTH} allowed")
    try:
        text = raw.decode("utf-8") if not isinstance(data, str) else data
        return json.loads(text, object_pairs_hook=_reject_duplicate_keys, parse_constant=_reject_constant)
    except FormatError as exc:
        raise FormatError(f"{what}: {exc.message}") from None
    except UnicodeDecodeError as exc:
        raise FormatError(f"{what} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    except (json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise FormatError(f"{what} is not valid JSON: {exc}") from None
