"""What an artifact holds: files, tensors grouped by role, quantization summary, manifest status.

Reads only the manifest, config.json and the safetensors headers (a few KB), never tensor data, so it is
instant on any model size. Full hashing is ``verify``'s job.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from squeeze.errors import FormatError
from squeeze.format.manifest import MANIFEST_NAME, Manifest
from squeeze.format.paths import (
    MAX_CONFIG_BYTES,
    MAX_DEPTH,
    open_inside,
    open_root,
    path_error,
    read_inside,
    resolve_root,
    short_path,
    walk_artifact,
)
from squeeze.format.quant_config import QuantizationConfig
from squeeze.format.safetensors_header import parse_safetensors_header, read_header_prefix
from squeeze.format.strict_json import strict_json_loads
from squeeze.quant.schemes import stored_roles


@dataclass
class RoleSummary:
    """All tensors sharing one role (the name's last dotted part, e.g. ``weight_lut``)."""

    role: str
    count: int = 0
    bytes: int = 0


@dataclass
class ArtifactInfo:
    """A summary of an artifact directory."""

    directory: str
    files: list[dict[str, Any]] = field(default_factory=list)  # {path, size, listed}
    roles: list[RoleSummary] = field(default_factory=list)
    n_tensors: int = 0
    #: config.json's squeeze ``quantization_config`` (read leniently: junk reads as absent), None without one
    quantization: QuantizationConfig | None = None
    bits_per_weight: float | None = None
    quantized_modules: int = 0
    #: quantized 3-D expert parameters of MoE layers (module entries with ``experts``; counted in
    #: quantized_modules too) and the expert matrices they hold together (each entry's E summed)
    expert_parameters: int = 0
    experts: int = 0
    #: quantized modules per code width, e.g. {3: 140, 4: 70}: a bits-per-weight budget (weights.target_bpw)
    #: gives each linear its own width; a uniform recipe has one key
    widths: dict[int, int] = field(default_factory=dict)
    manifest_status: str = "absent"
    root_digest: str | None = None
    provenance: dict[str, Any] | None = None
    #: KV-cache bytes per token over all layers {"fp16", "int8", "int4"} (filled in by squeeze.api.inspect).
    kv_bytes_per_token: dict[str, int] | None = None
    #: config.json as read (hardened, size-capped; not verified), None if absent or malformed. Not serialised.
    config: dict[str, Any] | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        quant = self.quantization.to_dict() if self.quantization is not None else {}
        quant.pop("modules", None)  # per-module detail is long; the summary says how many
        return {
            "directory": self.directory,
            "files": self.files,
            "tensors": self.n_tensors,
            "roles": [{"role": r.role, "count": r.count, "bytes": r.bytes} for r in self.roles],
            "quantization": quant or None,
            "quantized_modules": self.quantized_modules,
            "expert_parameters": self.expert_parameters,
            "experts": self.experts,
            "widths": {str(bits): n for bits, n in self.widths.items()},
            "bits_per_weight": self.bits_per_weight,
            "manifest": {"status": self.manifest_status, "root_digest": self.root_digest},
            "provenance": self.provenance,
            "kv_bytes_per_token": self.kv_bytes_per_token,
        }


def inspect_artifact(path: str | os.PathLike[str]) -> ArtifactInfo:
    """Summarise the artifact at ``path`` (directory or manifest). Raises FormatError if it is not one.

    A symlinked artifact path is resolved to its real root; inside it nothing is followed: a shard or
    config.json that is a link, FIFO or device is listed with its ``problem`` and not read.
    """
    given = Path(path)
    if given.name == MANIFEST_NAME:
        given = given.parent
    try:
        is_directory = given.is_dir()
    except OSError as exc:  # e.g. a path longer than the OS allows
        raise path_error("cannot read", given, exc) from None
    if not is_directory:
        raise FormatError(f"{short_path(given)} is not a directory", hint="pass an artifact directory")
    directory = resolve_root(given)
    info = ArtifactInfo(directory=str(directory))
    manifest = _read_manifest_quietly(directory, info)
    listed = manifest.entry_map() if manifest else {}
    root_fd = open_root(directory)
    try:
        on_disk = {rel: st for rel, st in walk_artifact(root_fd) if rel != MANIFEST_NAME}
        regular = {rel for rel, st in on_disk.items() if stat.S_ISREG(st.st_mode)}
        for rel in sorted(set(on_disk) | set(listed)):
            size = on_disk[rel].st_size if rel in on_disk else None
            entry: dict[str, Any] = {"path": rel, "size": size, "listed": rel in listed}
            if rel in on_disk and rel not in regular:
                entry["problem"] = _kind(on_disk[rel].st_mode) + "; not read"
            info.files.append(entry)
        roles: dict[str, RoleSummary] = {}
        problems: dict[str, str | None] = {}
        for rel in sorted(regular):
            if rel.endswith(".safetensors"):
                tensors, problems[rel] = _read_header(root_fd, rel, on_disk[rel].st_size)
                for name, tensor in tensors.items():
                    role = name.rsplit(".", 1)[-1]
                    summary = roles.setdefault(role, RoleSummary(role))
                    summary.count += 1
                    summary.bytes += tensor.end - tensor.begin
                    info.n_tensors += 1
        info.roles = sorted(roles.values(), key=lambda r: -r.bytes)
        for entry in info.files:
            if problems.get(entry["path"]):
                entry["problem"] = problems[entry["path"]]
        if "config.json" in regular:
            _read_quantization(root_fd, info, roles)
    finally:
        os.close(root_fd)
    if manifest is not None:
        sizes_match = set(on_disk) == set(listed) and all(
            rel in regular and on_disk[rel].st_size == entry.size for rel, entry in listed.items()
        )
        info.manifest_status = "sizes match (run `squeeze verify` to check hashes)" if sizes_match else "MISMATCH"
    return info


def _kind(mode: int) -> str:
    """What a non-regular entry is, for the file list."""
    if stat.S_ISLNK(mode):
        return "symbolic link"
    if stat.S_ISDIR(mode):
        return f"directory nested more than {MAX_DEPTH} levels deep"
    return "not a regular file"


def _read_manifest_quietly(directory: Path, info: ArtifactInfo) -> Manifest | None:
    from squeeze.format.verify import read_manifest

    try:
        os.lstat(directory / MANIFEST_NAME)
    except OSError:
        return None
    try:
        manifest = read_manifest(directory)
    except FormatError as exc:
        info.manifest_status = f"malformed: {exc.message}"
        return None
    info.root_digest = manifest.root_digest
    info.provenance = manifest.provenance.to_dict()
    return manifest


def _read_header(root_fd: int, rel: str, size: int) -> tuple[dict[str, Any], str | None]:
    """(tensors of one shard's header, None), or ({}, why) when it cannot be read: inspect reports what it can."""
    try:
        fd = open_inside(root_fd, rel)
    except (OSError, FormatError):  # replaced by a link or a FIFO since the walk listed it
        return {}, "changed while being inspected; not read"
    with os.fdopen(fd, "rb") as handle:
        prefix = read_header_prefix(handle)
    try:
        return dict(parse_safetensors_header(prefix, size, rel).tensors), None
    except FormatError as exc:
        return {}, exc.message.removeprefix(f"{rel}: ")


def _read_quantization(root_fd: int, info: ArtifactInfo, roles: dict[str, RoleSummary]) -> None:
    try:
        config = strict_json_loads(read_inside(root_fd, "config.json", MAX_CONFIG_BYTES), "config.json")
    except FormatError:
        return
    if not isinstance(config, dict):
        return
    info.config = config
    quant = QuantizationConfig.from_model_config(config, strict=False)  # unverified: summarised, never refused
    if quant is None:
        return
    info.quantization = quant
    modules = quant.modules.values()
    if modules:
        info.quantized_modules = len(modules)
        counts = [m.experts for m in modules if m.is_experts]
        info.expert_parameters, info.experts = len(counts), sum(counts)
        for bits in sorted(m.bits for m in modules):
            if bits:
                info.widths[bits] = info.widths.get(bits, 0) + 1
        n_weights = sum(m.n_weights for m in modules)
        quant_bytes = sum(roles[r].bytes for r in stored_roles() if r in roles)  # every registered format's
        if n_weights:
            info.bits_per_weight = round(quant_bytes * 8 / n_weights, 4)
