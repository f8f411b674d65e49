"""Calibration text -> token windows, as GPTQ/SqueezeLLM draw them (random starts, seeded, deterministic)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from squeeze.config import CalibrationSpec
from squeeze.errors import CalibrationError, SqueezeError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_calibration_text(spec: CalibrationSpec) -> str:
    """The calibration text of ``spec``: a local UTF-8 file, or a dataset field joined with ``"\\n\\n"``.

    Datasets are read with ``datasets.load_dataset`` and must already be in the local cache (or be a local
    dataset directory); squeeze never downloads.
    """
    if spec.source == "text":
        return _read_text_file(spec)
    return _read_dataset(spec)


def _read_text_file(spec: CalibrationSpec) -> str:
    return read_text_file(spec.path or "", "calibration text file", CalibrationError)


def read_text_file(path: str | os.PathLike[str], what: str, error: type[SqueezeError]) -> str:
    """A UTF-8 text file's content; a missing, unreadable, non-UTF-8 or empty file raises ``error``."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise error(
            f"{what} {str(path)!r} does not exist" + (" (it is a directory)" if path.is_dir() else ""),
            hint="pass an existing UTF-8 text file"
            + (", or a calibration spec YAML naming one" if error is CalibrationError else ""),
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise error(
            f"{what} {str(path)!r} is not valid UTF-8 (bad byte at offset {exc.start})",
            hint="convert it to UTF-8 (e.g. iconv -t utf-8)",
        ) from exc
    except OSError as exc:
        raise error(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from exc
    if not text.strip():
        raise error(f"{what} {str(path)!r} is empty", hint="use a file with at least a few thousand words of prose")
    return text


def _read_dataset(spec: CalibrationSpec) -> str:
    name = spec.dataset if spec.dataset_config is None else f"{spec.dataset}/{spec.dataset_config}"
    hint = (
        "the dataset must already be in the local Hugging Face datasets cache (squeeze works offline); "
        "or use a local text file (source: text, path: ...)"
    )
    try:
        import datasets

        data: Any = datasets.load_dataset(spec.dataset, spec.dataset_config, split=spec.split)
    except Exception as exc:  # noqa: BLE001 - datasets raises many types for "not cached / not found"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CalibrationError(
            f"cannot load calibration dataset {name!r} split {spec.split!r}: {first}", hint=hint
        ) from exc
    columns = list(getattr(data, "column_names", None) or [])
    if spec.field not in columns:
        raise CalibrationError(
            f"calibration dataset {name!r} has no field {spec.field!r}; fields found: {columns}",
            hint="set 'field' in the calibration spec to the text column",
        )
    texts = data[spec.field]
    if not all(isinstance(t, str) for t in texts):
        raise CalibrationError(
            f"calibration dataset {name!r} field {spec.field!r} is not a text column",
            hint="set 'field' to a column of strings",
        )
    text = "\n\n".join(texts)
    if not text.strip():
        raise CalibrationError(f"calibration dataset {name!r} split {spec.split!r} has no text in {spec.field!r}")
    return text


def tokenize_text(text: str, tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """Token ids of the whole text, tokenized once without special tokens: int64 ``(N,)``."""
    # Tokenizing the joined text in one call (not per line or per document) is what the paper protocol
    # does; no BOS/EOS is added so windows cut anywhere look alike. The long-input warning is irrelevant:
    # we never feed the whole sequence to the model.
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def calibration_windows(spec: CalibrationSpec, tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """``spec.num_samples`` windows of ``spec.seq_len`` tokens: int64 ``(num_samples, seq_len)``.

    Each window starts at a random offset drawn from a ``torch.Generator`` seeded with ``spec.seed``
    (GPTQ/SqueezeLLM style), so the same spec and tokenizer always give the same windows. When the text
    holds fewer than ``num_samples * seq_len`` tokens the windows overlap; that is fine for a Fisher
    estimate (it just weights the repeated text more) and is not an error.
    """
    ids = tokenize_text(load_calibration_text(spec), tokenizer)
    return sample_windows(ids, spec.num_samples, spec.seq_len, spec.seed, what=_describe(spec))


def sample_windows(
    ids: torch.Tensor, num_samples: int, seq_len: int, seed: int, *, what: str = "calibration text"
) -> torch.Tensor:
    """Draw ``num_samples`` windows of ``seq_len`` tokens from int64 ``ids (N,)``: int64 ``(num_samples, seq_len)``.

    Start positions are uniform in ``[0, N - seq_len - 1]`` (the GPTQ convention: one token of slack after
    the window), drawn with a generator seeded by ``seed``.
    """
    n = int(ids.numel())
    if n < seq_len + 1:
        raise CalibrationError(
            f"{what} is too short: it has {n} tokens, one window needs {seq_len + 1} (seq_len {seq_len} + 1)",
            hint="use a longer text or a smaller seq_len",
        )
    generator = torch.Generator().manual_seed(seed)
    # randint's high is exclusive: starts in [0, n - seq_len - 1], so start + seq_len <= n - 1.
    starts = torch.randint(0, n - seq_len, (num_samples,), generator=generator)
    offsets = torch.arange(seq_len)
    return ids[starts[:, None] + offsets[None, :]]  # (num_samples, seq_len) gather in one indexing op


def _describe(spec: CalibrationSpec) -> str:
    if spec.source == "text":
        return f"calibration text {spec.path!r}"
    return f"calibration dataset {spec.dataset!r} split {spec.split!r}"


__all__ = ["load_calibration_text", "tokenize_text", "calibration_windows", "sample_windows"]
