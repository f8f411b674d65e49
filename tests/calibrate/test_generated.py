"""Windows sampled from the model itself (squeeze.calibrate.generated): seeded, what the model predicts, and
the Hessians hooks accumulate while sampling are those of one plain forward over the sampled tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from squeeze.calibrate.generated import sample_windows_from_model, start_token
from squeeze.calibrate.hessian import input_hessians
from squeeze.errors import ConfigError
from squeeze.models.targets import find_target_linears


def test_same_seed_same_tokens_other_seed_other_tokens(tiny_llama):
    model, _ = tiny_llama
    a = sample_windows_from_model(model, 3, 12, start=1, seed=0, batch_size=2)
    b = sample_windows_from_model(model, 3, 12, start=1, seed=0, batch_size=2)
    c = sample_windows_from_model(model, 3, 12, start=1, seed=1, batch_size=2)
    assert a.shape == (3, 12) and a.dtype == torch.int64
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert int(a.min()) >= 0 and int(a.max()) < model.config.vocab_size
    assert len(set(a.flatten().tolist())) > 3  # sampled, not one repeated token


def test_a_tiny_temperature_gives_the_models_greedy_continuation(tiny_llama):
    model, _ = tiny_llama
    out = sample_windows_from_model(model, 2, 10, start=1, seed=0, temperature=1e-6)
    ids = torch.cat([torch.full((2, 1), 1), out], dim=1)  # (2, 11): the start token, then the samples
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits  # (2, 11, V): one plain forward, no cache
    assert torch.equal(logits[:, :-1].argmax(dim=-1), out)


def test_hooks_see_every_step_as_one_forward_over_the_samples(tiny_llama):
    model, _ = tiny_llama
    targets = find_target_linears(model, ("q_proj", "o_proj", "down_proj"), ("lm_head",))
    steps: list[tuple[int, int]] = []
    with input_hessians(targets) as during:
        out = sample_windows_from_model(
            model, 3, 8, start=1, seed=0, batch_size=2, progress=lambda d, t: steps.append((d, t))
        )
    assert steps[-1] == (16, 16) and len(steps) == 16  # 2 batches x 8 steps
    fed = torch.cat([torch.full((3, 1), 1), out[:, :-1]], dim=1)  # what the 8 steps fed each sequence
    with input_hessians(targets) as plain, torch.no_grad():
        model(input_ids=fed, use_cache=False)
    for name in targets:
        torch.testing.assert_close(during.result()[name], plain.result()[name], rtol=1e-4, atol=1e-4)


def test_start_token_is_bos_else_eos_else_a_clear_error():
    assert start_token(SimpleNamespace(bos_token_id=5, eos_token_id=7)) == 5
    assert start_token(SimpleNamespace(bos_token_id=None, eos_token_id=7)) == 7
    with pytest.raises(ConfigError, match="no BOS or EOS token"):
        start_token(SimpleNamespace(bos_token_id=None, eos_token_id=None))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_samples": 0}, "num_samples"),
        ({"seq_len": 0}, "num_samples, seq_len"),
        ({"temperature": 0.0}, "temperature"),
    ],
)
def test_bad_arguments(tiny_llama, kwargs, match):
    model, _ = tiny_llama
    with pytest.raises(ValueError, match=match):
        sample_windows_from_model(model, **{"num_samples": 2, "seq_len": 4, "start": 1, "seed": 0, **kwargs})
