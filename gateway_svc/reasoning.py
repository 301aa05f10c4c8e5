"""Reasoning outputs, as vLLM's `--reasoning-parser` serves them: a reasoning model (DeepSeek-R1,
QwQ, Qwen3) thinks between `<think>` and `</think>` before it answers, and a chat's answer gives
that thinking as `reasoning` (vLLM's name; `reasoning_content` too, SGLang's and DeepSeek's API's)
apart from its `content`.

Both markers must be single tokens of the model's vocabulary, checked at start: the executor
then knows where thinking ends (a grammar constrains only the answer after it), and a reasoning
token count is exact. Each choice's text goes through a `ReasoningReader`, whole or piece by piece.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from turnstile.gateway_svc.errors import ApiError
from turnstile.gateway_svc.request_types import ChatCompletionRequest, CompletionRequest
from turnstile.gateway_svc.text_stream import partial_suffix
from turnstile.shared.tokenizer import Tokenizer

START, END = "<think>", "</think>"


@dataclass(slots=True, frozen=True)
class ThinkTokens:
    """The ids of the two markers in the served model's vocabulary."""

    start: int
    end: int

    @classmethod
    def of(cls, tokenizer: Tokenizer, parser: str) -> ThinkTokens:
        """The markers of `parser`; a ValueError naming it where the vocabulary lacks them."""
        ids = []
        for marker in (START, END):
            found = tokenizer.backend.token_to_id(marker)
            if found is None or tokenizer.decode([found]) != marker:
                raise ValueError(
                    f"--reasoning-parser {parser}: the model's vocabulary has no {marker} token "
                    "(or skips it as a special token), so its thinking cannot be told apart"
                )
            ids.append(found)
        return cls(*ids)

    def starts_thinking(self, prompt_ids: list[int], tokenizer: Tokenizer) -> bool:
        """Whether the output begins inside the thinking: unless the prompt closed it, as
        Qwen3's template does with `enable_thinking: false` (`<think>\\n\\n</think>\\n\\n`).
        DeepSeek-R1's template opens it in the prompt; Qwen3's leaves the opening to the model."""
        if self.end not in prompt_ids:
            return True
        last = len(prompt_ids) - 1 - prompt_ids[::-1].index(self.end)
        return self.start in prompt_ids[last:] or bool(
            tokenizer.decode(prompt_ids[last + 1 :]).strip()
        )


class ReasoningCounter(Protocol):
    """Tells, token by token, which of an answer's tokens are its reasoning."""

    def reasoning(self, token_id: int) -> bool: ...


class ThinkCounter:
    """An answer that starts thinking: its tokens up to </think>, the markers left out."""

    def __init__(self, think: ThinkTokens) -> None:
        self._think: ThinkTokens | None = think

    def reasoning(self, token_id: int) -> bool:
        if self._think is None:
            return False
        if token_id == self._think.end:
            self._think = None
            return False
        return token_id != self._think.start


class ReasoningReader:
    """One choice's text split into its reasoning and its content; `feed` each piece, then
    `finish`."""

    def __init__(self, thinking: bool, streamed: bool = True) -> None:
        self.thinking = thinking  # inside the thinking, until </think>
        self.streamed = streamed  # False (SGLang's stream_reasoning): the reasoning in one piece
        self.reasoned = thinking  # whether the answer has a reasoning part at all
        self._text = ""  # held back: it may end in part of a marker

    def feed(self, piece: str) -> tuple[str, str]:
        """(reasoning now, content now)."""
        if not self.thinking:
            return "", piece
        self._text += piece
        end = self._text.find(END)
        if end >= 0:
            reasoning, content = self._text[:end], self._text[end + len(END) :]
            self._text, self.thinking = "", False
            return reasoning.replace(START, ""), content
        if not self.streamed:
            return "", ""
        cut = len(self._text) - max(partial_suffix(self._text, m) for m in (START, END))
        said, self._text = self._text[:cut], self._text[cut:]
        return said.replace(START, ""), ""

    def finish(self) -> str:
        """The thinking still held: a choice that ends still thinking has said only that."""
        reasoning, self._text = self._text.replace(START, ""), ""
        return reasoning

    def whole(self, text: str) -> tuple[str | None, str]:
        """A whole answer: its reasoning (None where it has none) and its content."""
        reasoning, content = self.feed(text)
        return (reasoning + self.finish() if self.reasoned else None), content


class ReasoningReaders:
    """The `ReasoningReader` of each choice of one chat request, and what it asked to see."""

    def __init__(self, thinking: bool, shown: bool, streamed: bool) -> None:
        self.shown = shown  # vLLM's include_reasoning: false leaves the thinking out
        self._thinking, self._streamed = thinking, streamed
        self._readers: dict[int, ReasoningReader] = {}

    def step(self, index: int, piece: str, last: bool) -> tuple[str, str]:
        """A streamed piece of choice `index` as (reasoning to show, content); `last`: the
        choice's final piece."""
        reader = self._reader(index)
        reasoning, content = reader.feed(piece)
        if last:
            reasoning += reader.finish()
        return (reasoning if self.shown else ""), content

    def whole(self, index: int, text: str) -> tuple[str | None, str]:
        """Choice `index`'s whole answer as (reasoning to show, or None; content)."""
        reasoning, content = self._reader(index).whole(text)
        return (reasoning if self.shown else None), content

    def _reader(self, index: int) -> ReasoningReader:
        if index not in self._readers:
            self._readers[index] = ReasoningReader(self._thinking, self._streamed)
        return self._readers[index]


def reasoning_readers(request: ChatCompletionRequest, thinking: bool) -> ReasoningReaders | None:
    """The readers of a chat whose answer `thinking` starts or not; None where the request
    asks for its thinking left in `content` (SGLang's separate_reasoning false)."""
    if not request.separate_reasoning:
        return None
    return ReasoningReaders(thinking, request.include_reasoning, request.stream_reasoning)


def answer_thinks(
    request: CompletionRequest | ChatCompletionRequest,
    think: ThinkTokens | None,
    prompt_ids: list[int],
    tokenizer: Tokenizer,
) -> ThinkTokens | None:
    """The markers, where a chat's answer starts inside its thinking under a reasoning parser;
    else None. vLLM's thinking_token_budget without a parser is refused."""
    if not isinstance(request, ChatCompletionRequest):
        return None
    if request.thinking_token_budget is not None and think is None:
        raise ApiError(400, "thinking_token_budget needs a server started with "
                       "--reasoning-parser", param="thinking_token_budget")  # fmt: skip
    if think is None or not think.starts_thinking(prompt_ids, tokenizer):
        return None  # the prompt closed the thinking, where it did: the answer is all content
    return think
