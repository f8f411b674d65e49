"""Issue 41 item 15: the KV-block utilisation metric reads 0 before any step (it read 1.0: full use of a pool
nothing had used yet)."""

from __future__ import annotations

from pathlib import Path

from squeeze import api
from squeeze.serve.types import EngineConfig, EngineStats


def test_block_utilisation_is_zero_before_any_step(serve_artifact: Path) -> None:
    engine = api.serve_engine(serve_artifact, config=EngineConfig(kv_memory_bytes=4 << 20))
    assert engine.stats().kv_block_utilisation == 0.0
    fresh = EngineStats(
        kv_blocks_total=1, kv_blocks_free=1, requests_running=0, requests_waiting=0, block_size=16, kv_bits=16
    )
    assert fresh.kv_block_utilisation == 0.0
