import json
import struct

import pytest
import torch
from safetensors.torch import load_file

from squeeze.errors import FormatError
from squeeze.format.shards import INDEX_NAME, ShardWriter, shard_name, write_shards


def test_golden_bytes_of_a_small_shard(tmp_path):
    write_shards(tmp_path, {"b": torch.arange(3, dtype=torch.int16), "a": torch.tensor([1.0, -2.0])}, 1000)
    data = (tmp_path / "model-00001-of-00001.safetensors").read_bytes()
    header = (
        b'{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
        b'"b":{"dtype":"I16","shape":[3],"data_offsets":[8,14]}}'
    )
    header += b" " * (-len(header) % 8)  # safetensors pads the header to 8-byte alignment with spaces
    body = b"\x00\x00\x80\x3f" + b"\x00\x00\x00\xc0" + b"\x00\x00\x01\x00\x02\x00"
    assert data == struct.pack("<Q", len(header)) + header + body
    assert struct.pack("<Q", len(header)) == b"\x90\x00\x00\x00\x00\x00\x00\x00"


def test_shards_split_at_max_size_and_index_maps_every_tensor(tmp_path):
    tensors = {f"t{i}": torch.full((100,), float(i)) for i in range(7)}  # 400 bytes each
    index = write_shards(tmp_path, tensors, 1000)
    assert index.shards == [shard_name(i, 4) for i in range(1, 5)]
    assert [p.name for p in sorted(tmp_path.iterdir())] == sorted(index.shards + [INDEX_NAME])
    body = json.loads((tmp_path / INDEX_NAME).read_text())
    assert body["metadata"]["total_size"] == 7 * 400
    assert set(body["weight_map"]) == set(tensors)
    for name, tensor in tensors.items():
        loaded = load_file(tmp_path / body["weight_map"][name])
        assert torch.equal(loaded[name], tensor)


def test_tensor_larger_than_the_limit_gets_its_own_shard(tmp_path):
    index = write_shards(tmp_path, {"small": torch.zeros(10), "big": torch.zeros(1000), "x": torch.zeros(1)}, 100)
    assert len(index.shards) == 3
    assert index.weight_map["big"] == shard_name(2, 3)


def test_shard_names_follow_transformers():
    assert shard_name(1, 3) == "model-00001-of-00003.safetensors"


def test_duplicate_tensor_name_is_refused(tmp_path):
    with pytest.raises(FormatError, match="written twice"):
        with ShardWriter(tmp_path, 1000) as writer:
            writer.add("a", torch.zeros(1))
            writer.add("a", torch.zeros(1))
    assert list(tmp_path.iterdir()) == []  # the aborted writer leaves nothing behind


def test_error_inside_the_block_leaves_no_file(tmp_path):
    with pytest.raises(RuntimeError):
        with ShardWriter(tmp_path, 10) as writer:
            writer.add("a", torch.zeros(100))  # flushed to a temp shard at once
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_metadata_holds_format_pt(tmp_path):
    write_shards(tmp_path, {"a": torch.zeros(2)}, 100)
    raw = (tmp_path / shard_name(1, 1)).read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    assert json.loads(raw[8 : 8 + length])["__metadata__"] == {"format": "pt"}


def test_shards_are_byte_identical_across_processes(tmp_path):
    # safetensors orders __metadata__ keys by a per-process hash: only a single key is reproducible
    import subprocess
    import sys

    code = (
        "import sys, torch; from squeeze.format.shards import write_shards; "
        "write_shards(sys.argv[1], {'b': torch.arange(6.0), 'a': torch.ones(3, dtype=torch.int32)}, 100)"
    )
    for name in ("one", "two", "three"):
        subprocess.run([sys.executable, "-c", code, str(tmp_path / name)], check=True)
    blobs = {(tmp_path / n / shard_name(1, 1)).read_bytes() for n in ("one", "two", "three")}
    assert len(blobs) == 1
