"""Fixtures for the quantization-core tests (the one-thread fixture and ``stories_dir`` are in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def stories_tensors(stories_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of the tiny stories260K checkpoint (skips with a reason when ../shared is absent)."""
    path = stories_dir / "model.safetensors"
    if not path.is_file():
        pytest.skip(f"{path} is absent (../shared has no stories260K weights)")
    from safetensors.torch import load_file

    return load_file(str(path))
