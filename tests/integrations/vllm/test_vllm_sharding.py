"""The rank's slice of each fused checkpoint module (vLLM not needed): the geometry of column-, row-parallel and
replicated layers, and the parts they cut reassembling into the whole layer's product."""

from __future__ import annotations

import pytest
import torch

from squeeze.errors import FormatError
from squeeze.integrations.vllm.sharding import (
    ExpertGeometry,
    LayerGeometry,
    ShardPlan,
    plan_shards,
    take_expert_shards,
    take_shard,
    vocab_rows,
)
from squeeze.quant.schemes import LutWeight
from squeeze.quant.schemes.lut import quantize_lut
from toy_format import ToyAbsmaxWeight

IN = 60


def lut(rows: int, cols: int = IN, bits: int = 3, seed: int = 0) -> LutWeight:
    """A (rows, cols) 3-bit LUT weight with a sparse part on both sides of every cut tested below."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    return quantize_lut(w, torch.rand(rows, cols, generator=g), bits, sensitive_fraction=0.05, outlier_fraction=0.05)


def column(
    tp_rank: int, tp_size: int, sizes: tuple[int, ...], *, qkv: bool = False, replicas: int = 1
) -> LayerGeometry:
    return LayerGeometry("column", tp_rank, tp_size, sizes, IN, qkv=qkv, kv_replicas=replicas)


def test_qkv_shards_cut_output_rows_and_share_replicated_kv_heads() -> None:
    # 6 query heads and 1 key/value head of 4 channels at tensor parallel 3: each rank holds 2 query heads and
    # the one key/value head, which all three ranks replicate
    modules = ("a.q_proj", "a.k_proj", "a.v_proj")
    for rank in range(3):
        plans = plan_shards(modules, column(rank, 3, (8, 4, 4), qkv=True, replicas=3))
        assert list(plans) == ["q", "k", "v"]
        assert plans["q"] == ShardPlan("a.q_proj", "q", "rows", 8 * rank, 8 * rank + 8, 8)
        assert plans["k"] == ShardPlan("a.k_proj", "k", "rows", 0, 4, 4)
        assert plans["v"] == ShardPlan("a.v_proj", "v", "rows", 0, 4, 4)


def test_merged_shards_are_numbered_and_row_parallel_cuts_columns() -> None:
    merged = plan_shards(("m.gate_proj", "m.up_proj"), column(1, 2, (5, 5)))
    assert merged == {
        0: ShardPlan("m.gate_proj", 0, "rows", 5, 10, 5),
        1: ShardPlan("m.up_proj", 1, "rows", 5, 10, 5),
    }
    row = plan_shards(("m.down_proj",), LayerGeometry("row", 2, 3, (7,), 20))
    assert row == {None: ShardPlan("m.down_proj", None, "cols", 40, 60, 7)}
    whole = plan_shards(("m.x",), LayerGeometry("replicated", 1, 2, (7,), IN))
    assert whole == {None: ShardPlan("m.x", None, None, 0, 7, 7)}


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_row_parallel_parts_sum_to_the_whole_product(tp: int) -> None:
    # 60 input columns at tp 4: 15 per rank, so 3-bit codes are cut mid-byte (45 bits) at every boundary
    q = lut(7)
    x = torch.randn(3, IN)
    total = torch.zeros(3, 7)
    for rank in range(tp):
        geometry = LayerGeometry("row", rank, tp, (7,), IN // tp)
        (plan,) = plan_shards(("m.down_proj",), geometry).values()
        part = take_shard(q, plan, geometry)
        assert (part.out_features, part.in_features) == (7, IN // tp)
        assert torch.equal(part.dequantize(), q.dequantize()[:, plan.start : plan.stop])
        total += x[:, plan.start : plan.stop] @ part.dequantize().T
    torch.testing.assert_close(total, x @ q.dequantize().T, rtol=1e-5, atol=1e-5)


def test_column_parallel_parts_concatenate_to_the_whole_weight() -> None:
    q, k = lut(12, seed=1), lut(4, seed=2)
    pieces_q, pieces_k = [], []
    for rank in range(2):
        geometry = column(rank, 2, (6, 2), qkv=True)
        plans = plan_shards(("a.q_proj", "a.k_proj"), geometry)
        pieces_q.append(take_shard(q, plans["q"], geometry).dequantize())
        pieces_k.append(take_shard(k, plans["k"], geometry).dequantize())
    assert torch.equal(torch.cat(pieces_q), q.dequantize())
    assert torch.equal(torch.cat(pieces_k), k.dequantize())


def test_a_weight_that_does_not_fit_the_layer_is_refused() -> None:
    geometry = column(0, 2, (5,))
    (plan,) = plan_shards(("m.up_proj",), geometry).values()
    with pytest.raises(FormatError, match=r"m\.up_proj: the artifact's weight is 12 x 60, but vLLM's layer at tensor "):
        take_shard(lut(12), plan, geometry)


def test_fused_module_count_must_match_the_layer() -> None:
    with pytest.raises(FormatError, match="fuses 2 weights, but the artifact maps 3 modules"):
        plan_shards(("a", "b", "c"), column(0, 1, (4, 4)))


def test_a_format_without_column_slices_names_the_module_and_the_way_out() -> None:
    w = torch.randn(4, 8)
    toy = ToyAbsmaxWeight.quantize(w, None, type("O", (), {"bits": 4})())
    geometry = LayerGeometry("row", 0, 2, (4,), 4)
    (plan,) = plan_shards(("m.o_proj",), geometry).values()
    with pytest.raises(FormatError, match="m.o_proj: weight format 'toy-absmax' cannot be split by input columns") as e:
        take_shard(toy, plan, geometry)
    assert "tensor_parallel_size 1" in (e.value.hint or "")


# -- MoE experts and vocab-parallel tables -------------------------------------------------------------------

E, H, INTER = 4, 12, 10  # 10 channels at tp 2: 5 per rank, so 3-bit down_proj codes are cut mid-byte (15 bits)


def experts_pair(seed: int = 3) -> tuple[LutWeight, LutWeight]:
    """A MoE layer's gate_up_proj (E*2I, H) and down_proj (E*H, I) as squeeze stores them, with sparse parts."""
    return lut(E * 2 * INTER, H, seed=seed), lut(E * H, INTER, seed=seed + 1)


