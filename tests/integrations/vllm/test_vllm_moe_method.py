"""The fused-MoE method's forward on its own (skipped without vLLM): the rank's routed experts run on their
compressed shards and, summed over tensor-parallel ranks, give the dense experts' output; under expert
parallelism a rank adds only its own experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/check_vllm.sh builds an environment with it)")

from squeeze.integrations.vllm.moe import ExpertsState, routed_experts  # noqa: E402
from squeeze.integrations.vllm.sharding import ExpertGeometry, take_expert_shards  # noqa: E402
from squeeze.quant.schemes.lut import quantize_lut  # noqa: E402
from squeeze.runtime.experts import SqueezeExperts  # noqa: E402

E, H, INTER, T, K = 4, 16, 12, 5, 2


def weights() -> tuple:
    g = torch.Generator().manual_seed(0)
    gate_up = quantize_lut(torch.randn(E * 2 * INTER, H, generator=g), torch.rand(E * 2 * INTER, H, generator=g), 4)
    down = quantize_lut(torch.randn(E * H, INTER, generator=g), torch.rand(E * H, INTER, generator=g), 3)
    return gate_up, down


def dense_moe(gate_up, down, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, only=range(E)) -> torch.Tensor:
    """The reference: every routed expert of ``only`` from its dequantized matrices, weighted and summed."""
    gu = gate_up.dequantize().view(E, 2 * INTER, H)
    dn = down.dequantize().view(E, H, INTER)
    out = torch.zeros_like(x)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            if e in only:
                gate, up = (x[t] @ gu[e].T).chunk(2)
                out[t] += w[t, k] * ((F.silu(gate) * up) @ dn[e].T)
    return out


def state(gate_up, down, geometry: ExpertGeometry, local_of: torch.Tensor | None) -> ExpertsState:
    gu, dn = take_expert_shards(gate_up, down, E, geometry, "m.experts")
    s = ExpertsState("m.experts", geometry, E, local_of, torch.device("cpu"))
    s.gate_up, s.down = SqueezeExperts(gu, len(geometry.experts)), SqueezeExperts(dn, len(geometry.experts))
    return s


def routing() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    return x, torch.rand(T, K, generator=g), ids


@pytest.mark.parametrize("tp", [1, 2])
def test_the_ranks_partial_sums_are_the_dense_experts_output(tp: int) -> None:
    gate_up, down = weights()
    x, w, ids = routing()
    total = sum(
        routed_experts(state(gate_up, down, ExpertGeometry(tuple(range(E)), r, tp, H, INTER), None), x, w, ids)
        for r in range(tp)
    )
    torch.testing.assert_close(total, dense_moe(gate_up, down, x, w, ids), rtol=1e-4, atol=1e-4)


def test_under_expert_parallelism_a_rank_adds_only_its_experts() -> None:
    gate_up, down = weights()
    x, w, ids = routing()
    mine = (3, 1)  # local 0 is global 3, local 1 is global 1
    local_of = torch.tensor([-1, 1, -1, 0])
    out = routed_experts(state(gate_up, down, ExpertGeometry(mine, 0, 1, H, INTER), local_of), x, w, ids)
    torch.testing.assert_close(out, dense_moe(gate_up, down, x, w, ids, only=mine), rtol=1e-4, atol=1e-4)
