"""Every request field is honoured or refused with a 400 naming it (never a silent 200),
checked with the official openai client against the running service; and the fields the
gateway itself honours: n, several prompts, echo, stop text, max_tokens defaults, names."""

from __future__ import annotations

import typing
from typing import Any

import msgspec
import openai
import pytest
from conftest import MODEL
from openai.types import completion_create_params as completion_params
from openai.types import embedding_create_params as embedding_params
from openai.types.chat import completion_create_params as chat_params

from turnstile.bench.server_process import Server
from turnstile.gateway_svc.embeddings import EmbeddingRequest
from turnstile.gateway_svc.request_types import ChatCompletionRequest, CompletionRequest

pytestmark = pytest.mark.slow  # starts a stack

OK, REFUSED = "honoured", "refused"
FCFS = "refused under the default policy"  # honoured with --policy priority
NO_PARSER = "refused without --reasoning-parser"  # honoured with one (test_reasoning.py)
NO_EFFORT = "refused where the template does not read it"  # honoured: test_harmony.py
# For each field (OpenAI's and vLLM's): the body fields sent with it, and what must happen.
COMMON: dict[str, tuple[dict[str, Any], str]] = {
    "model": ({"model": MODEL}, OK),
    "max_tokens": ({"max_tokens": 3}, OK),
    "temperature": ({"temperature": 0.5}, OK),
    "top_p": ({"top_p": 0.5}, OK),
    "top_k": ({"top_k": 5}, OK),
    "min_p": ({"min_p": 0.1}, OK),
    "presence_penalty": ({"presence_penalty": 0.5}, OK),
    "frequency_penalty": ({"frequency_penalty": 0.5}, OK),
    "repetition_penalty": ({"repetition_penalty": 1.2}, OK),
    "logit_bias": ({"logit_bias": {"0": -100}}, OK),
    "allowed_token_ids": ({"allowed_token_ids": [1, 2, 3]}, OK),
    "bad_words": ({"bad_words": ["the"]}, OK),
    "min_tokens": ({"min_tokens": 2}, OK),
    "seed": ({"seed": 7, "temperature": 1.0}, OK),
    "stop": ({"stop": ["\n\n"]}, OK),
    "stop_token_ids": ({"stop_token_ids": [2]}, OK),
    "include_stop_str_in_output": ({"include_stop_str_in_output": True}, OK),
    "ignore_eos": ({"ignore_eos": True}, OK),
    "skip_special_tokens": ({"skip_special_tokens": False}, OK),
    "spaces_between_special_tokens": ({"spaces_between_special_tokens": False}, OK),
    "stream": ({"stream": True}, OK),
    "stream_options": ({"stream": True, "stream_options": {"include_usage": True}}, OK),
    "priority": ({"priority": -1}, FCFS),
    "n": ({"n": 2}, OK),
    "best_of": ({"best_of": 2}, REFUSED),
    "use_beam_search": ({"use_beam_search": True, "n": 2}, OK),  # test_beam_search.py
    "length_penalty": ({"use_beam_search": True, "length_penalty": 0.5}, OK),
    "truncate_prompt_tokens": ({"truncate_prompt_tokens": 4}, OK),
    "return_token_ids": ({"return_token_ids": True}, OK),
    "cache_salt": ({"cache_salt": "tenant-a"}, OK),
    "return_tokens_as_token_ids": ({"return_tokens_as_token_ids": True}, OK),
    "request_id": ({"request_id": "job-1"}, OK),
    "prompt_logprobs": ({"prompt_logprobs": 1}, OK),
    "response_format": ({"response_format": {"type": "json_object"}}, OK),
    "structured_outputs": ({"structured_outputs": {"regex": "a+"}}, OK),
    "guided_json": ({"guided_json": {"type": "object"}}, OK),
    "guided_regex": ({"guided_regex": "a+"}, OK),
    "guided_choice": ({"guided_choice": ["a", "b"]}, OK),
    "guided_grammar": ({"guided_grammar": 'root ::= "a"'}, OK),
    "store": ({"store": True}, REFUSED),
    "user": ({"user": "someone"}, OK),  # accepted, not used
    "metadata": ({"metadata": {"k": "v"}}, OK),  # accepted, not used
    "service_tier": ({"service_tier": "auto"}, OK),  # accepted, not used
    "safety_identifier": ({"safety_identifier": "h"}, OK),  # accepted, not used
    "prompt_cache_key": ({"prompt_cache_key": "k"}, OK),  # accepted, not used
    "no_stop_trim": ({"no_stop_trim": True}, OK),  # SGLang's include_stop_str_in_output
    "return_hidden_states": ({"return_hidden_states": True}, REFUSED),
}
COMPLETIONS = COMMON | {
    "prompt": ({"prompt": "Hi"}, OK),
    "logprobs": ({"logprobs": 2}, OK),
    "echo": ({"echo": True}, OK),
    "suffix": ({"suffix": "end"}, REFUSED),
    "add_special_tokens": ({"add_special_tokens": False}, OK),
}
CHAT = COMMON | {
    "messages": ({"messages": [{"role": "user", "content": "Hi"}]}, OK),
    "max_completion_tokens": ({"max_completion_tokens": 3}, OK),
    "logprobs": ({"logprobs": True}, OK),
    "top_logprobs": ({"logprobs": True, "top_logprobs": 2}, OK),
    "add_generation_prompt": ({"add_generation_prompt": False}, OK),
    "continue_final_message": (
        {
            "add_generation_prompt": False,
            "continue_final_message": True,
            "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "I"}],
        },
        OK,
    ),
    "add_special_tokens": ({"add_special_tokens": True}, OK),
    "chat_template_kwargs": ({"chat_template_kwargs": {"enable_thinking": False}}, OK),
    "tools": (
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
        OK,
    ),
    "tool_choice": ({"tool_choice": "none"}, OK),
    "parallel_tool_calls": ({"parallel_tool_calls": False}, OK),  # without tools: no effect
    "functions": ({"functions": [{"name": "f"}]}, REFUSED),
    "function_call": ({"function_call": "auto"}, REFUSED),
    "audio": ({"audio": {"voice": "alloy", "format": "mp3"}}, REFUSED),
    "modalities": ({"modalities": ["text", "audio"]}, REFUSED),
    "prediction": ({"prediction": {"type": "content", "content": "x"}}, REFUSED),
    "reasoning_effort": ({"reasoning_effort": "low"}, NO_EFFORT),
    "verbosity": ({"verbosity": "low"}, REFUSED),
    "web_search_options": ({"web_search_options": {}}, REFUSED),
    "chat_template": ({"chat_template": "{{ messages }}"}, REFUSED),
    "documents": ({"documents": [{"text": "x"}]}, REFUSED),
    "echo": ({"echo": True}, REFUSED),
    "moderation": ({"moderation": {"policy": {}}}, REFUSED),
    "prompt_cache_options": ({"prompt_cache_options": {"ttl": "1h"}}, REFUSED),
    "prompt_cache_retention": ({"prompt_cache_retention": "24h"}, REFUSED),
    # Without --reasoning-parser, either value holds (test_reasoning.py: with one)
    "include_reasoning": ({"include_reasoning": False}, OK),
    "separate_reasoning": ({"separate_reasoning": False}, OK),
    "stream_reasoning": ({"stream_reasoning": False}, OK),
    "thinking_token_budget": ({"thinking_token_budget": 8}, NO_PARSER),
}

