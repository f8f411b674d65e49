"""The tokenizer of an artifact, built from the bytes the loader verified (never re-read from the directory)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from squeeze.errors import ModelError
from squeeze.models.remote_code import is_remote_code_refusal


def tokenizer_from_files(files: dict[str, bytes]) -> Any:
    """The tokenizer, built from the verified bytes (copied to a private temp dir, never re-read in place)."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="squeeze-tokenizer-") as tmp:
        for name, data in files.items():
            if "/" not in name:
                (Path(tmp) / name).write_bytes(data)
        try:
            return AutoTokenizer.from_pretrained(tmp, local_files_only=True, trust_remote_code=False)
        except ValueError as exc:
            if not is_remote_code_refusal(exc):
                raise
            # tokenizer_config.json's auto_map names a tokenizer class shipped as Python files: never run
            raise ModelError(
                "the artifact's tokenizer needs its own Python code to load (tokenizer_config.json has an "
                "auto_map); that would take trust_remote_code=True, and squeeze never runs a model's own code",
                hint="compress a model whose tokenizer transformers supports natively",
            ) from None


__all__ = ["tokenizer_from_files"]
