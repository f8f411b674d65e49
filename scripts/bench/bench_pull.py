"""squeeze pull of a ~1 GiB artifact from a local HTTP server, against the fastest single-stream download.

    .venv/bin/python scripts/bench/bench_pull.py [--shards-mib 768,256] [--repeats 3] [--dir /root/scratch/bench-C]

Builds an artifact of two safetensors shards of random bytes (sealed: manifest version 2, 64 MiB chunks)
and a version-1 copy of its manifest (no chunks: one hashed stream per file), serves it from a separate
server process (tests/distribution/pull_server.py, socket.sendfile from the page cache), then times, best of
``--repeats`` each:

(a) the baseline: one connection, the files one after the other, a plain readinto loop, no hashing, into
    /dev/null, and the same into files on disk (written, not fsynced);
(b) ``squeeze pull`` with its default workers (v2: parallel chunk ranges verified as they stream; v1: one
    hashed stream per file), into a fresh output each time: hashing, staging, fsync and the final rename
    included;

and, for the reading of (b)/(a), the machine's floors: ``squeeze verify`` of the served files (hashing every
byte on every core, from the page cache) and a durable write of as many bytes (write + fdatasync).

Prints the ratios (b)/(a) and the core count; writes JSON; deletes everything it built.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

import torch
from bench_common import command_line, revision  # scripts/bench/ is on sys.path when a script runs
from safetensors.torch import save_file

from squeeze.distribution.pull import pull_artifact
from squeeze.format.manifest import FileEntry, root_digest, write_manifest
from squeeze.format.verify import seal_artifact, verify_artifact

ROOT = Path(__file__).resolve().parents[2]
BUFFER = 1 << 20
SERVER = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from pull_server import ArtifactServer
server = ArtifactServer(Path(sys.argv[2]), timeout=60.0)
server.faults.link_bytes_per_s = float(sys.argv[3])
print(server.url, flush=True)
sys.stdin.read()  # until the benchmark closes our stdin
server.close()
"""


def build(root: Path, shards_mib: list[int]) -> tuple[Path, Path]:
    """(v2 artifact, v1 artifact) under ``root``: the same files, hard-linked, two manifests."""
    v2, v1 = root / "v2", root / "v1"
    v2.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    for index, mib in enumerate(shards_mib):
        data = torch.randint(0, 256, (mib * 2**20 - 4096,), dtype=torch.uint8, generator=generator)
        save_file({f"shard{index}.weight": data}, v2 / f"model-{index + 1:05d}-of-{len(shards_mib):05d}.safetensors")
        del data
    (v2 / "config.json").write_text('{"model_type": "bench"}\n')
    manifest = seal_artifact(v2)
    v1.mkdir()
    for entry in manifest.files:
        os.link(v2 / entry.path, v1 / entry.path)
    entries = tuple(FileEntry(e.path, e.size, e.sha256) for e in manifest.files)
    write_manifest(
        v1, replace(manifest, files=entries, format_version=1, chunk_bytes=None, root_digest=root_digest(entries))
    )
    return v2, v1


