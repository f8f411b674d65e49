"""Artifacts and engines the serving tests share: stories260K compressed (LUT w4, sparse), with calibrated int4 KV."""

from __future__ import annotations

import shutil
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
def wide32_artifact(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path, tiny_text_file: Path) -> Path:
    """The tiny Llama with every layer width a multiple of 32 (intermediate 128 instead of 144), compressed w4.

    torch's elementwise CPU kernels run vectors of 32 floats and compute a leftover tail in scalar code, so
    only at such widths (those of real models) is each row's activation independent of the tensor around it.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(tiny_llama_dir, intermediate_size=128)).eval()
    source = tmp_path_factory.mktemp("wide32") / "tiny-llama-128"
    model.save_pretrained(source)
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(source)
    out = source.parent / "tiny-llama-128-w4"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        api.compress(
            str(source),
            out,
            recipe="w4",
            calibration=str(tiny_text_file),
            calibration_overrides={"num_samples": 4, "seq_len": 32},
        )
    finally:
        torch.set_num_threads(threads)
    return out
