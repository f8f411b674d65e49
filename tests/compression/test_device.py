"""compress --device: the device is checked before any work; the blocks move through the same path as on a GPU,
and with ``device="cpu"`` that path gives the bytes of a run without a device (bounded or not)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from squeeze.calibrate import block_walk, blockwise
from squeeze.cli.app import app
from squeeze.compression.preflight import check_device
from squeeze.errors import ConfigError
from squeeze.format.manifest import MANIFEST_NAME
from squeeze.models.placement import on_device, to_device

runner = CliRunner()


def _files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _assert_same_artifact(got: Path, want: Path) -> None:
    """Every file byte for byte but the manifest, whose creation time differs; its file list and digests match."""
    files, expected = _files(got), _files(want)
    assert sorted(files) == sorted(expected) and any(name.endswith(".safetensors") for name in files)
    for name in expected:
        if name != MANIFEST_NAME:
            assert files[name] == expected[name], name
    manifests = [json.loads((d / MANIFEST_NAME).read_text())["files"] for d in (got, want)]
    assert manifests[0] == manifests[1]


# -- the device spec, checked before any work


def test_cuda_without_cuda_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA GPU is available") as info:
        check_device("cuda")
    assert "drop --device" in (info.value.hint or "")


def test_index_out_of_range_names_the_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    with pytest.raises(ConfigError, match=r"has 2 CUDA GPU\(s\), cuda:0 to cuda:1"):
        check_device("cuda:2")
    assert check_device("cuda:1") == torch.device("cuda", 1)
    assert check_device("CUDA") == torch.device("cuda", 1)  # the current device, index spelled out


@pytest.mark.parametrize("spec", ["tpu", "cuda:x", "cpu:0", "cuda:", ""])
def test_malformed_device_is_refused(spec: str) -> None:
    with pytest.raises(ConfigError, match="expected cpu, cuda or cuda:N"):
        check_device(spec)


def test_cpu_and_none() -> None:
    assert check_device(None) is None and check_device(" cpu ") == torch.device("cpu")


def test_cli_refuses_cuda_in_one_line_before_any_work(
    tmp_path: Path, stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out"
    result = runner.invoke(app, ["compress", str(stories_dir), "-o", str(out), "-r", "rtn-w4", "--device", "cuda"])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("Error: --device cuda: no CUDA GPU is available here"), result.stderr
    assert "Traceback" not in result.output and not out.exists()


def test_error_compensation_on_a_device_is_refused(tmp_path: Path, compress_tiny: Callable[..., Path]) -> None:
    with pytest.raises(ConfigError, match="does not run error compensation"):
        compress_tiny(tmp_path / "out", "w3-ec", device="cpu")
    assert not (tmp_path / "out").exists()


# -- the placement helpers, on a device that is not the host's


def test_on_device_on_the_host_keeps_the_very_same_tensors() -> None:
    """cpu (where the tensors are) and None move nothing: the same storage, hence the same bits downstream.
    (A move to another device swaps each tensor's data as nn.Module.to does; it needs a GPU: gpu_check.)"""
    embed = nn.Embedding(5, 3)
    head = nn.Linear(3, 5, bias=False)
    head.weight = embed.weight  # tied: one tensor
    pointers = [t.data_ptr() for m in (embed, head) for t in m.parameters()]
    for device in (torch.device("cpu"), None):
        with on_device(device, embed, head):
            assert [t.data_ptr() for m in (embed, head) for t in m.parameters()] == pointers
            assert head.weight is embed.weight


def test_to_device_walks_keyword_inputs() -> None:
    kw = {"position_embeddings": (torch.ones(2), torch.zeros(2)), "mask": None, "ids": [torch.arange(3)], "n": 4}
    moved = to_device(kw, torch.device("meta"))
    assert moved["position_embeddings"][0].is_meta and moved["ids"][0].is_meta
    assert moved["mask"] is None and moved["n"] == 4
    assert to_device(kw, None) is kw


def test_every_step_runs_its_modules_on_the_device(
    tiny_llama: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The blockwise Fisher with a device moves each block (forward, then backward), the norm and head, and the
    embedding there, and hands back host tensors; with cpu its numbers are those of the whole-model Fisher."""
    from squeeze.calibrate.fisher import fisher_information
    from squeeze.models.targets import find_target_linears

    model, _tokenizer = tiny_llama
    placed: list[tuple[torch.device | None, tuple[nn.Module, ...]]] = []
    real = block_walk.on_device

    @contextlib.contextmanager
    def recording(device: torch.device | None, *modules: nn.Module) -> Iterator[None]:
        placed.append((device, modules))
        with real(device, *modules):
            yield

    monkeypatch.setattr(block_walk, "on_device", recording)
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    targets = {**find_target_linears(model, names), "model.embed_tokens": model.model.embed_tokens}
    windows = torch.randint(0, model.config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    got = blockwise.blockwise_fisher(model, windows, targets, device=torch.device("cpu"))
    want = fisher_information(model, windows, targets)
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]) and want[name].abs().sum() > 0, name
    blocks = list(model.model.layers)
    moved = [modules for device, modules in placed if device == torch.device("cpu")]
    assert len(moved) == len(placed)
    for block in blocks:  # once for the forward, once for the recomputation and backward
        assert sum(1 for modules in moved if modules == (block,)) == 2
    assert (model.model.norm, model.lm_head) in moved
    assert any(model.model.embed_tokens in modules for modules in moved)


# -- whole runs: device="cpu" takes the device path and must give the default's bytes


@pytest.mark.parametrize(
    ("recipe", "overrides"),
    [("w4", {}), ("w3-s045", {"weights.embedding_bits": 8}), ("rtn-w4", {})],
    ids=["w4", "w3-s045-e8", "rtn-w4"],
)
def test_cpu_device_run_is_byte_identical(
    recipe: str, overrides: dict[str, Any], tmp_path: Path, compress_tiny: Callable[..., Path]
) -> None:
    default = compress_tiny(tmp_path / "default", recipe, overrides=overrides)
    device = compress_tiny(tmp_path / "device", recipe, overrides=overrides, device="cpu")
    _assert_same_artifact(device, default)


def test_cpu_device_bounded_run_is_byte_identical(tmp_path: Path, compress_tiny: Callable[..., Path]) -> None:
    default = compress_tiny(tmp_path / "default")
    bounded = compress_tiny(tmp_path / "bounded", max_memory="64GB", device="cpu")
    _assert_same_artifact(bounded, default)


def test_device_moves_quantization_inputs_and_returns_host_tensors(
    tmp_path: Path, compress_tiny: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The quantize stage hands k-means the weight and Fisher through to_device and stores what comes back."""
    from squeeze.compression import quantize

    calls: list[int] = []
    real = quantize.to_device

    def counting(value: Any, device: torch.device | None) -> Any:
        calls.append(1)
        assert device == torch.device("cpu")
        return real(value, device)

    monkeypatch.setattr(quantize, "to_device", counting)
    compress_tiny(tmp_path / "out", device="cpu")
    assert len(calls) == 14  # 2 blocks x 7 linears of the tiny Llama