NOT_MATRYOSHKA = "refused unless the model is Matryoshka"  # honoured: test_embeddings.py
CONVERSATION = [{"role": "user", "content": "Hi"}]
EMBEDDINGS: dict[str, tuple[dict[str, Any], str]] = {
    "input": ({"input": ["Hi", "Ho"]}, OK),
    "model": ({"model": MODEL}, OK),
    "encoding_format": ({"encoding_format": "float"}, OK),
    "dimensions": ({"dimensions": 8}, NOT_MATRYOSHKA),
    "user": ({"user": "someone"}, OK),
    "truncate_prompt_tokens": ({"truncate_prompt_tokens": 1}, OK),
    "truncation_side": ({"truncate_prompt_tokens": 1, "truncation_side": "left"}, OK),
    "add_special_tokens": ({"add_special_tokens": False}, OK),
    "use_activation": ({"use_activation": False}, OK),
    # vLLM's chat embeddings (a conversation in place of input): test_embeddings.py
    "messages": ({"messages": CONVERSATION}, OK),
    "add_generation_prompt": ({"messages": CONVERSATION, "add_generation_prompt": True}, OK),
    "continue_final_message": ({"messages": CONVERSATION, "continue_final_message": True}, OK),
    "chat_template_kwargs": ({"messages": CONVERSATION, "chat_template_kwargs": {"a": 1}}, OK),
}


