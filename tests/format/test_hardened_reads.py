"""Reading an artifact never follows a link inside it, never blocks, never reads past a bound (issue 11).

Each test is a probe that failed before the fix.
"""

from __future__ import annotations

import json
import struct

import pytest

from squeeze import verify_model_integrity
from squeeze.errors import FormatError
from squeeze.format.manifest import MANIFEST_NAME
from squeeze.format.safetensors_header import parse_safetensors_header
from squeeze.format.verify import seal_artifact

SHARD = "model-00001-of-00002.safetensors"


# ------------------------------------------------------------------------------------------------------
# safetensors shapes


def _header_bytes(tensors: dict) -> bytes:
    body = json.dumps(tensors).encode()
    return struct.pack("<Q", len(body)) + body


@pytest.mark.parametrize("shape", [[0, 2**64], [0, 2**53 + 1], [2**30, 0, 2**30]])
def test_a_zero_size_tensor_with_huge_dimensions_is_malformed(shape):
    prefix = _header_bytes({"t": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}})
    with pytest.raises(FormatError, match="multiply past 2\\^53"):
        parse_safetensors_header(prefix, len(prefix), "x.safetensors")


def test_verify_reports_a_resealed_shard_with_a_huge_dimension(artifact):
    path = artifact / SHARD
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8 : 8 + length]), raw[8 + length :]
    header["huge"] = {"dtype": "F32", "shape": [0, 2**64], "data_offsets": [len(data), len(data)]}
    path.write_bytes(_header_bytes(header) + data)
    index = json.loads((artifact / "model.safetensors.index.json").read_text())
    index["weight_map"]["huge"] = SHARD
    (artifact / "model.safetensors.index.json").write_text(json.dumps(index))
    (artifact / MANIFEST_NAME).unlink()
    seal_artifact(artifact)
    report = verify_model_integrity(artifact)
    assert not report.ok and "multiply past 2^53" in report.first_error()
