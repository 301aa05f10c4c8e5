"""The gateway service's settings: the engine it fronts, where it listens, what it accepts."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Any, Literal

from turnstile.gateway_svc.sampling_fields import RequestDefaults, model_sampling_defaults
from turnstile.shared.config import AddressConfig, EngineConfig
from turnstile.shared.lora import LoraConfig
from turnstile.shared.settings import nested, setting


@dataclass(slots=True, frozen=True)
class GatewayConfig:
    """The OpenAI-compatible HTTP gateway"""

    host: str = setting("127.0.0.1", "the address to listen on")
    port: int = setting(8000, "the port to listen on")
    api_key: str | None = setting(None, "require 'Authorization: Bearer KEY' on /v1/")
    allowed_origins: tuple[str, ...] = setting(
        ("*",), "the origins a browser page may call the API from (CORS; *: any, as vLLM)"
    )
    allowed_methods: tuple[str, ...] = setting(("*",), "the methods such a page may use (CORS)")
    allowed_headers: tuple[str, ...] = setting(("*",), "the headers such a page may send (CORS)")
    allow_credentials: bool = setting(False, "such a page may send its cookies (CORS)")
    max_body_mb: float = setting(4.0, "largest request body accepted")
    request_timeout: float = setting(
        1800.0, "seconds after which a request still running ends with an error (HTTP 504)"
    )
    served_model_name: list[str] | None = setting(
        None,
        "the names clients may ask for: the first is reported (none: the model's file or "
        "folder name)",
    )
    chat_template: str | None = setting(
        None, "a Jinja chat template, or a file holding one, in place of the model's"
    )
    generation_config: Literal["auto", "none"] = setting(
        "auto",
        "auto: generation_config.json's temperature, top_p, top_k (and max_new_tokens, a chat's "
        "default output) for requests that leave them out (as vLLM); none: neutral (1, 1, off)",
    )
    override_generation_config: dict[str, float] | None = setting(
        None,
        'sampling defaults as JSON, e.g. {"temperature": 0.5}: over the model\'s (auto) or '
        "alone (none); temperature, top_p, top_k, min_p, the penalties, and max_new_tokens: "
        "every request's most output tokens (vLLM's flag)",
    )
    default_chat_template_kwargs: dict[str, Any] | None = setting(
        None,
        'the chat template\'s keyword arguments as JSON, e.g. {"enable_thinking": false}; a '
        "request's chat_template_kwargs win (vLLM's flag)",
    )
    enable_force_include_usage: bool = setting(
        False, "every stream ends with its usage, as stream_options.include_usage (vLLM's flag)"
    )
    enable_auto_tool_choice: bool = setting(
        False, 'tool_choice "auto": the model may call the tools; --tool-call-parser reads them'
    )
    tool_call_parser: (
        Literal[
            "glm45",
            "glm47",
            "granite",
            "hermes",
            "llama3_json",
            "mistral",
            "openai",
            "phi4_mini_json",
            "pythonic",
            "qwen3_coder",
        ]
        | None
    ) = setting(None, "how the model writes its tool calls (vLLM's parser names)")
    reasoning_parser: Literal["deepseek_r1", "glm45", "glm47", "qwen3", "openai_gptoss"] | None = (
        setting(
            None,
            "a reasoning model's thinking, between <think> and </think> (gpt-oss: its analysis "
            "channel), given apart from a chat's answer as `reasoning` (vLLM's parser names)",
        )
    )
    responses_store_size: int = setting(
        0,
        "Responses API responses kept in memory for previous_response_id and GET "
        "/v1/responses/{id}, the oldest forgotten first (0: none; store: true is refused)",
    )
    enable_log_requests: bool = setting(
        False, "log a line each request as it ends: id, endpoint, status, tokens, seconds (as vLLM)"
    )
    enable_prompt_tokens_details: bool = setting(
        False, "accepted as vLLM's command lines pass it: usage always gives prompt_tokens_details"
    )
    return_tokens_as_token_ids: bool = setting(
        False, "logprobs name tokens 'token_id:N' unless a request says otherwise (as vLLM)"
    )
    metrics_names: Literal["turnstile", "vllm"] = setting(
        "turnstile",
        "how /metrics names its series: turnstile:..., or vllm:... with vLLM's model_name and "
        "engine labels, for dashboards, autoscalers and routers written for vLLM",
    )
    ssl_certfile: str | None = setting(None, "a PEM certificate (chain): answer over HTTPS")
    ssl_keyfile: str | None = setting(None, "its private key, if not in the certificate's file")
    ssl_ca_certs: str | None = setting(None, "CA certificates a client's certificate is checked by")
    ssl_cert_reqs: int = setting(
        0, "a client certificate: 0 not asked for, 1 checked if given (ssl.CERT_*, vLLM's flag)"
    )

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.responses_store_size < 0:
            raise ValueError("--responses-store-size must be >= 0")
        model_sampling_defaults(None, self.override_generation_config)  # refused before a start
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ValueError("--ssl-keyfile needs --ssl-certfile")
        if self.ssl_cert_reqs not in (0, 1):  # 2 would shut out the stack's own health probe
            raise ValueError("--ssl-cert-reqs must be 0 or 1 (2, required, is not supported)")

    @property
    def scheme(self) -> str:
        return "http" if self.ssl_certfile is None else "https"

    def ssl_context(self) -> ssl.SSLContext | None:
        """The server's TLS context from the --ssl-* files (None: plain HTTP); a file that
        cannot be read or does not fit is refused by name."""
        if self.ssl_certfile is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
            if self.ssl_ca_certs is not None:
                context.load_verify_locations(self.ssl_ca_certs)
        except (OSError, ssl.SSLError) as exc:
            files = [f for f in (self.ssl_certfile, self.ssl_keyfile, self.ssl_ca_certs) if f]
            raise ValueError(f"--ssl-*: {', '.join(files)}: {exc}") from None
        context.verify_mode = ssl.VerifyMode(self.ssl_cert_reqs)
        return context

    def request_defaults(self, found: dict[str, float] | None) -> RequestDefaults:
        """What requests that leave sampling out get, given the model's generation config."""
        found = found if self.generation_config == "auto" else None
        return model_sampling_defaults(found, self.override_generation_config)

    @property
    def auto_tool_parser(self) -> str | None:
        """The parser of "auto" tool calls; None: "auto" is refused."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None


@dataclass(slots=True, frozen=True)
class GatewayServiceConfig:
    engine: EngineConfig = nested(EngineConfig)
    addresses: AddressConfig = nested(AddressConfig)
    gateway: GatewayConfig = nested(GatewayConfig)
    lora: LoraConfig = nested(LoraConfig)
