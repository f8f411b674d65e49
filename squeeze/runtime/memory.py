"""Will an artifact fit in memory? Estimated from its manifest and config.json before any weight is read.

Loading reads every file of the artifact into private memory (the loader hashes exactly the bytes it
builds tensors from, and the unquantized tensors are views of them), so the load holds the artifact's
bytes. With the dense cache (the default), every quantized linear is also dequantized once, on first use,
to a (out_features, in_features) weight in the model's float dtype, and kept. Add a fixed allowance for
what the imports, tokenizer and a short generation allocate. ``--low-memory`` drops the dense cache:
one (chunk_rows, in_features) slice at a time instead.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from squeeze.errors import ResourceError, SqueezeError
from squeeze.format.inspect import module_dim
from squeeze.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, parse_manifest, strict_json_loads
from squeeze.format.paths import MAX_CONFIG_BYTES, open_root, read_inside, resolve_root, short_path, walk_artifact
from squeeze.system import available_memory_bytes

#: transformers' modules, the tokenizer, activations and KV cache of a short generation: the peak RSS of
#: `squeeze.generate` on SmolLM2-135M (32 new tokens) exceeds the artifact + dense cache by 355-384 MB over
#: what the process held after `import squeeze`; rounded up.
OVERHEAD_BYTES = 512 * 2**20
_FLOAT_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class LoadEstimate:
    """Bytes a load will hold: the artifact's files, the dense fp cache (0 when low-memory), a fixed overhead."""

    artifact_bytes: int
    dense_cache_bytes: int
    low_memory_bytes: int  # the low-memory path's largest dequantized slice
    overhead_bytes: int = OVERHEAD_BYTES

    def total(self, *, dense_cache: bool) -> int:
        working = self.dense_cache_bytes if dense_cache else self.low_memory_bytes
        return self.artifact_bytes + working + self.overhead_bytes


def estimate_load(directory: str | os.PathLike[str], chunk_rows: int = 1024) -> LoadEstimate | None:
    """What loading ``directory`` will hold, from the manifest's sizes and config.json; None if unreadable.

    Nothing here is trusted: it only sizes the load. A missing or malformed manifest or config gives None
    (or no dense part), and the loader's verification then reports the real problem. Both files are read
    through the hardened reader (no link followed, FIFOs refused without blocking, size capped before
    reading), so sizing a hostile artifact can neither hang nor read more than those caps.
    """
    try:
        root_fd = open_root(resolve_root(directory))
    except SqueezeError:
        return None
    try:
        artifact = _listed_bytes(root_fd)
        if artifact is None:  # no usable manifest (an unverified load): the regular files on disk (lstat only)
            artifact = sum(st.st_size for _, st in walk_artifact(root_fd) if stat.S_ISREG(st.st_mode))
        dense, slice_ = _dense_cache_bytes(root_fd, artifact, chunk_rows)
    except OSError:
        return None
    finally:
        os.close(root_fd)
    return LoadEstimate(artifact_bytes=artifact, dense_cache_bytes=dense, low_memory_bytes=slice_)


def _listed_bytes(root_fd: int) -> int | None:
    """Total size of the files the manifest lists, None when it is absent or malformed."""
    try:
        manifest = parse_manifest(read_inside(root_fd, MANIFEST_NAME, MAX_MANIFEST_BYTES))
    except SqueezeError:
        return None
    return manifest.total_size


def _dense_cache_bytes(root_fd: int, artifact_bytes: int, chunk_rows: int) -> tuple[int, int]:
    """(dense cache bytes, largest low-memory slice bytes) from config.json's quantized modules; (0, 0) on junk.

    Every quantized weight stores at least one bit per weight, so a config claiming more than 8 weights
    per artifact byte does not describe this artifact: it sizes nothing (verification will say why).
    """
    try:
        config = strict_json_loads(read_inside(root_fd, "config.json", MAX_CONFIG_BYTES), "config.json")
        quant = config.get("quantization_config") or {}
        width = _FLOAT_BYTES.get(str(config.get("dtype") or config.get("torch_dtype") or "float32"), 4)
        shapes = [
            (module_dim(spec, "out_features"), module_dim(spec, "in_features"))
            for spec in (quant.get("modules") or {}).values()
        ]
    except (SqueezeError, TypeError, AttributeError):
        return 0, 0
    if sum(rows * cols for rows, cols in shapes) > 8 * artifact_bytes:
        return 0, 0
    dense = sum(rows * cols * width for rows, cols in shapes)
    slice_ = max((min(rows, chunk_rows) * cols * width for rows, cols in shapes), default=0)
    return dense, slice_


def check_load_memory(directory: str | os.PathLike[str], *, dense_cache: bool) -> LoadEstimate | None:
    """Raise ResourceError when the load will not fit in the available memory (checked before reading)."""
    estimate = estimate_load(directory)
    available = available_memory_bytes()
    if estimate is None or available is None:
        return estimate
    needed = estimate.total(dense_cache=dense_cache)
    if needed <= available:
        return estimate
    parts = f"artifact {_gb(estimate.artifact_bytes)}"
    if dense_cache:
        parts += f" + dense weight cache {_gb(estimate.dense_cache_bytes)}"
    parts += f" + overhead {_gb(estimate.overhead_bytes)}"
    low = estimate.total(dense_cache=False)
    if dense_cache and low <= available:
        hint = (
            f"use --low-memory (squeeze.load(..., dense_cache=False)): it needs about {_gb(low)}, "
            "dequantizing in row slices (slower)"
        )
    else:
        hint = "free memory (close other programs) or use a machine with more memory"
    raise ResourceError(
        f"not enough memory to load {short_path(directory)}: needs about {_gb(needed)} ({parts}), "
        f"{_gb(available)} available",
        hint=hint,
    )


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


__all__ = ["LoadEstimate", "available_memory_bytes", "estimate_load", "check_load_memory", "OVERHEAD_BYTES"]
