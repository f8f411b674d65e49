"""fisher_information against a naive reference (loss.backward(), grad**2 summed) on stories260K."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from squeeze.calibrate import fisher_information
from squeeze.config import DEFAULT_TARGETS
from squeeze.models import find_target_linears


@pytest.fixture()
def model(stories: tuple):
    """A private copy of stories260K: these tests toggle flags on it."""
    return copy.deepcopy(stories[0])


def _windows(n: int = 3, t: int = 24, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n, t), generator=g)


def _naive_fisher(model, windows: torch.Tensor, names: list[str], batch_size: int = 1) -> dict[str, torch.Tensor]:
    """The obvious implementation: every parameter requires grad, backward per batch, square, add."""
    modules = dict(model.named_modules())
    acc = {name: torch.zeros_like(modules[name].weight) for name in names}
    model.eval()
    for start in range(0, windows.shape[0], batch_size):
        ids = windows[start : start + batch_size]
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        for name in names:
            acc[name] += modules[name].weight.grad ** 2
    model.zero_grad(set_to_none=True)
    return acc


def _assert_matches(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert got.keys() == ref.keys()
    for name in ref:
        g, r = got[name], ref[name]
        assert g.shape == r.shape and g.dtype == torch.float32
        rel = (g - r).abs().max() / r.abs().max()
        assert rel <= 1e-6, f"{name}: relative error {rel:.2e}"


def test_matches_naive_reference_and_restores_state(model) -> None:
    targets = find_target_linears(model, DEFAULT_TARGETS, ["lm_head"])
    # Mixed requires_grad flags and training mode beforehand: all must come back as they were.
    model.train()
    model.model.norm.weight.requires_grad_(False)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    windows = _windows()
    calls: list[tuple[int, int]] = []
    got = fisher_information(model, windows, targets, progress=lambda d, t: calls.append((d, t)))

    assert calls == [(1, 3), (2, 3), (3, 3)]
    assert model.training
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert all(p.grad is None for p in model.parameters())
    assert all(bool((f >= 0).all()) and bool(f.any()) for f in got.values())

    ref = _naive_fisher(copy.deepcopy(model), windows, list(targets))
    _assert_matches(got, ref)


def test_batched_is_square_of_batch_gradient(model) -> None:
    targets = find_target_linears(model, ["down_proj", "q_proj"], [])
    windows = _windows(4, 16, seed=1)
    got = fisher_information(model, windows, targets, batch_size=2)
    _assert_matches(got, _naive_fisher(copy.deepcopy(model), windows, list(targets), batch_size=2))


def test_subset_of_modules_and_lm_head(model) -> None:
    targets = find_target_linears(model, ["lm_head", "layers.2.mlp.up_proj"], [])
    windows = _windows(2, 12, seed=2)
    got = fisher_information(model, windows, targets)
    assert set(got) == {"lm_head", "model.layers.2.mlp.up_proj"}
    _assert_matches(got, _naive_fisher(copy.deepcopy(model), windows, list(targets)))


def test_hooks_are_removed(model) -> None:
    targets = find_target_linears(model, ["o_proj"], [])
    fisher_information(model, _windows(1, 8), targets)
    # A leftover hook would square the grad away and set .grad to None: an ordinary backward keeps it.
    ids = _windows(1, 8)
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(m.weight.grad is not None for m in targets.values())


def test_failure_restores_flags(model) -> None:
    targets = find_target_linears(model, ["q_proj"], [])
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    bad = torch.full((1, 8), 10_000)  # token id beyond the 512-entry vocabulary: the embedding raises
    with pytest.raises(IndexError):
        fisher_information(model, bad, targets)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert all(p.grad is None for p in model.parameters())


def test_works_under_inference_mode(model) -> None:
    targets = find_target_linears(model, ["v_proj"], [])
    with torch.inference_mode():
        got = fisher_information(model, _windows(1, 8), targets)
    assert all(bool(f.any()) for f in got.values())


def test_accumulator_device_and_dtype_bf16(stories_dir) -> None:
    from squeeze.models import load_model, resolve_model

    bf16, _ = load_model(resolve_model(str(stories_dir)), dtype=torch.bfloat16)
    targets = find_target_linears(bf16, ["gate_proj"], [])
    got = fisher_information(bf16, _windows(1, 8), targets, accumulator_device="cpu")
    assert all(f.dtype == torch.float32 and f.shape == (172, 64) and bool(f.any()) for f in got.values())


@pytest.mark.parametrize(
    ("windows", "match"),
    [
        (torch.zeros(2, 8), "int64"),
        (torch.zeros(8, dtype=torch.long), r"\(n, T\)"),
        (torch.zeros(2, 1, dtype=torch.long), ">= 2 tokens"),
        (torch.zeros(0, 8, dtype=torch.long), ">= 2 tokens"),
    ],
)
def test_bad_windows(model, windows: torch.Tensor, match: str) -> None:
    targets = find_target_linears(model, ["q_proj"], [])
    with pytest.raises(ValueError, match=match):
        fisher_information(model, windows, targets)


def test_bad_arguments(model) -> None:
    targets = find_target_linears(model, ["q_proj"], [])
    with pytest.raises(ValueError, match="batch_size"):
        fisher_information(model, _windows(), targets, batch_size=0)
    with pytest.raises(ValueError, match="at least one target"):
        fisher_information(model, _windows(), {})
    other = copy.deepcopy(model)
    with pytest.raises(ValueError, match="not part of the model"):
        fisher_information(model, _windows(), find_target_linears(other, ["q_proj"], []))


def test_shared_weight_feeds_every_name(model) -> None:
    targets = find_target_linears(model, ["layers.1.mlp.up_proj"], [])
    # The same module under two names (as tied linears appear): both accumulators see the same gradient.
    twice = {"a": targets["model.layers.1.mlp.up_proj"], "b": targets["model.layers.1.mlp.up_proj"]}
    got = fisher_information(model, _windows(2, 8), twice)
    assert torch.equal(got["a"], got["b"]) and bool(got["a"].any())


def test_add_square_in_slices_matches_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """add_square widens a slice of dim 0 at a time (a MoE expert gradient is as large as all its experts):
    the float64 sums are bit-identical to squaring the whole gradient at once, for any slice size."""
    from squeeze.calibrate import fisher as fisher_module

    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(7, 5, 3, generator=g) * 10 ** torch.randint(-6, 6, (7, 5, 3), generator=g) for _ in range(3)]
    whole = torch.zeros(7, 5, 3, dtype=torch.float64)
    for grad in grads:
        gd = grad.double()
        whole.addcmul_(gd, gd)
    for chunk in (1, 15, 16, 40, 10**6):
        monkeypatch.setattr(fisher_module, "SQUARE_CHUNK_ELEMENTS", chunk)
        acc = torch.zeros(7, 5, 3, dtype=torch.float64)
        for grad in grads:
            fisher_module.add_square(acc, grad)
        assert torch.equal(acc, whole), chunk
    vector = torch.zeros(4, dtype=torch.float64)  # 1-D (a bias-like or embedding row): sliced too
    fisher_module.add_square(vector, torch.tensor([1.5, -2.0, 3.0, 0.25]))
    assert vector.tolist() == [2.25, 4.0, 9.0, 0.0625]
