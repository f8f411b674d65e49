"""SqueezeEmbedding: gathered rows equal the reference dequantization bit for bit, for every dense format."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from squeeze.errors import FormatError
from squeeze.quant.schemes.lut import quantize_lut
from squeeze.quant.schemes.rtn import rtn_quantize
from squeeze.runtime.embedding import SqueezeEmbedding, gather_rows, tie_quantized_heads
from squeeze.runtime.linear import SqueezeLinear

TABLE = torch.randn(97, 40, generator=torch.Generator().manual_seed(0))
FISHER = torch.rand(97, 40, generator=torch.Generator().manual_seed(1))
WEIGHTS = {
    "lut4": lambda: quantize_lut(TABLE, FISHER, 4),
    "lut4-int8": lambda: quantize_lut(TABLE, FISHER, 4, lut_dtype="int8"),
    "lut3": lambda: quantize_lut(TABLE, None, 3),
    "rtn8": lambda: rtn_quantize(TABLE, 8),
    "rtn6": lambda: rtn_quantize(TABLE, 6),  # embedding-only width: 4 codes in 3 bytes, rows straddle bytes
    "rtn4-g16": lambda: rtn_quantize(TABLE, 4, 16),
}


@pytest.mark.parametrize("kind", sorted(WEIGHTS))
def test_gathered_rows_are_the_reference_rows_bit_for_bit(kind: str) -> None:
    qweight = WEIGHTS[kind]()
    index = torch.tensor([5, 0, 96, 5, 33])  # repeats and both ends
    assert torch.equal(gather_rows(qweight, index).dequantize(), qweight.dequantize()[index])


@pytest.mark.parametrize("kind", ["lut4", "rtn8", "rtn6"])
def test_forward_equals_the_dense_lookup_and_keeps_the_ids_shape(kind: str) -> None:
    qweight = WEIGHTS[kind]()
    module = SqueezeEmbedding(qweight)
    ids = torch.tensor([[1, 2, 3], [96, 0, 1]])
    out = module(ids)
    assert out.shape == (2, 3, 40) and out.dtype == torch.float32
    assert torch.equal(out, F.embedding(ids, qweight.dequantize()))
    assert module(torch.zeros(0, dtype=torch.long)).shape == (0, 40)


def test_forward_never_dequantizes_the_whole_table(monkeypatch: pytest.MonkeyPatch) -> None:
    qweight = WEIGHTS["lut4"]()
    module = SqueezeEmbedding(qweight)
    sizes: list[int] = []
    original = type(qweight).dequantize

    def spy(self, dtype=torch.float32):  # noqa: ANN001, ANN202
        sizes.append(self.out_features)
        return original(self, dtype)

    monkeypatch.setattr(type(qweight), "dequantize", spy)
    module(torch.tensor([[4, 4, 7]]))
    assert sizes == [3]  # the looked-up rows only, never the 97-row table


def test_an_id_outside_the_table_is_an_index_error() -> None:
    module = SqueezeEmbedding(WEIGHTS["lut4"]())
    for bad in (97, -1):
        with pytest.raises(IndexError, match="97 rows"):
            module(torch.tensor([0, bad]))


def test_a_weight_with_a_sparse_part_cannot_be_an_embedding() -> None:
    with_sparse = quantize_lut(TABLE, FISHER, 4, 0.01, 0.01)
    with pytest.raises(FormatError, match="by row"):
        SqueezeEmbedding(with_sparse)
    with pytest.raises(ValueError, match="not stored by row"):
        gather_rows(with_sparse, torch.tensor([0]))


@pytest.mark.parametrize(("kind", "table"), [("lut4", "weight_lut"), ("rtn6", "weight_scales")])
def test_a_tied_head_reads_the_embedding_buffers_without_a_copy(kind: str, table: str) -> None:
    model = torch.nn.Module()
    model.embed = SqueezeEmbedding(WEIGHTS[kind]())
    model.head = torch.nn.Linear(40, 97, bias=False)
    tie_quantized_heads(model, {"head": "embed"}, activations="float32")  # the exact path, compared below
    assert isinstance(model.head, SqueezeLinear)
    assert model.head.weight_packed is model.embed.weight_packed
    assert getattr(model.head, table) is getattr(model.embed, table)
    assert torch.equal(model.head.dequantize(), model.embed.dequantize())  # one weight, bit for bit
    x = torch.randn(2, 40)
    torch.testing.assert_close(model.head(x), x @ WEIGHTS[kind]().dequantize().T, rtol=1e-5, atol=1e-5)
    model.head = torch.nn.Linear(40, 96, bias=False)  # a head of another size is not this embedding's
    with pytest.raises(FormatError, match="96 x 40 LM head"):
        tie_quantized_heads(model, {"head": "embed"})
    with pytest.raises(FormatError, match="not a quantized embedding"):
        tie_quantized_heads(model, {"head": "missing"})


def test_a_six_bit_embedding_reloads_from_its_state_dict_with_every_check() -> None:
    source = SqueezeEmbedding(WEIGHTS["rtn6"]())
    state = source.state_dict()
    target = SqueezeEmbedding(rtn_quantize(torch.zeros(97, 40), 6))
    target.load_state_dict(state)  # rebinds through RtnWeight.from_tensors at 6 bits, values checked
    ids = torch.tensor([0, 50, 96])
    assert target.qweight.bits == 6 and torch.equal(target(ids), source(ids))
    bad_zero = state["weight_zeros"].clone()
    bad_zero[3] = 64  # a valid 8-bit zero point, beyond the 6-bit grid
    with pytest.raises(FormatError, match=r"weight_zeros must hold integers in \[0, 63\]"):
        target.load_state_dict({**state, "weight_zeros": bad_zero})


def test_config_vocab_must_match_a_quantized_embedding() -> None:
    from squeeze.runtime.config_shapes import check_config_shapes

    spec = {"method": "squeeze", "bits": 4, "in_features": 40, "out_features": 97}
    config = {"vocab_size": 97, "hidden_size": 40, "num_hidden_layers": 0}
    check_config_shapes(config, {}, {"model.embed_tokens": spec})
    with pytest.raises(FormatError, match="model.embed_tokens has out_features 97"):
        check_config_shapes({**config, "vocab_size": 10**9}, {}, {"model.embed_tokens": spec})


def test_the_load_estimate_counts_the_float32_copies_of_16_bit_tensors(tmp_path) -> None:  # noqa: ANN001
    from safetensors.torch import save_file

    from squeeze.runtime.memory import estimate_load

    save_file(
        {
            "model.norm.weight": torch.ones(64, dtype=torch.bfloat16),
            "model.embed_tokens.weight": torch.ones(10, 8, dtype=torch.float16),
            "model.layers.0.mlp.up_proj.weight_lut": torch.ones(4, 16, dtype=torch.float16),  # a quantized role
            "model.layers.0.mlp.down_proj.weight": torch.ones(4, 4),  # float32: no copy
        },
        str(tmp_path / "model.safetensors"),
    )
    spec = {"method": "squeeze", "bits": 4, "in_features": 8, "out_features": 4}
    config = {"quantization_config": {"quant_method": "squeeze", "modules": {"model.layers.0.mlp.up_proj": spec}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    estimate = estimate_load(tmp_path)
    assert estimate is not None and estimate.upcast_bytes == (64 + 80) * 4
