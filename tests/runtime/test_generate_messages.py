"""Context-length messages of generate / ``squeeze run``: the hint given is one that works when followed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from squeeze import api
from squeeze.cli.app import app
from squeeze.errors import ConfigError
from squeeze.runtime.generate import check_context, generate

SENTENCE = "Once upon a time there was a little girl."
CONTEXT = 512  # stories260K's max_position_embeddings


def _n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text)["input_ids"])  # what generate counts: special tokens (BOS) included


def _prompt_of_at_most(tokenizer, n: int) -> str:
    """The longest run of SENTENCE words that tokenizes to at most ``n`` tokens."""
    words = (SENTENCE + " ") * (n // 4 + 10)
    words = words.split()
    lo, hi = 1, len(words)
    while lo < hi:  # binary search on the word count
        mid = (lo + hi + 1) // 2
        if _n_tokens(tokenizer, " ".join(words[:mid])) <= n:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def _hint_number(hint: str, pattern: str) -> int:
    found = re.search(pattern, hint)
    assert found, hint
    return int(found.group(1))


def test_a_prompt_longer_than_the_context_says_so_and_the_hint_works(stories) -> None:
    model, tokenizer = stories
    long_prompt = " ".join([SENTENCE] * 60)
    n = _n_tokens(tokenizer, long_prompt)
    assert n > CONTEXT
    for max_new in (5, 1):
        with pytest.raises(ConfigError) as info:
            generate(model, tokenizer, [long_prompt], max_new_tokens=max_new)
        assert f"the prompt is too long: it has {n} tokens" in info.value.message
        assert f"context is {CONTEXT} tokens" in info.value.message
        hint = info.value.hint or ""
        assert "--max-new-tokens 1 or less" not in hint  # the old hint, which failed the same way
        room = _hint_number(hint, r"shorten the prompt to at most (\d+) tokens")
        assert room == CONTEXT - max_new
        shorter = _prompt_of_at_most(tokenizer, room)
        result = generate(model, tokenizer, [shorter], max_new_tokens=max_new)  # following the hint works
        assert result.prompt_tokens[0] <= room and result.new_tokens[0] >= 1


def test_a_prompt_that_exactly_fills_the_context_is_too_long() -> None:
    with pytest.raises(ConfigError, match="too long: it has 512 tokens") as info:
        check_context([512], 1, CONTEXT)
    assert "at most 511 tokens" in (info.value.hint or "")


def test_more_new_tokens_than_the_context_holds_asks_for_both() -> None:
    with pytest.raises(ConfigError, match="too long") as info:
        check_context([600], 700, CONTEXT)
    assert "lower --max-new-tokens" in (info.value.hint or "") and "at most" not in (info.value.hint or "")


def test_too_many_new_tokens_suggests_a_count_that_fits(stories) -> None:
    model, tokenizer = stories
    prompt = " ".join([SENTENCE] * 40)
    n = _n_tokens(tokenizer, prompt)
    assert n < CONTEXT
    with pytest.raises(ConfigError, match=f"\\({n} tokens\\) \\+ max_new_tokens \\(100\\)") as info:
        generate(model, tokenizer, [prompt], max_new_tokens=100)
    fits = _hint_number(info.value.hint or "", r"--max-new-tokens (\d+) or less")
    assert fits == CONTEXT - n >= 1
    assert generate(model, tokenizer, [prompt], max_new_tokens=fits).prompt_tokens == [n]


def test_in_a_batch_the_longest_prompt_is_named(stories) -> None:
    model, tokenizer = stories
    with pytest.raises(ConfigError, match="prompt 2 of 3 is too long") as info:
        generate(model, tokenizer, ["Hi", " ".join([SENTENCE] * 60), "Once"], max_new_tokens=4)
    assert "shorten prompt 2 of 3 to at most 508 tokens" in (info.value.hint or "")


def test_cli_run_hint_for_a_too_long_prompt(tmp_path: Path, stories_dir: Path) -> None:
    artifact = tmp_path / "art"
    api.compress(str(stories_dir), artifact, recipe="rtn-w4")
    result = CliRunner().invoke(app, ["run", " ".join([SENTENCE] * 60), "-m", str(artifact), "-n", "1"])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("Error: the prompt is too long: it has ")
    assert "Hint: shorten the prompt to at most 511 tokens" in result.stderr