def fields_of(typed_dict: type) -> set[str]:
    return set(typing.get_type_hints(typed_dict))


def test_every_field_of_openai_and_of_our_types_is_classified() -> None:
    openai_completions = fields_of(completion_params.CompletionCreateParamsBase)
    openai_chat = fields_of(chat_params.CompletionCreateParamsBase)
    assert openai_completions | set(CompletionRequest.__struct_fields__) == set(COMPLETIONS)
    assert openai_chat | set(ChatCompletionRequest.__struct_fields__) == set(CHAT)
    for table, kind in ((COMPLETIONS, CompletionRequest), (CHAT, ChatCompletionRequest)):
        refused = {name for name, (_, outcome) in table.items() if outcome == REFUSED}
        assert refused == set(kind.REFUSED)  # what the table says is what the server does


def test_every_embeddings_field_is_honoured_or_refused_by_name(client: openai.OpenAI) -> None:
    given = fields_of(embedding_params.EmbeddingCreateParams)
    assert given | set(EmbeddingRequest.__struct_fields__) == set(EMBEDDINGS)
    for field, (body, outcome) in EMBEDDINGS.items():
        asked = body if "messages" in body else {"input": "Hi"} | body
        if outcome == OK:
            answer = client.post("/embeddings", cast_to=object, body=asked)
            inputs = asked.get("input", ["a conversation"])
            assert len(answer["data"]) == (len(inputs) if isinstance(inputs, list) else 1)
            continue
        with pytest.raises(openai.BadRequestError) as refusal:
            client.post("/embeddings", cast_to=object, body=asked)
        assert refusal.value.body["param"] == field


@pytest.mark.parametrize(
    "body", [{"add_generation_prompt": True}, {"continue_final_message": False},
             {"chat_template_kwargs": {}}],
)  # fmt: skip
def test_a_chat_option_beside_input_is_refused_by_name(client: openai.OpenAI, body: dict) -> None:
    """It would change nothing: input is never templated."""
    with pytest.raises(openai.BadRequestError) as refusal:
        client.post("/embeddings", cast_to=object, body={"input": "Hi"} | body)
    assert refusal.value.body["param"] == next(iter(body))


def send(client: openai.OpenAI, chat: bool, body: dict[str, Any]) -> Any:
    base = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    base |= {"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hi"}
    resource = client.chat.completions if chat else client.completions
    # extra_body: the fields travel as they are written, unchecked by the client.
    response = resource.create(**base | {"stream": body.get("stream", False)}, extra_body=body)
    return list(response) if body.get("stream") else response


@pytest.mark.parametrize(
    ("chat", "field"), [(False, f) for f in COMPLETIONS] + [(True, f) for f in CHAT]
)
def test_a_field_is_honoured_or_refused_by_name(
    client: openai.OpenAI, chat: bool, field: str
) -> None:
    body, outcome = (CHAT if chat else COMPLETIONS)[field]
    if outcome == OK:
        assert send(client, chat, body)
        return
    with pytest.raises(openai.BadRequestError) as refusal:
        send(client, chat, body)
    assert field in refusal.value.body["message"]
    assert refusal.value.body["param"] == (None if outcome == FCFS else field)


def test_an_unknown_field_is_refused_by_name(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refusal:
        send(client, False, {"temperatur": 0.5})
    assert refusal.value.body["param"] == "temperatur"


def test_field_refusals_in_the_openapi_document(service: Server) -> None:
    import urllib.request

    with urllib.request.urlopen(f"{service.url}/openapi.json", timeout=5) as response:
        document = msgspec.json.decode(response.read())
    chat = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert "not supported" in chat["functions"]["description"]
    assert {"/tokenize", "/detokenize", "/version"} <= set(document["paths"])
