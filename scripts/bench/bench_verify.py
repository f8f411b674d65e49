"""Verify and verified-load hashing of one big shard: manifest v2 (chunk digests, hashed on every core) vs v1
(one thread per file), warm and cold, against the page-cache read floor.

    .venv/bin/python scripts/bench/bench_verify.py --dir /root/scratch/bench-A [--size-mib 1024] [--repeats 3]
        [--out bench-out/verify.json] [--workers 2,4,8] [--sha256sum]

Builds one artifact with a single ``--size-mib`` shard (random bytes) sealed as version 2 (64 MiB chunks),
and a version-1 twin (the same shard hard-linked, a version-1 manifest over the same entries), so both
read the same page-cache pages. Measures, median of ``--repeats``:

- read floor: every byte of the shard read once from a warm page cache (8 MiB reads into one buffer);
- SHA-256 floor: hashlib over the shard on one thread (what v1 verification costs at best);
- ``verify_artifact`` (v1 / v2, and v2 with each ``--workers``), and with ``capture`` (what a verified load
  does: every byte read into one private buffer and hashed from there);
- cold: the same after evicting the shard from the page cache: ``echo 1 > /proc/sys/vm/drop_caches`` when
  this process may write it, else ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the shard (the JSON says which).

Prints a table and the ratios, writes JSON. The temp artifact is deleted afterwards (``--keep`` keeps it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from squeeze.format import Provenance, seal_artifact, write_shards
from squeeze.format.manifest import FileEntry, root_digest, write_manifest
from squeeze.format.verify import read_manifest, verify_artifact

READ_BYTES = 8 * 2**20


def build(root: Path, size_mib: int) -> tuple[Path, Path, Path]:
    """(v2 artifact, v1 artifact, the shard's path): one shard of ``size_mib`` MiB of random bytes."""
    v2, v1 = root / "v2", root / "v1"
    v2.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    per_tensor = 64 * 2**20
    count = max(1, size_mib * 2**20 // per_tensor)
    # the last tensor 4 KiB short, so the header fits and the shard is at most size_mib MiB (whole chunks)
    tensors = {
        f"layer{i}.weight": torch.randint(
            0, 255, (per_tensor - 4096 * (i == count - 1),), dtype=torch.uint8, generator=generator
        )
        for i in range(count)
    }
    write_shards(v2, tensors, max_shard_bytes=2**40)  # one shard
    del tensors
    (v2 / "config.json").write_text('{"model_type": "bench"}\n')
    manifest = seal_artifact(v2, Provenance(source_model="bench"))
    v1.mkdir()
    for entry in manifest.files:
        os.link(v2 / entry.path, v1 / entry.path)
    entries = tuple(FileEntry(e.path, e.size, e.sha256) for e in manifest.files)
    old = replace(manifest, files=entries, format_version=1, chunk_bytes=None, root_digest=root_digest(entries))
    write_manifest(v1, old)
    shard = max((v2 / e.path for e in manifest.files), key=lambda p: p.stat().st_size)
    return v2, v1, shard


def read_floor(path: Path) -> None:
    buffer = bytearray(READ_BYTES)
    with open(path, "rb", buffering=0) as handle:
        while handle.readinto(buffer):
            pass


def sha256_floor(path: Path) -> None:
    digest = hashlib.sha256()
    buffer = bytearray(READ_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            digest.update(view[:count])


def can_drop_caches() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("1\n")
        return True
    except OSError:
        return False


def evict(path: Path, method: str) -> None:
    """Drop ``path``'s pages from the page cache (and, with drop_caches, every clean page)."""
    os.sync()
    if method == "drop_caches":
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("1\n")
    else:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn: Callable[[], object], before: Callable[[], None] | None = None) -> float:
    if before is not None:
        before()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def checked_verify(directory: Path, workers: int | None = None, capture: bool = False) -> Callable[[], None]:
    def run() -> None:
        report = verify_artifact(directory, workers=workers, capture=(lambda _p: True) if capture else None)
        if not report.ok:
            raise SystemExit(f"verify failed on a fresh artifact: {report.first_error()}")
        del report  # the captured buffer is freed before the next run

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cold-repeats", type=int, default=3)
    parser.add_argument("--workers", default="2,4,8", help="extra worker counts to time v2 verify with")
    parser.add_argument("--sha256sum", action="store_true", help="also time coreutils sha256sum on the shard")
    parser.add_argument("--out", default="bench-out/verify.json")
    parser.add_argument("--dir", default=None, help="where to build the artifact (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the built artifact")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="squeeze-bench-verify-", dir=args.dir))
    try:
        v2, v1, shard = build(root, args.size_mib)
        size = shard.stat().st_size
        total = sum(e.size for e in read_manifest(v2).files)
        chunks = len(next(e for e in read_manifest(v2).files if e.path == shard.name).chunks)
        method = "drop_caches" if can_drop_caches() else "posix_fadvise(DONTNEED)"
        warm: dict[str, Callable[[], object]] = {
            "page-cache read of the shard (floor)": lambda: read_floor(shard),
            "SHA-256 of the shard, one thread": lambda: sha256_floor(shard),
            "verify v1 (one thread per file)": checked_verify(v1),
            "verify v2 (chunks, default workers)": checked_verify(v2),
            "verified-load hashing v1 (capture)": checked_verify(v1, capture=True),
            "verified-load hashing v2 (capture)": checked_verify(v2, capture=True),
        }
        for n in (int(w) for w in args.workers.split(",") if w):
            warm[f"verify v2, {n} workers"] = checked_verify(v2, workers=n)
        if args.sha256sum:
            warm["sha256sum (coreutils)"] = lambda: subprocess.run(
                ["sha256sum", str(shard)], check=True, stdout=subprocess.DEVNULL
            )
        cold: dict[str, Callable[[], object]] = {
            "cold read of the shard": lambda: read_floor(shard),
            "cold verify v1": checked_verify(v1),
            "cold verify v2": checked_verify(v2),
            "cold verified-load hashing v1 (capture)": checked_verify(v1, capture=True),
            "cold verified-load hashing v2 (capture)": checked_verify(v2, capture=True),
        }
        cold_names = list(cold)
        load_before = os.getloadavg()
        for fn in warm.values():
            fn()  # warm-up: page cache, imports, allocator
        # round robin, so a change in the machine's load (it is shared) hits every row alike
        times: dict[str, list[float]] = {name: [] for name in [*warm, *cold_names]}
        for _ in range(args.repeats):
            for name, fn in warm.items():
                times[name].append(timed(fn))
        for _ in range(args.cold_repeats):
            for name, fn in cold.items():
                times[name].append(timed(fn, before=lambda: evict(shard, method)))
        results = {name: statistics.median(values) for name, values in times.items()}
        best = {name: min(values) for name, values in times.items()}  # the least disturbed run of each
        load = (load_before[0], os.getloadavg()[0])
        floor = results["page-cache read of the shard (floor)"]
        print(
            f"one shard of {size / 2**30:.3f} GiB ({chunks} chunks of 64 MiB; artifact {total} bytes), "
            f"{os.cpu_count()} CPUs (1-min load {load[0]:.1f} before, {load[1]:.1f} after), "
            f"median of {args.repeats} warm / {args.cold_repeats} cold ({method}), rows interleaved"
        )
        print(f"{'':46s} {'median s':>8s} {'MB/s':>8s} {'x read floor':>13s} {'best s':>8s}")
        rows = []
        for name, seconds in results.items():
            speed, ratio = size / seconds / 1e6, seconds / floor
            rows.append(
                {"what": name, "seconds": seconds, "best_seconds": best[name], "mb_per_s": speed, "x_floor": ratio}
            )
            print(f"{name:46s} {seconds:8.3f} {speed:8.0f} {ratio:13.1f} {best[name]:8.3f}")
        ratios = {
            "verify v1 / v2 (speed-up)": results["verify v1 (one thread per file)"]
            / results["verify v2 (chunks, default workers)"],
            "capture v1 / v2 (speed-up)": results["verified-load hashing v1 (capture)"]
            / results["verified-load hashing v2 (capture)"],
            "cold verify v1 / v2 (speed-up)": results["cold verify v1"] / results["cold verify v2"],
            "cold capture v1 / v2 (speed-up)": results["cold verified-load hashing v1 (capture)"]
            / results["cold verified-load hashing v2 (capture)"],
            "cold capture v2 / warm read floor": results["cold verified-load hashing v2 (capture)"] / floor,
            "cold capture v2 / cold read": results["cold verified-load hashing v2 (capture)"]
            / results["cold read of the shard"],
        }
        best_ratios = {
            "best verify v1 / v2 (speed-up)": best["verify v1 (one thread per file)"]
            / best["verify v2 (chunks, default workers)"],
            "best capture v1 / v2 (speed-up)": best["verified-load hashing v1 (capture)"]
            / best["verified-load hashing v2 (capture)"],
        }
        ratios.update(best_ratios)
        for name, value in ratios.items():
            print(f"{name:46s} {value:8.2f}")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps(
                {
                    "shard_bytes": size,
                    "chunks": chunks,
                    "cpus": os.cpu_count(),
                    "cold_method": method,
                    "load_average_before_after": load,
                    "results": rows,
                    "ratios": ratios,
                },
                indent=2,
            )
        )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
