"""The gateway's request types, without a server: what a request becomes for the scheduler."""

from __future__ import annotations

from typing import Any

import pytest

from turnstile.gateway_svc.config import GatewayConfig
from turnstile.gateway_svc.openai_api import engine_request, parse
from turnstile.gateway_svc.request_types import ChatCompletionRequest, CompletionRequest
from turnstile.gateway_svc.sampling_fields import RequestDefaults, model_sampling_defaults
from turnstile.shared.model_info import embedded_model_path, read_model_info
from turnstile.shared.settings import build
from turnstile.shared.tokenizer import Tokenizer

MODEL_DEFAULTS = {"temperature": 0.6, "top_k": 20}  # as a generation_config.json gives them


def sampling_of(body: bytes, defaults: dict[str, float] | None) -> tuple[float, float, int]:
    path = embedded_model_path()
    tokenizer = Tokenizer(path, read_model_info(path))
    request = parse(body, CompletionRequest)
    given = None if defaults is None else RequestDefaults(defaults)
    sampling = engine_request(request, [1, 2, 3], 64, tokenizer, given).sampling
    return sampling.temperature, sampling.top_p, sampling.top_k


def test_fields_a_request_leaves_out_take_the_models_defaults_else_neutral_values() -> None:
    bare = b'{"prompt": "hi", "max_tokens": 4}'
    assert sampling_of(bare, MODEL_DEFAULTS) == (0.6, 1.0, 20)
    assert sampling_of(bare, None) == (1.0, 1.0, 0)  # --generation-config none
    given = b'{"prompt": "hi", "max_tokens": 4, "temperature": 0, "top_p": 0.5, "top_k": -1}'
    assert sampling_of(given, MODEL_DEFAULTS) == (0.0, 0.5, 0)


@pytest.mark.parametrize(
    ("flags", "defaults"),
    [
        ({"generation_config": "auto"}, MODEL_DEFAULTS),
        ({"generation_config": "none"}, {}),
        # vLLM's --override-generation-config: alone under none, over the model's under auto
        ({"generation_config": "none", "override_generation_config": {"temperature": 0}},
         {"temperature": 0}),
        ({"override_generation_config": {"temperature": 1.0}},
         {**MODEL_DEFAULTS, "temperature": 1.0}),
    ],
)  # fmt: skip
def test_the_generation_config_flags_choose_the_defaults(
    flags: dict[str, Any], defaults: dict[str, float]
) -> None:
    """Each combination; two of them through a stack in test_choices_and_endpoints.py."""
    assert build(GatewayConfig, **flags).request_defaults(MODEL_DEFAULTS).sampling == defaults


@pytest.mark.parametrize(
    ("found", "override", "outputs"),
    [
        (None, None, (16, 40, 61, 40)),  # completions 16 (as OpenAI), chats the context's rest
        ({"max_new_tokens": 5}, None, (16, 40, 5, 40)),  # the model's: a chat's default only
        (None, {"max_new_tokens": 5}, (5, 5, 5, 5)),  # the override's: every request's limit
        ({"max_new_tokens": 30}, {"max_new_tokens": 20}, (16, 20, 20, 20)),
    ],
)  # fmt: skip
def test_max_new_tokens_is_a_chats_default_and_from_the_override_every_requests_limit(
    found: dict[str, float] | None, override: dict[str, float] | None, outputs: tuple[int, ...]
) -> None:
    """The max_tokens of a completion leaving it out, a completion asking 40, a chat leaving
    it out, a chat asking 40, in a 64-token context: vLLM's `get_max_tokens`."""
    path = embedded_model_path()
    tokenizer = Tokenizer(path, read_model_info(path))
    defaults = model_sampling_defaults(found, override)
    requests = [
        parse(b'{"prompt": "hi"}', CompletionRequest),
        parse(b'{"prompt": "hi", "max_tokens": 40}', CompletionRequest),
        parse(b'{"messages": [{"role": "user", "content": "hi"}]}', ChatCompletionRequest),
        parse(b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 40}',
              ChatCompletionRequest),
    ]  # fmt: skip
    asked = [engine_request(r, [1, 2, 3], 64, tokenizer, defaults).max_tokens for r in requests]
    assert tuple(asked) == outputs


