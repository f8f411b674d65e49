"""Fixtures for the quantization-core tests (the one-thread fixture and ``stories_dir`` are in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from squeeze.quant import schemes
from toy_format import ToyAbsmaxWeight


@pytest.fixture(scope="session")
def stories_tensors(stories_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of the tiny stories260K checkpoint (skips with a reason when ../shared is absent)."""
    path = stories_dir / "model.safetensors"
    if not path.is_file():
        pytest.skip(f"{path} is absent (../shared has no stories260K weights)")
    from safetensors.torch import load_file

    return load_file(str(path))


@pytest.fixture()
def toy_registered() -> Iterator[type[ToyAbsmaxWeight]]:
    """The toy format (tests/toy_format.py) registered for one test, then removed again."""
    schemes.register_format(ToyAbsmaxWeight)
    try:
        yield ToyAbsmaxWeight
    finally:
        schemes.unregister_format(ToyAbsmaxWeight.name)
