"""The native KV write (squeeze.runtime.kernels.cpu_kv_write) stores exactly the bytes the torch codec
(squeeze.runtime.kv_codecs.TokenCodec.encode) stores, for every layout the attention kernel reads."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import squeeze.serve.engine.kv_pool as kv_pool
from squeeze.quant.kv import KeyRotation
from squeeze.quant.kv_spec import KVSpec, LayerKV
from squeeze.runtime.kernels.cpu_attention import attention_kernels
from squeeze.runtime.kernels.cpu_kv_write import write_params
from squeeze.runtime.kv_codecs import FP8Codec, layer_codecs
from squeeze.serve.engine.kv_pool import AttentionShape, PagedKVPool, StepSlots

H, D, SLOTS = 3, 64, 64


@pytest.fixture(autouse=True)
def _kernel() -> None:
    if attention_kernels() is None:
        pytest.skip("no C++ compiler: the native attention kernel is not built")


def _layer(*, k_group: int | None, v_group: int | None, v_levels: bool, v_symmetric: bool, rotation: bool) -> LayerKV:
    gen = torch.Generator().manual_seed(3)
    return LayerKV(
        k_scale=torch.rand(H, D, generator=gen) + 0.5,
        k_zero=torch.randn(H, D, generator=gen) * 0.1,
        v_clip=torch.rand(H, generator=gen) * 0.3 + 0.7,
        k_symmetric=True,
        v_symmetric=v_symmetric,
        k_group=k_group,
        v_group=v_group,
        v_levels=torch.sort(torch.randn(16, generator=gen)).values if v_levels else None,
        k_rotation=KeyRotation(
            torch.rand(D, generator=gen) * 0.5, torch.randn(H, D, generator=gen), torch.randn(H, D, generator=gen)
        )
        if rotation
        else None,
    )


SPECS = {
    "dynamic int4": KVSpec.dynamic(4, ("l0",), 0),
    "dynamic int8": KVSpec.dynamic(8, ("l0",), 0),
    "calibrated int4 (grids of 32, rotating centre, codebook)": KVSpec(
        4, 0, ("l0",), (_layer(k_group=32, v_group=32, v_levels=True, v_symmetric=True, rotation=True),)
    ),
    "calibrated int4, asymmetric value grids": KVSpec(
        4, 0, ("l0",), (_layer(k_group=None, v_group=16, v_levels=False, v_symmetric=False, rotation=False),)
    ),
    "calibrated int8, symmetric per-head clip": KVSpec(
        8, 0, ("l0",), (_layer(k_group=None, v_group=None, v_levels=False, v_symmetric=True, rotation=True),)
    ),
    "calibrated int8, asymmetric": KVSpec(
        8, 0, ("l0",), (_layer(k_group=32, v_group=32, v_levels=False, v_symmetric=False, rotation=False),)
    ),
}


def _tokens(n: int) -> torch.Tensor:
    """(H, n, D) float32 keys / values with the awkward cases: zeros, tiny and huge magnitudes, exact ties."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(H, n, D, generator=gen) * torch.logspace(-6, 3, n)[None, :, None]
    x[0, 0] = 0.0  # an all-zero token: the smallest grid scale
    x[1, 1, ::2] = 0.5  # values on grid points and midpoints
    x[2, 2] = torch.arange(D, dtype=torch.float32) - D / 2
    # int4 grid of scale 0.5 (absmax 3.5 = 7 steps): codes exactly halfway between two levels round to even
    x[0, 3] = torch.tensor([3.5, 0.25, 1.25, -1.25, -0.25, 0.75, 2.25, -2.75]).repeat(D // 8)
    return x.transpose(0, 1).contiguous().transpose(0, 1)  # token-major memory, as the model's keys arrive


def _written(spec: KVSpec, native: bool, monkeypatch: pytest.MonkeyPatch, x: torch.Tensor, v: torch.Tensor) -> Any:
    with monkeypatch.context() as patch:
        if not native:
            patch.setattr(kv_pool._QuantizedLayerTensor, "_write_natively", lambda *_: False)
        pool = PagedKVPool(
            spec, AttentionShape(1, H, D), num_blocks=SLOTS // 16, block_size=16, sequences=1, dtype=torch.float32
        )
        n = x.shape[1]
        slots = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(1))[:n]
        positions = torch.arange(5, 5 + n)
        empty = torch.empty(0, dtype=torch.long)
        step = StepSlots(slots, empty, empty, slots, empty, empty, positions, positions)
        pool.write(0, x[None], v[None], step)
    return [(t.codes, t.scale, t.offset) for t in (pool._keys[0], pool._values[0])]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_native_write_stores_the_torch_codecs_bytes(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = SPECS[name]
    keys, values = layer_codecs(spec.bits, spec.layers[0])
    assert write_params(keys, H) is not None and write_params(values, H) is not None
    calls: list[int] = []
    original = kv_pool.write_tokens
    monkeypatch.setattr(kv_pool, "write_tokens", lambda *a: calls.append(1) or original(*a))
    x, v = _tokens(24), _tokens(25)[:, 1:] * 3
    native = _written(spec, True, monkeypatch, x, v)
    torch_codec = _written(spec, False, monkeypatch, x, v)
    assert len(calls) == 2  # keys and values went through the kernel
    for ours, theirs in zip(native, torch_codec, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_fp8_stays_on_the_torch_codec() -> None:
    assert write_params(FP8Codec(0.5), H) is None


@pytest.mark.parametrize("name", sorted(SPECS))
def test_squeeze_runs_cache_stores_the_torch_codecs_bytes(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The contiguous cache (squeeze run): two batch rows, a prefill of 6 tokens then a decode token, after 4
    sink tokens (the rotating centre's positions start there)."""
    import squeeze.runtime.quantized_cache as quantized_cache
    from squeeze.runtime.quantized_cache import QuantizedStream

    calls: list[int] = []
    original = quantized_cache.write_tokens
    monkeypatch.setattr(quantized_cache, "write_tokens", lambda *a: calls.append(1) or original(*a))
    spec = SPECS[name]
    x = torch.stack([_tokens(7), _tokens(8)[:, 1:] * 5])  # (2, H, 7, D)

    def stored(native: bool) -> list[Any]:
        streams = []
        with monkeypatch.context() as patch:
            if not native:
                patch.setattr(QuantizedStream, "_append_natively", lambda *_: False)
            for codec in layer_codecs(spec.bits, spec.layers[0]):
                stream = QuantizedStream(codec, origin=4)
                stream.append(x[:, :, :6])
                stream.append(x[:, :, 6:])
                assert stream.codes is not None and stream.scale is not None
                n = stream.length
                offset = stream.offset[:, :, :n] if stream.offset is not None else None
                streams.append((stream.codes[:, :, :n], stream.scale[:, :, :n], offset))
        return streams

    native = stored(True)
    assert len(calls) == 2 * 2 * 2  # keys and values, two appends, two batch rows
    for ours, theirs in zip(native, stored(False), strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
