"""squeeze.system: machine facts and the heap release after a load."""

from __future__ import annotations

import platform

import pytest

from squeeze import system


def test_available_memory_is_read_from_meminfo() -> None:
    value = system.available_memory_bytes()
    assert value is None or value > 0


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_release_free_heap_gives_freed_holes_back_on_glibc() -> None:
    # 16 KiB blocks live in the heap (below the mmap threshold); freeing every other one leaves holes that
    # free() itself never returns, since live blocks sit above them: only malloc_trim does
    blocks = [bytearray(b"x" * (16 << 10)) for _ in range(4096)]  # 64 MiB, touched
    keep = blocks[1::2]
    del blocks
    before = _rss()
    assert system.release_free_heap() is True
    assert before - _rss() > 16 << 20  # most of the 32 MiB of holes went back
    assert len(keep) == 2048


def _rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as handle:
        return int(handle.read().split()[1]) * 4096


def test_release_free_heap_without_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(system, "_malloc_trim", lambda: None)
    assert system.release_free_heap() is False
