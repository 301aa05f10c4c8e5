"""The harmony reader (`gateway_svc/harmony.py`) case by case, each text read whole and fed a
character at a time (a stream cuts anywhere, inside a marker too), which must agree; and the
`openai` tool parser on what it passes on. Through a real stack: `test_harmony.py`."""

from __future__ import annotations

import pytest

from turnstile.gateway_svc.harmony import HarmonyReader, HarmonyReaders, call_text
from turnstile.gateway_svc.tool_parsers.harmony_calls import HarmonyCalls

THINK_THEN_ANSWER = (
    "<|channel|>analysis<|message|>2 and 2 make 4.<|end|><|start|>assistant<|channel|>final"
    "<|message|>It is 4."
)
CALL = (
    "<|channel|>analysis<|message|>Ask the tool.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
)


@pytest.mark.parametrize(
    ("text", "calls", "reasoning", "content"),
    [
        (THINK_THEN_ANSWER, True, "2 and 2 make 4.", "It is 4."),
        (CALL, True, "Ask the tool.", call_text("get_weather", '{"city": "Paris"}')),
        (CALL, False, "Ask the tool.", ""),  # no tools asked for: the call is not the client's
        # the recipient before the channel; the content type after it, without <|constrain|>
        ("<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}<|call|>",
         True, None, call_text("f", "{}")),
        ("<|channel|>commentary<|message|>Looking it up.<|end|>", True, None, "Looking it up."),
        ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis"
         "<|message|>b<|end|>", True, "ab", ""),  # two thoughts
        ('{"answer": 4}', True, None, '{"answer": 4}'),  # no header: a grammar forced it
        ("<|channel|>final<|message|>x<|end|><|start|>assistant<|chan", True, None, "x"),
        ("<|channel|>secret<|message|>hidden<|end|><|channel|>final<|message|>shown", True,
         None, "shown"),  # a channel not the client's
        ("", True, None, ""),
    ],
)  # fmt: skip
def test_read_whole_or_a_character_at_a_time_alike(
    text: str, calls: bool, reasoning: str | None, content: str
) -> None:
    assert HarmonyReader(calls).whole(text) == (reasoning, content)
    reader, thought, said = HarmonyReader(calls), [], []
    for character in text:
        piece = reader.feed(character)
        thought.append(piece[0])
        said.append(piece[1])
    last = reader.finish()
    assert "".join([*thought, last[0]]) == (reasoning or "")
    assert "".join([*said, last[1]]) == content
    assert all("<|" not in piece for piece in thought)  # no marker's piece leaks out


def test_reasoning_not_streamed_comes_a_message_at_a_time() -> None:
    reader = HarmonyReader(calls=True, streamed=False)
    pieces = [reader.feed(character)[0] for character in THINK_THEN_ANSWER]
    assert [p for p in pieces if p] == ["2 and 2 make 4."]


def test_the_openai_parser_reads_the_calls_passed_on() -> None:
    parser = HarmonyCalls([])
    text, calls = parser.feed(call_text("f", '{"a":  1}') + call_text("g", "not json"))
    more, rest = parser.finish()
    assert text + more == ""
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls + rest] == [
        ("f", '{"a": 1}'), ("g", "not json")]  # fmt: skip


def test_without_the_reasoning_parser_the_analysis_is_left_out() -> None:
    """As vLLM serves gpt-oss without --reasoning-parser: the answer's content alone."""
    hidden = HarmonyReaders(calls=False, shown=False, streamed=True)
    assert hidden.whole(0, THINK_THEN_ANSWER) == (None, "It is 4.")
    assert hidden.step(1, THINK_THEN_ANSWER, last=True) == ("", "It is 4.")
    shown = HarmonyReaders(calls=False, shown=True, streamed=True)
    assert shown.step(0, THINK_THEN_ANSWER, last=True) == ("2 and 2 make 4.", "It is 4.")
