"""How log-probabilities name tokens (squeeze.serve.engine.token_names, issue 50 item 5) on a SentencePiece-like
tokenizer: read in context, distinct at each position, offsets that index the text. No model: milliseconds."""

from __future__ import annotations

from typing import Any

import pytest

from sentencepiece_tokenizer import build_sentencepiece_tokenizer
from squeeze.runtime.text_stream import continuation_text
from squeeze.serve.engine.token_names import token_names
from squeeze.serve.logprobs import LegacyLogprobs, chat_logprobs
from squeeze.serve.types import TokenLogprob


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_sentencepiece_tokenizer()


def _entries(tokenizer: Any, ids: list[int], alternatives: list[int]) -> list[TokenLogprob]:
    """Each id chosen, with ``alternatives`` (and itself) as its top tokens."""
    return [
        TokenLogprob(t, -1.0, ((t, -1.0), *((a, -2.0 - k) for k, a in enumerate(alternatives) if a != t))) for t in ids
    ]


def test_tokens_are_named_by_the_text_they_add_in_context(tokenizer: Any) -> None:
    prompt = tokenizer("Once upon a time")["input_ids"]
    ids = tokenizer(" the cat sat", add_special_tokens=False)["input_ids"]
    vocab = tokenizer.get_vocab()
    # words with and without their space, the bare space, a byte and the end of text: out of context "it" and
    # "\u2581it", or "\u2581" and "</s>", decoded alike and collided as dict keys
    lookalikes = [vocab[p] for p in ("\u2581it", "it", "\u2581a", "a", "\u2581", "</s>", "<0xC3>", "<s>")]
    named = token_names(tokenizer, prompt, _entries(tokenizer, ids, lookalikes))
    assert "".join(n.text for n in named) == " the cat sat"
    for entry, name in zip(_entries(tokenizer, ids, lookalikes), named, strict=True):
        assert set(name.names) == {entry.token_id, *lookalikes}
        assert len(set(name.names.values())) == len(name.names)  # distinct: a dict of 9 ids has 9 keys
        assert name.names[entry.token_id] == name.text  # a word is named by its text
    first = named[0].names
    assert first[vocab["\u2581it"]] == " it" and first[vocab["it"]] == "it" and first[vocab["\u2581"]] == " "
    assert first[vocab["</s>"]] == "</s>" and first[vocab["<0xC3>"]] == "<0xC3>"  # adds no text: its entry


def test_a_character_spelled_in_bytes_is_written_on_its_last_byte(tokenizer: Any) -> None:
    prompt = tokenizer("a")["input_ids"]
    ids = tokenizer(" \u00e9\U0001f600 b", add_special_tokens=False)["input_ids"]
    named = token_names(tokenizer, prompt, [TokenLogprob(t, -1.0) for t in ids])
    pieces = [n.text for n in named]
    assert "".join(pieces) == " \u00e9\U0001f600 b"
    assert "\U0001f600" in pieces and pieces[pieces.index("\U0001f600") - 1] == ""  # its earlier bytes add nothing
    for token, piece, name in zip(ids, pieces, named, strict=True):
        if piece == "":  # a byte of an unfinished character: named by its vocabulary entry
            assert name.names[token] == tokenizer.convert_ids_to_tokens(token) and name.names[token].startswith("<0x")
        else:
            assert name.names[token] == piece
    # chat's bytes: a byte token's own byte (not the bytes of its name "<0xC3>"), so they join to the text's
    chat = chat_logprobs([TokenLogprob(t, -1.0) for t in ids], lambda c, e: token_names(tokenizer, c, e), 0, prompt)
    assert b"".join(bytes(item["bytes"]) for item in chat["content"]) == " \u00e9\U0001f600 b".encode()


