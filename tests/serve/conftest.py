"""Artifacts and engines the serving tests share: stories260K compressed (LUT w4, sparse), with calibrated int4 KV."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

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
def half_serve_artifact(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path, tinystories_file: Path) -> Path:
    """As :func:`serve_artifact`, from a float16 copy of stories260K: the artifact keeps its embedding in float16
    (as SmolLM2's does), so the model's first parameter is not the dtype it computes in."""
    from safetensors.torch import load_file, save_file

    source = tmp_path_factory.mktemp("half-source")
    for item in stories_dir.iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            shutil.copy(item, source / item.name)
    (weights,) = stories_dir.glob("*.safetensors")
    tensors = {name: t.to(torch.float16) if t.is_floating_point() else t for name, t in load_file(weights).items()}
    save_file(tensors, source / weights.name, metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "torch_dtype": "float16"}))
    out = tmp_path_factory.mktemp("serve-half") / "stories16-w4-s045"
    api.compress(str(source), out, recipe="w4-s045", overrides={"weights.sensitivity": "uniform"})
    api.calibrate_kv(out, tinystories_file, bits=4, calibration_overrides={"num_samples": 2, "seq_len": 64})
    return out


@pytest.fixture
def attend_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Where each native attention call came from ("run": squeeze run's attention, "serve": the engine's runner),
    in order; skips where the native kernel is not built."""
    import squeeze.runtime.attention as run_attention
    import squeeze.serve.engine.runner as serve_runner
    from squeeze.runtime.kernels.cpu_attention import attend, attention_kernels

    if attention_kernels() is None:
        pytest.skip("no C++ compiler: the native attention kernel is not built")
    calls: list[str] = []

    def counting(where: str) -> Callable[..., object]:
        def call(*args: object, **kwargs: object) -> object:
            calls.append(where)
            return attend(*args, **kwargs)

        return call

    monkeypatch.setattr(run_attention, "attend", counting("run"))
    monkeypatch.setattr(serve_runner, "attend", counting("serve"))
    return calls