def test_a_model_default_outside_the_requests_ranges_is_refused_by_name() -> None:
    found = {"temperature": 0.7, "repetition_penalty": 1.05, "min_p": 0.1}
    assert model_sampling_defaults(found).sampling == found
    with pytest.raises(ValueError, match="repetition_penalty"):
        model_sampling_defaults({"temperature": 0.7, "repetition_penalty": 3.0})
    for most in (0, 2.5):
        with pytest.raises(ValueError, match="max_new_tokens must be a whole number"):
            model_sampling_defaults({"max_new_tokens": most})


TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System messages must come first, not at ' ~ loop.index) }}"
    "{%- endif %}"
    "{%- if m.content == 'stop here' %}{% break %}{% endif %}"
    "<|{{ m.role }}|>{{ m.content | tojson }}{{ eos_token }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{{ strftime_now('%Y') }}{%- endif %}"
)


def test_chat_templates_render_as_transformers_renders_them() -> None:
    import dataclasses

    import transformers

    from turnstile.gateway_svc.errors import ApiError
    from turnstile.gateway_svc.openai_api import prompts_of
    from turnstile.gateway_svc.request_types import ChatCompletionRequest
    from turnstile.shared.model_info import embedded_model_path, read_model_info
    from turnstile.shared.tokenizer import Tokenizer

    path = embedded_model_path()
    info = dataclasses.replace(read_model_info(path), chat_template=TEMPLATE)
    ours = Tokenizer(path, info)
    eos = ours.token_text(info.eos_token_id)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=ours.backend, eos_token=eos)
    messages = [
        {"role": "system", "content": "Sé breve <b>"},
        {"role": "user", "content": "¿Qué hora es?"},
        {"role": "assistant", "content": "stop here"},
        {"role": "user", "content": "never rendered"},
    ]
    expected = theirs.apply_chat_template(
        messages, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert ours.render_chat(messages) == expected
    assert '"Sé breve <b>"' in expected  # tojson as transformers': no ASCII or HTML escapes
    body = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "x"}]}'
    try:
        prompts_of(parse(body, ChatCompletionRequest), ours)
    except ApiError as exc:
        assert exc.status == 400
        assert "System messages must come first, not at 2" in exc.message
    else:
        raise AssertionError("the template's raise_exception did not refuse the request")


@pytest.mark.parametrize(
    ("generation_prompt", "continue_final", "kwargs", "ending"),
    [
        (True, False, {"enable_thinking": True}, "<|assistant|>T2"),  # then the year
        (False, True, {}, '"Well,'),  # inside the last message, for the model to go on
        (False, False, {"x": 1}, '"Well, "<|im_end|>'),
    ],
)
def test_chat_options_render_as_transformers_renders_them(
    generation_prompt: bool, continue_final: bool, kwargs: dict, ending: str
) -> None:
    import dataclasses

    import transformers

    from turnstile.shared.model_info import embedded_model_path, read_model_info
    from turnstile.shared.tokenizer import Tokenizer

    template = TEMPLATE.replace("<|assistant|>", "<|assistant|>{{ 'T' if enable_thinking }}")
    path = embedded_model_path()
    info = dataclasses.replace(read_model_info(path), chat_template=template)
    ours = Tokenizer(path, info)
    eos = ours.token_text(info.eos_token_id)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=ours.backend, eos_token=eos)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well, "}]
    options = dict(add_generation_prompt=generation_prompt, continue_final_message=continue_final)
    expected = theirs.apply_chat_template(
        messages, chat_template=template, tokenize=False, **options, **kwargs
    )
    assert ours.render_chat(messages, **options, **kwargs) == expected
    assert ending in expected[-len(ending) - 4 :]
