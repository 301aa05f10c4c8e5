"""The gateway's request types, without a server: what a request becomes for the scheduler."""

from __future__ import annotations

from turnstile.gateway_svc.openai_api import CompletionRequest, engine_request, parse

MODEL_DEFAULTS = {"temperature": 0.6, "top_k": 20}  # as a generation_config.json gives them


def sampling_of(body: bytes, defaults: dict[str, float] | None) -> tuple[float, float, int]:
    request = parse(body, CompletionRequest)
    sampling = engine_request(request, [1, 2, 3], 64, defaults).sampling
    return sampling.temperature, sampling.top_p, sampling.top_k


def test_fields_a_request_leaves_out_take_the_models_defaults_else_neutral_values() -> None:
    bare = b'{"prompt": "hi", "max_tokens": 4}'
    assert sampling_of(bare, MODEL_DEFAULTS) == (0.6, 1.0, 20)
    assert sampling_of(bare, None) == (1.0, 1.0, 0)  # --generation-config none
    given = b'{"prompt": "hi", "max_tokens": 4, "temperature": 0, "top_p": 0.5, "top_k": -1}'
    assert sampling_of(given, MODEL_DEFAULTS) == (0.0, 0.5, 0)
