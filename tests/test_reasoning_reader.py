"""A choice's text split into its thinking and its answer, whole or in pieces cut anywhere (a
marker may come cut across pieces): the same parts either way."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnstile.gateway_svc.reasoning import ReasoningReader

TEXTS = [
    ("I weigh it.</think>It is 4.", True, ("I weigh it.", "It is 4.")),
    ("<think>\nI weigh it.\n</think>\n\nIt is 4.", True, ("\nI weigh it.\n", "\n\nIt is 4.")),
    ("still <thin thinking", True, ("still <thin thinking", "")),  # no marker: all thinking
    ("It is 4.", False, (None, "It is 4.")),  # the prompt closed the thinking
    ("</think>", True, ("", "")),
    ("a</think>b</think>c", True, ("a", "b</think>c")),  # the answer is kept as said
]


@pytest.mark.parametrize(("text", "thinking", "parts"), TEXTS)
def test_a_whole_answer_splits_at_the_closing_marker(
    text: str, thinking: bool, parts: tuple[str | None, str]
) -> None:
    assert ReasoningReader(thinking).whole(text) == parts


@given(st.sampled_from(TEXTS), st.lists(st.integers(0, 60), max_size=8), st.booleans())
def test_pieces_cut_anywhere_give_the_whole_answers_parts(
    case: tuple[str, bool, tuple[str | None, str]], cuts: list[int], streamed: bool
) -> None:
    text, thinking, (reasoning, content) = case
    at = sorted({min(cut, len(text)) for cut in cuts} | {0, len(text)})
    reader = ReasoningReader(thinking, streamed)
    said: list[tuple[str, str]] = [reader.feed(text[a:b]) for a, b in pairwise(at)]
    said.append((reader.finish(), ""))
    assert "".join(r for r, _ in said) == (reasoning or "")
    assert "".join(c for _, c in said) == content
    if not streamed:  # SGLang's stream_reasoning false: the thinking in one piece
        assert sum(1 for r, _ in said if r) <= 1
