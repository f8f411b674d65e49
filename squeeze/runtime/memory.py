"""Will an artifact fit in memory? Estimated from its manifest, config.json and shard headers before any
weight is read.

Loading reads every file of the artifact into private memory (the loader hashes exactly the bytes it
builds tensors from, and the unquantized tensors are views of them), so the load holds the artifact's
bytes. What the quantized linears add depends on their path (``SqueezeLinear.weight_path``):

* default: the weights stay compressed. The native CPU kernels run on the packed codes in place and add
  only their prepared form: at most 20 bytes per sparse entry and 20 per row of a 3/4-bit weight (the LUTs
  are read in place). A weight no kernel covers (a format without one, or no C++ compiler on this machine)
  falls back to a dense cache of it.
* ``dense_cache=True`` (``--dense``): every quantized linear is dequantized once, on first use, to a
  (out_features, in_features) weight in the model's float dtype, and kept.
* ``low_memory=True`` (``--low-memory``): weights no kernel covers are dequantized one (chunk_rows,
  in_features) slice at a time instead of cached.

Quantized expert parameters of MoE layers (squeeze.runtime.experts) stay compressed on every path: the
native kernels run routed experts on their packed codes, and other paths dequantize one routed expert's
gate/up and down matrices at a time, so they add at most the largest expert's two matrices (float32)
whatever the flags, plus the native kernels' prepared form of their sparse entries (as a linear's).

Add a fixed allowance for what the imports, tokenizer and a short generation allocate.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from squeeze.errors import ResourceError, SqueezeError
from squeeze.format.dtypes import float_itemsize
from squeeze.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, parse_manifest
from squeeze.format.paths import (
    MAX_CONFIG_BYTES,
    open_inside,
    open_root,
    read_inside,
    resolve_root,
    short_path,
    walk_artifact,
)
from squeeze.format.quant_config import QuantizationConfig
from squeeze.format.safetensors_header import TensorInfo, parse_safetensors_header, read_header_prefix
from squeeze.format.strict_json import strict_json_loads
from squeeze.limits import is_weight_bits
from squeeze.quant.schemes import formats_of
from squeeze.system import available_memory_bytes, process_memory_limit

#: transformers' modules, the tokenizer, activations and KV cache of a short generation: the peak RSS of
#: `squeeze.generate` on SmolLM2-135M (32 new tokens) exceeds the artifact + dense cache by 355-384 MB over
#: what the process held after `import squeeze`; rounded up.
OVERHEAD_BYTES = 512 * 2**20
#: Bytes the native kernels' prepared form holds per sparse entry, at most: permuted column (int32), residual
#: and exact value (float32; no copy when the artifact's values are float32) (cpu_lut.prepare_cpu), plus the
#: int8 form's column (int32) and residual (float32) (cpu_w8.prepare_w8).
SPARSE_ENTRY_BYTES = 20
#: Bytes the int8 (W4A8) form holds per weight row of a 3- or 4-bit LUT weight: 16 int8 levels, a float32 scale.
W8_ROW_BYTES = 20
W8_BITS = (3, 4)
_SPARSE_COLS = ".weight_sparse_cols"


@dataclass(frozen=True)
class LoadEstimate:
    """Bytes a load will hold, by part (module docstring); :meth:`total` adds those of one weights path."""

    artifact_bytes: int
    #: every quantized linear dequantized (``dense_cache=True``)
    dense_cache_bytes: int
    #: the largest row slice of a weight no kernel covers (``low_memory=True``; 0 when the kernels cover all)
    low_memory_bytes: int
    #: the native kernels' prepared form of the weights they cover (their sparse entries)
    prepared_bytes: int = 0
    #: dense caches of the weights no kernel covers (the default path's fallback)
    fallback_bytes: int = 0
    overhead_bytes: int = OVERHEAD_BYTES
    #: float32 copies of the unquantized tensors stored in bfloat16 / float16 (the loader upcasts them; the
    #: stored bytes stay held with the shard the quantized tensors are views of)
    upcast_bytes: int = 0
    #: the dequantized matrices of one routed expert in flight (twice the largest expert matrix, float32)
    experts_bytes: int = 0

    def working_bytes(self, *, dense_cache: bool = False, low_memory: bool = False) -> int:
        """What the quantized linears and experts add to the artifact's bytes on the path the flags choose."""
        if dense_cache:
            return self.dense_cache_bytes + self.experts_bytes
        return self.prepared_bytes + (self.low_memory_bytes if low_memory else self.fallback_bytes) + self.experts_bytes

    def total(self, *, dense_cache: bool = False, low_memory: bool = False) -> int:
        """Bytes the whole load holds on that path: artifact + working bytes + the fixed overhead."""
        working = self.working_bytes(dense_cache=dense_cache, low_memory=low_memory)
        return self.artifact_bytes + self.upcast_bytes + working + self.overhead_bytes


