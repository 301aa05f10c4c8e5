"""Reasoning outputs through a real stack (`--reasoning-parser`) and the official openai client,
on a tiny random model whose vocabulary has <think> and </think> (`random_llama.thinker`) and a
template that opens the thinking, as DeepSeek-R1's: the answer's thinking
comes as `reasoning` (and `reasoning_content`), whole or streamed, its tokens counted; a grammar
constrains only what follows </think>; the Responses API gives a reasoning item, the Messages
API a thinking block; a vocabulary without the markers is refused at start. Sampled with a bias
towards </think>, so that it comes within a few tokens."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import requests

from turnstile.bench import random_llama
from turnstile.bench.server_process import Server, launched_server

pytestmark = pytest.mark.slow  # starts a stack

START, END = random_llama.THINK_TOKENS
THOUGHTFUL = {"temperature": 1.0, "logit_bias": {str(END): 5}, "max_tokens": 40}
MESSAGES = [{"role": "user", "content": "w5 w6 w7"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = random_llama.thinker(tmp_path_factory.mktemp("thinker"))
    with launched_server(
        "--model", str(folder), "--dtype", "float32", "--reasoning-parser", "deepseek_r1",
        "--responses-store-size", "4", "--served-model-name", "thinker",
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def chat(client: openai.OpenAI, **fields: Any) -> Any:
    return client.chat.completions.create(
        model="thinker",
        messages=MESSAGES,
        **(THOUGHTFUL | fields),  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def seed(client: openai.OpenAI) -> int:
    """A seed whose answer thinks a few tokens, says </think>, then answers."""
    for seed in range(16):
        ids = chat(client, seed=seed, extra_body={"return_token_ids": True}).choices[0].token_ids
        if END in ids[1:-1]:
            return seed
    raise AssertionError("no seed of 16 gave </think> inside the answer")


def expected(server: Server, ids: list[int]) -> tuple[str, str]:
    """The answer's text cut at </think>, the opening marker left out: (reasoning, content)."""
    text = requests.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"]
    reasoning, _, content = text.partition("</think>")
    return reasoning.replace("<think>", ""), content


def test_the_thinking_comes_apart_from_the_answer_with_its_tokens_counted(
    server: Server, client: openai.OpenAI, seed: int
) -> None:
    answer = chat(client, seed=seed, extra_body={"return_token_ids": True})
    message, ids = answer.choices[0].message, answer.choices[0].token_ids
    reasoning, content = expected(server, ids)
    assert message.model_extra["reasoning"] == reasoning != ""
    assert message.model_extra["reasoning_content"] == reasoning  # SGLang's name
    assert message.content == content != ""
    thought = ids.index(END) - ids[: ids.index(END)].count(START)
    assert answer.usage.completion_tokens_details.reasoning_tokens == thought > 0


def test_a_streamed_answer_gives_the_same_parts(client: openai.OpenAI, seed: int) -> None:
    whole = chat(client, seed=seed).choices[0].message
    for streamed in (True, False):  # SGLang's stream_reasoning
        reasoning, content, carrying = [], [], 0
        stream = chat(client, seed=seed, stream=True, stream_options={"include_usage": True},
                      extra_body={"stream_reasoning": streamed})  # fmt: skip
        for chunk in stream:
            if not chunk.choices:
                assert chunk.usage.completion_tokens_details.reasoning_tokens > 0
                continue
            delta = chunk.choices[0].delta
            if thought := (delta.model_extra or {}).get("reasoning"):
                reasoning.append(thought)
                carrying += 1
            content.append(delta.content or "")
        assert "".join(reasoning) == whole.model_extra["reasoning"]
        assert "".join(content) == whole.content
        assert carrying > 1 if streamed else carrying == 1


def test_include_and_separate_reasoning_as_vllm_and_sglang_read_them(
    server: Server, client: openai.OpenAI, seed: int
) -> None:
    ids = chat(client, seed=seed, extra_body={"return_token_ids": True}).choices[0].token_ids
    reasoning, content = expected(server, ids)
    hidden = chat(client, seed=seed, extra_body={"include_reasoning": False}).choices[0].message
    assert hidden.content == content and "reasoning" not in (hidden.model_extra or {})
    kept = chat(client, seed=seed, extra_body={"separate_reasoning": False}).choices[0].message
    assert kept.content == reasoning + "</think>" + content
    assert "reasoning" not in (kept.model_extra or {})


