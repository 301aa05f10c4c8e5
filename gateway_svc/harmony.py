"""gpt-oss's answers, written in OpenAI's harmony format, read as vLLM reads them: a chat's answer
is a run of messages, each `<|channel|>CHANNEL[ to=RECIPIENT][<|constrain|>TYPE]<|message|>BODY`
ended by `<|end|>` (the next starting `<|start|>assistant`), `<|call|>` or `<|return|>` (both
end generation, their text hidden). The `analysis` channel is the model's reasoning: given as
`reasoning` under `--reasoning-parser openai_gptoss`, else left out (as vLLM leaves it). `final`,
and `commentary` to no one, is the answer's `content`. A message to `functions.NAME` is a tool
call, passed on, where the request has tools, to the `openai` tool parser
(`tool_parsers/harmony_calls.py`) as `call_text`; else dropped. Text before any header (an
answer a grammar forced from its first token) is content.

Each choice's text is decoded with its special tokens kept (the markers are special tokens).
"""

from __future__ import annotations

import re

from turnstile.gateway_svc.reasoning import (
    ReasoningCounter,
    ReasoningReaders,
    ThinkCounter,
    ThinkTokens,
    reasoning_readers,
)
from turnstile.gateway_svc.request_types import ChatCompletionRequest
from turnstile.gateway_svc.text_stream import partial_suffix
from turnstile.shared.model_info import ModelInfo
from turnstile.shared.tokenizer import Tokenizer

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
CALL, RETURN = "<|call|>", "<|return|>"
ENDS = (END, CALL, RETURN, START)  # what ends a message's body
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def check_parsers(info: ModelInfo, tool_parser: str | None, reasoning_parser: str | None) -> None:
    """At start: harmony's parsers for a harmony model, and only for one (a ValueError)."""
    harmony = info.chat_format == "harmony"
    flags = (("--tool-call-parser", tool_parser, "openai"),
             ("--reasoning-parser", reasoning_parser, "openai_gptoss"))  # fmt: skip
    for flag, parser, its in flags:
        if parser is not None and (parser == its) != harmony:
            raise ValueError(
                f"{flag} {parser}: {info.name} writes its answers in harmony (gpt-oss): use "
                f"{flag} {its}"
                if harmony
                else f"{flag} {parser} reads gpt-oss's harmony messages; {info.name} has none"
            )


def header_of(header: str) -> tuple[str, str]:
    """A message header's channel and recipient ("" where it names none)."""
    found = _RECIPIENT.search(header)
    channel = header.partition(CHANNEL)[2].strip()
    return re.split(r"[\s<]", channel)[0], (found.group(1) if found else "")


class HarmonyCounter:
    """An answer's reasoning tokens, as vLLM counts gpt-oss's: its analysis messages' bodies,
    read by a `HarmonyReader` token by token (markers are never counted)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._reader = HarmonyReader(calls=False)
        self._inside = False  # in an analysis body before the token

    def reasoning(self, token_id: int) -> bool:
        self._reader.feed(self._tokenizer.decode([token_id], skip_special_tokens=False))
        counted, self._inside = self._inside and self._reader.in_analysis, self._reader.in_analysis
        return counted


def counter_of(
    think: ThinkTokens | None, harmony: bool, tokenizer: Tokenizer
) -> ReasoningCounter | None:
    """A chat's reasoning counter: under a `<think>` parser, of an answer that starts thinking;
    a harmony model's; else None."""
    if think is not None:
        return ThinkCounter(think)
    return HarmonyCounter(tokenizer) if harmony else None


def call_text(name: str, arguments: str) -> str:
    """A tool call as the `openai` tool parser reads it."""
    return f"{CALL}{name}{MESSAGE}{arguments}{END}"


