"""One generation request, from its parsed body to the HTTP answer: each of its prompts (a
completions request may hold several) runs as `n` engine requests, the choices, streamed back
together or answered whole.

The `n` choices of a prompt share its KV blocks: the first runs alone until its prompt is
computed (its first token arrives), then the others start and find the prompt's full blocks in
the prefix cache, so the prompt is computed once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from turnstile.gateway_svc import metrics
from turnstile.gateway_svc.beam_search import BeamSearch
from turnstile.gateway_svc.engine_client import End, EngineClient, PromptEntries, RequestStream
from turnstile.gateway_svc.errors import REFUSALS, ApiError, refusal
from turnstile.gateway_svc.reasoning import ReasoningCounter
from turnstile.gateway_svc.request_types import ChatCompletionRequest, CompletionRequest
from turnstile.gateway_svc.text_stream import TextStream
from turnstile.shared.protocol import AddRequest
from turnstile.shared.tokenizer import Tokenizer

Request = CompletionRequest | ChatCompletionRequest
Logprobs = list[list[tuple[int, float]]]
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


@dataclass(slots=True)
class Piece:
    """Text of choice `index` that became safe to send, with its tokens' logprobs and ids."""

    index: int
    text: str
    logprobs: Logprobs
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)


class Choice:
    """One answer: its engine request, its text so far and the latency series it feeds."""

    def __init__(self, index: int, request: Request, tokenizer: Tokenizer, hidden: frozenset[int],
                 arrival: float) -> None:  # fmt: skip
        self.index = index
        self.text = TextStream(
            tokenizer,
            request.stop_strings,
            request.skip_special_tokens,
            request.include_stop_str_in_output,
        )
        self.hidden = hidden  # stop tokens, whose text is not shown
        self.echo = ""  # text it starts with (the prompt, for completions' `echo`)
        # completions' max_tokens 0 with echo: the prompt alone, its one computed token unsaid
        self.silent = isinstance(request, CompletionRequest) and request.max_tokens == 0
        self.stream: RequestStream | None = None
        self.tokens = 0
        self.cached_tokens = 0
        # Per prompt position, where asked (a prompt's first choice brings them): ([(token,
        # logprob), top N...], rank); the first has none, as in vLLM.
        self.prompt_logprobs: list[tuple[list[tuple[int, float]], int] | None] = []
        self.prompt_ids: list[int] = []
        self.counter: ReasoningCounter | None = None  # which of its tokens are reasoning
        self.reasoning_tokens = 0
        self._last = arrival

    def token(self, token_id: int) -> None:
        if self.counter is not None:
            self.reasoning_tokens += self.counter.reasoning(token_id)
        now = time.perf_counter()
        histogram = metrics.INTER_TOKEN_LATENCY if self.tokens else metrics.TIME_TO_FIRST_TOKEN
        histogram.observe(now - self._last)
        self._last = now
        self.tokens += 1
        metrics.GATEWAY_GENERATION_TOKENS.inc()