def single_stream(base_url: str, names: list[str], sink: Path | None) -> int:
    """Download ``names`` one after the other over one kept-alive connection; no hashing. Returns bytes."""
    parts = urlsplit(base_url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    buffer = bytearray(BUFFER)
    total = 0
    try:
        for name in names:
            connection.request("GET", parts.path + name)
            response = connection.getresponse()
            if response.status != 200:
                raise SystemExit(f"baseline GET {name}: HTTP {response.status}")
            out = os.open(sink / name if sink else os.devnull, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                while count := response.readinto(buffer):
                    if sink is not None:
                        os.write(out, memoryview(buffer)[:count])
                    total += count
            finally:
                os.close(out)
    finally:
        connection.close()
    return total


def durable_write(path: Path, size: int) -> None:
    """Write ``size`` bytes to ``path`` in 1 MiB buffers and fdatasync it."""
    buffer = os.urandom(BUFFER)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(size // BUFFER):
            os.write(fd, buffer)
        os.fdatasync(fd)
    finally:
        os.close(fd)


def best(repeats: int, run, before=None) -> float:  # noqa: ANN001 - two small callables
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards-mib", default="768,256")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/root/scratch/bench-C")
    parser.add_argument("--workers", default="", help="extra worker counts to time the v2 pull with, e.g. 2,4")
    parser.add_argument(
        "--link-mbps",
        type=float,
        default=0.0,
        help="emulate one shared link of this many MB/s (0: loopback, as fast as it goes)",
    )
    parser.add_argument("--out", default="bench-out/pull.json")
    args = parser.parse_args()
    root = Path(args.dir)
    if root.exists():
        raise SystemExit(f"{root} exists; pass another --dir (it is deleted afterwards)")
    shards = [int(x) for x in args.shards_mib.split(",")]
    print(f"# {revision()}\n# {command_line()}\n# cores: {os.cpu_count()}")
    server = None
    try:
        v2, v1 = build(root / "served", shards)
        names = sorted(p.name for p in v2.iterdir() if p.name != "squeeze.manifest.json")
        size = sum((v2 / n).stat().st_size for n in names)
        server = subprocess.Popen(
            [
                sys.executable,
                "-c",
                SERVER,
                str(ROOT / "tests" / "distribution"),
                str(root / "served"),
                str(args.link_mbps * 1e6),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout is not None
        base = server.stdout.readline().strip()
        sink = root / "sink"
        sink.mkdir()
        os.sync()
        single_stream(base + "v2/", names, None)  # warm-up: the served files are in the page cache
        results: dict[str, float] = {}
        results["download_devnull_s"] = best(args.repeats, lambda: single_stream(base + "v2/", names, None))
        results["download_disk_s"] = best(
            args.repeats, lambda: single_stream(base + "v2/", names, sink), lambda: os.sync()
        )
        shutil.rmtree(sink)
        # the machine's own floors for a verified, durable pull: hashing every byte (squeeze verify: the served
        # files from the page cache, chunks on every core) and writing them to disk durably (fdatasync)
        results["floor_verify_s"] = best(args.repeats, lambda: verify_artifact(v2))
        results["floor_durable_write_s"] = best(args.repeats, lambda: durable_write(root / "write-test", size), os.sync)
        (root / "write-test").unlink()
        out = root / "pulled"

        def clean() -> None:
            shutil.rmtree(out, ignore_errors=True)
            os.sync()  # no writeback left over from the previous run competes with the next

        def pull(kind: str, workers: int | None = None):  # noqa: ANN202
            def run() -> None:
                result = pull_artifact(base + kind + "/", out, workers=workers)
                if result.bytes_downloaded != size:
                    raise SystemExit(f"pull moved {result.bytes_downloaded} bytes, expected the whole artifact")

            return run

        results["pull_v2_s"] = best(args.repeats, pull("v2"), clean)
        if not verify_artifact(out).ok:
            raise SystemExit("the pulled artifact does not verify")
        results["pull_v1_s"] = best(args.repeats, pull("v1"), clean)
        for workers in [int(w) for w in args.workers.split(",") if w]:
            results[f"pull_v2_workers{workers}_s"] = best(args.repeats, pull("v2", workers), clean)
        clean()
        fastest = min(results["download_devnull_s"], results["download_disk_s"])
        report = {
            "bytes": size,
            "shards_mib": shards,
            "cores": os.cpu_count(),
            "link_mbps": args.link_mbps or None,
            "repeats": args.repeats,
            **{k: round(v, 3) for k, v in results.items()},
            "ratio_v2_vs_fastest_download": round(results["pull_v2_s"] / fastest, 3),
            "ratio_v1_vs_fastest_download": round(results["pull_v1_s"] / fastest, 3),
            "ratio_v2_vs_download_to_disk": round(results["pull_v2_s"] / results["download_disk_s"], 3),
        }
        print(f"{'what':<44}{'seconds':>9}{'GB/s':>8}")
        for key, value in results.items():
            print(f"{key:<44}{value:>9.3f}{size / value / 1e9:>8.2f}")
        for key in ("ratio_v2_vs_fastest_download", "ratio_v1_vs_fastest_download", "ratio_v2_vs_download_to_disk"):
            print(f"{key:<44}{report[key]:>9.3f}")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    finally:
        if server is not None:
            assert server.stdin is not None
            server.stdin.close()
            server.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
