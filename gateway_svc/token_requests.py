"""vLLM's `/tokenize` and `/detokenize` bodies (`token_endpoints.py` answers them)."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from turnstile.gateway_svc.request_types import ChatMessage, TokenId


class TokenizeCompletion(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    prompt: str
    model: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    model: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class Detokenize(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tokens: list[TokenId]
    model: str | None = None
