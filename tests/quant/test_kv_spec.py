"""The KV-cache spec (squeeze.quant.kv_spec): its artifact form, its FormatErrors, and its bytes per token."""

from __future__ import annotations

import pytest
import torch

from squeeze.errors import ConfigError, FormatError
from squeeze.quant.kv import KeyRotation
from squeeze.quant.kv_bytes import (
    default_key_group,
    default_value_group,
    fp_bytes_per_token,
    kv_bytes_table,
    layer_bytes_per_token,
)
from squeeze.quant.kv_spec import (
    KV_FP8_E4M3,
    KVSpec,
    LayerFP8,
    LayerKV,
    check_kv_bits,
)


def test_check_kv_bits() -> None:
    assert check_kv_bits(8) == 8
    for bad in (2, 3, 16, True, "8", None):
        with pytest.raises(ConfigError, match="must be 4 or 8"):
            check_kv_bits(bad)


def _spec(v_symmetric: bool = True, v_group: int | None = None) -> KVSpec:
    layer = LayerKV(
        torch.rand(2, 8) + 0.1, torch.full((2, 8), 8.0), torch.tensor([0.9, 1.0]), False, v_symmetric, v_group
    )
    return KVSpec(4, 1, ("model.layers.0.self_attn", "model.layers.1.self_attn"), (layer, layer))


def test_spec_round_trips_through_config_and_tensors() -> None:
    spec = _spec(v_symmetric=False, v_group=4)
    tensors = spec.to_tensors()
    roles = ("k_scale", "k_zero", "v_clip")
    assert sorted(tensors) == sorted(f"model.layers.{i}.self_attn.{r}" for i in (0, 1) for r in roles)
    back = KVSpec.from_config(spec.to_config(), tensors)
    assert back.bits == 4 and back.sink_tokens == 1 and back.names == spec.names
    for a, b in zip(back.layers, spec.layers, strict=True):
        assert a is not None and b is not None
        assert torch.equal(a.k_scale, b.k_scale) and torch.equal(a.v_clip, b.v_clip)
        assert (a.k_symmetric, a.v_symmetric, a.value_group) == (b.k_symmetric, b.v_symmetric, 4)


def test_codebook_spec_round_trips_and_bad_codebooks_are_format_errors() -> None:
    layer = LayerKV(
        torch.rand(2, 8) + 0.1, torch.zeros(2, 8), torch.ones(2), True, True, None, 4, torch.linspace(-1, 1, 16)
    )
    spec = KVSpec(4, 4, ("a", "b"), (layer, layer))
    tensors = spec.to_tensors()
    assert sorted(tensors) == sorted(f"{n}.{r}" for n in "ab" for r in ("k_scale", "k_zero", "v_levels"))
    back = KVSpec.from_config(spec.to_config(), tensors)
    assert back.sink_tokens == 4
    for got in back.layers:
        assert got is not None and got.v_levels is not None and torch.equal(got.v_levels, layer.v_levels)
        assert (got.key_group, got.value_group, got.v_symmetric) == (4, 8, True)
    assert back.bytes_per_token(2, 8) == spec.bytes_per_token(2, 8) == 2 * (2 * 2 * 4 + 2 * 2 * 2 + 2 * 2)
    config = spec.to_config()
    with pytest.raises(FormatError, match=r"\.v_levels"):
        KVSpec.from_config(config, {k: v for k, v in tensors.items() if not k.endswith("v_levels")})
    with pytest.raises(FormatError, match="inconsistent shapes"):
        KVSpec.from_config(config, {**tensors, "a.v_levels": torch.zeros(8)})
    with pytest.raises(FormatError, match="ascending"):
        KVSpec.from_config(config, {**tensors, "a.v_levels": torch.linspace(1, -1, 16)})
    with pytest.raises(FormatError, match="ascending"):
        KVSpec.from_config(config, {**tensors, "a.v_levels": torch.full((16,), float("nan"))})
    bad = spec.to_config()
    bad["layers"][0]["v_codebook"] = "yes"  # type: ignore[index]
    with pytest.raises(FormatError, match="true or false"):
        KVSpec.from_config(bad, tensors)
    bad = spec.to_config()
    bad["layers"][1]["k_group"] = 6  # type: ignore[index]
    with pytest.raises(FormatError, match="k_group of b must be an even divisor of 8"):
        KVSpec.from_config(bad, tensors)


