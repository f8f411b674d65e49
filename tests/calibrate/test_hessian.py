"""Input Hessians accumulated by forward hooks (squeeze.calibrate.hessian), alone and during the Fisher pass."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from squeeze.calibrate.fisher import fisher_information
from squeeze.calibrate.hessian import (
    MIN_ROWS,
    MIN_TILED_WIDTH,
    dedupe_hessians,
    hessian_bytes_bound,
    input_hessians,
    output_weighted_hessians,
)
from squeeze.models.targets import find_target_linears
from squeeze.quant.ec import row_groups


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


def test_one_token_steps_are_buffered_and_a_wide_input_is_tiled_yet_the_sum_is_x_T_x():
    """Decode-like calls (a row each, fewer than MIN_ROWS) and a big one, on an input wide enough to be tiled:
    the result is the full symmetric sum, also when more calls follow a result() (it flushes, then goes on)."""
    torch.manual_seed(0)
    width = MIN_TILED_WIDTH + 3  # tiles of unequal widths
    linear = nn.Linear(width, 2)
    steps = [torch.randn(2, 1, width) for _ in range(MIN_ROWS // 2 + 5)]  # more than MIN_ROWS rows in all
    big = torch.randn(1, MIN_ROWS + 7, width)
    with input_hessians({"l": linear}) as acc:
        for x in [*steps[:3], big, *steps[3:]]:
            linear(x)
        first = acc.result()["l"].clone()
        linear(steps[0])
        second = acc.result()["l"]
    flat = torch.cat([x.reshape(-1, width) for x in [*steps, big]]).double()
    expected = (flat.T @ flat).float()
    torch.testing.assert_close(first, expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(first, first.T)  # mirrored, not computed twice
    extra = steps[0].reshape(-1, width).double()
    torch.testing.assert_close(second, (flat.T @ flat + extra.T @ extra).float(), rtol=1e-5, atol=1e-4)
    assert torch.equal(second, second.T)


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


def test_output_weighted_hessians_weight_each_token_by_its_groups_squared_output_gradient():
    torch.manual_seed(0)
    block = Block()
    xs = [torch.randn(2, 5, 6) for _ in range(2)]
    modules = {"a": block.a, "b": block.b, "c": block.c}
    grads: dict[str, list[torch.Tensor]] = {"a": [], "b": []}

    def catch(name: str):  # the reference output gradients, by tensor hooks on the outputs
        def hook(_module: nn.Module, _args: object, out: torch.Tensor) -> None:
            out.register_hook(lambda g: grads[name].append(g.detach()))

        return hook

    hooks = [getattr(block, n).register_forward_hook(catch(n)) for n in grads]
    try:
        with output_weighted_hessians(modules, 2) as acc:
            for x in xs:
                (block(x) ** 2).sum().backward()
    finally:
        for hook in hooks:
            hook.remove()
    h = acc.result()
    assert h["a"].shape == (2, 6, 6) and h["c"].shape == (2, 4, 4)
    assert h["b"] is not h["a"]  # same input, different output gradients: no sharing
    flat = torch.cat([x.reshape(-1, 6) for x in xs])
    for name, out in (("a", 4), ("b", 3)):
        g2 = torch.cat([g.reshape(-1, out) for g in grads[name]]) ** 2
        for g, rows in enumerate(row_groups(out, 2)):
            weights = g2[:, rows].mean(dim=1)
            torch.testing.assert_close(h[name][g], (flat * weights[:, None]).T @ flat, rtol=1e-5, atol=1e-5)


def test_output_weighted_hessians_without_a_backward_are_zero():
    block = Block()
    with output_weighted_hessians({"a": block.a}, 3) as acc, torch.no_grad():
        block(torch.randn(1, 4, 6))
    assert torch.equal(acc.result()["a"], torch.zeros(3, 6, 6))
    with pytest.raises(ValueError, match="groups must be >= 1"):
        output_weighted_hessians({"a": block.a}, 0).__enter__()


LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _tiny_copy(tiny_llama):
    import copy

    model, _tokenizer = tiny_llama
    return copy.deepcopy(model)


def _windows(n: int = 3, length: int = 24) -> torch.Tensor:
    return torch.randint(3, 300, (n, length), generator=torch.Generator().manual_seed(5))


def test_sequential_hessians_without_quantization_are_the_whole_model_pass(tiny_llama):
    from squeeze.calibrate.hessian import sequential_hessians

    model = _tiny_copy(tiny_llama)
    targets = find_target_linears(model, LLAMA_TARGETS)
    windows = _windows()
    with input_hessians(targets) as acc, torch.no_grad():
        for row in windows:
            model(input_ids=row[None], use_cache=False)
    expected = acc.result()
    seen: dict[str, torch.Tensor] = {}
    order: list[int] = []

    def record(index: int, hessians: dict[str, torch.Tensor]) -> None:
        order.append(index)
        assert all(f"layers.{index}." in name for name in hessians)  # only this block's targets
        seen.update(hessians)

    sequential_hessians(model, windows, targets, record)
    assert order == [0, 1] and sorted(seen) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(seen[name], expected[name], rtol=1e-5, atol=1e-4)
    assert seen["model.layers.0.self_attn.k_proj"] is seen["model.layers.0.self_attn.q_proj"]  # shared input


def test_sequential_hessians_see_the_blocks_above_as_quantized(tiny_llama, tmp_path):
    from squeeze.calibrate.hessian import sequential_hessians

    model = _tiny_copy(tiny_llama)
    targets = find_target_linears(model, LLAMA_TARGETS)
    windows = _windows()
    original = {name: m.weight.detach().clone() for name, m in targets.items()}
    seen: dict[str, torch.Tensor] = {}

    def coarsen(index: int, hessians: dict[str, torch.Tensor]) -> None:  # a stand-in quantizer: round to 0.05
        seen.update(hessians)
        for name in hessians:
            targets[name].weight.data = (targets[name].weight.data / 0.05).round() * 0.05

    sequential_hessians(model, windows, targets, coarsen, spill_dir=tmp_path / "spill")
    assert not any((tmp_path / "spill").iterdir())  # every spilled state read and removed
    # block 1's Hessians are those of the model whose block 0 is already coarsened, block 1 not yet (within a
    # block every Hessian comes from the block's weights before it is quantized)
    reference = _tiny_copy((model, None))
    for name, module in find_target_linears(reference, LLAMA_TARGETS).items():
        if ".layers.1." in name:
            module.weight.data = original[name].clone()
    ref_targets = {n: m for n, m in find_target_linears(reference, LLAMA_TARGETS).items() if ".layers.1." in n}
    with input_hessians(ref_targets) as acc, torch.no_grad():
        for row in windows:
            reference(input_ids=row[None], use_cache=False)
    for name, h in acc.result().items():
        torch.testing.assert_close(seen[name], h, rtol=1e-5, atol=1e-4)
    # and they differ from the original model's: the inputs moved
    name = "model.layers.1.mlp.down_proj"
    base = _tiny_copy(tiny_llama)
    with input_hessians({name: base.get_submodule(name)}) as acc, torch.no_grad():
        for row in windows:
            base(input_ids=row[None], use_cache=False)
    assert not torch.allclose(acc.result()[name], seen[name], rtol=1e-3, atol=1e-3)


def test_sequential_hessians_refuse_a_target_outside_the_blocks(tiny_llama):
    from squeeze.calibrate.hessian import sequential_hessians

    model = _tiny_copy(tiny_llama)
    with pytest.raises(ValueError, match="outside every block"):
        sequential_hessians(model, _windows(), {"lm_head": model.lm_head}, lambda i, h: None)
