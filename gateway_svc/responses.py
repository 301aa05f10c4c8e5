"""OpenAI response bodies: completion and chat, whole or as stream chunks, with logprobs."""

from __future__ import annotations

import time
from typing import Any

from turnstile.shared.tokenizer import Tokenizer


class ResponseShape:
    """Builds the JSON bodies of one request, completion or chat."""

    def __init__(self, chat: bool, model: str, req_id: int, tokenizer: Tokenizer) -> None:
        self.chat = chat
        self.model = model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{req_id:x}-{time.time_ns():x}"
        self.created = int(time.time())
        self.tokenizer = tokenizer

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

    def chunk(
        self, text: str, finish_reason: str | None, logprobs: Any, first: bool = False
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
        else:
            choice["text"] = text
        return self._envelope([choice], chunk=True)

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        body = self._envelope([], chunk=True)
        body["usage"] = usage
        return body

    def whole(
        self, text: str, finish_reason: str, logprobs: Any, usage: dict[str, int]
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        body = self._envelope([choice], chunk=False)
        body["usage"] = usage
        return body

    def logprobs(self, entries: list[list[tuple[int, float]]], offset: int) -> Any:
        """OpenAI logprobs for tokens whose entries are [(token, logprob), *top-N]."""
        if not entries:
            return None
        text_of = self.tokenizer.decode
        if self.chat:
            return {
                "content": [
                    {
                        "token": text_of([token]),
                        "logprob": logprob,
                        "bytes": list(text_of([token]).encode()),
                        "top_logprobs": [
                            {
                                "token": text_of([t]),
                                "logprob": lp,
                                "bytes": list(text_of([t]).encode()),
                            }
                            for t, lp in top
                        ],
                    }
                    for (token, logprob), *top in entries
                ]
            }
        tokens = [text_of([entry[0][0]]) for entry in entries]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [entry[0][1] for entry in entries],
            "top_logprobs": [{text_of([t]): lp for t, lp in entry[1:]} for entry in entries],
            "text_offset": offsets,
        }
