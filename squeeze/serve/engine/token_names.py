"""The strings log-probabilities name tokens by: each token read in context, distinct at every position.

A token's text depends on what precedes it (a SentencePiece word's leading space, the bytes of a character),
so each one, chosen or alternative, is named by the text it adds after the tokens before it, as the response's
text reads it (:mod:`squeeze.runtime.text_stream`): ``" there"`` and ``"there"`` stay apart, and the chosen
token's name is its own entry in ``tokens`` and a key of its own ``top_logprobs``. Where that text cannot tell
tokens apart (a special token the text drops, a byte of an unfinished character, two tokens adding the same
text) the token's vocabulary entry names it (``</s>``, ``<0xE2>``, as vLLM's ``convert_ids_to_tokens``), and
``token_id:N`` (vLLM's spelling) where even that is taken, so ``logprobs: 20`` gives 20 keys. Chat's ``bytes``
are each token's own where its vocabulary entry spells them (``<0xE2>``, a byte-level BPE entry), so the bytes of
a character's tokens join to the character.

The text a token adds is read as vLLM's incremental detokenizer reads it: decode the tokens from the start of
the last complete piece of text (``prefix``) through the token, and take what follows that piece's own text
(``prefix`` to ``read``); a token that leaves a character unfinished adds nothing yet, and the offsets move on
only past complete text, so a window never starts inside a character.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

from squeeze.runtime.text_stream import CONTEXT_TOKENS, INCOMPLETE, char_start, text_after
from squeeze.serve.types import TokenLogprob, TokenNames


def token_names(
    tokenizer: Any, context: Sequence[int], entries: Sequence[TokenLogprob], *, specials: bool = False
) -> list[TokenNames]:
    """The names of each entry's chosen token and alternatives, each read after ``context`` and the entries
    before it. ``specials``: the text spells special tokens (an echoed prompt sent as ids, which
    ``detokenize`` writes with them); else they add nothing to it, as in generated text."""

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=not specials)) if ids else ""

    tokens = [int(i) for i in context[-CONTEXT_TOKENS:]]
    read = len(tokens)
    prefix = char_start(decode, tokens, 0)
    named = []
    counted = 0  # characters of the response's text these entries have written so far
    for entry in entries:
        window = tokens[prefix:]
        before = decode(tokens[prefix:read])

        def added(token: int, window: list[int] = window, before: str = before) -> tuple[str, int] | None:
            """What ``token`` adds after the window (as the response's text reads it) and how many characters
            at the end of the window's text it rewrites; None while it leaves a character unfinished."""
            full = decode([*window, token])
            if full.endswith(INCOMPLETE):
                return None
            text = text_after(full, before)
            return text, len(before) - (len(full) - len(text))

        chosen = added(entry.token_id)
        names: dict[int, str] = {}
        raw_bytes: dict[int, list[int]] = {}
        for token in (entry.token_id, *(i for i, _ in entry.top)):
            if token in names:
                continue
            reading = (chosen if token == entry.token_id else added(token)) or ("", 0)
            # the U+FFFD of earlier bytes that this token shows will never complete are theirs, not its own
            names[token] = _distinct(reading[0].lstrip(INCOMPLETE), tokenizer, token, names)
            own = _own_bytes(tokenizer, token)  # the last byte of a character is named by the character
            if own is not None:
                raw_bytes[token] = own
        text, rewrites = chosen or ("", 0)
        rewrites = min(rewrites, counted)  # the context's own text (an unfinished character) is not the response's
        counted += len(text) - rewrites
        lead = len(text) - len(text.lstrip(INCOMPLETE))
        named.append(TokenNames(text, names, raw_bytes, lead, rewrites))
        tokens.append(entry.token_id)
        if text:  # complete text up to here: the next window starts at this token's piece (never at a special
            # token that adds nothing: a window that starts there would lose the next word's leading space)
            prefix, read = read, len(tokens)
    return named


def _distinct(text: str, tokenizer: Any, token: int, names: dict[int, str]) -> str:
    """``text``, or the token's vocabulary entry where the text is empty, unfinished or another token's name,
    or ``token_id:N`` where even that is taken."""
    taken = set(names.values())
    if text and INCOMPLETE not in text and text not in taken:
        return text
    entry = tokenizer.convert_ids_to_tokens(token)
    if isinstance(entry, str) and entry and entry not in taken:
        return entry
    return f"token_id:{token}"


def _own_bytes(tokenizer: Any, token: int) -> list[int] | None:
    """A token's bytes read from its vocabulary entry: SentencePiece's byte tokens (``<0xE2>``) and a
    byte-level BPE's entries (GPT-2's printable stand-ins for bytes); None for any other entry."""
    entry = tokenizer.convert_ids_to_tokens(token)
    if not isinstance(entry, str) or not entry:
        return None
    match = _BYTE_TOKEN.fullmatch(entry)
    if match:
        return [int(match.group(1), 16)]
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if type(decoder).__name__ == "ByteLevel":
        table = _byte_level_table()
        if all(char in table for char in entry):
            return [table[char] for char in entry]
    return None


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_table() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


__all__ = ["token_names"]