def test_spec_from_bad_config_is_a_format_error() -> None:
    spec = _spec()
    tensors = spec.to_tensors()
    with pytest.raises(FormatError, match="bits must be 4 or 8"):
        KVSpec.from_config({**spec.to_config(), "bits": 3}, tensors)
    with pytest.raises(FormatError, match="are missing"):
        KVSpec.from_config(spec.to_config(), {k: v for k, v in tensors.items() if not k.endswith("v_clip")})
    tensors["model.layers.1.self_attn.k_zero"] = torch.zeros(3, 8)
    with pytest.raises(FormatError, match="inconsistent shapes"):
        KVSpec.from_config(spec.to_config(), tensors)
    with pytest.raises(FormatError):
        KVSpec.from_config([], {})
    bad_group = spec.to_config()
    bad_group["layers"][0]["v_group"] = 3  # type: ignore[index]
    with pytest.raises(FormatError, match="even divisor"):
        KVSpec.from_config(bad_group, spec.to_tensors())


def test_bytes_per_token_smollm2_geometry_meets_the_ratios() -> None:
    # SmolLM2-135M: 30 layers, 3 KV heads of 64 channels
    fp16 = fp_bytes_per_token(30, 3, 64)
    assert fp16 == 23040
    names = tuple(str(i) for i in range(30))
    layer = LayerKV(torch.rand(3, 64), torch.zeros(3, 64), torch.ones(3), False, True)
    int8 = KVSpec(8, 1, names, tuple(layer for _ in names))
    # the int4 default: two key grids of 32 channels per head, a value codebook with one scale per head
    default4 = LayerKV(torch.rand(3, 64), torch.zeros(3, 64), torch.ones(3), False, True, None, 32, torch.arange(16.0))
    default_spec = KVSpec(4, 4, names, tuple(default4 for _ in names))
    assert default_spec.bytes_per_token(3, 64) == 30 * (3 * 64 + 3 * 2 * 2 + 3 * 2)
    assert int8.bytes_per_token(3, 64) == 30 * (2 * 3 * 64 + 2 * 3 * 2)  # codes + key and value scales
    assert int8.bytes_per_token(3, 64) / fp16 <= 0.52
    grouped = LayerKV(torch.rand(3, 64), torch.zeros(3, 64), torch.ones(3), False, True, 32)
    int4 = KVSpec(4, 1, names, tuple(grouped for _ in names))
    assert int4.bytes_per_token(3, 64) == 30 * (2 * 3 * 32 + 3 * 2 + 2 * 3 * 2)  # two value grids per head
    assert int4.bytes_per_token(3, 64) / fp16 <= 0.28
    assert layer_bytes_per_token(3, 64, 4, asymmetric_values=True) == 2 * 3 * 32 + 3 * 2 + 3 * 2 * 2
    assert KVSpec.dynamic(4, names).bytes_per_token(3, 64) == 30 * (2 * 3 * 32 + 3 * 2 * 2)
    table = kv_bytes_table(
        {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    )
    assert table == {"fp16": 23040, "fp8": 11520, "int8": int8.bytes_per_token(3, 64), "int4": 6300}
    assert table["int4"] / fp16 <= 0.28
    assert default_value_group(4, 64) == 64 and default_value_group(8, 64) == 64
    assert default_key_group(4, 64) == 32 and default_key_group(8, 64) == 64 and default_key_group(8, 8) == 8
    # small heads at int4: two grids per head (stories260K, head_dim 8: +8.9% -> +4.7% perplexity), as long as
    # half a head is an even count (int4 packs channel pairs); 80-channel heads keep one grid
    assert [default_key_group(4, d) for d in (4, 6, 8, 12, 32, 80, 128)] == [2, 6, 4, 6, 16, 80, 32]
    stories = {"num_hidden_layers": 5, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8}
    # per layer: codes 2 * 4 heads * 8 * 4 bits, two key scales and one value scale per head, fp16
    assert kv_bytes_table(stories)["int4"] == 5 * (32 + 4 * 2 * 2 + 4 * 2) == 280


def _fp8_spec() -> KVSpec:
    names = ("model.layers.0.self_attn", "model.layers.1.self_attn")
    layers = (LayerFP8(torch.tensor(0.0625), torch.tensor(0.01)), LayerFP8(torch.tensor(1.5), torch.tensor(2e-3)))
    return KVSpec.fp8(names, layers)


def test_fp8_spec_is_vllms_scalars_and_round_trips() -> None:
    spec = _fp8_spec()
    assert (spec.kind, spec.bits, spec.sink_tokens, spec.label, spec.choice) == (KV_FP8_E4M3, 8, 0, "fp8", "fp8")
    tensors = spec.to_tensors()
    assert sorted(tensors) == sorted(f"model.layers.{i}.self_attn.{r}" for i in (0, 1) for r in ("k_scale", "v_scale"))
    assert all(t.dtype == torch.float32 and t.shape == () for t in tensors.values())
    config = spec.to_config()
    assert config["format"] == "fp8_e4m3" and config["version"] == 1
    assert config["layers"] == [{"module": name} for name in spec.names]
    back = KVSpec.from_config(
        {**config, "file": "kv_cache.safetensors", "calibration": "c", "calibration_hash": "h"}, tensors
    )
    assert back.kind == KV_FP8_E4M3 and back.names == spec.names and back.sink_tokens == 0
    for got, want in zip(back.layers, spec.layers, strict=True):
        assert isinstance(got, LayerFP8) and isinstance(want, LayerFP8)
        assert torch.equal(got.k_scale, want.k_scale) and torch.equal(got.v_scale, want.v_scale)
    shaped = {k: v.reshape(1) for k, v in tensors.items()}  # shape (1,) is vLLM's other scalar form
    assert torch.equal(KVSpec.from_config(config, shaped).layers[1].v_scale, torch.tensor(2e-3))  # type: ignore[union-attr]
    assert spec.bytes_per_token(3, 64) == 2 * 2 * 3 * 64  # one byte per element, nothing per token


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda c, t: c.update(format="fp4"), "kv_cache.format must be one of"),
        (lambda c, t: c.update(version=2), "version of format fp8_e4m3 is 2; this squeeze reads 1"),
        (lambda c, t: c.pop("version"), "version of format fp8_e4m3 is None"),
        (lambda c, t: c.update(bits=8), r"unknown kv_cache keys for format fp8_e4m3: \['bits'\]"),
        (lambda c, t: c.update(layers=[]), "non-empty list"),
        (lambda c, t: c["layers"].append({"module": "model.layers.0.self_attn"}), "twice"),
        (lambda c, t: c["layers"][0].update(k_group=64), "is {'module': name}"),
        (lambda c, t: t.pop("model.layers.1.self_attn.v_scale"), "model.layers.1.self_attn.v_scale is missing"),
        (lambda c, t: t.update({"model.layers.0.self_attn.k_scale": torch.ones(2)}), r"one float32 \(shape \(\)"),
        (lambda c, t: t.update({"model.layers.0.self_attn.k_scale": torch.tensor(0.5).half()}), "found float16"),
        (lambda c, t: t.update({"model.layers.0.self_attn.k_scale": torch.tensor(0.0)}), "finite and > 0"),
        (lambda c, t: t.update({"model.layers.0.self_attn.k_scale": torch.tensor(-1.0)}), "finite and > 0"),
        (lambda c, t: t.update({"model.layers.0.self_attn.v_scale": torch.tensor(float("nan"))}), "finite and > 0"),
    ],
)
def test_bad_fp8_sections_are_format_errors(change, match: str) -> None:  # noqa: ANN001
    spec = _fp8_spec()
    config, tensors = spec.to_config(), spec.to_tensors()
    change(config, tensors)
    with pytest.raises(FormatError, match=match) as info:
        KVSpec.from_config(config, tensors)
    assert info.value.hint


