"""vLLM's `/tokenize`, `/detokenize` and `/version`, shaped as vLLM answers them, Anthropic's
`/v1/messages/count_tokens`, and SGLang's `/server_info`, where sglang-router reads the model's
name to route by it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib.metadata import version

from aiohttp import web

from turnstile.gateway_svc.errors import ApiError
from turnstile.gateway_svc.messages_api import MessagesCount
from turnstile.gateway_svc.openai_api import chat_text, parse_body
from turnstile.gateway_svc.token_requests import Detokenize, TokenizeChat, TokenizeCompletion
from turnstile.shared.tokenizer import Tokenizer


class TokenEndpoints:
    def __init__(
        self,
        tokenizer: Tokenizer,
        max_model_len: int,
        check_model: Callable[[str | None], object],
        served_name: str,
    ) -> None:
        self.tokenizer = tokenizer
        self.served_name = served_name
        self.max_model_len = max_model_len
        self.check_model = check_model

    def routes(self) -> list[tuple[str, str, Callable[[web.Request], Awaitable[web.Response]]]]:
        """Each endpoint's method, path and handler (/server_info: SGLang's, and its older name)."""
        return [
            ("POST", "/tokenize", self.tokenize), ("POST", "/detokenize", self.detokenize),
            ("POST", "/v1/messages/count_tokens", self.count_message_tokens),
            ("GET", "/version", self.version), ("GET", "/server_info", self.server_info),
            ("GET", "/get_server_info", self.server_info),
        ]  # fmt: skip

    async def tokenize(self, http: web.Request) -> web.Response:
        body = await http.read()
        chat = b'"messages"' in body  # as a key: inside a JSON string its quotes are escaped
        request = parse_body(body, TokenizeChat if chat else TokenizeCompletion)
        self.check_model(request.model)
        text = chat_text(request, self.tokenizer) if chat else request.prompt
        ids = self.tokenizer.encode(text, request.add_special_tokens)
        strs = [self.tokenizer.token_text(t) for t in ids] if request.return_token_strs else None
        return web.json_response(
            {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
             "token_strs": strs}
        )  # fmt: skip

    async def detokenize(self, http: web.Request) -> web.Response:
        request = parse_body(await http.read(), Detokenize)
        self.check_model(request.model)
        if any(t >= self.tokenizer.vocab_size for t in request.tokens):
            raise ApiError(
                400, f"token ids must lie in [0, {self.tokenizer.vocab_size})", param="tokens"
            )
        return web.json_response({"prompt": self.tokenizer.decode(request.tokens)})

    async def count_message_tokens(self, http: web.Request) -> web.Response:
        """Anthropic's /v1/messages/count_tokens: the tokens the request's input would take."""
        request = parse_body(await http.read(), MessagesCount)
        self.check_model(request.model)
        ids = self.tokenizer.encode(chat_text(request.as_chat(), self.tokenizer))
        return web.json_response({"input_tokens": len(ids)})

    async def version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": version("turnstile")})

    async def server_info(self, _: web.Request) -> web.Response:
        return web.json_response(
            {"served_model_name": self.served_name, "max_model_len": self.max_model_len,
             "version": version("turnstile")}
        )  # fmt: skip
