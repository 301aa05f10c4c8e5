"""vLLM's truncation of a pooled request's prompts (/v1/embeddings, /classify, /score,
/rerank): `truncate_prompt_tokens` keeps k tokens (-1: the context's), and as vLLM serves a
pooling model, from the start: a text as transformers' tokenizer truncates it (the special
tokens kept, a pair's longer text cut first; what sentence-transformers and cross-encoders
read), token ids their first k. `truncation_side` ("left" or "right") instead slices the
tokenized prompt on that side, special tokens or not, as vLLM does then."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from turnstile.gateway_svc.errors import ApiError
from turnstile.gateway_svc.openai_api import kept_tokens
from turnstile.shared.tokenizer import Tokenizer

Side = Literal["left", "right"]


@dataclass(frozen=True, slots=True)
class Truncation:
    keep: int | None  # None: nothing cut
    side: Side | None  # None: the tokenizer's truncation

    @classmethod
    def of(cls, keep: int | None, side: Side | None, max_model_len: int) -> Truncation:
        return cls(kept_tokens(keep, max_model_len), side)

    def ids(self, ids: list[int]) -> list[int]:
        """Token ids given as they are: their first k (their last, `truncation_side` left)."""
        if self.keep is None or len(ids) <= self.keep:
            return ids
        return ids[-self.keep :] if self.side == "left" else ids[: self.keep]

    def texts(
        self, tokenizer: Tokenizer, texts: tuple[str, ...], add_special_tokens: bool = True
    ) -> tuple[list[int], int]:
        """A text's (or a pair's) token ids, and where those typed 1 start (-1: none)."""
        if self.keep is None or self.side is not None:
            if len(texts) == 2:
                ids, second = tokenizer.encode_pair(*texts)
            else:
                ids, second = tokenizer.encode(texts[0], add_special_tokens), -1
            kept = self.ids(ids)
            if second >= 0 and self.side == "left":  # moved by what was cut from the left
                second = max(0, second - (len(ids) - len(kept)))
            return kept, second if second < len(kept) else -1
        try:
            return tokenizer.truncated(texts, self.keep, add_special_tokens)
        except ValueError as error:
            raise ApiError(400, f"truncate_prompt_tokens: {error}",
                           param="truncate_prompt_tokens") from None  # fmt: skip