def test_byte_level_tokens_of_a_character_carry_their_own_bytes() -> None:
    """GPT-2-style byte-level BPE (SmolLM2, Llama 3, Qwen): "\u00e9" is two tokens, each one byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(["the cat sat on the mat"] * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    prompt = tokenizer("the cat")["input_ids"]
    ids = tokenizer(" caf\u00e9 \U0001f600", add_special_tokens=False)["input_ids"]
    named = token_names(tokenizer, prompt, [TokenLogprob(t, -1.0) for t in ids])
    assert "".join(n.text for n in named) == " caf\u00e9 \U0001f600"
    chat = chat_logprobs([TokenLogprob(t, -1.0) for t in ids], lambda c, e: token_names(tokenizer, c, e), 0, prompt)
    assert b"".join(bytes(item["bytes"]) for item in chat["content"]) == " caf\u00e9 \U0001f600".encode()
    assert any(n.text == "" for n in named)  # a byte of an unfinished character adds nothing yet


def test_text_offsets_index_the_text_and_every_top_key_is_distinct(tokenizer: Any) -> None:
    prompt = tokenizer("Once upon a time")["input_ids"]
    ids = tokenizer(" the cat \u00e9 sat", add_special_tokens=False)["input_ids"]
    alternatives = list(range(20))  # specials, byte tokens: 20 ids that add no text or no whole character
    entries = _entries(tokenizer, ids, alternatives)
    writer = LegacyLogprobs(lambda c, e, specials=False: token_names(tokenizer, c, e, specials=specials), offset=5)
    body = writer.render(entries, context=prompt)
    text = "12345 the cat \u00e9 sat"
    for i, (token, offset, top) in enumerate(
        zip(body["tokens"], body["text_offset"], body["top_logprobs"], strict=True)
    ):
        assert token in top and top[token] == -1.0  # the chosen token is a key of its own dict
        assert len(top) == len({ids[i], *alternatives})  # no two ids share a key
        if not token.startswith("<0x"):
            assert text[offset:].startswith(token), (i, token, offset)
    chat = chat_logprobs(entries, lambda c, e: token_names(tokenizer, c, e), 20, prompt)
    for item in chat["content"]:
        names = [t["token"] for t in item["top_logprobs"]]
        assert len(names) == len(set(names)) == 20 and item["token"] in names


def test_an_echoed_prompt_sent_as_ids_is_named_with_its_special_tokens(tokenizer: Any) -> None:
    ids = tokenizer("Once upon a time")["input_ids"]
    echoed = tokenizer.decode(ids, skip_special_tokens=False)  # what detokenize echoes: "<s> Once upon a time"
    entries = [TokenLogprob(ids[0], None), *(TokenLogprob(t, -1.0) for t in ids[1:])]
    body = LegacyLogprobs(lambda c, e, specials=False: token_names(tokenizer, c, e, specials=specials)).render(
        entries, specials=True
    )
    assert "".join(body["tokens"]) == echoed and body["tokens"][0] == "<s>"
    assert all(echoed[o:].startswith(t) for o, t in zip(body["text_offset"], body["tokens"], strict=True))
    plain = LegacyLogprobs(lambda c, e, specials=False: token_names(tokenizer, c, e, specials=specials)).render(entries)
    assert plain["tokens"][0] == "<s>" and plain["text_offset"][:2] == [0, 0]  # a prompt sent as text: no <s> in it
    assert "".join(plain["tokens"][1:]) == "Once upon a time"


def test_offsets_follow_a_byte_run_that_an_invalid_byte_rewrites(tokenizer: Any) -> None:
    """A byte-fallback decoder writes every byte of a run as U+FFFD once one byte is invalid: "(&" read as
    two characters becomes three U+FFFD with the orphan first byte of "\u00e9" after it. The next word's offset
    still indexes the final text."""
    prompt = tokenizer("Once upon")["input_ids"]
    ids = [
        *tokenizer.convert_tokens_to_ids(["<0x28>", "<0x26>", "<0xC3>"]),
        *tokenizer(" the", add_special_tokens=False)["input_ids"],
    ]
    text = continuation_text(tokenizer, prompt, ids)
    assert text.startswith("\ufffd\ufffd\ufffd") and text.endswith(" the")
    writer = LegacyLogprobs(lambda c, e, specials=False: token_names(tokenizer, c, e, specials=specials))
    body = writer.render([TokenLogprob(t, -1.0) for t in ids], context=prompt)
    assert body["tokens"][:2] == ["(", "&"] and body["tokens"][3] == " the"
    assert text[body["text_offset"][3] :] == " the"


def test_a_word_after_a_special_token_keeps_its_space(tokenizer: Any) -> None:
    prompt = tokenizer("Once upon")["input_ids"]
    ids = [tokenizer.eos_token_id, *tokenizer(" a time", add_special_tokens=False)["input_ids"]]
    assert continuation_text(tokenizer, prompt, ids) == " a time"  # the text drops </s>
    named = token_names(tokenizer, prompt, [TokenLogprob(t, -1.0) for t in ids])
    assert [n.text for n in named] == ["", " a", " time"] and named[0].names[ids[0]] == "</s>"


def test_a_character_begun_in_the_context_is_the_first_tokens_text_at_offset_zero(tokenizer: Any) -> None:
    whole = tokenizer("a \u00e9 b")["input_ids"]
    cut = next(i for i, t in enumerate(tokenizer.convert_ids_to_tokens(whole)) if t == "<0xC3>") + 1
    body = LegacyLogprobs(lambda c, e, specials=False: token_names(tokenizer, c, e, specials=specials)).render(
        [TokenLogprob(t, -1.0) for t in whole[cut:]], context=whole[:cut]
    )
    assert continuation_text(tokenizer, whole[:cut], whole[cut:]) == "\u00e9 b"
    assert "".join(body["tokens"]) == "\u00e9 b" and body["tokens"][0] == "\u00e9"
    assert body["text_offset"] == [0, 1, 2][: len(body["tokens"])]  # it was -1: the context's U+FFFD "rewritten"
