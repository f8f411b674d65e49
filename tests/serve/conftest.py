"""Artifacts and engines the serving tests share: stories260K compressed (LUT w4, sparse), with calibrated int4 KV."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from squeeze import api


@pytest.fixture(scope="session")
def serve_artifact(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path, tinystories_file: Path) -> Path:
    """stories260K, recipe w4-s045 (uniform sensitivity: no backward pass), with int4 KV calibrated on the sample."""
    out = tmp_path_factory.mktemp("serve") / "stories-w4-s045"
    api.compress(str(stories_dir), out, recipe="w4-s045", overrides={"weights.sensitivity": "uniform"})
    api.calibrate_kv(out, tinystories_file, bits=4, calibration_overrides={"num_samples": 2, "seq_len": 64})
    return out


@pytest.fixture
def artifact_copy(tmp_path: Path, serve_artifact: Path) -> Path:
    """A private copy of the serving artifact (for tests that tamper with it)."""
    return Path(shutil.copytree(serve_artifact, tmp_path / serve_artifact.name))


@pytest.fixture(scope="session")
def wide32_artifact(
    tmp_path_factory: pytest.TempPathFactory,
    resized_tiny_llama: Callable[..., Path],
    compress_tiny: Callable[..., Path],
) -> Path:
    """The tiny Llama with every layer width a multiple of 32 (intermediate 128 instead of 144), compressed w4.

    torch's elementwise CPU kernels run vectors of 32 floats and compute a leftover tail in scalar code, so
    only at such widths (those of real models) is each row's activation independent of the tensor around it.
    """
    source = resized_tiny_llama(tmp_path_factory.mktemp("wide32") / "tiny-llama-128", intermediate_size=128)
    return compress_tiny(source.parent / "tiny-llama-128-w4", "w4", source=source)
