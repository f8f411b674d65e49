"""Calibration text loading and seeded random token windows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from squeeze.calibrate import calibration_windows, load_calibration_text, sample_windows, tokenize_text
from squeeze.config import CalibrationSpec
from squeeze.errors import CalibrationError


def _spec(path: Path | str, **kw: object) -> CalibrationSpec:
    return CalibrationSpec(source="text", path=str(path), **kw)  # type: ignore[arg-type]


def _starts(ids: torch.Tensor, windows: torch.Tensor) -> list[int]:
    """Start offset of each window in ids (each window must be a contiguous slice of the stream)."""
    n, t = windows.shape
    all_slices = ids.unfold(0, t, 1)  # (N - t + 1, t)
    starts = []
    for w in windows:
        hits = (all_slices == w).all(dim=1).nonzero().flatten()
        assert hits.numel() >= 1, "window is not a contiguous slice of the token stream"
        starts.append(int(hits[0]))
    return starts


def test_windows_shape_dtype_determinism(stories: tuple, tinystories_file: Path) -> None:
    _, tok = stories
    spec = _spec(tinystories_file, num_samples=6, seq_len=32, seed=3)
    w = calibration_windows(spec, tok)
    assert w.shape == (6, 32) and w.dtype == torch.int64
    assert torch.equal(w, calibration_windows(spec, tok))  # same spec -> same windows
    other = calibration_windows(_spec(tinystories_file, num_samples=6, seq_len=32, seed=4), tok)
    assert not torch.equal(w, other)
    ids = tokenize_text(tinystories_file.read_text(encoding="utf-8"), tok)
    starts = _starts(ids, w)
    assert all(0 <= s <= ids.numel() - 32 - 1 for s in starts)


def test_no_special_tokens_added(stories: tuple) -> None:
    _, tok = stories
    ids = tokenize_text("Once upon a time", tok)
    assert tok.bos_token_id not in ids.tolist()
    assert ids.dtype == torch.int64 and ids.ndim == 1


def test_overlapping_windows_allowed(stories: tuple, tmp_path: Path) -> None:
    _, tok = stories
    f = tmp_path / "short.txt"
    f.write_text("Once upon a time there was a little girl named Lily. She loved to play outside.")
    n_tokens = tokenize_text(f.read_text(), tok).numel()
    w = calibration_windows(_spec(f, num_samples=10, seq_len=n_tokens - 1), tok)
    assert w.shape == (10, n_tokens - 1)  # 10 windows from a text that holds barely one


def test_sample_windows_edge_exactly_one_window() -> None:
    ids = torch.arange(11)
    w = sample_windows(ids, 3, 10, seed=0)
    assert torch.equal(w, torch.arange(10).expand(3, 10))  # the only valid start is 0


def test_text_shorter_than_one_window(stories: tuple, tmp_path: Path) -> None:
    _, tok = stories
    f = tmp_path / "tiny.txt"
    f.write_text("Once upon a time")
    n_tokens = tokenize_text(f.read_text(), tok).numel()
    with pytest.raises(CalibrationError) as info:
        calibration_windows(_spec(f, seq_len=n_tokens), tok)
    assert f"has {n_tokens} tokens" in info.value.message
    assert f"needs {n_tokens + 1}" in info.value.message
    assert info.value.hint


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CalibrationError, match="does not exist") as info:
        load_calibration_text(_spec(tmp_path / "nope.txt"))
    assert info.value.hint


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(CalibrationError, match="is a directory"):
        load_calibration_text(_spec(tmp_path))


def test_empty_file(tmp_path: Path) -> None:
    f = tmp_path / "empty.txt"
    f.write_text("  \n\n")
    with pytest.raises(CalibrationError, match="is empty"):
        load_calibration_text(_spec(f))


def test_not_utf8(tmp_path: Path) -> None:
    f = tmp_path / "latin1.txt"
    f.write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(CalibrationError, match="not valid UTF-8") as info:
        load_calibration_text(_spec(f))
    assert "iconv" in (info.value.hint or "")


@pytest.fixture()
def local_datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import datasets

    cache = tmp_path / "datasets-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    return cache


def test_hf_dataset_not_cached(local_datasets_cache: Path) -> None:
    spec = CalibrationSpec(source="hf", dataset="nobody/not-a-cached-dataset", split="train")
    with pytest.raises(CalibrationError, match="cannot load calibration dataset") as info:
        load_calibration_text(spec)
    assert "cache" in (info.value.hint or "") and "local text file" in (info.value.hint or "")


def test_hf_dataset_local_dir_joined(local_datasets_cache: Path, tmp_path: Path) -> None:
    data = tmp_path / "ds"
    data.mkdir()
    rows = [{"text": "first story.", "id": 1}, {"text": "second story.", "id": 2}]
    (data / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    spec = CalibrationSpec(source="hf", dataset=str(data), split="train", field="text")
    assert load_calibration_text(spec) == "first story.\n\nsecond story."

    with pytest.raises(CalibrationError, match="no field 'body'") as info:
        load_calibration_text(CalibrationSpec(source="hf", dataset=str(data), split="train", field="body"))
    assert "'text'" in info.value.message  # lists the fields that exist
    with pytest.raises(CalibrationError, match="not a text column"):
        load_calibration_text(CalibrationSpec(source="hf", dataset=str(data), split="train", field="id"))
