"""squeeze serve's KV memory preflight sees the process's limits (issue 50 item 8): ``serve --kv-memory 10GB``
under ``ulimit -v 6000000`` exited 3 (an internal error) because only MemAvailable was compared."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from squeeze import api, system
from squeeze.errors import ResourceError
from squeeze.serve.types import EngineConfig

CLI = "from squeeze.cli.app import main; main()"


@pytest.mark.parametrize(
    ("source", "hint"), [("RLIMIT_AS", "ulimit -v"), ("cgroup", "container more memory"), ("MemAvailable", "1GiB")]
)
def test_a_pool_over_the_tightest_limit_is_refused_naming_it(monkeypatch, source: str, hint: str) -> None:
    monkeypatch.setattr(system, "memory_headroom", lambda: system.MemoryHeadroom(5 << 30, source))
    with pytest.raises(ResourceError) as caught:
        api.check_engine_config(EngineConfig(kv_memory_bytes=10 << 30))
    assert "--kv-memory 10.00 GiB is more than the 5.00 GiB" in caught.value.message
    assert hint in (caught.value.hint or "")
    api.check_engine_config(EngineConfig(kv_memory_bytes=4 << 30))  # under it: accepted


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmSize from /proc")
def test_serve_under_ulimit_v_is_one_error_with_a_hint(tmp_path: Path) -> None:
    """The reproduction, in a child process whose address space is limited as ``ulimit -v 6000000`` does."""

    def limit_address_space() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (6_000_000 * 1024, resource.getrlimit(resource.RLIMIT_AS)[1]))

    result = subprocess.run(
        [sys.executable, "-c", CLI, "serve", str(tmp_path / "not-read"), "--kv-memory", "10GB", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit_address_space,
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert lines[0].startswith("Error: --kv-memory 9.31 GiB is more than the"), lines
    assert "ulimit -v" in lines[0] and lines[1].startswith("Hint: ") and len(lines) == 2


def test_an_allocation_the_system_refuses_is_a_resource_error(compress_tiny, tmp_path, monkeypatch) -> None:
    """What the preflight cannot foresee (overcommit off, another process's growth) is still no internal error."""
    import squeeze.serve.engine.engine

    artifact = compress_tiny(tmp_path / "tiny-w4")

    def refuse(*args, **kwargs):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:118] data. DefaultCPUAllocator: can't allocate memory: you tried to "
            "allocate 4294967296 bytes. Error code 12 (Cannot allocate memory)"
        )

    monkeypatch.setattr(squeeze.serve.engine.engine, "Engine", refuse)
    with pytest.raises(ResourceError, match="refused the memory for the KV pool") as caught:
        api.serve_engine(artifact, config=EngineConfig(kv_memory_bytes=4 << 20))
    assert "--kv-memory" in (caught.value.hint or "")

    def broken(*args, **kwargs):
        raise RuntimeError("a bug of squeeze's own")

    monkeypatch.setattr(squeeze.serve.engine.engine, "Engine", broken)
    with pytest.raises(RuntimeError, match="a bug of squeeze's own"):  # other errors stay what they are
        api.serve_engine(artifact, config=EngineConfig(kv_memory_bytes=4 << 20))


def test_a_load_past_the_process_s_own_limit_is_refused_naming_it(compress_tiny, tmp_path, monkeypatch) -> None:
    """The load's preflight too: under ``ulimit -v`` the machine's free memory is not what can be allocated."""
    import squeeze.runtime.memory as memory

    artifact = compress_tiny(tmp_path / "tiny-w4")
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 64 << 30)
    monkeypatch.setattr(memory, "process_memory_limit", lambda: system.MemoryHeadroom(1000, "RLIMIT_AS"))
    with pytest.raises(ResourceError, match="of address space left under this process's limit") as caught:
        memory.check_load_memory(artifact, dense_cache=False)
    assert "ulimit -v" in (caught.value.hint or "")
    monkeypatch.setattr(memory, "process_memory_limit", lambda: None)
    assert memory.check_load_memory(artifact, dense_cache=False) is not None  # 64 GiB free: it fits
