"""Signing and signature checks on a big artifact: what ``squeeze sign`` and ``--public-key`` cost.

    .venv/bin/python scripts/bench/bench_sign.py --dir /root/scratch/bench-B [--size-mib 1024] [--repeats 3]
        [--out bench-out/sign.json]

Builds one artifact with a single ``--size-mib`` shard (random bytes) and a config, seals it, makes an EC P-256
key, and measures (warm page cache, median of ``--repeats``):

- seal (hash every file, write the manifest);
- ``sign_artifact`` (verify, then sign the verified digests: one pass over the bytes);
- ``verify_artifact`` without and with the signature check (``verify_with_signature``), and their ratio;
- the signature check alone (``check_signature`` on a finished report: no file is read);
- a verified load's hashing (``capture``: every byte read into private memory), without and with the check;
- for reference, model_signing's own ``sign key`` and ``verify key`` (in process; they hash every file again).

The cases run round robin (each repeat runs every case once), so a busy machine slows them alike.

Prints a table, writes JSON. The temp artifact is deleted afterwards (``--keep`` keeps it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_common import command_line, revision  # scripts/bench/ is on sys.path when a script runs

from squeeze.format import Provenance, seal_artifact, write_shards
from squeeze.format.manifest import SIGNATURE_NAME
from squeeze.format.signature import check_signature, sign_artifact, verify_with_signature
from squeeze.format.verify import verify_artifact


def build(root: Path, size_mib: int) -> Path:
    """An unsealed artifact directory: one shard of ``size_mib`` MiB of random bytes and a config."""
    directory = root / "artifact"
    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    per_tensor = 64 * 2**20
    tensors = {
        f"layer{i}.weight": torch.randint(0, 255, (per_tensor,), dtype=torch.uint8, generator=generator)
        for i in range(max(1, size_mib * 2**20 // per_tensor))
    }
    write_shards(directory, tensors, max_shard_bytes=2**40)  # one shard
    (directory / "config.json").write_text('{"model_type": "bench"}\n')
    return directory


def make_keys(root: Path) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    private, public = root / "key.pem", root / "pub.pem"
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return private, public


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench-out/sign.json")
    parser.add_argument("--dir", default=None, help="where to build the artifact (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the built artifact")
    parser.add_argument("--no-reference", action="store_true", help="skip model_signing's own sign / verify")
    args = parser.parse_args()
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="squeeze-bench-sign-", dir=args.dir))
    try:
        directory = build(root, args.size_mib)
        private, public = make_keys(root)
        size = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
        results: dict[str, float] = {}
        results["seal"] = timed(lambda: seal_artifact(directory, Provenance(source_model="bench")))
        sign_artifact(directory, private)  # warm-up: imports (model_signing), page cache

        def verify_plain(capture: bool = False) -> None:
            report = verify_artifact(directory, capture=(lambda _p: True) if capture else None)
            if not report.ok:
                raise SystemExit(f"verify failed on a fresh artifact: {report.first_error()}")

        def verify_signed() -> None:
            if not verify_with_signature(directory, public).ok:
                raise SystemExit("the signature did not check out on a fresh artifact")

        def load_hashing_signed() -> None:  # what api.load(..., public_key=...) does before building anything
            report = verify_artifact(directory, capture=lambda _p: True)
            check_signature(report, public)

        finished = verify_artifact(directory)
        cases: dict[str, Callable[[], object]] = {
            "sign (verify + sign)": lambda: sign_artifact(directory, private),
            "verify without signature": verify_plain,
            "verify with signature": verify_signed,
            "signature check alone (on a report)": lambda: check_signature(finished, public),
            "load hashing (capture), no signature": lambda: verify_plain(capture=True),
            "load hashing (capture) + signature check": load_hashing_signed,
        }
        if not args.no_reference:
            from model_signing import signing, verifying

            reference_sig = root / "reference.sig"  # outside the artifact: the artifact's own model.sig stays
            cases["model_signing sign key (reference)"] = lambda: (
                signing.Config().use_elliptic_key_signer(private_key=private).sign(directory, reference_sig)
            )
            cases["model_signing verify key (reference)"] = lambda: (
                verifying.Config()
                .use_elliptic_key_verifier(public_key=public)
                .verify(directory, directory / SIGNATURE_NAME)
            )
        for fn in cases.values():
            fn()  # warm-up
        runs: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.repeats):  # round robin: a busy neighbour slows every case alike, not one of them
            for name, fn in cases.items():
                runs[name].append(timed(fn))
        results.update({name: statistics.median(times) for name, times in runs.items()})
        ratios = {
            "verify with / without signature": results["verify with signature"] / results["verify without signature"],
            "load hashing with / without signature": results["load hashing (capture) + signature check"]
            / results["load hashing (capture), no signature"],
            "sign / verify without signature": results["sign (verify + sign)"] / results["verify without signature"],
        }
        print(revision())
        print(command_line())
        print(
            f"artifact of {size / 2**30:.3f} GiB (one shard + config), {os.cpu_count()} CPUs, "
            f"median of {args.repeats} warm round-robin runs (seal: once)"
        )
        print(f"{'':44s} {'seconds':>8s} {'MB/s':>8s}")
        for name, seconds in results.items():
            print(f"{name:44s} {seconds:8.3f} {size / seconds / 1e6:8.0f}")
        for name, value in ratios.items():
            print(f"{name:44s} {value:8.3f}")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps(
                {
                    "revision": revision(),
                    "command": command_line(),
                    "bytes": size,
                    "cpus": os.cpu_count(),
                    "repeats": args.repeats,
                    "seconds": results,
                    "runs": runs,
                    "ratios": ratios,
                },
                indent=2,
            )
            + "\n"
        )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
