"""Will an artifact fit in memory? Estimated from its manifest and config.json before any weight is read.

Loading reads every file of the artifact into private memory (the loader hashes exactly the bytes it
builds tensors from, and the unquantized tensors are views of them), so the load holds the artifact's
bytes. With the dense cache (the default), every quantized linear is also dequantized once, on first use,
to a (out_features, in_features) weight in the model's float dtype, and kept. Add a fixed allowance for
what the imports, tokenizer and a short generation allocate. ``--low-memory`` drops the dense cache:
one (chunk_rows, in_features) slice at a time instead.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from squeeze.errors import ResourceError
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
    (or no dense part), and the loader's verification then reports the real problem.
    """
    directory = Path(directory)
    try:
        manifest = json.loads((directory / "squeeze.manifest.json").read_bytes())
        artifact = sum(int(entry["size"]) for entry in manifest["files"])
    except (OSError, ValueError, KeyError, TypeError):
        try:  # no usable manifest (an unverified load): the regular files on disk
            artifact = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file() and not p.is_symlink())
        except OSError:
            return None
    dense = slice_ = 0
    try:
        config = json.loads((directory / "config.json").read_bytes())
        quant = config.get("quantization_config") or {}
        width = _FLOAT_BYTES.get(str(config.get("dtype") or config.get("torch_dtype") or "float32"), 4)
        for spec in (quant.get("modules") or {}).values():
            rows, cols = int(spec.get("out_features", 0)), int(spec.get("in_features", 0))
            dense += rows * cols * width
            slice_ = max(slice_, min(rows, chunk_rows) * cols * width)
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    return LoadEstimate(artifact_bytes=artifact, dense_cache_bytes=dense, low_memory_bytes=slice_)


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
        hint = (f"use --low-memory (squeeze.load(..., dense_cache=False)): it needs about {_gb(low)}, "
                "dequantizing in row slices (slower)")
    else:
        hint = "free memory (close other programs) or use a machine with more memory"
    raise ResourceError(f"not enough memory to load {directory}: needs about {_gb(needed)} ({parts}), "
                        f"{_gb(available)} available", hint=hint)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


__all__ = ["LoadEstimate", "available_memory_bytes", "estimate_load", "check_load_memory", "OVERHEAD_BYTES"]
