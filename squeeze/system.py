"""Facts about the machine squeeze runs on, read where every stage can share them."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), or None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def release_free_heap() -> bool:
    """Give the C heap's free pages back to the OS (glibc ``malloc_trim``); False where there is no glibc.

    A load frees tens of MB of temporaries (file reads, JSON, the tokenizer's construction) that glibc keeps
    mapped for later: measured on SmolLM2-135M, 36 MB of the process's resident memory after a load.
    """
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


@functools.cache
def _malloc_trim() -> Any:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


__all__ = ["available_memory_bytes", "release_free_heap"]
