"""vLLM's token-level request fields through the running service and the official openai
client: `truncate_prompt_tokens` (each prompt's last k tokens), `return_token_ids` (the prompt's
and each choice's token ids beside the text, whole and streamed) and
`return_tokens_as_token_ids` (logprobs name their tokens "token_id:N"); and `echo` with
`logprobs`, the prompt's tokens' logprobs first (with max_tokens 0, the prompt alone: how
lm-evaluation-harness scores a continuation); `cache_salt`, the prefix cache kept apart by salt."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from conftest import MODEL

from turnstile.shared.model_info import embedded_model_path, read_model_info
from turnstile.shared.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # starts a stack

GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 6}
PROMPT = list(range(1000, 1040))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    model = embedded_model_path()
    return Tokenizer(model, read_model_info(model))


def completion(client: openai.OpenAI, **fields: Any) -> dict[str, Any]:
    """A completion as the server wrote it (vLLM's fields are extras to the client's types)."""
    return client.completions.create(**GREEDY | fields).model_dump()


def test_truncation_keeps_each_prompts_last_tokens(client: openai.OpenAI) -> None:
    fields = {"truncate_prompt_tokens": 7, "return_token_ids": True}
    cut = completion(client, prompt=PROMPT, echo=True, extra_body=fields)
    short = completion(client, prompt=PROMPT[-7:], echo=True)
    assert cut["usage"]["prompt_tokens"] == 7
    assert cut["choices"][0]["prompt_token_ids"] == PROMPT[-7:]
    assert cut["choices"][0]["text"] == short["choices"][0]["text"]  # echo: the kept prompt
    both = completion(client, prompt=[PROMPT, PROMPT[:5]], extra_body=fields)
    assert both["usage"]["prompt_tokens"] == 7 + 5  # a prompt already shorter is whole
    chat = client.chat.completions.create(
        **GREEDY, messages=[{"role": "user", "content": "Hi there, how are you?"}],
        extra_body={"truncate_prompt_tokens": 3},
    )  # fmt: skip
    assert chat.usage.prompt_tokens == 3  # the templated conversation's last three


@pytest.mark.parametrize(("keep", "why"), [(0, "-1"), (1 << 30, "max_model_len")])
def test_a_truncation_that_means_nothing_is_refused_by_name(
    client: openai.OpenAI, keep: int, why: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refusal:
        completion(client, prompt=PROMPT, extra_body={"truncate_prompt_tokens": keep})
    assert refusal.value.body["param"] == "truncate_prompt_tokens"
    assert why in refusal.value.body["message"]


def test_token_ids_come_with_the_text_whole_and_streamed(
    client: openai.OpenAI, tokenizer: Tokenizer
) -> None:
    ids = {"return_token_ids": True, "ignore_eos": True}
    whole = completion(client, prompt=[PROMPT, PROMPT[:9]], n=2, extra_body=ids)
    for choice in whole["choices"]:
        prompt = PROMPT if choice["index"] < 2 else PROMPT[:9]
        assert choice["prompt_token_ids"] == prompt
        assert len(choice["token_ids"]) == 6
        assert tokenizer.decode(choice["token_ids"]) == choice["text"]
    stream = client.completions.create(**GREEDY, prompt=PROMPT, stream=True, extra_body=ids)
    chunks = [chunk.model_dump()["choices"][0] for chunk in stream]
    assert chunks[0]["prompt_token_ids"] == PROMPT
    assert not any("prompt_token_ids" in chunk for chunk in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == whole["choices"][0]["token_ids"]
    # A stop string cuts the text, not the tokens computed up to it.
    stop = tokenizer.decode(whole["choices"][0]["token_ids"][2:4])
    cut = completion(client, prompt=PROMPT, stop=[stop], extra_body=ids)["choices"][0]
    assert cut["token_ids"] == whole["choices"][0]["token_ids"][: len(cut["token_ids"])]
    assert tokenizer.decode(cut["token_ids"]).startswith(cut["text"] + stop)


def test_a_chats_prompt_ids_are_at_the_top_whole_and_in_the_first_chunk(
    client: openai.OpenAI, service: Any
) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    root = openai.OpenAI(base_url=service.url, api_key="unused", max_retries=0)
    templated = root.post("/tokenize", cast_to=object, body={"messages": messages})["tokens"]
    body = {"return_token_ids": True}
    whole = client.chat.completions.create(**GREEDY, messages=messages, extra_body=body)
    answer = whole.model_dump()
    assert answer["prompt_token_ids"] == templated
    assert len(answer["choices"][0]["token_ids"]) == whole.usage.completion_tokens
    stream = client.chat.completions.create(
        **GREEDY, messages=messages, stream=True, extra_body=body
    )
    chunks = [chunk.model_dump() for chunk in stream]
    assert chunks[0]["prompt_token_ids"] == templated
    streamed = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert streamed == answer["choices"][0]["token_ids"]


def test_logprobs_name_tokens_by_id_where_asked(client: openai.OpenAI) -> None:
    fields = {"return_token_ids": True}
    named = completion(client, prompt=PROMPT, logprobs=2, extra_body=fields)["choices"][0]
    by_id = completion(
        client, prompt=PROMPT, logprobs=2, extra_body=fields | {"return_tokens_as_token_ids": True}
    )["choices"][0]
    assert by_id["logprobs"]["tokens"] == [f"token_id:{t}" for t in by_id["token_ids"]]
    assert by_id["logprobs"]["text_offset"] == named["logprobs"]["text_offset"]
    assert by_id["logprobs"]["token_logprobs"] == named["logprobs"]["token_logprobs"]
    for top in by_id["logprobs"]["top_logprobs"]:
        assert len(top) == 2 and all(key.startswith("token_id:") for key in top)
    chat = client.chat.completions.create(
        **GREEDY, messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=1,
        extra_body=fields | {"return_tokens_as_token_ids": True},
    ).model_dump()["choices"][0]  # fmt: skip
    content = chat["logprobs"]["content"]
    assert [entry["token"] for entry in content] == [f"token_id:{t}" for t in chat["token_ids"]]
    assert all(entry["top_logprobs"][0]["token"].startswith("token_id:") for entry in content)


def test_echo_with_logprobs_puts_the_prompts_tokens_first(client: openai.OpenAI) -> None:
    asked = {"logprobs": 2, "prompt": PROMPT[:12]}
    echoed = completion(client, echo=True, extra_body={"prompt_logprobs": 1}, **asked)
    plain = completion(client, **asked)["choices"][0]
    choice, vllms = echoed["choices"][0], echoed["choices"][0]["prompt_logprobs"]
    logprobs, answer = choice["logprobs"], plain["logprobs"]
    assert choice["text"] == completion(client, prompt=PROMPT[:12], echo=True, max_tokens=0)[
        "choices"][0]["text"] + plain["text"]  # fmt: skip
    assert len(logprobs["tokens"]) == 12 + 6 and logprobs["token_logprobs"][0] is None
    assert logprobs["top_logprobs"][0] is None
    # The prompt's: those of vLLM's prompt_logprobs (its top 1 here), then the answer's.
    for position, entries in enumerate(vllms[1:], start=1):
        mine = entries[str(PROMPT[position])]["logprob"]
        assert logprobs["token_logprobs"][position] == pytest.approx(mine, abs=1e-6)
        assert len(logprobs["top_logprobs"][position]) == 2 and len(entries) <= 2
    assert logprobs["token_logprobs"][12:] == answer["token_logprobs"]
    assert logprobs["top_logprobs"][12:] == answer["top_logprobs"]
    start = len(choice["text"]) - len(plain["text"])  # the answer's offsets follow the prompt
    assert logprobs["text_offset"][12:] == [start + offset for offset in answer["text_offset"]]
    assert logprobs["text_offset"][:12] == sorted(logprobs["text_offset"][:12])


def test_max_tokens_0_with_echo_answers_the_prompt_alone(client: openai.OpenAI) -> None:
    alone = completion(client, prompt=PROMPT[:12], echo=True, max_tokens=0, logprobs=0)
    choice = alone["choices"][0]
    assert alone["usage"]["completion_tokens"] == 0 and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == 12
    assert all(lp is not None for lp in choice["logprobs"]["token_logprobs"][1:])
    # lm-evaluation-harness's loglikelihood request: several prompts, each's own logprobs.
    harness = {"echo": True, "max_tokens": 1, "logprobs": 1, "seed": 1234}
    both = completion(client, prompt=[PROMPT[:12], PROMPT[20:27]], **harness)["choices"]
    second = completion(client, prompt=PROMPT[20:27], **harness)["choices"][0]
    assert both[0]["logprobs"]["token_logprobs"][:12] == choice["logprobs"]["token_logprobs"]
    assert both[1]["logprobs"] == second["logprobs"] and len(second["logprobs"]["tokens"]) == 8
    for position, top in enumerate(second["logprobs"]["top_logprobs"][1:], start=1):
        assert second["logprobs"]["token_logprobs"][position] <= max(top.values())
    with pytest.raises(openai.BadRequestError) as refusal:
        completion(client, prompt=PROMPT, max_tokens=0)
    assert refusal.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as refusal:
        completion(client, prompt=PROMPT, echo=True, logprobs=1, stream=True)
    assert refusal.value.body["param"] == "echo"


def test_a_cache_salt_shares_the_prefix_cache_only_with_its_own_salt(
    client: openai.OpenAI,
) -> None:
    prompt = list(range(5000, 5100))  # 6 full blocks of 16, in no other test's prompt

    def cached(salt: str | None) -> int:
        fields = {} if salt is None else {"cache_salt": salt}
        answer = completion(client, prompt=prompt, max_tokens=1, extra_body=fields)
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("tenant-a") == 0  # first seen
    assert cached("tenant-a") == 96  # its own salt: the 6 full blocks
    assert cached("tenant-b") == 0 and cached(None) == 0  # another salt, or none: nothing
    assert cached(None) == 96 and cached("tenant-b") == 96  # each now has its own copy
    with pytest.raises(openai.BadRequestError) as refusal:
        completion(client, prompt=prompt, extra_body={"cache_salt": ""})
    assert refusal.value.body["param"] == "cache_salt"