def test_a_prompt_that_closes_the_thinking_gets_an_answer_alone(client: openai.OpenAI) -> None:
    """Qwen3's template with enable_thinking false closes it in the prompt."""
    answer = chat(client, seed=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert "reasoning" not in (answer.choices[0].message.model_extra or {})
    assert answer.usage.completion_tokens_details.reasoning_tokens == 0


def test_a_grammar_constrains_the_answer_after_the_thinking(
    client: openai.OpenAI, seed: int
) -> None:
    regex = {"structured_outputs": {"regex": "w7w8w9"}}
    answer = chat(client, seed=seed, extra_body=regex | {"return_token_ids": True}).choices[0]
    ids = answer.token_ids
    assert answer.message.content == " w7 w8 w9" and answer.finish_reason == "stop"
    assert set(ids[: ids.index(END)]) - {7, 8, 9}  # the thinking was free
    closed = {"chat_template_kwargs": {"enable_thinking": False}}
    alone = chat(client, seed=seed, extra_body=regex | closed).choices[0].message
    assert alone.content == "w7 w8 w9"  # no thinking: constrained from the first token


def test_a_thinking_budget_ends_the_thinking_after_that_many_tokens(client: openai.OpenAI) -> None:
    """vLLM's thinking_token_budget: greedy, this model never writes </think> itself."""

    def greedy(**fields: Any) -> Any:
        body = {"return_token_ids": True} | fields
        return chat(client, temperature=0, logit_bias=None, extra_body=body)

    free = greedy().choices[0].token_ids
    assert END not in free
    for budget in (0, 3):
        answer = greedy(thinking_token_budget=budget)
        ids = answer.choices[0].token_ids
        assert ids[: budget + 1] == [*free[:budget], END]
        assert answer.usage.completion_tokens_details.reasoning_tokens == budget
        assert answer.choices[0].message.content  # the answer after it, unconstrained
    closed = {"chat_template_kwargs": {"enable_thinking": False}}  # no thinking to end
    spent = greedy(thinking_token_budget=0, **closed).choices[0].token_ids
    assert spent == greedy(**closed).choices[0].token_ids


def test_an_assistants_earlier_thinking_reaches_the_template(server: Server) -> None:
    said = {"role": "assistant", "content": "w9"}
    asked = [MESSAGES[0], said, {"role": "user", "content": "w4"}]
    lengths = []
    for thinking in ({}, {"reasoning": "w20 w21"}, {"reasoning_content": "w20 w21"}):
        messages = [asked[0], said | thinking, asked[2]]
        body = {"model": "thinker", "messages": messages}
        lengths.append(requests.post(f"{server.url}/tokenize", json=body).json()["count"])
    assert lengths[1] == lengths[2] == lengths[0] + 4  # <think> w20 w21 </think>


def test_the_responses_api_gives_a_reasoning_item(client: openai.OpenAI) -> None:
    """Greedy (the Responses API has no seed nor bias), so the whole answer is thinking."""
    whole = chat(client, temperature=0, logit_bias=None)
    fields = {"model": "thinker", "input": "w5 w6 w7", "temperature": 0, "max_output_tokens": 40}
    response = client.responses.create(**fields)  # type: ignore[call-overload]
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"]
    assert response.output[0].content[0].text == whole.choices[0].message.model_extra["reasoning"]
    assert response.output_text == (whole.choices[0].message.content or "")
    thought = whole.usage.completion_tokens_details.reasoning_tokens
    assert response.usage.output_tokens_details.reasoning_tokens == thought > 0
    events = list(client.responses.create(**fields, stream=True))  # type: ignore[call-overload]
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == response.output[0].content[0].text
    assert [item.type for item in events[-1].response.output] == kinds
    again = client.responses.create(  # the stored reasoning item goes back into the chat
        model="thinker", input="w4", previous_response_id=response.id, max_output_tokens=2
    )
    assert again.usage.input_tokens > response.usage.input_tokens + response.usage.output_tokens


def test_the_messages_api_gives_a_thinking_block(server: Server, client: openai.OpenAI) -> None:
    """Anthropic's API, greedy as above: the thinking first, whole and streamed alike."""
    import anthropic

    whole = chat(client, temperature=0, logit_bias=None).choices[0].message
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    args: dict[str, Any] = dict(model="thinker", max_tokens=40, messages=MESSAGES,
                                extra_body={"temperature": 0})  # fmt: skip
    message = claude.messages.create(**args)
    kinds = ["thinking", "text"] if whole.content else ["thinking"]  # max_tokens while thinking
    assert [block.type for block in message.content] == kinds
    assert message.content[0].thinking == whole.model_extra["reasoning"] != ""
    assert "".join(getattr(b, "text", "") for b in message.content) == (whole.content or "")
    with claude.messages.stream(**args) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None)) for b in streamed.content] == [
        (b.type, getattr(b, "thinking", None)) for b in message.content
    ]


@pytest.mark.parametrize("parser", ["qwen3", "glm45"])
def test_a_vocabulary_without_the_markers_is_refused_at_start(parser: str) -> None:
    """Every <think> parser (deepseek_r1, qwen3, glm45, glm47) reads the same markers alike."""
    done = subprocess.run(
        [sys.executable, "-m", "turnstile.cli", "serve", "--reasoning-parser", parser],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert f"--reasoning-parser {parser}: the model's vocabulary has no <think>" in done.stderr
