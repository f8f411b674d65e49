"""squeeze artifacts served by vLLM itself (skipped without vLLM; scripts/check_vllm.sh builds its environment).

A tiny Llama vLLM's CPU attention accepts (head_dim 64; a vocabulary of 384, which 3 ranks split evenly),
shaped to exercise the plugin's sharding at tensor parallel 3: 6 query heads and 1 key/value head (k and v
replicated on every rank), and an MLP of 300 channels (down_proj's 3-bit codes cut mid-byte at each rank's 100
columns). Each engine runs in a process of its own
(scripts/bench/vllm_generate.py), since vLLM spawns workers; each start costs 15-60 s on 2 cores.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/check_vllm.sh builds an environment with it)")

from vllm_runs import assert_squeeze_run_text, run_vllm  # noqa: E402

from squeeze import api  # noqa: E402
from squeeze.format.manifest import MANIFEST_NAME  # noqa: E402
from squeeze.format.verify import seal_artifact  # noqa: E402
from squeeze.quant.packing import unpack_codes  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_tiny(
    tmp_path_factory: pytest.TempPathFactory,
    resized_tiny_llama: Callable[..., Path],
    compress_tiny: Callable[..., Path],
) -> Path:
    """The tiny vLLM-shaped Llama (the tiny Llama's config and tokenizer, resized) at 3 bits with a sparse part."""
    source = resized_tiny_llama(
        tmp_path_factory.mktemp("vllm-tiny") / "source",
        hidden_size=384,
        intermediate_size=300,
        num_attention_heads=6,
        num_key_value_heads=1,
        head_dim=64,  # the saved config spells out the tiny model's 16
        vocab_size=384,  # vLLM pads the vocabulary to a multiple of 64 and splits it over the ranks: 384 = 3 x 128
    )
    return compress_tiny(source.parent / "w3", "w3-s045", source=source)


@pytest.fixture(scope="module")
def tp1(vllm_tiny: Path) -> dict[str, Any]:
    result, log = run_vllm(vllm_tiny)
    assert result is not None, log[-4000:]
    return result


def test_vllm_generates_what_squeeze_run_generates(vllm_tiny: Path, tp1: dict[str, Any]) -> None:
    assert_squeeze_run_text(vllm_tiny, tp1)


def test_tensor_parallel_3_equals_tensor_parallel_1(vllm_tiny: Path, tp1: dict[str, Any]) -> None:
    # the row-parallel cuts really are mid-byte: 100 columns of 3 bits = 37.5 bytes
    down = api.load(vllm_tiny).model.model.layers[0].mlp.down_proj
    assert down.in_features == 300 and (100 * 3) % 8 != 0
    assert unpack_codes(down.weight_packed, 3, 300).shape == (384, 300)
    # load_format "squeeze": every rank loads exactly the bytes it hashed
    result, log = run_vllm(vllm_tiny, tp=3, load_format="squeeze")
    assert result is not None, log[-4000:]
    assert result["tokens"] == tp1["tokens"]


def test_a_tampered_artifact_stops_vllm_with_the_integrity_error(vllm_tiny: Path, tmp_path: Path) -> None:
    copy = shutil.copytree(vllm_tiny, tmp_path / "tampered")
    shard = next(copy.glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    result, log = run_vllm(copy)
    assert result is None
    assert "squeeze.errors.IntegrityError: artifact" in log and "failed verification" in log


def test_a_future_format_version_is_refused_at_start(vllm_tiny: Path, tmp_path: Path) -> None:
    copy = shutil.copytree(vllm_tiny, tmp_path / "future")
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"]["format_version"] = 2
    (copy / "config.json").write_text(json.dumps(config))
    (copy / MANIFEST_NAME).unlink()
    seal_artifact(copy)  # intact, but written by a future squeeze
    result, log = run_vllm(copy)
    assert result is None
    assert "squeeze.errors.FormatError: quantization_config.format_version is 2; this squeeze reads 1" in log


def test_a_tensor_parallel_size_that_does_not_divide_the_heads_gets_vllms_message(vllm_tiny: Path) -> None:
    result, log = run_vllm(vllm_tiny, tp=4)
    assert result is None
    assert "divisible" in log and "squeeze/integrations" not in log


def test_calibrated_fp8_kv_scales_reach_vllms_fp8_cache(vllm_tiny: Path, tmp_path: Path, tiny_text_file: Path) -> None:
    copy = shutil.copytree(vllm_tiny, tmp_path / "fp8")
    api.calibrate_kv(copy, tiny_text_file, bits="fp8", calibration_overrides={"num_samples": 4, "seq_len": 32})
    calibrated, log = run_vllm(copy, kv_cache_dtype="fp8")
    if calibrated is None and "FP8 KV cache on CPU requires x86 with AVX-512 or AMX" in log:
        pytest.skip("vLLM runs an fp8 KV cache on CPU only with AVX-512 or AMX, which this CPU lacks")
    assert calibrated is not None, log[-4000:]
    assert "squeeze: the attention layers take the artifact's calibrated fp8 KV scales" in log
    # the same weights without fp8 scales (vllm_tiny's KV calibration is squeeze's int8 grids): vLLM's scale 1.0.
    # fp8 is floating point, so a scale only moves values out of the subnormals and away from saturation,
    # and the texts differ (SmolLM2 w4: 5 of 8 prompts; docs/benchmarks.md). squeeze's own fp8 cache is not
    # compared token for token: the engines round at different points (SmolLM2 w4: 1 of 8 texts equal)
    default, log = run_vllm(vllm_tiny, kv_cache_dtype="fp8")
    assert default is not None, log[-4000:]
    assert calibrated["tokens"] != default["tokens"]
