"""What the gateway itself does with a request, through the running service and the official
openai client: n choices (sharing the prompt's KV blocks), several prompts, echo, stop text,
max_tokens defaults (a chat's to the end of the KV cache), the token endpoints, served names and a
chat template file."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from conftest import MODEL

from turnstile.bench.server_process import Server, launched_server

pytestmark = pytest.mark.slow  # starts a stack


@pytest.fixture(scope="module")
def root(service: Server) -> openai.OpenAI:
    """For vLLM's endpoints outside /v1."""
    return openai.OpenAI(base_url=service.url, api_key="unused", max_retries=0)


def test_max_tokens_defaults_as_vllm(client: openai.OpenAI) -> None:
    completion = client.completions.create(
        model=MODEL, prompt="Once upon a time", temperature=0, extra_body={"ignore_eos": True}
    )
    assert completion.usage.completion_tokens == 16  # completions: 16, as OpenAI


def test_n_choices_differ_by_seed_and_several_prompts_come_in_order(
    client: openai.OpenAI,
) -> None:
    seeded = dict(model=MODEL, prompt="My favourite fruit is", max_tokens=8, temperature=1.0)
    many = client.completions.create(**seeded, n=3, seed=11)
    assert [c.index for c in many.choices] == [0, 1, 2]
    texts = [c.text for c in many.choices]
    assert len(set(texts)) > 1  # each choice draws its own tokens
    alone = client.completions.create(**seeded, seed=11)
    assert alone.choices[0].text == texts[0]  # choice 0 is the request's own seed
    assert many.usage.completion_tokens == sum(
        len(c.logprobs.tokens) for c in client.completions.create(**seeded, n=3, seed=11,
                                                                    logprobs=0).choices
    )  # fmt: skip
    prompts = ["One, two,", "Red, green,"]
    both = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0, n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        single = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
        assert both.choices[2 * i].text == both.choices[2 * i + 1].text == single.choices[0].text
    streamed = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=4, temperature=0, stream=True
    )
    texts = ["", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [both.choices[0].text, both.choices[2].text]


def settled(service: Server) -> dict[str, float]:
    """The scheduler's series once they stop changing (it publishes them twice a second)."""
    last = service.scrape()
    while True:
        time.sleep(0.6)
        now = service.scrape()
        if now == last:
            return now
        last = now


def test_n_choices_compute_the_prompt_once(service: Server, client: openai.OpenAI) -> None:
    prompt = list(range(1000, 3000))  # 2,000 token ids
    before = settled(service)
    answer = client.completions.create(
        model=MODEL, prompt=prompt, n=4, max_tokens=4, temperature=1.0, seed=3
    )
    assert len(answer.choices) == 4
    # The scheduler's series lag its work by up to a status interval, more when the executor
    # holds both cores: wait (10 s at most) until all four choices' lookups are counted.
    queries = "turnstile:prefix_cache_queries_total"
    deadline = time.monotonic() + 10
    while service.scrape()[queries] - before[queries] < 4 * len(prompt):
        if time.monotonic() > deadline:
            break  # the bounds below then say what was missed
        time.sleep(0.2)
    after = settled(service)
    looked_up = after[queries] - before[queries]
    found = after["turnstile:prefix_cache_hits_total"] - before["turnstile:prefix_cache_hits_total"]
    # Once in full, then each other choice only its last block (at least one token computes).
    # Bounds on the hits, not on the lookups: a request another test left may still be looked up.
    assert 3 * (len(prompt) - 16) <= found <= 3 * len(prompt), (looked_up, found)
    assert looked_up - found >= len(prompt)


def test_n_beyond_the_kv_cache_is_refused_by_name(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refusal:
        client.completions.create(model=MODEL, prompt="Hi", n=64, max_tokens=1000)
    assert refusal.value.body["param"] == "n" and "KV blocks" in refusal.value.body["message"]


def test_echo_and_stop_text(client: openai.OpenAI) -> None:
    args = dict(model=MODEL, prompt="Count: one, two, three,", max_tokens=12, temperature=0)
    plain = client.completions.create(**args).choices[0].text
    echoed = client.completions.create(**args, echo=True).choices[0].text
    assert echoed == args["prompt"] + plain
    stop = plain[4:7]
    for keep in ("include_stop_str_in_output", "no_stop_trim"):  # vLLM's name, SGLang's
        cut = client.completions.create(**args, stop=[stop], extra_body={keep: True})
        assert cut.choices[0].text == plain[: plain.index(stop) + len(stop)]


def test_stop_token_text_is_shown_only_when_asked(
    client: openai.OpenAI, root: openai.OpenAI
) -> None:
    args = dict(model=MODEL, prompt="Count: one, two, three,", max_tokens=12, temperature=0)
    assert "," in client.completions.create(**args).choices[0].text
    [comma] = root.post("/tokenize", cast_to=object, body={"prompt": ","})["tokens"]
    hidden = client.completions.create(**args, extra_body={"stop_token_ids": [comma]})
    shown = client.completions.create(
        **args, extra_body={"stop_token_ids": [comma], "include_stop_str_in_output": True}
    )
    assert hidden.choices[0].finish_reason == shown.choices[0].finish_reason == "stop"
    assert shown.choices[0].text == hidden.choices[0].text + ","


def test_tokenize_detokenize_and_version(client: openai.OpenAI, root: openai.OpenAI) -> None:
    tokens = root.post("/tokenize", cast_to=object, body={"prompt": "Hello there"})
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] > 0
    text = root.post("/detokenize", cast_to=object, body={"tokens": tokens["tokens"]})
    assert text == {"prompt": "Hello there"}
    chat = root.post(
        "/tokenize", cast_to=object,
        body={"messages": [{"role": "user", "content": "Hi"}], "return_token_strs": True},
    )  # fmt: skip
    answered = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1
    )
    assert chat["count"] == answered.usage.prompt_tokens == len(chat["token_strs"])
    with pytest.raises(openai.BadRequestError):
        root.post("/detokenize", cast_to=object, body={"tokens": [10**9]})
    assert root.get("/version", cast_to=object)["version"]


