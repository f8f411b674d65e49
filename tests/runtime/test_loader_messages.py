"""Issue 41 item 15: the loader's refusals say what is wrong. A transposed quantized tensor is reported against
the shape its module entry gives, and a config transformers rejects keeps its reason (it was cut at a colon)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from squeeze import api
from squeeze.errors import FormatError
from squeeze.format.manifest import MANIFEST_NAME, parse_manifest
from squeeze.format.verify import seal_artifact


@pytest.fixture(scope="module")
def rtn_artifact(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("messages") / "stories-rtn-w4"
    api.compress(str(stories_dir), out, recipe="rtn-w4")
    return out


def reseal(directory: Path) -> None:
    seal_artifact(directory, parse_manifest((directory / MANIFEST_NAME).read_bytes()).provenance)


def test_a_transposed_tensor_is_reported_against_its_modules_shape(rtn_artifact: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(rtn_artifact, tmp_path / "transposed"))
    (shard,) = copy.glob("model-*.safetensors")
    tensors = load_file(shard)
    name = "model.layers.0.self_attn.q_proj.weight_packed"
    rows, cols = tensors[name].shape
    assert rows != cols
    tensors[name] = tensors[name].T.contiguous()
    save_file(tensors, shard, metadata={"format": "pt"})
    reseal(copy)
    with pytest.raises(FormatError) as info:
        api.load(copy, check_memory=False)
    assert f"expected torch.uint8 ({rows}, {cols}), found torch.uint8 ({cols}, {rows})" in info.value.message


def test_inconsistent_heads_keep_their_reason(rtn_artifact: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(rtn_artifact, tmp_path / "heads"))
    config = json.loads((copy / "config.json").read_text())
    config["num_attention_heads"] = 7  # hidden_size 64 is not a multiple of it
    (copy / "config.json").write_text(json.dumps(config))
    reseal(copy)
    with pytest.raises(FormatError) as info:
        api.load(copy, check_memory=False)
    message = info.value.message
    assert "\n" not in message
    assert "describes no model" in message and "not a multiple of the number of attention heads" in message