def test_spec_kinds_do_not_mix() -> None:
    fp8 = LayerFP8(torch.tensor(1.0), torch.tensor(1.0))
    grid = LayerKV(torch.ones(2, 8), torch.zeros(2, 8), torch.ones(2), True, True)
    with pytest.raises(ValueError, match="layers of another kind"):
        KVSpec(8, 0, ("a",), (fp8,))  # an int spec holding fp8 scales
    with pytest.raises(ValueError, match="layers of another kind"):
        KVSpec(8, 0, ("a", "b"), (fp8, grid), KV_FP8_E4M3)
    with pytest.raises(ValueError, match="layers of another kind"):
        KVSpec(8, 0, ("a",), (None,), KV_FP8_E4M3)  # fp8 has no uncalibrated baseline
    with pytest.raises(ValueError, match="no sink"):
        KVSpec(8, 4, ("a",), (fp8,), KV_FP8_E4M3)


def _rotating_spec() -> KVSpec:
    gen = torch.Generator().manual_seed(3)
    mu = torch.randn(2, 8, generator=gen) * 5
    rotation = KeyRotation(
        torch.cat([torch.tensor([1.0, 0.1, 0.01, 0.001])] * 2), mu, torch.cat([-mu[:, 4:], mu[:, :4]], dim=-1)
    )
    plain = LayerKV(torch.rand(2, 8, generator=gen) + 0.1, torch.zeros(2, 8), torch.ones(2), True, True, None, 4)
    rotating = LayerKV(plain.k_scale, plain.k_zero, plain.v_clip, True, True, None, 4, None, rotation)
    return KVSpec(4, 4, ("a", "b"), (rotating, plain))