@pytest.fixture(scope="module")
def named(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Two served names, a chat template file, and a KV cache of 64 blocks of 16 tokens."""
    template = tmp_path_factory.mktemp("template") / "template.jinja"
    template.write_text(
        "{% if messages[0].role != 'user' %}{{ raise_exception('Start with the user') }}{% endif %}"
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    with launched_server(
        "--served-model-name", "first", "org/second", "--chat-template", str(template),
        "--num-blocks", "64",
    ) as server:  # fmt: skip
        yield server


def test_served_model_names_and_a_chat_template_file(named: Server) -> None:
    client = openai.OpenAI(base_url=f"{named.url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["first", "org/second"]
    answer = client.chat.completions.create(
        model="org/second", messages=[{"role": "user", "content": "Hi"}], max_tokens=1
    )
    assert answer.model == "first"
    root = openai.OpenAI(base_url=named.url, api_key="unused", max_retries=0)
    rendered = root.post(
        "/tokenize", cast_to=object,
        body={"messages": [{"role": "user", "content": "Hi"}], "return_token_strs": True},
    )  # fmt: skip
    text = root.post("/detokenize", cast_to=object, body={"tokens": rendered["tokens"]})
    assert text["prompt"] == "[user] Hi\n[assistant]"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as refusal:  # the template's own words
        client.chat.completions.create(
            model="first", messages=[{"role": "assistant", "content": "Hi"}], max_tokens=1
        )
    assert "Start with the user" in refusal.value.body["message"]


def test_a_chat_without_max_tokens_runs_to_the_end_of_the_kv_cache(named: Server) -> None:
    """As vLLM: the rest of the context, here bounded by the KV cache (64 blocks of 16)."""
    client = openai.OpenAI(base_url=f"{named.url}/v1", api_key="unused", max_retries=0)
    root = openai.OpenAI(base_url=named.url, api_key="unused", max_retries=0)
    room, tokens = 40, 64 * 16
    messages = [{"role": "user", "content": "hi " * (tokens - room)}]
    counted = root.post("/tokenize", cast_to=object, body={"messages": messages})["count"]
    messages[0]["content"] = "hi " * (tokens - room - (counted - (tokens - room)))
    prompt = root.post("/tokenize", cast_to=object, body={"messages": messages})["count"]
    chat = client.chat.completions.create(
        model="first", messages=messages, temperature=0, extra_body={"ignore_eos": True}
    )
    assert chat.usage.prompt_tokens == prompt and chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == tokens - prompt > 16


@pytest.mark.parametrize(
    ("flags", "greedy_left_out", "outputs"),
    [
        # the model's max_new_tokens: a chat's output when it sets none; a request may ask more
        (["--generation-config", "auto"], True, (5, 12)),
        # over the model's, and the override's max_new_tokens limits every request (as vLLM);
        # every combination: test_openai_api.py, without a stack
        (["--override-generation-config", '{"temperature": 1.0, "max_new_tokens": 3}'], False,
         (3, 3)),
    ],
)  # fmt: skip
def test_the_models_generation_config_fills_what_a_request_leaves_out(
    tmp_path: Path, flags: list[str], greedy_left_out: bool, outputs: tuple[int, int]
) -> None:
    """A model folder whose generation_config.json asks for greedy decoding and 5 new tokens:
    requests without a temperature decode greedily under --generation-config auto, and sample
    under the override's; `outputs`: the tokens of a chat without max_tokens, and of a
    completion asking 12."""
    import json

    from test_tensor_parallel import tiny_llama

    folder = tiny_llama(tmp_path)
    generation = {"temperature": 0.0, "max_new_tokens": 5}
    (folder / "generation_config.json").write_text(json.dumps(generation))
    template = "{{ messages[0].content }}"
    no_eos = {"ignore_eos": True}
    with launched_server("--model", str(folder), "--dtype", "float32", "--num-blocks", "64",
                         "--chat-template", template, *flags) as server:  # fmt: skip
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        args = dict(model=folder.name, prompt="w5 w6 w7", max_tokens=12, extra_body=no_eos)
        greedy = client.completions.create(**args, temperature=0)
        left_out = {client.completions.create(**args, seed=s).choices[0].text for s in range(4)}
        chat = client.chat.completions.create(
            model=folder.name, messages=[{"role": "user", "content": "w5 w6"}], extra_body=no_eos
        )
    if greedy_left_out:
        assert left_out == {greedy.choices[0].text}
    else:
        assert left_out != {greedy.choices[0].text}  # temperature 1: the draws differ from greedy
    assert (chat.usage.completion_tokens, greedy.usage.completion_tokens) == outputs


def test_usage_counts_the_prompt_tokens_found_cached(client: openai.OpenAI) -> None:
    prompt = list(range(2000, 2100))  # 100 token ids: 6 full blocks of 16
    args = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    first = client.completions.create(**args)
    again = client.completions.create(**args, stop=[first.choices[0].text[2:5]])
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].finish_reason == "stop"  # ended by the gateway, counts still come
    assert again.usage.prompt_tokens_details.cached_tokens == 96


def test_prompt_logprobs_agree_with_the_logprobs_of_the_same_tokens_generated(
    client: openai.OpenAI, root: openai.OpenAI
) -> None:
    prompt = root.post("/tokenize", cast_to=object, body={"prompt": "The capital of France"})
    prompt_ids = prompt["tokens"]
    generated = client.completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=6, temperature=0, logprobs=2
    ).choices[0]
    continuation = root.post(
        "/tokenize", cast_to=object, body={"prompt": generated.text, "add_special_tokens": False}
    )["tokens"]
    ids = prompt_ids + continuation
    for _ in range(2):  # the second finds the prompt cached, and must compute it all the same
        body = client.completions.create(
            model=MODEL, prompt=ids, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
        ).model_dump()
        entries = body["choices"][0]["prompt_logprobs"]
        assert len(entries) == len(ids) and entries[0] is None
        for position, token in enumerate(ids[1:], start=1):
            assert str(token) in entries[position]  # the prompt's own token, with the top 2
            assert 2 <= len(entries[position]) <= 3
        for k, token in enumerate(continuation):  # greedy: each was the likeliest
            entry = entries[len(prompt_ids) + k][str(token)]
            assert entry["rank"] == 1
            assert abs(entry["logprob"] - generated.logprobs.token_logprobs[k]) < 0.05
            assert entry["decoded_token"] == generated.logprobs.tokens[k]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    ).model_dump()  # fmt: skip
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(
            model=MODEL, prompt="x", stream=True, extra_body={"prompt_logprobs": 1}
        )
