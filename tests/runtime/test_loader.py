"""The verifying loader: bytes loaded are bytes hashed; swaps after verify are caught; no fp32 copy."""

from __future__ import annotations

import shutil

import pytest
import torch
from typer.testing import CliRunner

import squeeze.format.hashing as hashing
from squeeze import api
from squeeze.cli.app import app
from squeeze.errors import IntegrityError
from squeeze.runtime.kernels.cpu_build import cpu_kernels
from squeeze.runtime.linear import SqueezeLinear

runner = CliRunner()
SHARD = "model-00001-of-00001.safetensors"


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, compress_tiny):
    root = tmp_path_factory.mktemp("loader")
    uniform = {"weights.sensitivity": "uniform"}
    return (
        compress_tiny(root / "a", "w4-s045", overrides=uniform),
        compress_tiny(root / "b", "w4-s045", overrides={**uniform, "weights.bits": 3}),
    )


def test_loads_and_runs_without_an_fp32_copy_of_the_linears(artifacts):
    a, _ = artifacts
    loaded = api.load(a)
    assert loaded.report is not None and loaded.report.ok
    model = loaded.model
    squeezed = [m for m in model.modules() if isinstance(m, SqueezeLinear)]
    assert len(squeezed) == 2 * 7  # the tiny Llama: 2 layers x (q, k, v, o, gate, up, down)
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    held = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in model.state_dict().values()}.values())
    shards = (a / SHARD).stat().st_size
    assert held <= shards  # packed codes + LUTs + the rest: nothing dequantized at load
    with torch.inference_mode():
        logits = model(torch.tensor([[1, 50, 60, 70]])).logits
    assert torch.isfinite(logits).all()
    kernels = cpu_kernels()
    if kernels is not None:  # the native kernels read the packed codes: no dense weight after a forward either
        assert {m.weight_path for m in squeezed} == {f"native-{kernels.isa}"}
        assert all(m._dense is None for m in squeezed)


def test_a_plain_forward_outside_no_grad_runs_the_kernels(artifacts):
    # the loaded model wants no gradients: activations never require grad, so the kernels (no backward) run
    a, _ = artifacts
    model = api.load(a).model
    assert not any(p.requires_grad for p in model.parameters())
    if cpu_kernels() is None:
        pytest.skip("no C++ compiler: the native kernels are unavailable")
    logits = model(torch.tensor([[1, 50, 60, 70]])).logits
    assert torch.isfinite(logits).all()
    assert all(m._dense is None for m in model.modules() if isinstance(m, SqueezeLinear))  # no dense fallback


def test_shard_swapped_after_verify_is_caught_at_load(artifacts, tmp_path):
    a, b = artifacts
    target = tmp_path / "a"
    shutil.copytree(a, target)
    assert runner.invoke(app, ["verify", str(target)]).exit_code == 0
    shutil.copyfile(b / SHARD, target / SHARD)  # a valid shard of another artifact
    with pytest.raises(IntegrityError, match=SHARD):
        api.load(target)


def test_file_rewritten_after_hashing_does_not_reach_the_model(artifacts, tmp_path, monkeypatch):
    a, _ = artifacts
    target = tmp_path / "a"
    shutil.copytree(a, target)
    reference = api.load(target).model.state_dict()
    original = hashing.hash_file

    def hash_then_tamper(root_fd, relative, on_bytes=None, *, capture=False):
        result = original(root_fd, relative, on_bytes, capture=capture)
        if relative == SHARD:  # an attacker rewrites the file right after it was read and hashed
            data = bytearray((target / SHARD).read_bytes())
            data[-1] ^= 0xFF
            (target / SHARD).write_bytes(bytes(data))
        return result

    monkeypatch.setattr(hashing, "hash_file", hash_then_tamper)
    loaded = api.load(target).model.state_dict()
    assert all(torch.equal(loaded[k], reference[k]) for k in reference)


def test_no_verify_skips_hashing(artifacts, tmp_path):
    a, _ = artifacts
    target = tmp_path / "a"
    shutil.copytree(a, target)
    (target / "stray.txt").write_text("not in the manifest")
    with pytest.raises(IntegrityError):
        api.load(target)
    loaded = api.load(target, verify=False)
    assert loaded.report is None and isinstance(loaded.model.get_submodule("model.layers.0.mlp.up_proj"), SqueezeLinear)


def test_loaded_model_matches_the_reference_dequantization(artifacts):
    a, _ = artifacts
    cached = api.load(a, dense_cache=True).model
    # the native float32 kernels where there is a compiler: float32 sums in another order
    default = api.load(a, activations="float32").model
    ids = torch.tensor([[1, 20, 30, 40, 50, 60]])
    with torch.inference_mode():  # (under grad mode the default path would be the dense one too)
        assert torch.allclose(cached(ids).logits, default(ids).logits, rtol=1e-5, atol=1e-5)


def _count(monkeypatch, module, name: str) -> list[int]:
    calls = [0]
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_skeleton_and_tokenizer_are_built_once_after_verification(artifacts, monkeypatch):
    import squeeze.runtime.loader as loader

    a, _ = artifacts
    events: list[str] = []
    real_verify, real_build = loader.verify_artifact, loader.build_skeleton
    monkeypatch.setattr(loader, "verify_artifact", lambda *a, **k: events.append("verified") or real_verify(*a, **k))
    monkeypatch.setattr(loader, "build_skeleton", lambda *a, **k: events.append("skeleton") or real_build(*a, **k))
    tokenizers = _count(monkeypatch, loader, "tokenizer_from_files")
    loaded = api.load(a)
    assert events == ["verified", "skeleton"] and tokenizers == [1]  # nothing built from unverified bytes
    assert loaded.tokenizer("Once upon a time")["input_ids"]
