"""Shared fixtures: paths to ../shared (tests skip with a reason when absent) and small artifacts."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers/huggingface_hub are imported
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# tests/runtime/test_kernels.py runs the Triton kernels in Triton's CPU interpreter, which must be on before
# triton is first imported (triton.language's own @jit helpers are built then); transformers' cache and
# quantizer modules import triton, and other test modules import those at collection, before test_kernels
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from squeeze.format import Provenance, seal_artifact, write_shards  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("SQUEEZE_SHARED", REPO.parent / "shared"))
STORIES = SHARED / "models" / "stories260K"
CORPORA = SHARED / "corpora"



def require_shared(path: Path) -> Path:
    """Skip the calling test (with a reason) when a file or folder from ../shared is absent."""
    if not path.exists():
        pytest.skip(f"{path} is absent (tests that need ../shared skip on machines without it)")
    return path


@pytest.fixture(autouse=True)
def _one_torch_thread(request: pytest.FixtureRequest):
    """Run tiny-model tests on one thread (restored afterwards; slow-marked tests keep all threads).

    stories260K's matmuls take microseconds; with 2 OpenMP threads on a shared, busy machine every op can
    wait a scheduler tick for a descheduled peer thread (measured: 3.5 s instead of 0.1 s per call).
    """
    if request.node.get_closest_marker("slow"):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    if not (STORIES / "config.json").is_file():
        pytest.skip(f"stories260K not found at {STORIES} (../shared is absent)")
    return STORIES


@pytest.fixture(scope="session")
def stories(stories_dir: Path):
    """(model, tokenizer) of stories260K, loaded once per session. Tests must not modify it."""
    from squeeze.models import load_model, resolve_model

    return load_model(resolve_model(str(stories_dir)))


@pytest.fixture(scope="session")
def corpora_dir() -> Path:
    return require_shared(CORPORA)


@pytest.fixture(scope="session")
def tinystories_file() -> Path:
    return require_shared(CORPORA / "tinystories_sample.txt")


@pytest.fixture(scope="session")
def tinystories_text(tinystories_file: Path) -> str:
    return tinystories_file.read_text(encoding="utf-8")


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
