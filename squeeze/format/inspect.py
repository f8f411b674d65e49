"""What an artifact holds: files, tensors grouped by role, quantization summary, manifest status.

Reads only the manifest, config.json and the safetensors headers (a few KB), never tensor data, so it is
instant on any model size. Full hashing is ``verify``'s job.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from squeeze.errors import FormatError
from squeeze.format.manifest import MANIFEST_NAME, Manifest, strict_json_loads
from squeeze.format.paths import _OPEN_DIR, open_inside, walk_artifact
from squeeze.format.safetensors_header import MAX_HEADER_BYTES, parse_safetensors_header

#: Tensor-name suffixes that make up a quantized weight (see docs/format.md).
QUANTIZED_ROLES = (
    "weight_packed", "weight_lut", "weight_lut_scale", "weight_lut_zero", "weight_scales", "weight_zeros",
    "weight_sparse_rowptr", "weight_sparse_cols", "weight_sparse_vals",
)


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
    quantization: dict[str, Any] | None = None
    bits_per_weight: float | None = None
    quantized_modules: int = 0
    manifest_status: str = "absent"
    root_digest: str | None = None
    provenance: dict[str, Any] | None = None
    #: KV-cache bytes per token over all layers {"fp16", "int8", "int4"} (filled in by squeeze.api.inspect).
    kv_bytes_per_token: dict[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        quant = dict(self.quantization or {})
        quant.pop("modules", None)  # per-module detail is long; the summary says how many
        return {
            "directory": self.directory,
            "files": self.files,
            "tensors": self.n_tensors,
            "roles": [{"role": r.role, "count": r.count, "bytes": r.bytes} for r in self.roles],
            "quantization": quant or None,
            "quantized_modules": self.quantized_modules,
            "bits_per_weight": self.bits_per_weight,
            "manifest": {"status": self.manifest_status, "root_digest": self.root_digest},
            "provenance": self.provenance,
            "kv_bytes_per_token": self.kv_bytes_per_token,
        }


def inspect_artifact(path: str | os.PathLike[str]) -> ArtifactInfo:
    """Summarise the artifact at ``path`` (directory or manifest). Raises FormatError if it is not one."""
    directory = Path(path)
    if directory.name == MANIFEST_NAME:
        directory = directory.parent
    if not directory.is_dir():
        raise FormatError(f"{directory} is not a directory", hint="pass an artifact directory")
    info = ArtifactInfo(directory=str(directory))
    manifest = _read_manifest_quietly(directory, info)
    listed = manifest.entry_map() if manifest else {}
    root_fd = os.open(directory, _OPEN_DIR)
    try:
        on_disk = {rel: st for rel, st in walk_artifact(directory) if rel != MANIFEST_NAME}
        for rel in sorted(set(on_disk) | set(listed)):
            size = on_disk[rel].st_size if rel in on_disk else None
            info.files.append({"path": rel, "size": size, "listed": rel in listed})
        roles: dict[str, RoleSummary] = {}
        for rel in sorted(on_disk):
            if rel.endswith(".safetensors"):
                for name, tensor in _read_header(root_fd, rel, on_disk[rel].st_size).items():
                    role = name.rsplit(".", 1)[-1]
                    summary = roles.setdefault(role, RoleSummary(role))
                    summary.count += 1
                    summary.bytes += tensor.end - tensor.begin
                    info.n_tensors += 1
        info.roles = sorted(roles.values(), key=lambda r: -r.bytes)
        if "config.json" in on_disk:
            _read_quantization(root_fd, info, roles)
    finally:
        os.close(root_fd)
    if manifest is not None:
        sizes_match = all(
            rel in on_disk and on_disk[rel].st_size == entry.size for rel, entry in listed.items()
        ) and set(on_disk) == set(listed)
        info.manifest_status = "sizes match (run `squeeze verify` to check hashes)" if sizes_match else "MISMATCH"
    return info


def _read_manifest_quietly(directory: Path, info: ArtifactInfo) -> Manifest | None:
    from squeeze.format.verify import read_manifest

    if not (directory / MANIFEST_NAME).exists():
        return None
    try:
        manifest = read_manifest(directory)
    except FormatError as exc:
        info.manifest_status = f"malformed: {exc.message}"
        return None
    info.root_digest = manifest.root_digest
    info.provenance = manifest.provenance.to_dict()
    return manifest


def _read_header(root_fd: int, rel: str, size: int) -> dict[str, Any]:
    fd = open_inside(root_fd, rel)
    with os.fdopen(fd, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) == 8:
            length = int.from_bytes(prefix, "little")
            prefix += handle.read(min(length, MAX_HEADER_BYTES))
    return parse_safetensors_header_lenient(prefix, size, rel)


def parse_safetensors_header_lenient(prefix: bytes, size: int, rel: str) -> dict[str, Any]:
    """Header tensors of ``rel``; inspect reports what it can, so a bad header reads as no tensors."""
    try:
        return dict(parse_safetensors_header(prefix, size, rel).tensors)
    except FormatError:
        return {}


def _read_quantization(root_fd: int, info: ArtifactInfo, roles: dict[str, RoleSummary]) -> None:
    fd = open_inside(root_fd, "config.json")
    with os.fdopen(fd, "rb") as handle:
        try:
            config = strict_json_loads(handle.read(), "config.json")
        except FormatError:
            return
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(quant, dict):
        return
    info.quantization = quant
    modules = quant.get("modules")
    if isinstance(modules, dict) and modules:
        info.quantized_modules = len(modules)
        n_weights = sum(int(m.get("in_features", 0)) * int(m.get("out_features", 0)) for m in modules.values())
        quant_bytes = sum(roles[r].bytes for r in QUANTIZED_ROLES if r in roles)
        if n_weights:
            info.bits_per_weight = round(quant_bytes * 8 / n_weights, 4)


