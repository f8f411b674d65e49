"""Input Hessians accumulated by forward hooks (squeeze.calibrate.hessian), alone and during the Fisher pass."""

from __future__ import annotations

import torch
from torch import nn

from squeeze.calibrate.fisher import fisher_information
from squeeze.calibrate.hessian import dedupe_hessians, hessian_bytes_bound, input_hessians
from squeeze.models.targets import find_target_linears


class Block(nn.Module):
    """a and b read the same input (as q/k/v do); c reads another."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 4)
        self.b = nn.Linear(6, 3)
        self.c = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.a(x) * 2.0) + self.b(x).sum(-1, keepdim=True)


def test_hessians_are_sum_xxT_and_shared_inputs_share_one_tensor():
    torch.manual_seed(0)
    block = Block()
    xs = [torch.randn(2, 5, 6) for _ in range(3)]
    modules = {"a": block.a, "b": block.b, "c": block.c}
    with input_hessians(modules) as acc:
        for x in xs:
            block(x)
    h = acc.result()
    flat = torch.cat([x.reshape(-1, 6) for x in xs])
    torch.testing.assert_close(h["a"], flat.T @ flat)
    assert h["b"] is h["a"]  # accumulated once, not twice
    mid = torch.cat([(block.a(x) * 2.0).reshape(-1, 4) for x in xs]).detach()
    torch.testing.assert_close(h["c"], mid.T @ mid)
    assert acc.shared_inputs() == {"a": "a", "b": "a", "c": "c"}
    stored, alias = dedupe_hessians(h)
    assert sorted(stored) == ["a", "c"] and alias == {"a": "a", "b": "a", "c": "c"}
    assert hessian_bytes_bound(modules) == 4 * (36 + 36 + 16)
    # the hooks are gone: running again changes nothing
    before = h["a"].clone()
    block(xs[0])
    assert torch.equal(h["a"], before)


def test_a_module_never_called_gets_a_zero_hessian():
    block = Block()
    with input_hessians({"a": block.a}) as acc:
        pass
    h = acc.result()["a"]
    assert h.shape == (6, 6) and not h.any()


def test_accumulated_during_the_fisher_pass_on_a_llama(tiny_llama):
    model, _ = tiny_llama
    targets = find_target_linears(
        model, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), ("lm_head",)
    )
    windows = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with input_hessians(targets) as acc:
        fisher = fisher_information(model, windows, targets)
    h = acc.result()
    assert sorted(fisher) == sorted(h)
    layer = "model.layers.0"
    assert h[f"{layer}.self_attn.k_proj"] is h[f"{layer}.self_attn.q_proj"] is h[f"{layer}.self_attn.v_proj"]
    assert h[f"{layer}.mlp.up_proj"] is h[f"{layer}.mlp.gate_proj"]
    assert h[f"{layer}.self_attn.o_proj"] is not h[f"{layer}.self_attn.q_proj"]
    down = h[f"{layer}.mlp.down_proj"]
    assert down.shape == (model.config.intermediate_size,) * 2
    # reference for q's input: the layer's input norm over the same windows, one plain forward
    captured: list[torch.Tensor] = []
    handle = model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(
        lambda _m, args: captured.append(args[0].detach().reshape(-1, args[0].shape[-1]))
    )
    try:
        with torch.no_grad():
            model(input_ids=windows, use_cache=False)
    finally:
        handle.remove()
    flat = torch.cat(captured)
    torch.testing.assert_close(h[f"{layer}.self_attn.q_proj"], flat.T @ flat, rtol=1e-4, atol=1e-4)
    assert len(set(map(id, h.values()))) == 4 * model.config.num_hidden_layers  # qkv, o, gate/up, down per block