class HarmonyReader:
    """One choice's harmony text as (reasoning, content) pieces: `feed` each, then `finish`."""

    def __init__(self, calls: bool, streamed: bool = True) -> None:
        self.calls = calls  # tool calls passed on in content (`call_text`); else dropped
        self.streamed = streamed  # False: each message's reasoning in one piece
        self.reasoned = False  # whether any reasoning was read
        self._text = ""  # not read yet: a header, or what may start a marker
        self._first = True  # nothing read yet
        self._in_body = False
        self._kind = ""  # the body's: "reasoning", "content", "call" or "" (left out)
        self._name = ""  # a call's function
        self._held = ""  # a call's body, or reasoning not streamed, until its message ends

    @property
    def in_analysis(self) -> bool:
        """Inside an analysis message's body, as far as the text read tells."""
        return self._in_body and self._kind == "reasoning"

    def feed(self, piece: str) -> tuple[str, str]:
        self._text += piece
        return self._read(final=False)

    def finish(self) -> tuple[str, str]:
        return self._read(final=True)

    def whole(self, text: str) -> tuple[str | None, str]:
        """A whole answer: its reasoning (None where it has none) and its content."""
        reasoning, content = self.feed(text)
        more, rest = self.finish()
        return (reasoning + more if self.reasoned else None), content + rest

    def _read(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while (self._in_body or self._header(final)) and self._body(reasoning, content, final):
            pass
        return "".join(reasoning), "".join(content)

    def _header(self, final: bool) -> bool:
        """Reads a message's header, up to its body; False where it is not all here."""
        if self._first and self._text[:2] and not "<|".startswith(self._text[:2]):
            self._begin("", "final")  # no header at all: all content
            return True
        at = self._text.find(MESSAGE)
        if at < 0:
            self._text = "" if final else self._text  # a header cut short says nothing
            return False
        header, self._text = self._text[:at], self._text[at + len(MESSAGE) :]
        channel, recipient = header_of(header)
        self._begin(recipient, channel)
        return True

    def _begin(self, recipient: str, channel: str) -> None:
        self._first, self._in_body = False, True
        if recipient.startswith(FUNCTIONS):
            self._kind, self._name = ("call" if self.calls else ""), recipient[len(FUNCTIONS) :]
        elif channel == "analysis":
            self._kind = "reasoning"
        elif channel == "final" or (channel == "commentary" and not recipient):
            self._kind = "content"
        else:
            self._kind = ""  # to another recipient, or another channel: not the client's

    def _body(self, reasoning: list[str], content: list[str], final: bool) -> bool:
        """Reads the body as far as it is here; True where a marker ended it."""
        ends = [(at, marker) for marker in ENDS if (at := self._text.find(marker)) >= 0]
        if ends:
            at, marker = min(ends)
            said = self._text[:at]
            self._text = self._text[at:] if marker == START else self._text[at + len(marker) :]
        else:
            cut = len(self._text) - (
                0 if final else max(partial_suffix(self._text, m) for m in ENDS)
            )
            said, self._text = self._text[:cut], self._text[cut:]
        done = bool(ends) or final
        if self._kind == "call":
            self._held += said
            if done:
                content.append(call_text(self._name, self._held))
        elif self._kind == "reasoning":
            self.reasoned |= bool(said)
            self._held += said
            if self.streamed or done:
                reasoning.append(self._held)
                self._held = ""
        elif self._kind == "content":
            content.append(said)
        if done:
            self._in_body, self._held = False, ""
        return bool(ends)


class HarmonyReaders(ReasoningReaders):
    """The `HarmonyReader` of each choice of one chat; `calls`: the request has tools; `shown`:
    under `--reasoning-parser openai_gptoss`, unless the request leaves its reasoning out."""

    def __init__(self, calls: bool, shown: bool, streamed: bool) -> None:
        super().__init__(thinking=False, shown=shown, streamed=streamed)
        self._calls = calls
        self._harmony: dict[int, HarmonyReader] = {}

    def step(self, index: int, piece: str, last: bool) -> tuple[str, str]:
        reader = self._harmony_reader(index)
        reasoning, content = reader.feed(piece)
        if last:
            more, rest = reader.finish()
            reasoning, content = reasoning + more, content + rest
        return (reasoning if self.shown else ""), content

    def whole(self, index: int, text: str) -> tuple[str | None, str]:
        reasoning, content = self._harmony_reader(index).whole(text)
        return (reasoning if self.shown else None), content

    def _harmony_reader(self, index: int) -> HarmonyReader:
        if index not in self._harmony:
            self._harmony[index] = HarmonyReader(self._calls, self._streamed)
        return self._harmony[index]


def readers_of(
    chat: ChatCompletionRequest, thinking: bool | None, calls: bool, harmony: bool | None
) -> ReasoningReaders | None:
    """A chat's readers: a harmony model's (`harmony`: whether its reasoning is shown, None for
    another model), or under a `<think>` parser those of an answer `thinking` starts or not;
    None where SGLang's `separate_reasoning: false` asks for the answer as written."""
    if harmony is not None and chat.separate_reasoning:
        return HarmonyReaders(calls, harmony and chat.include_reasoning, chat.stream_reasoning)
    if harmony is not None:
        return None
    return None if thinking is None else reasoning_readers(chat, thinking)
