"""Incremental text with stop strings (squeeze.runtime.text_stream): the pieces concatenate to the final text,
which ends before the first stop string."""

from __future__ import annotations

import pytest

from squeeze.runtime.text_stream import TextState


class _CharTokenizer:
    """Token i is character chr(i); 0xFFFD stands for a half-arrived multi-byte character."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def _stream(text: str, stops: tuple[str, ...]) -> tuple[list[str], bool]:
    state, pieces, stopped = TextState(stops), [], False
    ids = [ord(c) for c in text]
    for n in range(1, len(ids) + 1):
        piece, stopped = state.update(_CharTokenizer(), ids[:n], final=n == len(ids))
        pieces.append(piece)
        if stopped:
            break
    return pieces, stopped


@pytest.mark.parametrize(
    ("text", "stops", "final", "stopped"),
    [
        ("hello world", (), "hello world", False),
        ("hello world", ("wor",), "hello ", True),
        ("hello world", ("xyz", "lo w"), "hel", True),
        ("ab ab abc", ("abc",), "ab ab ", True),  # "ab" is held back twice, then released
        ("aaa", ("aab",), "aaa", False),  # a held-back tail comes out at the end
    ],
)
def test_pieces_concatenate_to_the_text_before_the_first_stop(
    text: str, stops: tuple[str, ...], final: str, stopped: bool
) -> None:
    pieces, did_stop = _stream(text, stops)
    assert "".join(pieces) == final and did_stop is stopped


def test_a_tail_that_may_become_a_stop_string_is_held_back() -> None:
    state = TextState(("END",))
    piece, _ = state.update(_CharTokenizer(), [ord(c) for c in "xyEN"], final=False)
    assert piece == "xy"
    piece, _ = state.update(_CharTokenizer(), [ord(c) for c in "xyENx"], final=False)
    assert piece == "ENx"


def test_an_incomplete_character_waits_for_its_bytes() -> None:
    state = TextState(())
    assert state.update(_CharTokenizer(), [ord("a"), 0xFFFD], final=False)[0] == "a"
    assert state.update(_CharTokenizer(), [ord("a"), ord("é")], final=False)[0] == "é"
