"""The memory check before a load: the estimate is right, and a load that cannot fit fails before reading."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import squeeze.format.hashing as hashing
import squeeze.runtime.memory as memory
from squeeze import api
from squeeze.errors import ResourceError
from squeeze.runtime.linear import SqueezeLinear


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory, compress_tiny) -> Path:
    out = tmp_path_factory.mktemp("memory") / "w4"
    return compress_tiny(out, "w4-s045", overrides={"weights.sensitivity": "uniform"})


def _available(monkeypatch: pytest.MonkeyPatch, n: int | None) -> None:
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: n)


def _no_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("an artifact file was read before the memory check refused the load")

    monkeypatch.setattr(hashing, "hash_file", refuse)


def _native_here() -> bool:
    from squeeze.runtime.kernels.cpu_build import cpu_kernels

    return cpu_kernels() is not None


def test_estimate_matches_what_the_load_holds(artifact: Path) -> None:
    estimate = memory.estimate_load(artifact)
    assert estimate is not None
    assert estimate.artifact_bytes == sum(
        p.stat().st_size for p in artifact.iterdir() if p.is_file() and p.name != "squeeze.manifest.json"
    )
    loaded = api.load(artifact)  # default: compressed, the native kernels' prepared form only
    assert sum(h.data.numel() for h in loaded.report.captured.values()) == estimate.artifact_bytes
    linears = [m for m in loaded.model.modules() if isinstance(m, SqueezeLinear)]
    if _native_here():
        sparse = [m for m in linears if m.qweight.sparse is not None]
        assert sparse, "the fixture's recipe keeps a sparse part: its kernel form must be sized"
        # sized at 20 bytes per entry: what the kernels hold at most (16 when the values are float32 already),
        # and the int8 form's 20 bytes per row of a 3- or 4-bit weight
        nnz = sum(m.qweight.sparse.nnz for m in sparse)
        rows = sum(m.out_features for m in linears if m.qweight.bits in memory.W8_BITS)
        assert estimate.prepared_bytes == memory.SPARSE_ENTRY_BYTES * nnz + memory.W8_ROW_BYTES * rows
        assert sum(m._cpu.extra_bytes for m in linears) <= estimate.prepared_bytes
        assert estimate.fallback_bytes == 0 and estimate.low_memory_bytes == 0  # the kernels cover every weight
        assert estimate.total() == estimate.artifact_bytes + estimate.prepared_bytes + estimate.overhead_bytes
    dense = api.load(artifact, dense_cache=True)
    dense.model(torch.tensor([[1, 20, 30]]))  # builds every dense cache
    caches = [m._dense for m in dense.model.modules() if isinstance(m, SqueezeLinear)]
    assert estimate.dense_cache_bytes == sum(d.numel() * d.element_size() for d in caches)
    assert estimate.total(dense_cache=True) > estimate.total()  # the tiny model's LUTs still cost less than fp32
    # without a compiler every weight falls back: dense by default, one row slice with low_memory
    fallback = memory.estimate_load(artifact, native=False)
    assert fallback.prepared_bytes == 0 and fallback.fallback_bytes == estimate.dense_cache_bytes
    assert fallback.low_memory_bytes == max(d.numel() * d.element_size() for d in caches)  # < 1024 rows each


def test_a_dense_load_that_does_not_fit_hints_to_drop_dense(artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    estimate = memory.estimate_load(artifact, native=memory.native_kernels_expected())
    _available(monkeypatch, estimate.total(dense_cache=True) - 1)  # the compressed load still fits
    _no_reads(monkeypatch)
    with pytest.raises(ResourceError, match="not enough memory to load") as info:
        api.load(artifact, dense_cache=True)
    assert "drop --dense" in info.value.hint and "dense_cache=False" in info.value.hint
    assert "dense weight cache" in info.value.message
    with pytest.raises(ResourceError):
        api.generate(str(artifact), "Once", max_new_tokens=2, dense_cache=True)
    monkeypatch.undo()
    _available(monkeypatch, estimate.total(dense_cache=True) - 1)
    assert api.load(artifact).report.ok  # the hint is right: the default load fits
    assert api.load(artifact, dense_cache=True, check_memory=False).report.ok  # the refusal can be skipped


def test_without_kernels_a_fallback_that_does_not_fit_hints_at_low_memory(
    artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memory, "native_kernels_expected", lambda: False)  # a machine without a C++ compiler
    estimate = memory.estimate_load(artifact, native=False)
    _available(monkeypatch, estimate.total(low_memory=True))  # the default load's dense fallback does not fit
    _no_reads(monkeypatch)
    cases = [(False, "use --low-memory", "dense fallback"), (True, "drop --dense and use --low-memory", "dense weight")]
    for dense_cache, how, part in cases:
        with pytest.raises(ResourceError) as info:
            memory.check_load_memory(artifact, dense_cache=dense_cache)
        assert info.value.hint.startswith(how) and "low_memory=True" in info.value.hint
        assert part in info.value.message
    assert memory.check_load_memory(artifact, dense_cache=False, low_memory=True) == estimate  # the hint fits


def test_nothing_fits_hints_at_freeing_memory(artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _available(monkeypatch, 1000)
    with pytest.raises(ResourceError) as info:
        api.load(artifact)
    assert "free memory" in info.value.hint and "dense weight cache" not in info.value.message
    if _native_here():
        assert "kernel sparse entries" in info.value.message


def test_the_memory_check_comes_before_verification(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "a"
    shutil.copytree(artifact, target)
    (target / "stray.txt").write_text("not in the manifest")
    _available(monkeypatch, 1000)
    with pytest.raises(ResourceError):
        api.load(target)


def test_unknown_available_memory_does_not_block(artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _available(monkeypatch, None)
    assert api.load(artifact).report.ok


def test_available_memory_reads_proc_meminfo() -> None:
    n = memory.available_memory_bytes()
    if Path("/proc/meminfo").is_file():
        assert n is not None and n > 0
    else:
        assert n is None


# ------------------------------------------------------------------------------------------------------
# The estimate reads an unverified artifact: it never blocks, follows a link or reads past a bound


def _within(seconds: float, call, unblock: Path):
    """``call()``'s result, failing if it blocks longer than ``seconds`` (then the FIFO ``unblock`` is released)."""
    import os
    import threading

    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(value=call()), daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        os.close(os.open(unblock, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(5)
        pytest.fail(f"estimate_load blocked on {unblock.name}")
    return outcome["value"]


@pytest.fixture
def copy(artifact: Path, tmp_path: Path) -> Path:
    target = tmp_path / "a"
    shutil.copytree(artifact, target)
    return target


def test_a_fifo_manifest_or_config_does_not_block_the_estimate(copy: Path) -> None:
    import os

    reference = memory.estimate_load(copy)
    (copy / "config.json").unlink()
    os.mkfifo(copy / "config.json")  # before: blocked run / eval / calibrate-kv forever
    estimate = _within(20, lambda: memory.estimate_load(copy), copy / "config.json")
    assert estimate.artifact_bytes == reference.artifact_bytes and estimate.dense_cache_bytes == 0
    (copy / "squeeze.manifest.json").unlink()
    os.mkfifo(copy / "squeeze.manifest.json")
    estimate = _within(20, lambda: memory.estimate_load(copy), copy / "squeeze.manifest.json")
    assert estimate is not None and estimate.dense_cache_bytes == 0


def test_a_config_linked_elsewhere_is_not_followed(copy: Path, tmp_path: Path) -> None:
    import os

    outside = tmp_path / "outside-fifo"
    os.mkfifo(outside)  # a link to /dev/zero grew memory without bound; to a FIFO it blocked
    (copy / "config.json").unlink()
    os.symlink(outside, copy / "config.json")
    estimate = _within(20, lambda: memory.estimate_load(copy), outside)
    assert estimate is not None and estimate.dense_cache_bytes == 0


def test_a_huge_or_deeply_nested_manifest_gives_an_estimate_from_the_files(copy: Path) -> None:
    on_disk = sum(p.stat().st_size for p in copy.iterdir() if p.name != "squeeze.manifest.json")
    manifest = copy / "squeeze.manifest.json"
    manifest.write_text("[" * 100_000 + "]" * 100_000)  # before: RecursionError (internal error)
    assert memory.estimate_load(copy).artifact_bytes == on_disk + manifest.stat().st_size
    with open(manifest, "r+b") as handle:
        handle.truncate(2**30)  # before: read whole
    assert memory.estimate_load(copy).artifact_bytes == on_disk + 2**30


def test_a_config_claiming_more_weights_than_the_artifact_holds_sizes_no_dense_cache(copy: Path) -> None:
    import json

    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"]["modules"]["model.layers.0.mlp.up_proj"]["out_features"] = 10**15
    (copy / "config.json").write_text(json.dumps(config))
    estimate = memory.estimate_load(copy)  # unverified: the load's verification reports the edit
    assert estimate is not None and estimate.dense_cache_bytes == 0


def test_a_shard_with_a_junk_header_sizes_no_sparse_part(copy: Path) -> None:
    reference = memory.estimate_load(copy)
    for shard in copy.glob("*.safetensors"):
        with open(shard, "r+b") as handle:
            handle.write((2**62).to_bytes(8, "little"))  # a header length past the file's end
    lut_only = memory.estimate_load(copy)  # unverified: the load's verification reports the edit
    assert lut_only is not None and lut_only.artifact_bytes == reference.artifact_bytes
    assert lut_only.dense_cache_bytes == reference.dense_cache_bytes
    # no sparse entries (the LUTs: read in place); the int8 form's rows are sized from config.json alone
    assert 0 < lut_only.prepared_bytes < reference.prepared_bytes
    assert lut_only.prepared_bytes % memory.W8_ROW_BYTES == 0