@dataclass(frozen=True)
class _Module:
    """One quantized linear as config.json describes it (dimensions 0 when absent or junk)."""

    name: str
    rows: int
    cols: int
    bits: int
    covered: bool  # the native kernels run its format
    experts: int = 0  # E for a 3-D expert parameter (rows = E * one expert's rows), 0 for a linear


def estimate_load(
    directory: str | os.PathLike[str], chunk_rows: int = 1024, *, native: bool = True
) -> LoadEstimate | None:
    """What loading ``directory`` will hold, from the manifest's sizes, config.json and the shards' headers;
    None if unreadable. ``native``: whether the native CPU kernels will run (False: every weight falls back).

    Nothing here is trusted: it only sizes the load. A missing or malformed manifest, config or header
    gives None (or no part for the quantized linears), and the loader's verification then reports the real
    problem. Every file is read through the hardened reader (no link followed, FIFOs refused without
    blocking, sizes capped before reading), so sizing a hostile artifact can neither hang nor read more than
    those caps.
    """
    try:
        root_fd = open_root(resolve_root(directory))
    except SqueezeError:
        return None
    try:
        regular = {rel: st.st_size for rel, st in walk_artifact(root_fd) if stat.S_ISREG(st.st_mode)}
        artifact = _listed_bytes(root_fd)
        if artifact is None:  # no usable manifest (an unverified load): the regular files on disk (lstat only)
            artifact = sum(regular.values())
        config = _read_config(root_fd)
        modules = _modules(config, native) if config is not None else []
        if sum(m.rows * m.cols for m in modules) > 8 * artifact:
            # every quantized weight stores at least one bit: such a config does not describe this artifact
            modules = []
        tensors = list(_shard_tensors(root_fd, regular))  # one pass over the shard headers serves both counts
        nnz = _sparse_entries(tensors) if any(m.covered for m in modules) else {}
        upcast = _upcast_bytes(tensors, {m.name for m in modules})
    except OSError:
        return None
    finally:
        os.close(root_fd)
    width = _float_width(config)
    experts = [m for m in modules if m.experts]
    linears = [m for m in modules if not m.experts]  # experts are never cached: no dense cache, no fallback
    covered = [m for m in modules if m.covered]  # the native kernels' prepared form: linears and experts
    fallback = [m for m in linears if not m.covered]
    return LoadEstimate(
        artifact_bytes=artifact,
        dense_cache_bytes=sum(m.rows * m.cols * width for m in linears),
        low_memory_bytes=max((min(m.rows, chunk_rows) * m.cols * width for m in fallback), default=0),
        prepared_bytes=sum(
            SPARSE_ENTRY_BYTES * nnz.get(m.name, 0) + (W8_ROW_BYTES * m.rows if m.bits in W8_BITS else 0)
            for m in covered
        ),
        fallback_bytes=sum(m.rows * m.cols * width for m in fallback),
        upcast_bytes=upcast,
        experts_bytes=2 * max((m.rows // m.experts * m.cols * 4 for m in experts), default=0),
    )


def _listed_bytes(root_fd: int) -> int | None:
    """Total size of the files the manifest lists, None when it is absent or malformed."""
    try:
        manifest = parse_manifest(read_inside(root_fd, MANIFEST_NAME, MAX_MANIFEST_BYTES))
    except SqueezeError:
        return None
    return manifest.total_size


def _read_config(root_fd: int) -> dict[str, Any] | None:
    try:
        config = strict_json_loads(read_inside(root_fd, "config.json", MAX_CONFIG_BYTES), "config.json")
    except SqueezeError:
        return None
    return config if isinstance(config, dict) else None


def _float_width(config: Mapping[str, Any] | None) -> int:
    """Bytes per element of the model's float dtype (what a dense cache is built in); 4 when unknown."""
    name = (config.get("dtype") or config.get("torch_dtype") or "float32") if config is not None else "float32"
    return float_itemsize(name, 4)


def _modules(config: Mapping[str, Any], native: bool) -> list[_Module]:
    """config.json's quantized linears; [] when its quantization_config is junk (read leniently: unverified)."""
    quant = QuantizationConfig.from_model_config(config, strict=False)
    if quant is None:
        return []
    modules = []
    for name, entry in quant.modules.items():
        kinds = formats_of(entry.method) if entry.method else ()
        covered = native and bool(kinds) and all(cls.kernel == "lut" for cls in kinds) and is_weight_bits(entry.bits)
        modules.append(
            _Module(
                name=str(name),
                rows=entry.out_features,
                cols=entry.in_features,
                bits=entry.bits if is_weight_bits(entry.bits) else 0,
                covered=covered,
                experts=entry.experts if entry.is_experts else 0,
            )
        )
    return modules


def _shard_tensors(root_fd: int, regular: Mapping[str, int]) -> Iterator[tuple[str, TensorInfo]]:
    """(name, header entry) of every tensor of the top-level shards. Only the headers are read (capped by
    read_header_prefix); a shard that cannot be read, or was replaced since the walk, yields nothing."""
    for rel in _shards(regular):
        try:
            fd = open_inside(root_fd, rel)
        except (OSError, SqueezeError):  # replaced by a link or a FIFO since the walk listed it
            continue
        with os.fdopen(fd, "rb") as handle:
            prefix = read_header_prefix(handle)
        try:
            tensors = parse_safetensors_header(prefix, regular[rel], rel).tensors
        except SqueezeError:
            continue
        yield from tensors.items()


def _sparse_entries(tensors: Iterable[tuple[str, TensorInfo]]) -> dict[str, int]:
    """Sparse entries per module: the lengths of its ``<module>.weight_sparse_cols``."""
    return {
        key.removesuffix(_SPARSE_COLS): info.shape[0]
        for key, info in tensors
        if key.endswith(_SPARSE_COLS) and len(info.shape) == 1
    }


def _upcast_bytes(tensors: Iterable[tuple[str, TensorInfo]], quantized: Iterable[str]) -> int:
    """Bytes of the float32 copies the loader makes of 16-bit tensors that belong to no quantized module."""
    modules = set(quantized)
    return sum(
        (info.end - info.begin) * 2
        for key, info in tensors
        if info.dtype in ("F16", "BF16") and key.rpartition(".")[0] not in modules
    )


def _shards(regular: Iterable[str]) -> list[str]:
    return sorted(rel for rel in regular if "/" not in rel and rel.endswith(".safetensors"))


def native_kernels_expected() -> bool:
    """Whether the native CPU kernels can be built here (a C++ compiler is found); checked without building."""
    from squeeze.runtime.kernels.cpu_build import find_compiler

    return find_compiler() is not None


def check_load_memory(
    directory: str | os.PathLike[str], *, dense_cache: bool, low_memory: bool = False
) -> LoadEstimate | None:
    """Raise ResourceError when the load will not fit in the available memory, or under this process's own limit
    (``ulimit -v``, its cgroup) when that is less (checked before reading).

    ``dense_cache`` / ``low_memory``: the weights' path, as in ``squeeze.load``. The hint names the cheaper
    path that would fit: without ``--dense`` (compressed weights), or with ``--low-memory``.
    """
    estimate = estimate_load(directory, native=native_kernels_expected())
    available, where = available_memory_bytes(), "available"
    limit = process_memory_limit()  # ulimit -v or a cgroup: allocations fail there, whatever the machine has
    if limit is not None and (available is None or limit.bytes < available):
        available, where = limit.bytes, f"of {limit.describe()}"
    if estimate is None or available is None:
        return estimate
    needed = estimate.total(dense_cache=dense_cache, low_memory=low_memory)
    if needed <= available:
        return estimate
    hint = _hint(estimate, available, dense_cache=dense_cache, low_memory=low_memory)
    if where != "available" and hint.startswith("free memory"):
        hint = "raise the limit (ulimit -v, or the container's memory) or use a machine with more memory"
    raise ResourceError(
        f"not enough memory to load {short_path(directory)}: needs about {_gb(needed)} "
        f"({_parts(estimate, dense_cache=dense_cache, low_memory=low_memory)}), {_gb(available)} {where}",
        hint=hint,
    )


def _parts(estimate: LoadEstimate, *, dense_cache: bool, low_memory: bool) -> str:
    """``artifact 1.20 GB + kernel sparse entries 0.02 GB + overhead 0.54 GB``: the parts that are not zero."""
    if dense_cache:
        parts = [("dense weight cache", estimate.dense_cache_bytes)]
    else:
        fallback = (
            ("row slice", estimate.low_memory_bytes) if low_memory else ("dense fallback", estimate.fallback_bytes)
        )
        parts = [("kernel sparse entries", estimate.prepared_bytes), fallback]
    parts.append(("routed experts in flight", estimate.experts_bytes))
    named = [
        ("artifact", estimate.artifact_bytes),
        ("float32 copies of 16-bit tensors", estimate.upcast_bytes),
        *parts,
        ("overhead", estimate.overhead_bytes),
    ]
    return " + ".join(f"{name} {_gb(n)}" for name, n in named if n or name in ("artifact", "overhead"))


def _hint(estimate: LoadEstimate, available: int, *, dense_cache: bool, low_memory: bool) -> str:
    compressed = estimate.total()
    low = estimate.total(low_memory=True)
    if dense_cache and compressed <= available:
        return (
            f"drop --dense (squeeze.load(..., dense_cache=False)): the weights then stay compressed, "
            f"about {_gb(compressed)}"
        )
    if not low_memory and low <= available:
        how = "drop --dense and use" if dense_cache else "use"
        return (
            f"{how} --low-memory (squeeze.load(..., low_memory=True)): it needs about {_gb(low)}, "
            "dequantizing the weights no native kernel covers in row slices (slower)"
        )
    return "free memory (close other programs) or use a machine with more memory"


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def check_kv_memory_available(kv_memory_bytes: int) -> None:
    """ResourceError when a KV pool of ``kv_memory_bytes`` alone is more than this process can allocate now: the
    least of the available memory, its address-space limit (``ulimit -v``) and its cgroup's limit (the pool is
    allocated at start, on the CPU: a pool that cannot fit failed there with "can't allocate memory")."""
    from squeeze.system import memory_headroom

    headroom = memory_headroom()
    if headroom is not None and kv_memory_bytes > headroom.bytes:
        raise ResourceError(
            f"--kv-memory {kv_memory_bytes / 2**30:,.2f} GiB is more than the {headroom.bytes / 2**30:,.2f} GiB of "
            f"{headroom.describe()} (and the model needs room too)",
            hint=_kv_memory_hint(headroom.source),
        )


def _kv_memory_hint(source: str) -> str:
    smaller = "pass a smaller --kv-memory, e.g. 1GiB (it must hold one full-context sequence)"
    if source == "RLIMIT_AS":
        return f"{smaller}, or raise the limit (ulimit -v unlimited)"
    if source == "cgroup":
        return f"{smaller}, or give the container more memory (its memory limit)"
    return smaller


def allocation_refused(exc: BaseException, kv_memory_bytes: int) -> ResourceError | None:
    """The ResourceError for a KV pool (or model) the system would not allocate, from torch's "can't allocate
    memory" RuntimeError or a MemoryError; None for any other error."""
    if not isinstance(exc, MemoryError) and "can't allocate memory" not in str(exc):
        return None
    return ResourceError(
        f"the system refused the memory for the KV pool and the model (--kv-memory {kv_memory_bytes / 2**30:,.2f} "
        "GiB): out of memory, or over a limit of this process (ulimit -v, a cgroup)",
        hint="pass a smaller --kv-memory, e.g. 1GiB, or raise the limit",
    )


__all__ = [
    "check_kv_memory_available",
    "allocation_refused",
    "LoadEstimate",
    "available_memory_bytes",
    "estimate_load",
    "check_load_memory",
    "native_kernels_expected",
    "OVERHEAD_BYTES",
    "SPARSE_ENTRY_BYTES",
]