def expert_output(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU MLP from its dense matrices: gate_up (2i, H), down (H, i), x (T, H) -> (T, H)."""
    gate, up = (x @ gate_up.T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ down.T


@pytest.mark.parametrize(("tp", "experts"), [(1, (0, 1, 2, 3)), (2, (0, 1, 2, 3)), (1, (2, 3)), (2, (3, 1))])
def test_expert_shards_hold_the_ranks_channels_of_its_experts(tp: int, experts: tuple[int, ...]) -> None:
    gate_up, down = experts_pair()
    full_gu = gate_up.dequantize().view(E, 2 * INTER, H)
    full_down = down.dequantize().view(E, H, INTER)
    x = torch.randn(3, H)
    for local_index, e in enumerate(experts):
        total = torch.zeros(3, H)
        for rank in range(tp):
            geometry = ExpertGeometry(experts, rank, tp, H, INTER)
            gu, dn = take_expert_shards(gate_up, down, E, geometry, "m.experts")
            i = INTER // tp
            assert (gu.out_features, gu.in_features) == (len(experts) * 2 * i, H)
            assert (dn.out_features, dn.in_features) == (len(experts) * H, i)
            mine_gu = gu.dequantize().view(len(experts), 2 * i, H)[local_index]
            mine_down = dn.dequantize().view(len(experts), H, i)[local_index]
            # exactly the stored values of the rank's gate channels, its up channels, its down columns
            assert torch.equal(mine_gu[:i], full_gu[e, rank * i : (rank + 1) * i])
            assert torch.equal(mine_gu[i:], full_gu[e, INTER + rank * i : INTER + (rank + 1) * i])
            assert torch.equal(mine_down, full_down[e][:, rank * i : (rank + 1) * i])
            total += expert_output(mine_gu, mine_down, x)
        # the partial sums vLLM's all-reduce adds give the whole expert's output
        torch.testing.assert_close(total, expert_output(full_gu[e], full_down[e], x), rtol=1e-5, atol=1e-5)


def test_one_rank_holding_every_expert_keeps_the_stored_weights() -> None:
    gate_up, down = experts_pair()
    assert take_expert_shards(gate_up, down, E, ExpertGeometry((0, 1, 2, 3), 0, 1, H, INTER), "m") == (gate_up, down)


def test_expert_weights_that_do_not_fit_the_layer_are_refused() -> None:
    gate_up, down = experts_pair()
    with pytest.raises(
        FormatError, match=r"m\.experts\.gate_up_proj: the artifact's weight is 80 x 12, but vLLM's MoE"
    ):
        take_expert_shards(gate_up, down, E, ExpertGeometry((0,), 0, 1, H, 2 * INTER), "m.experts")
    with pytest.raises(FormatError, match="10 intermediate channels per expert cannot be split over tensor parallel"):
        take_expert_shards(gate_up, down, E, ExpertGeometry((0,), 0, 3, H, INTER), "m.experts")
    with pytest.raises(FormatError, match="vLLM places expert 7 on this rank, but the layer has 4"):
        take_expert_shards(gate_up, down, E, ExpertGeometry((7,), 0, 1, H, INTER), "m.experts")


def test_vocab_rows_are_the_ranks_block_of_the_table() -> None:
    table = lut(10, seed=5)
    assert vocab_rows(table, 0, 10, "e") is table
    assert torch.equal(vocab_rows(table, 5, 10, "e").dequantize(), table.dequantize()[5:])
    with pytest.raises(
        FormatError, match=r"e: vLLM's vocab-parallel shard is rows \[5, 12\), but the artifact's table"
    ):
        vocab_rows(table, 5, 12, "e")
