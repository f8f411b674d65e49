"""Issue 49 item 1: loading is decided once, in the runtime. ``load_artifact`` honours ``LoadOptions.device`` (off the
CPU: host memory checked for the compressed weights, built on the host for the dense path, then moved),
``load_or_place`` takes a path or a loaded model, and the options are checked once, where they are built."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import squeeze.runtime.loader as loader
import squeeze.runtime.options as options_module
from squeeze.errors import ConfigError
from squeeze.runtime.linear import SqueezeLinear
from squeeze.runtime.options import KVOptions, LoadOptions, split_keywords
from squeeze.runtime.sampling_params import SamplingParams
from squeeze.serve.types import EngineConfig


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory, compress_tiny: Any) -> Path:
    return compress_tiny(
        tmp_path_factory.mktemp("device") / "a", "w4-s045", overrides={"weights.sensitivity": "uniform"}
    )


def _on(device: str, **keywords: Any) -> LoadOptions:
    """Options built (and checked) for the CPU, then pointed at ``device``: a stand-in for a GPU this machine may
    lack (the meta device takes any move and allocates nothing)."""
    options = LoadOptions(**keywords)
    object.__setattr__(options, "torch_device", torch.device(device))
    return options


def test_load_artifact_moves_the_model_to_the_options_device(artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checked: list[dict[str, bool]] = []
    real = loader.check_load_memory
    monkeypatch.setattr(loader, "check_load_memory", lambda d, **k: checked.append(k) or real(d, **k))
    loaded = loader.load_artifact(artifact, _on("meta"))
    tensors = [*loaded.model.parameters(), *loaded.model.buffers()]
    assert tensors and all(t.device.type == "meta" for t in tensors)
    # the host holds the compressed weights only (a dense cache is built where the model goes), checked once
    assert checked == [{"dense_cache": False, "low_memory": True}]
    linears = [m for m in loaded.model.modules() if isinstance(m, SqueezeLinear)]
    assert linears and not any(m.low_memory for m in linears)  # the dense path a GPU runs, not the CPU kernels


def test_off_the_cpu_low_memory_keeps_the_chunked_path_and_check_memory_false_skips_the_check(
    artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loader, "check_load_memory", lambda *a, **k: pytest.fail("check_memory=False was ignored"))
    loaded = loader.load_artifact(artifact, _on("meta", low_memory=True, check_memory=False))
    assert all(m.low_memory for m in loaded.model.modules() if isinstance(m, SqueezeLinear))


def test_the_cpu_load_is_unchanged(artifact: Path) -> None:
    loaded = loader.load_artifact(artifact, LoadOptions())
    assert all(t.device.type == "cpu" for t in loaded.model.parameters())


def test_staged_on_host_is_a_copy_not_checked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    options, plain = LoadOptions(low_memory=True, activations="int8"), LoadOptions()
    monkeypatch.setattr(options_module, "_check_load", lambda o: pytest.fail("options checked twice"))
    staged = options.staged_on_host()
    assert (staged.device, staged.torch_device, staged.check_memory) == ("cpu", torch.device("cpu"), False)
    assert (staged.low_memory, staged.dense_cache, staged.activations) == (True, False, "int8")
    assert plain.staged_on_host().dense_cache  # no low_memory: the dense cache a GPU runs
    assert options.device == "cpu" and options.check_memory and not plain.dense_cache  # the originals untouched


def test_load_or_place_times_a_path_and_takes_a_loaded_model_as_it_is(artifact: Path) -> None:
    loaded, seconds = loader.load_or_place(artifact, LoadOptions())
    assert seconds > 0
    again, zero = loader.load_or_place(loaded, LoadOptions())
    assert again is loaded and zero == 0.0
    placed, _ = loader.load_or_place(loaded, _on("meta"))
    assert next(placed.model.parameters()).device.type == "meta"


def test_load_or_place_refuses_a_public_key_for_a_loaded_model(artifact: Path, tmp_path: Path) -> None:
    loaded = loader.load_artifact(artifact, LoadOptions())
    options = LoadOptions()
    object.__setattr__(options, "public_key", tmp_path / "key.pem")  # a checked key: only its presence matters here
    with pytest.raises(ConfigError, match="already loaded"):
        loader.load_or_place(loaded, options)


def test_generate_keywords_go_to_the_sampling_builder() -> None:
    keywords = {"max_new_tokens": 4, "top_p": 0.5, "device": "cpu", "kv_bits": 8, "seed": 1}
    sampling, load, kv = split_keywords(keywords, SamplingParams.for_generate, LoadOptions, KVOptions)
    assert sampling == {"max_new_tokens": 4, "top_p": 0.5, "seed": 1}
    assert (load, kv) == ({"device": "cpu"}, {"kv_bits": 8})
    with pytest.raises(TypeError, match="max_tokens"):
        split_keywords({"max_tokens": 4}, SamplingParams.for_generate, LoadOptions, KVOptions)


def test_engine_config_nests_kv_options() -> None:
    assert EngineConfig().kv == KVOptions()
    assert EngineConfig(kv=KVOptions(4, True)).kv.kv_dynamic
    with pytest.raises(ConfigError, match="kv must be a KVOptions"):
        EngineConfig(kv=4)  # type: ignore[arg-type]
