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


# -- what this process can allocate: RAM, ulimit -v, the cgroup (issue 50 item 8) -------------------------------

MiB = 1 << 20


def cgroup_tree(root, files: dict[str, str]):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_cgroup_v2_limit_counts_with_its_ancestors_and_reclaimable_cache(tmp_path) -> None:
    root = cgroup_tree(
        tmp_path / "cg",
        {
            "a/memory.max": f"{1024 * MiB}\n",
            "a/memory.current": f"{300 * MiB}\n",
            "a/memory.stat": f"anon {200 * MiB}\ninactive_file {100 * MiB}\n",
            "a/b/memory.max": "max\n",
            "a/b/memory.current": f"{250 * MiB}\n",
        },
    )
    listing = tmp_path / "cgroup"
    listing.write_text("0::/a/b\n")
    # a: 1024 - (300 - 100) = 824 MiB; b has no limit
    assert system.cgroup_memory_headroom(root, listing) == 824 * MiB
    listing.write_text("0::/\n")  # the root cgroup (no limit files): none
    assert system.cgroup_memory_headroom(root, listing) is None


def test_a_cgroup_v1_memory_limit_is_read_too(tmp_path) -> None:
    root = cgroup_tree(
        tmp_path / "cg",
        {
            "memory/memory.limit_in_bytes": "9223372036854771712\n",  # v1's "no limit"
            "memory/job/memory.limit_in_bytes": f"{512 * MiB}\n",
            "memory/job/memory.usage_in_bytes": f"{100 * MiB}\n",
            "memory/job/memory.stat": f"inactive_file {1 * MiB}\ntotal_inactive_file {20 * MiB}\n",
        },
    )
    listing = tmp_path / "cgroup"
    listing.write_text("9:name=systemd:/\n4:memory:/job\n0::/\n")
    assert system.cgroup_memory_headroom(root, listing) == (512 - 80) * MiB


def test_the_address_space_limit_less_what_is_mapped(monkeypatch) -> None:
    monkeypatch.setattr(system.resource, "getrlimit", lambda which: (6_000_000 * 1024, -1))
    monkeypatch.setattr(system, "_vm_size_bytes", lambda: 2_000_000 * 1024)
    assert system.address_space_headroom() == 4_000_000 * 1024
    monkeypatch.setattr(system.resource, "getrlimit", lambda which: (system.resource.RLIM_INFINITY,) * 2)
    assert system.address_space_headroom() is None


def test_the_headroom_is_the_least_of_the_three(monkeypatch) -> None:
    monkeypatch.setattr(system, "available_memory_bytes", lambda: 16 << 30)
    monkeypatch.setattr(system, "address_space_headroom", lambda: 5 << 30)
    monkeypatch.setattr(system, "cgroup_memory_headroom", lambda: 8 << 30)
    headroom = system.memory_headroom()
    assert headroom == system.MemoryHeadroom(5 << 30, "RLIMIT_AS") and "ulimit -v" in headroom.describe()
    monkeypatch.setattr(system, "cgroup_memory_headroom", lambda: 1 << 30)
    assert system.memory_headroom() == system.MemoryHeadroom(1 << 30, "cgroup")
    for name in ("available_memory_bytes", "address_space_headroom", "cgroup_memory_headroom"):
        monkeypatch.setattr(system, name, lambda: None)
    assert system.memory_headroom() is None
