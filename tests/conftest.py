"""Shared fixtures: paths to ../shared (tests skip with a reason when absent) and small artifacts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from squeeze.format import Provenance, seal_artifact, write_shards

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("SQUEEZE_SHARED", REPO.parent / "shared"))
STORIES = SHARED / "models" / "stories260K"
CORPORA = SHARED / "corpora"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def require_shared(path: Path) -> Path:
    """Skip the calling test (with a reason) when a file or folder from ../shared is absent."""
    if not path.exists():
        pytest.skip(f"{path} is absent (tests that need ../shared skip on machines without it)")
    return path


@pytest.fixture
def stories_dir() -> Path:
    return require_shared(STORIES)


@pytest.fixture
def corpora_dir() -> Path:
    return require_shared(CORPORA)


def make_artifact(directory: Path, max_shard_bytes: int = 3000) -> Path:
    """A small sealed artifact: two shards, an index, a config and a nested tokenizer file."""
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "model.layers.0.mlp.weight": torch.randn(20, 30, generator=generator),
        "model.layers.1.mlp.weight": torch.randn(20, 30, generator=generator),
        "model.norm.weight": torch.ones(30),
        "codes": torch.arange(100, dtype=torch.uint8),
    }
    write_shards(directory, tensors, max_shard_bytes)
    (directory / "config.json").write_text('{"model_type": "llama"}\n')
    (directory / "extra").mkdir()
    (directory / "extra" / "notes.txt").write_text("hello\n")
    seal_artifact(directory, Provenance(source_model="unit-test"))
    return directory


@pytest.fixture
def artifact(tmp_path: Path) -> Path:
    return make_artifact(tmp_path / "artifact")
