"""OpenAI response bodies: completion and chat, whole or as stream chunks, with logprobs."""

from __future__ import annotations

import time
from typing import Any

from turnstile.gateway_svc.reasoning import ReasoningReaders
from turnstile.gateway_svc.tool_calls import CallReaders
from turnstile.shared.tokenizer import Tokenizer


class ResponseShape:
    """Builds the JSON bodies of one request, completion or chat."""

    def __init__(self, chat: bool, model: str, tokenizer: Tokenizer, request_id: str) -> None:
        self.chat = chat
        self.model = model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.calls: CallReaders | None = None  # a chat with tools: each choice's calls
        self.reasoning: ReasoningReaders | None = None  # with --reasoning-parser: the thinking
        self.tokens_as_ids = False  # return_tokens_as_token_ids: logprobs name "token_id:N"
        # return_token_ids (vLLM's): each choice's prompt ids, and its tokens' ids beside text
        self.prompt_ids: list[list[int]] | None = None

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        if chunk and self.chat:
            kind += ".chunk"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: Any,
        delta: dict[str, Any] | None = None,
        calls: list[dict[str, Any]] | None = None,
        token_ids: list[int] | None = None,
        first: bool = True,
        reasoning: str | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs}
        if self.prompt_ids is not None:
            choice["token_ids"] = token_ids or []
            if first and not self.chat:
                choice["prompt_token_ids"] = self.prompt_ids[index]
        if not self.chat:
            choice["text"] = text
        elif delta is not None:
            choice["delta"] = delta
        else:
            said = (text or None) if calls or reasoning is not None else text
            choice["message"] = {"role": "assistant", "content": said} | _thinking(reasoning)
            if calls:
                choice["message"]["tool_calls"] = calls
        return choice | {"finish_reason": finish_reason}

    def chunk(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: Any,
        first: bool = False,
        usage: dict[str, Any] | None = None,
        calls: list[dict[str, Any]] | None = None,
        token_ids: list[int] | None = None,
        reasoning: str = "",
    ) -> dict[str, Any]:
        """One stream chunk of choice `index`; a chat's first one also names the role.
        `usage`: the counts so far (vLLM's continuous_usage_stats); `calls`: tool call deltas;
        `token_ids`: the ids of the chunk's tokens; `reasoning`: thinking to show."""
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        delta |= _thinking(reasoning or None)
        if text or not (calls or reasoning):
            delta["content"] = text
        if calls:
            delta["tool_calls"] = calls
        choice = self._choice(index, text, finish_reason, logprobs, delta, None, token_ids, first)
        body = self._envelope([choice], True)
        if first and self.chat and self.prompt_ids is not None:
            body["prompt_token_ids"] = self.prompt_ids[index]
        return body | {"usage": usage} if usage is not None else body

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        body = self._envelope([], chunk=True)
        body["usage"] = usage
        return body

    def whole(
        self,
        choices: list[tuple[str, str, Any, list[dict[str, Any]], list[int], str | None]],
        usage: dict[str, Any],
        prompt_logprobs: list[Any] | None = None,
    ) -> dict[str, Any]:
        """The response of every choice, each (text, finish_reason, logprobs, tool calls, token
        ids, reasoning), in index order;
        `prompt_logprobs` (vLLM's, where asked): per choice for completions, the first
        prompt's for a chat, at the top."""
        listed = [
            self._choice(index, text, finish, logprobs, calls=calls, token_ids=ids,
                         reasoning=reasoning)
            for index, (text, finish, logprobs, calls, ids, reasoning) in enumerate(choices)
        ]  # fmt: skip
        asked = bool(prompt_logprobs) and prompt_logprobs[0] is not None
        if asked and not self.chat:
            for choice, prompt in zip(listed, prompt_logprobs, strict=True):
                choice["prompt_logprobs"] = prompt
        body = self._envelope(listed, chunk=False)
        if asked and self.chat:
            body["prompt_logprobs"] = prompt_logprobs[0]
        if self.chat and self.prompt_ids is not None:
            body["prompt_token_ids"] = self.prompt_ids[0]
        body["usage"] = usage
        return body

    def prompt_logprobs(
        self, positions: list[tuple[list[tuple[int, float]], int] | None], top_n: int | None
    ) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's shape: per prompt token, {token id: {logprob, rank, decoded_token}} for the
        token and the top N (ranked 1..N); None for the first."""
        if not positions:
            return None
        out: list[dict[str, dict[str, Any]] | None] = []
        for position in positions:
            if position is None:
                out.append(None)
                continue
            ((token, logprob), *top), rank = position
            top = top[:top_n]
            ranked = [(token, logprob, rank)] + [(t, lp, r) for r, (t, lp) in enumerate(top, 1)]
            out.append({
                str(t): {"logprob": lp, "rank": r, "decoded_token": self.tokenizer.decode([t])}
                for t, lp, r in ranked
            })  # fmt: skip
        return out

    def echo_logprobs(
        self,
        prompt: list[int],
        positions: list[tuple[list[tuple[int, float]], int] | None],
        top_n: int,
    ) -> dict[str, list[Any]]:
        """Completions' logprobs of an echoed prompt's tokens: the first has none, as vLLM."""
        text_of = self.tokenizer.decode
        entries = [None if p is None else p[0][: top_n + 1] for p in positions]
        offsets = [0]
        for token in prompt[:-1]:
            offsets.append(offsets[-1] + len(text_of([token])))
        return {
            "tokens": [self._name(token) for token in prompt],
            "token_logprobs": [None if e is None else e[0][1] for e in entries],
            "top_logprobs": [
                None if e is None else {self._name(t): lp for t, lp in e[1:]} for e in entries
            ],
            "text_offset": offsets,
        }

    def _name(self, token: int) -> str:
        return f"token_id:{token}" if self.tokens_as_ids else self.tokenizer.decode([token])

    def logprobs(self, entries: list[list[tuple[int, float]]], offset: int) -> Any:
        """OpenAI logprobs for tokens whose entries are [(token, logprob), *top-N]."""
        if not entries:
            return None
        text_of, name = self.tokenizer.decode, self._name
        if self.chat:
            return {
                "content": [
                    {
                        "token": name(token),
                        "logprob": logprob,
                        "bytes": list(text_of([token]).encode()),
                        "top_logprobs": [
                            {"token": name(t), "logprob": lp, "bytes": list(text_of([t]).encode())}
                            for t, lp in top
                        ],
                    }
                    for (token, logprob), *top in entries
                ]
            }
        offsets = []
        for (token, _), *_top in entries:  # where each token's text starts in the answer
            offsets.append(offset)
            offset += len(text_of([token]))
        return {
            "tokens": [name(entry[0][0]) for entry in entries],
            "token_logprobs": [entry[0][1] for entry in entries],
            "top_logprobs": [{name(t): lp for t, lp in entry[1:]} for entry in entries],
            "text_offset": offsets,
        }


def _thinking(reasoning: str | None) -> dict[str, str]:
    """A chat message's or delta's thinking, under vLLM's name and SGLang's (DeepSeek's API's)."""
    return {} if reasoning is None else {"reasoning": reasoning, "reasoning_content": reasoning}
