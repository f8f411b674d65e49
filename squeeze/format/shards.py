"""Streaming, atomic, sharded safetensors writer (and the index transformers reads).

Tensors are added one at a time; a shard is flushed to disk as soon as the next tensor would push it past
``max_shard_bytes``, so at most one shard is ever buffered. Shards are written under hidden temp names and
renamed to ``model-0000i-of-0000N.safetensors`` only when the total count N is known (``close``); the index
``model.safetensors.index.json`` is written last. A killed writer leaves no file under a final name.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import torch
from safetensors.torch import save_file

from squeeze.errors import FormatError
from squeeze.format.atomic import atomic_write_text, commit_file, fsync_directory, temp_path_for

INDEX_NAME = "model.safetensors.index.json"
SHARD_METADATA = {"format": "pt"}


def shard_name(index: int, total: int) -> str:
    """transformers' shard naming: ``model-00001-of-00003.safetensors`` (1-based)."""
    return f"model-{index:05d}-of-{total:05d}.safetensors"


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass
class ShardIndex:
    """What a finished ShardWriter wrote: shard file names and which shard holds each tensor."""

    shards: list[str] = field(default_factory=list)
    weight_map: dict[str, str] = field(default_factory=dict)
    total_size: int = 0

    def to_json(self) -> str:
        body = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(self.weight_map.items()))}
        return json.dumps(body, indent=2) + "\n"


class ShardWriter:
    """Write tensors into size-capped safetensors shards in ``directory``; use as a context manager.

    On an exception inside the ``with`` block, every temp shard is removed and nothing is renamed.
    """

    def __init__(self, directory: str | Path, max_shard_bytes: int):
        if max_shard_bytes <= 0:
            raise FormatError(f"max shard size must be positive, found {max_shard_bytes}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        # Exactly one metadata key: safetensors stores __metadata__ as a hash map whose key order varies
        # between processes, and shards must be byte-identical for identical inputs. Versions live in
        # config.json and the manifest instead.
        self.metadata = dict(SHARD_METADATA)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._temps: list[tuple[Path, list[str]]] = []  # flushed shards: temp path, tensor names
        self._names: set[str] = set()
        self._total = 0
        self._closed = False

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor; flushes the current shard first if this one would overflow it."""
        if self._closed:
            raise FormatError("cannot add tensors to a closed ShardWriter")
        if name in self._names:
            raise FormatError(f"tensor name {name!r} written twice")
        size = tensor_nbytes(tensor)
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        # contiguous CPU copy detached from autograd: safetensors needs it, and the caller may reuse memory
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        self._pending_bytes += size
        self._names.add(name)
        self._total += size
        if self._pending_bytes >= self.max_shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        temp = temp_path_for(self.directory / "model.safetensors")
        save_file(self._pending, str(temp), metadata=self.metadata)
        self._temps.append((temp, list(self._pending)))
        self._pending = {}
        self._pending_bytes = 0

    def close(self) -> ShardIndex:
        """Flush the last shard, give every shard its final name, write the index; returns the index."""
        if self._closed:
            raise FormatError("ShardWriter closed twice")
        self._flush()
        self._closed = True
        total = len(self._temps)
        index = ShardIndex(total_size=self._total)
        for number, (temp, names) in enumerate(self._temps, start=1):
            final = shard_name(number, total)
            commit_file(temp, self.directory / final)
            index.shards.append(final)
            index.weight_map.update({name: final for name in names})
        self._temps = []
        atomic_write_text(self.directory / INDEX_NAME, index.to_json())
        fsync_directory(self.directory)
        return index

    def abort(self) -> None:
        """Remove every temp shard written so far (nothing under a final name is touched)."""
        for temp, _ in self._temps:
            with contextlib.suppress(FileNotFoundError):
                temp.unlink()
        self._temps = []
        self._pending = {}
        self._closed = True

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.close()


def write_shards(directory: str | Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> ShardIndex:
    """Convenience: write a dict of tensors as shards + index in one call."""
    with ShardWriter(directory, max_shard_bytes) as writer:
        for name, tensor in tensors.items():
            writer.add(name, tensor)
        return writer.close()
