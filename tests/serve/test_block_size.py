"""A KV block larger than the context a request may use is refused (issue 50 item 12): it was accepted, and
every sequence then held one mostly empty block."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from squeeze import api
from squeeze.cli.app import app
from squeeze.errors import ConfigError
from squeeze.serve.engine.context_length import check_block_size
from squeeze.serve.types import EngineConfig


@pytest.fixture(scope="module")
def tiny_artifact(compress_tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compress_tiny(tmp_path_factory.mktemp("block") / "tiny-w4")


def test_the_rule() -> None:
    check_block_size(64, 64)
    with pytest.raises(ConfigError, match="--block-size 65 is more than the context of 64 tokens") as caught:
        check_block_size(65, 64)
    assert caught.value.hint == "pass --block-size 16 (the default), at most 64"


def test_the_engine_refuses_a_block_beyond_max_model_len(tiny_artifact: Path) -> None:
    def config(block_size: int) -> EngineConfig:
        return EngineConfig(kv_memory_bytes=4 << 20, block_size=block_size, max_model_len=64)

    with pytest.raises(ConfigError, match="--block-size 128 is more than the context of 64 tokens"):
        api.serve_engine(tiny_artifact, config=config(128))
    engine = api.serve_engine(tiny_artifact, config=config(64))
    assert engine.stats().block_size == 64


def test_serve_refuses_a_block_beyond_the_model_s_context_in_one_line_with_a_hint(tiny_artifact: Path) -> None:
    result = CliRunner().invoke(app, ["serve", str(tiny_artifact), "--block-size", "1000000", "--port", "0"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[0].startswith("Error: --block-size 1000000 is more than the context of"), lines
    assert lines[-1].startswith("Hint: pass --block-size 16 (the default), at most")