class Generation:
    """The choices of one request, run on `engine` and merged into one stream of pieces."""

    def __init__(
        self, engine: EngineClient, request: Request, prompt_tokens: int, n: int = 1
    ) -> None:
        self.engine = engine
        self.request = request
        self.prompt_tokens = prompt_tokens
        self.n = n
        self.constraint_field: str | None = None  # the field that asks for a grammar
        self.tool_mode: str | None = None  # a chat's (`tool_calls.tool_mode`), if it has tools
        # Under a reasoning parser, a chat's: whether its answer starts thinking; else None.
        self.thinking: bool | None = None
        self.counts_reasoning = False  # usage gives the reasoning's tokens
        self.choices: list[Choice] = []
        self._pieces: asyncio.Queue[Piece | ApiError] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    def start(
        self, message: AddRequest, choices: list[Choice], beams: BeamSearch | None = None
    ) -> None:
        """Run `message` as `choices`, the first alone until its prompt is computed; or, with
        `beams`, as a beam search whose best beams are the choices, answered as it ends."""
        self.choices += choices
        if beams is None:
            run = self._run(message, choices[0], choices[1:])
        else:
            run = self._search(message, choices, beams)
        self._tasks.append(asyncio.get_running_loop().create_task(run))

    def close(self) -> None:
        """Stop whatever still runs (a no-op for choices that ended)."""
        for task in self._tasks:
            task.cancel()
        for choice in self.choices:
            if choice.stream is not None:
                self.engine.abort(choice.stream)

    def usage(self) -> dict[str, Any]:
        completion = sum(choice.tokens for choice in self.choices)
        # A prompt's first choice: the others find its blocks cached by design.
        cached = sum(choice.cached_tokens for choice in self.choices[:: self.n])
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if self.counts_reasoning:
            thought = sum(choice.reasoning_tokens for choice in self.choices)
            usage["completion_tokens_details"] = {"reasoning_tokens": thought}
        return usage

    async def pieces(self) -> AsyncIterator[Piece]:
        """Every choice's pieces as they come, until each has given its last."""
        open_choices = len(self.choices)
        while open_choices:
            piece = await self._pieces.get()
            if isinstance(piece, ApiError):
                raise piece
            open_choices -= piece.finish_reason is not None
            yield piece

    async def _run(self, message: AddRequest, first: Choice, rest: list[Choice]) -> None:
        try:
            await self._pump(first, message, rest)
        except ApiError as exc:
            self._pieces.put_nowait(exc)

    async def _search(self, message: AddRequest, choices: list[Choice], beams: BeamSearch) -> None:
        try:
            found = await beams.run(self.engine, message)
        except ApiError as exc:
            self._pieces.put_nowait(exc)
            return
        for choice, beam in zip(choices, found, strict=True):
            # an EOS that ended a beam is dropped unless shown (vLLM's token ids and usage)
            tokens = list(beam.tokens[: len(beam.tokens) - (beam.finished and bool(choice.hidden))])
            for token in tokens:
                choice.token(token)
            text = "".join(choice.text.add(token) for token in tokens) + choice.text.finish()
            finish = "stop" if beam.finished else "length"
            self._pieces.put_nowait(Piece(choice.index, text, [], finish, tokens))

    async def _pump(self, choice: Choice, message: AddRequest, siblings: list[Choice]) -> None:
        if choice.echo:
            self._pieces.put_nowait(Piece(choice.index, choice.echo, []))
        choice.stream = stream = self.engine.submit(message)
        entries: Logprobs = []
        tokens: list[int] = []  # ids since the last piece, a hidden stop token's included
        text = choice.text
        while True:
            event = await stream.events.get()
            computed = not isinstance(event, PromptEntries)  # those come with each chunk
            if siblings and computed and not (isinstance(event, End) and event.reason in REFUSALS):
                # The prompt is computed: the other choices start on its cached blocks.
                for offset, sibling in enumerate(siblings, start=1):
                    self._tasks.append(asyncio.get_running_loop().create_task(
                        self._run(sibling_request(message, offset), sibling, [])
                    ))  # fmt: skip
                siblings = []
            if isinstance(event, PromptEntries):
                for offset, entry in enumerate(zip(event.entries, event.ranks, strict=True)):
                    if event.first + offset < len(choice.prompt_logprobs):
                        choice.prompt_logprobs[event.first + offset] = entry
                continue
            if isinstance(event, End):
                if event.reason in REFUSALS:
                    param = self.constraint_field if event.reason == "grammar" else None
                    raise refusal(event.reason, event.error, param)
                finish = "stop" if event.reason == "stop" else event.reason
                choice.cached_tokens = event.cached_tokens
                self._pieces.put_nowait(Piece(choice.index, text.finish(), entries, finish, tokens))
                return
            if choice.silent:
                continue
            choice.token(event.token_id)
            tokens.append(event.token_id)
            if event.logprobs:
                entries.append(event.logprobs)
            piece = "" if event.token_id in choice.hidden else text.add(event.token_id)
            if text.stopped:
                self.engine.stop(stream)
                while not isinstance(end := await stream.events.get(), End):
                    pass  # tokens computed before the scheduler saw the stop
                choice.cached_tokens = end.cached_tokens
                self._pieces.put_nowait(Piece(choice.index, piece, entries, "stop", tokens))
                return
            if piece:
                self._pieces.put_nowait(Piece(choice.index, piece, entries, token_ids=tokens))
                entries, tokens = [], []


def sibling_request(message: AddRequest, offset: int) -> AddRequest:
    """Choice `offset` of a prompt: a seeded request draws from seed + offset (as vLLM), so the
    choices differ and each is reproducible; the prompt's logprobs come with the first."""
    seed = message.sampling.seed
    sampling = msgspec.structs.replace(
        message.sampling,
        seed=None if seed is None else (seed + offset) % 2**63,
        prompt_logprobs=None,
    )
    return msgspec.structs.replace(message, sampling=sampling)
