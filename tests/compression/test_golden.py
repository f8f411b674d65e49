"""Golden bytes: the same inputs and seed give these exact shards (guards every refactor of compress).

The digests were recorded with squeeze at commit 32b3d12 (before the hardening and registry work) on this
machine kind: CPU, torch 2.13, one thread. A change that moves a single bit of a shard fails here; if it is
meant (a new format version), record the new digests in the same commit and say why.

The calibrated cases depend on the CPU too: the Fisher comes from a backward pass whose float32 GEMMs sum in an
order set by the CPU's vector width, and a last-bit change of a sensitivity can move a k-means centroid or an
outlier. This machine kind has come as an AMD EPYC (the first recording) and as an Intel Xeon with AVX-512 and
AMX (w3-s045 differed there, recorded at commit 063449f; the code had not changed), and as an AMD EPYC of
family 25 (Zen 3, AVX2 without AVX-512; w3-s045 differed again, recorded at commit 8e71be0's code, unchanged
since for compress): each case accepts the shards recorded on any of them. A CPU of another kind that fails
only here, with unchanged code, needs its digests added (the failure prints them), not a code change.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from squeeze import api

GOLDEN = {
    "rtn-w4-g32": {
        "model-00001-of-00001.safetensors": "c9d1ba3c8b7cdb01317e233eafc2d56b90c0c0b80befcec3cdf4c357f2371fa6",
        "model.safetensors.index.json": "3bdca79a2da2c56e5499cb16d4c95646ebf7e2e69651ba2876e0c845038b4351",
    },
    "w3-s045": {
        "model-00001-of-00001.safetensors": "771615d87f5bbd66fcbb24dbf5b1e1304a8443a72cae0cd4e6782b64d4ab50f2",
        "model.safetensors.index.json": "a5054579a0bee6a464df07228f535b5a636b96274b0d951015a148762323a2bf",
    },
    "w4-lut8": {
        "model-00001-of-00001.safetensors": "a25891c3c522714a78d0a84aeb9055ce2348601a0c304f459fae1d75c8b0c97b",
        "model.safetensors.index.json": "0b75899fbf7beea54cef9fa85042fae1898d35b6eb3730c77d6f6b2a52216062",
    },
}

#: The same cases recorded on the other CPUs this machine kind has come as, where they differ.
GOLDEN_OTHER_CPUS = {
    "w3-s045": [
        {  # Intel Xeon, AVX-512 and AMX
            "model-00001-of-00001.safetensors": "d5a4f49b34d4481f831257e144e6d7b55f488efa6e6215eedf9c190254b9e3dc",
            "model.safetensors.index.json": "a5054579a0bee6a464df07228f535b5a636b96274b0d951015a148762323a2bf",
        },
        {  # AMD EPYC family 25 (Zen 3), AVX2
            "model-00001-of-00001.safetensors": "4113514dd42f4ac4cc13b17320cfa0bf4c613b24e3b8575f2cb61f209d708f4b",
            "model.safetensors.index.json": "a5054579a0bee6a464df07228f535b5a636b96274b0d951015a148762323a2bf",
        },
    ],
}

CASES = {
    "w3-s045": {"recipe": "w3-s045", "with_calibration": True},
    "w4-lut8": {"recipe": "w4-lut8", "with_calibration": True},
    "rtn-w4-g32": {"recipe": "rtn-w4", "overrides": {"weights.group_size": 32}},
}


@pytest.mark.skipif(
    not torch.__version__.startswith("2.13"),
    reason="golden digests were recorded with torch 2.13 on CPU; other versions may round k-means differently",
)
@pytest.mark.parametrize("case", sorted(CASES))
def test_shards_are_bit_identical_to_the_recorded_ones(
    case, tmp_path: Path, stories_dir: Path, tinystories_file: Path
) -> None:
    spec = CASES[case]
    out = tmp_path / case
    api.compress(
        str(stories_dir),
        out,
        spec["recipe"],
        str(tinystories_file) if spec.get("with_calibration") else None,
        overrides=spec.get("overrides"),
        calibration_overrides={"num_samples": 4, "seq_len": 64},
    )
    digests = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.iterdir())
        if p.suffix == ".safetensors" or p.name == "model.safetensors.index.json"
    }
    accepted = [GOLDEN[case], *GOLDEN_OTHER_CPUS.get(case, [])]
    assert digests in accepted, f"shards of {case} match no recorded CPU's: {digests}"
