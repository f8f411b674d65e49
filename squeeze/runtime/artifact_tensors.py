"""An artifact's tensors and small files as the loaders read them: views into the bytes verification hashed
(no second read), or, unverified, straight from disk, read like everything else (no link followed, regular
files only, small files capped, shard headers validated before any tensor is made).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Collection
from pathlib import Path

import torch

from squeeze.errors import FormatError
from squeeze.format.dtypes import torch_dtype
from squeeze.format.manifest import MANIFEST_NAME
from squeeze.format.paths import (
    MAX_CONFIG_BYTES,
    check_relative_path,
    describe_os_error,
    open_inside,
    open_root,
    read_inside,
    short_path,
    walk_artifact,
)
from squeeze.format.safetensors_header import SafetensorsHeader, parse_safetensors_header, read_header_prefix
from squeeze.format.shards import INDEX_NAME
from squeeze.format.strict_json import strict_json_loads
from squeeze.format.verify import VerifyReport
from squeeze.quant.kv_file import KV_FILE


def tensors_from_captured(report: VerifyReport, exclude: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """Every tensor of every shard (but the files in ``exclude``), as views into the bytes that verification
    hashed (no second read)."""
    tensors: dict[str, torch.Tensor] = {}
    for path, header in sorted(report.headers.items()):
        if path in exclude:
            continue
        data = report.captured[path].data
        if data is None:
            raise FormatError(f"{path} was verified without keeping its bytes")
        tensors.update(tensor_views(header, data))  # uint8 views, sharing the hashed buffer
    return tensors


def read_unverified(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, bytes], list[str]]:
    """(tensors, small top-level files, KV-file tensor names) read straight from disk (``verify=False``).

    Unverified, but read like everything else: no link followed, regular files only, no blocking open,
    small files capped (MAX_CONFIG_BYTES) and shard headers validated before any tensor is made.
    """
    root_fd = open_root(directory)
    try:
        top = {rel: st for rel, st in walk_artifact(root_fd) if "/" not in rel and stat.S_ISREG(st.st_mode)}
        if INDEX_NAME in top:
            index = strict_json_loads(read_inside(root_fd, INDEX_NAME, MAX_CONFIG_BYTES), INDEX_NAME)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict):
                raise FormatError(f"{INDEX_NAME} lacks a 'weight_map' object")
            shards = {check_relative_path(shard, INDEX_NAME) for shard in weight_map.values()}
            shards |= {KV_FILE} & set(top)
        else:
            shards = {rel for rel in top if rel.endswith(".safetensors")}
        tensors: dict[str, torch.Tensor] = {}
        kv_names: list[str] = []
        for shard in sorted(shards):
            header, data = read_shard(root_fd, shard)
            views = tensor_views(header, data)
            tensors.update(views)
            if shard == KV_FILE:
                kv_names = list(views)
        files = {
            rel: read_inside(root_fd, rel, MAX_CONFIG_BYTES)
            for rel in sorted(top)
            if not rel.endswith(".safetensors") and rel != MANIFEST_NAME
        }
    finally:
        os.close(root_fd)
    return tensors, files, kv_names


def read_shard(root_fd: int, relative: str) -> tuple[SafetensorsHeader, torch.Tensor]:
    """One shard read whole into private memory (uint8), its header validated against its size."""
    try:
        fd = open_inside(root_fd, relative)
    except OSError as exc:
        raise FormatError(f"cannot open {short_path(relative)}: {describe_os_error(exc)}") from None
    with os.fdopen(fd, "rb", buffering=0) as handle:
        size = os.fstat(handle.fileno()).st_size
        head = read_header_prefix(handle)
        header = parse_safetensors_header(head, size, short_path(relative))  # before sizing anything by it
        data = torch.empty(size, dtype=torch.uint8)
        view = data.numpy().data  # a writable memoryview of the tensor's bytes
        view[: len(head)] = head
        done = len(head)
        while done < size:
            count = handle.readinto(view[done:])
            if not count:
                raise FormatError(f"{short_path(relative)} shrank while being read")
            done += count
    return header, data


def tensor_views(header: SafetensorsHeader, data: torch.Tensor) -> dict[str, torch.Tensor]:
    """The header's tensors as views into ``data`` (the whole file as uint8), shapes and dtypes as declared."""
    base = header.data_start
    return {
        name: data[base + info.begin : base + info.end].view(torch_dtype(info.dtype)).reshape(info.shape)
        for name, info in header.tensors.items()
    }


def read_verified(report: VerifyReport) -> tuple[dict[str, torch.Tensor], dict[str, bytes], list[str]]:
    """(tensors, small files, KV-file tensor names) from the bytes verification hashed (no second read)."""
    files = {
        p: bytes(h.data.numpy())
        for p, h in report.captured.items()
        if h.data is not None and not p.endswith(".safetensors")
    }
    kv_header = report.headers.get(KV_FILE)
    return tensors_from_captured(report), files, list(kv_header.tensors) if kv_header is not None else []
