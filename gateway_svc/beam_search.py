"""vLLM's beam search (`use_beam_search`), run by the gateway as vLLM's frontend runs it: each
step, every live beam is one engine request of one token bringing its top 2 x width logprobs
(the model's, before any sampling setting; the beam's tokens so far found in the prefix cache);
the width best continuations by summed logprob live on, and one ending in EOS is set aside,
finished. After max_tokens steps the finished and the live beams are ranked by the summed
logprob over length ** length_penalty (the prompt's tokens counted, an EOS not, as vLLM
counts) and the best width are the choices."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import msgspec

from turnstile.gateway_svc.engine_client import End, EngineClient, Token
from turnstile.gateway_svc.errors import REFUSALS, ApiError, refusal
from turnstile.shared.protocol import AddRequest, pack_ids, unpack_ids

# Fields a beam search does not use: refused with it unless left out (temperature: or 0).
NOT_WITH_BEAMS = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words", "min_tokens", "seed",
    "stop", "stop_token_ids", "logprobs", "top_logprobs", "echo", "prompt_logprobs",
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "tools", "thinking_token_budget",
)  # fmt: skip


@dataclass(slots=True, frozen=True)
class Beam:
    tokens: tuple[int, ...]  # generated, an EOS included
    logprob: float  # summed over the tokens
    finished: bool = False


@dataclass(slots=True, frozen=True)
class BeamSearch:
    width: int
    eos_ids: frozenset[int]  # empty with ignore_eos: every beam runs to max_tokens
    length_penalty: float

    async def run(self, engine: EngineClient, message: AddRequest) -> list[Beam]:
        """The best `width` beams of `message`'s prompt, best first."""
        prompt = unpack_ids(message.prompt_ids).tolist()
        step = msgspec.structs.replace(
            message, max_tokens=1, stop_token_ids=[], ignore_eos=True,
            sampling=msgspec.structs.replace(
                message.sampling, temperature=0.0, logprobs=2 * self.width, seed=None,
                min_tokens=0, min_tokens_stop_ids=[], prompt_logprobs=None,
            ),
        )  # fmt: skip
        live, finished = [Beam((), 0.0)], []
        for _ in range(message.max_tokens):
            asked = [pack_ids(prompt + list(beam.tokens)) for beam in live]
            tops = await asyncio.gather(
                *(_top(engine, msgspec.structs.replace(step, prompt_ids=ids)) for ids in asked)
            )
            candidates = []
            for beam, top in zip(live, tops, strict=True):
                for token, logprob in top.items():
                    ends = token in self.eos_ids
                    grown = Beam((*beam.tokens, token), beam.logprob + logprob, ends)
                    (finished if ends else candidates).append(grown)
            live = sorted(candidates, key=lambda b: -b.logprob)[: self.width]
            if not live:
                break
        ranked = sorted(finished + live, key=lambda b: -self._score(b, len(prompt)))
        return ranked[: self.width]

    def _score(self, beam: Beam, prompt: int) -> float:
        length = prompt + len(beam.tokens) - beam.finished
        return beam.logprob / max(length, 1) ** self.length_penalty


def beam_search_of(request: Any, eos_ids: tuple[int, ...], max_logprobs: int) -> BeamSearch | None:
    """A completions or chat request's beam search (None: it samples), its width `n` (at most
    half `max_logprobs`: a step brings 2n); what it cannot honour refused by name."""
    if not request.use_beam_search:
        if request.length_penalty != 1.0:
            raise ApiError(400, "length_penalty needs use_beam_search", param="length_penalty")
        return None
    defaults = {field.name: field.default for field in msgspec.structs.fields(request)}
    for name in NOT_WITH_BEAMS:
        value = getattr(request, name, None)
        if value not in (None, defaults.get(name)) and not (name == "temperature" and value == 0):
            raise ApiError(400, f"{name} is not supported with use_beam_search (the beams rank "
                           "the model's own logprobs)", param=name)  # fmt: skip
    width = request.n or 1
    if 2 * width > max_logprobs:
        raise ApiError(400, f"n, the beam width, is at most {max_logprobs // 2} (a step asks "
                       "for 2n logprobs; the server's --max-logprobs)", param="n")  # fmt: skip
    eos = frozenset() if request.ignore_eos else frozenset(eos_ids)
    return BeamSearch(width, eos, request.length_penalty)


async def _top(engine: EngineClient, message: AddRequest) -> dict[int, float]:
    """One engine step's top logprobs (its greedy token is the first of them)."""
    stream = engine.submit(message)
    top: dict[int, float] = {}
    try:
        while not isinstance(event := await stream.events.get(), End):
            if isinstance(event, Token):
                top = dict(event.logprobs[1:])
    except asyncio.CancelledError:
        engine.abort(stream)
        raise
    if event.reason in REFUSALS:
        raise refusal(event.reason, event.error)
    if not top:
        raise ApiError(500, f"a beam's step ended without a token ({event.reason})",
                       "server_error")  # fmt: skip
    return top