def test_rotating_key_centre_round_trips_as_version_2() -> None:
    spec = _rotating_spec()
    config, tensors = spec.to_config(), spec.to_tensors()
    assert config["version"] == 2
    entries = config["layers"]
    assert isinstance(entries, list) and entries[0]["k_rotation"] is True and "k_rotation" not in entries[1]
    assert sorted(t for t in tensors if t.startswith("a.k_rot")) == ["a.k_rot_cos", "a.k_rot_freq", "a.k_rot_sin"]
    assert not any(t.startswith("b.k_rot") for t in tensors)
    back = KVSpec.from_config(config, tensors)
    got, want = back.layers[0], spec.layers[0]
    assert isinstance(got, LayerKV) and isinstance(want, LayerKV)
    assert got.k_rotation is not None and want.k_rotation is not None
    for a, b in zip(vars(got.k_rotation).values(), vars(want.k_rotation).values(), strict=True):
        assert torch.equal(a, b)
    assert isinstance(back.layers[1], LayerKV) and back.layers[1].k_rotation is None


def test_spec_without_rotation_writes_no_version_and_old_sections_still_load() -> None:
    config = _spec().to_config()
    assert "version" not in config  # byte-identical sections to the ones written before rotating centres
    back = KVSpec.from_config(config | {"version": 1}, _spec().to_tensors())
    assert all(isinstance(x, LayerKV) and x.k_rotation is None for x in back.layers)


def _bad_rotation(change: str) -> tuple[dict, dict]:  # type: ignore[type-arg]
    spec = _rotating_spec()
    config, tensors = spec.to_config(), spec.to_tensors()
    if change == "version 3":
        config["version"] = 3
    elif change == "no version":
        del config["version"]
    elif change == "flag not bool":
        config["layers"][0]["k_rotation"] = "yes"  # type: ignore[index]
    elif change == "missing":
        del tensors["a.k_rot_sin"]
    elif change == "fp16":
        tensors["a.k_rot_cos"] = tensors["a.k_rot_cos"].half()
    elif change == "shape":
        tensors["a.k_rot_freq"] = tensors["a.k_rot_freq"][:4]
    elif change == "not finite":
        tensors["a.k_rot_sin"][0, 0] = float("nan")
    elif change == "negative freq":
        tensors["a.k_rot_freq"][0] = -1.0
    return config, tensors


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ("version 3", "kv_cache.version is 3"),
        ("no version", "needs kv_cache.version 2"),
        ("flag not bool", "k_rotation of a must be true or false"),
        ("missing", r"a\.k_rot_sin is missing"),
        ("fp16", r"a\.k_rot_cos must be float32 of shape \(2, 8\), found float16"),
        ("shape", r"a\.k_rot_freq must be float32 of shape \(8,\)"),
        ("not finite", r"a\.k_rot_sin must be finite"),
        ("negative freq", r"a\.k_rot_freq must be >= 0"),
    ],
)
def test_bad_rotating_centres_are_format_errors(change: str, match: str) -> None:
    config, tensors = _bad_rotation(change)
    with pytest.raises(FormatError, match=match):
        KVSpec.from_config(config, tensors)
