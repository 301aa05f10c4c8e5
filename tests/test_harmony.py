"""gpt-oss's harmony answers through a real stack and the official openai client, on a tiny
gpt-oss whose greedy answers are known beforehand (`harmony_model.py`): under `--reasoning-parser
openai_gptoss` the analysis channel comes as `reasoning`, the final one as `content`; under
`--tool-call-parser openai` a message to `functions.get_weather` is a tool call; whole or
streamed alike. vLLM's `reasoning_effort` reaches a template that reads it (one that does not
refuses it: `test_request_fields.py`); harmony's parsers are refused at start for another
model, and another model's for gpt-oss. The reader's cases one by one:
`test_harmony_reader.py`. The Responses API alike."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import harmony_model
import openai
import pytest
import requests

from turnstile.bench.server_process import Server, launched_server

pytestmark = pytest.mark.slow  # starts a stack

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return harmony_model.write(tmp_path_factory.mktemp("harmony"))


@pytest.fixture(scope="module")
def server(folder: Any) -> Iterator[Server]:
    with launched_server(
        "--model", str(folder), "--dtype", "float32", "--reasoning-parser", "openai_gptoss",
        "--enable-auto-tool-choice", "--tool-call-parser", "openai", "--served-model-name", "oss",
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def chat(client: openai.OpenAI, **fields: Any) -> Any:
    return client.chat.completions.create(
        model="oss", messages=MESSAGES, temperature=0, max_tokens=40, **fields
    )


def streamed(client: openai.OpenAI, **fields: Any) -> tuple[list[str], str, list[Any], str]:
    """The reasoning's pieces, the content, the calls' pieces and the finish reason."""
    reasoning, content, calls, reason = [], [], [], ""
    for chunk in chat(client, stream=True, **fields):
        delta = chunk.choices[0].delta
        if thought := (delta.model_extra or {}).get("reasoning"):
            reasoning.append(thought)
        content.append(delta.content or "")
        calls += delta.tool_calls or []
        reason = chunk.choices[0].finish_reason or reason
    return reasoning, "".join(content), calls, reason


def test_the_analysis_is_the_reasoning_and_the_final_channel_the_content(
    client: openai.OpenAI,
) -> None:
    answer = chat(client, extra_body={"return_token_ids": True})
    message = answer.choices[0].message
    assert message.model_extra["reasoning"] == harmony_model.REASONING
    assert message.content == harmony_model.CONTENT
    assert answer.choices[0].finish_reason == "stop"
    assert len(answer.choices[0].token_ids) == len(harmony_model.ANSWER) - 1
    script = harmony_model.ANSWER  # the analysis's body: the tokens between its markers
    thought = script.index("<|end|>") - script.index("<|message|>") - 1
    assert answer.usage.completion_tokens_details.reasoning_tokens == thought == 2
    reasoning, content, _, reason = streamed(client)
    assert "".join(reasoning) == harmony_model.REASONING and len(reasoning) > 1
    assert content == harmony_model.CONTENT and reason == "stop"


def test_a_message_to_a_function_is_a_tool_call(client: openai.OpenAI) -> None:
    answer = chat(client, tools=TOOLS)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert answer.usage.completion_tokens_details.reasoning_tokens == 0
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == json.loads(harmony_model.ARGUMENTS)
    _, content, calls, reason = streamed(client, tools=TOOLS)
    assert not content.strip() and reason == "tool_calls"
    assert [c.function.name for c in calls if c.function.name] == ["get_weather"]
    arguments = "".join(c.function.arguments or "" for c in calls)
    assert json.loads(arguments) == json.loads(harmony_model.ARGUMENTS)


def test_the_responses_api_gives_the_reasoning_and_the_call_as_items(
    client: openai.OpenAI,
) -> None:
    fields = {"model": "oss", "input": "What is 2 + 2?", "temperature": 0}
    response = client.responses.create(**fields)  # type: ignore[call-overload]
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == harmony_model.REASONING
    assert response.output_text == harmony_model.CONTENT
    events = list(client.responses.create(**fields, stream=True))  # type: ignore[call-overload]
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == harmony_model.REASONING
    called = client.responses.create(**fields, tools=[{"type": "function", **TOOLS[0]["function"]}])
    assert [item.type for item in called.output][-1] == "function_call"
    assert called.output[-1].name == "get_weather"


def test_an_earlier_answers_reasoning_reaches_the_template_as_thinking(server: Server) -> None:
    said = {"role": "assistant", "content": "w5", "reasoning": "w6 w7 w8"}
    lengths = []
    for turns in ([*MESSAGES, said | {"reasoning": None}], [*MESSAGES, said]):
        body = {"model": "oss", "messages": turns}
        lengths.append(requests.post(f"{server.url}/tokenize", json=body).json()["count"])
    # <|start|> assistant <|channel|> analysis <|message|>, its 3 words, <|end|>
    assert lengths[1] == lengths[0] + 9


def test_separate_reasoning_false_gives_the_answer_as_written(client: openai.OpenAI) -> None:
    """SGLang's field: the channels and their markers left in `content`, as for `<think>`."""
    message = chat(client, extra_body={"separate_reasoning": False}).choices[0].message
    assert "reasoning" not in (message.model_extra or {})
    assert message.content == "".join(harmony_model.ANSWER[1:-1])


def test_reasoning_effort_reaches_a_template_that_reads_it(client: openai.OpenAI) -> None:
    answer = chat(client, reasoning_effort="low")
    assert answer.choices[0].message.content == harmony_model.CONTENT


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        (["--reasoning-parser", "openai_gptoss"], "reads gpt-oss's harmony messages"),
        (["--tool-call-parser", "openai"], "reads gpt-oss's harmony messages"),
        (["--GPT", "--tool-call-parser", "hermes"], "use --tool-call-parser openai"),
        (["--GPT", "--reasoning-parser", "qwen3"], "use --reasoning-parser openai_gptoss"),
    ],
)
def test_harmonys_parsers_go_with_harmony_models_only(
    folder: Any, flags: list[str], refusal: str
) -> None:
    model = ["--model", str(folder)] if flags[0] == "--GPT" else []
    done = subprocess.run(
        [sys.executable, "-m", "turnstile.cli", "serve", *model, *flags[flags[0] == "--GPT" :]],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1 and refusal in done.stderr
