"""The id a response is answered under, as vLLM chooses it: the client's `X-Request-Id` header,
else the body's `request_id`, else a fresh one, behind "chatcmpl-" or "cmpl-" (the Responses
API's `request_id` is the response's id as given); the id comes back as the `X-Request-Id`
header, streamed or whole; `--enable-log-requests` logs a line as each ends, under its id. And
`--return-tokens-as-token-ids`, vLLM's server default for the request field: this module's
stack runs with both. The scheduler's periodic stats line, as vLLM's (its absence under
`--disable-log-stats`: test_router.py), and /metrics under vLLM's names."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from conftest import MODEL, logged_stack

from turnstile.bench.server_process import Server

pytestmark = pytest.mark.slow  # starts a stack

GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 4}
HELLO = [{"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def service(stack_log: Path) -> Iterator[Server]:
    flags = ("--num-blocks", "256", "--return-tokens-as-token-ids", "--enable-log-requests",
             "--log-stats-interval", "0.5", "--metrics-names", "vllm")  # fmt: skip
    with logged_stack(stack_log, *flags) as running:
        yield running


def logged(log: Path, pattern: str) -> str:
    """The log's line matching `pattern`, once it is there (a request logs as it ends)."""
    for _ in range(100):
        found = re.search(pattern, log.read_text())
        if found:
            return found.group(0)
        time.sleep(0.1)
    raise AssertionError(f"no line matching {pattern!r} in the log")


def test_the_body_names_the_response(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        **GREEDY, messages=HELLO, extra_body={"request_id": "job-17/a"}
    )
    assert raw.parse().id == "chatcmpl-job-17/a"
    assert raw.headers["X-Request-Id"] == "job-17/a"


def test_the_header_wins_over_the_body(client: openai.OpenAI) -> None:
    raw = client.completions.with_raw_response.create(
        **GREEDY, prompt="Once", extra_body={"request_id": "from-body"},
        extra_headers={"X-Request-Id": "from-header"},
    )  # fmt: skip
    assert raw.parse().id == "cmpl-from-header"
    assert raw.headers["X-Request-Id"] == "from-header"


def test_a_request_without_one_gets_a_fresh_id_in_both_places(client: openai.OpenAI) -> None:
    ids = set()
    for _ in range(2):
        raw = client.chat.completions.with_raw_response.create(**GREEDY, messages=HELLO)
        given = raw.headers["X-Request-Id"]
        assert re.fullmatch("[0-9a-f]{32}", given)
        assert raw.parse().id == f"chatcmpl-{given}"
        ids.add(given)
    assert len(ids) == 2


def test_a_stream_carries_the_id_in_its_header_and_every_chunk(client: openai.OpenAI) -> None:
    with client.chat.completions.with_streaming_response.create(
        **GREEDY, messages=HELLO, stream=True, extra_body={"request_id": "streamed"}
    ) as raw:
        assert raw.headers["X-Request-Id"] == "streamed"
        chunks = list(raw.parse())
    assert len(chunks) > 1
    assert {chunk.id for chunk in chunks} == {"chatcmpl-streamed"}


def test_the_responses_api_takes_its_id_as_given(client: openai.OpenAI) -> None:
    raw = client.responses.with_raw_response.create(
        model=MODEL, input="Hello!", max_output_tokens=4, extra_body={"request_id": "resp_mine"}
    )
    assert raw.parse().id == "resp_mine"
    assert raw.headers["X-Request-Id"] == "resp_mine"
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=2).id.startswith(
        "resp_"
    )


@pytest.mark.parametrize("bad", ["", "two words", "line\nbreak", "x" * 257])
def test_a_request_id_that_cannot_be_a_header_is_refused_by_name(
    client: openai.OpenAI, bad: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refusal:
        client.chat.completions.create(**GREEDY, messages=HELLO, extra_body={"request_id": bad})
    assert refusal.value.body["param"] == "request_id"


def test_the_server_flag_names_tokens_by_id_unless_a_request_says_otherwise(
    client: openai.OpenAI,
) -> None:
    fields = {**GREEDY, "prompt": "Once upon a time", "logprobs": 1}
    by_default = client.completions.create(**fields).choices[0].logprobs
    assert by_default.tokens and all(re.fullmatch(r"token_id:\d+", t) for t in by_default.tokens)
    asked = client.completions.create(**fields, extra_body={"return_tokens_as_token_ids": False})
    texts = asked.choices[0].logprobs.tokens
    assert [int(t.split(":")[1]) for t in by_default.tokens] != texts
    assert "".join(texts) == asked.choices[0].text


def test_each_request_is_logged_as_it_ends_under_its_id(
    client: openai.OpenAI, stack_log: Path
) -> None:
    answer = client.completions.create(**GREEDY, prompt="Once", extra_body={"request_id": "l-1"})
    line = logged(stack_log, r"request l-1 \(completions\) 200: .*")
    usage = answer.usage
    assert f"{usage.prompt_tokens} prompt tokens" in line
    assert f", {usage.completion_tokens} generated" in line and "Once" not in line
    with client.chat.completions.with_streaming_response.create(
        model=MODEL, messages=HELLO, max_tokens=500, stream=True,
        extra_headers={"X-Request-Id": "gone"}, extra_body={"ignore_eos": True},
    ) as raw:  # fmt: skip
        next(raw.iter_lines())  # the stream has begun; leaving closes it
    assert "generated" in logged(stack_log, r"request gone \(chat\) aborted: .*")
    text = "Once upon a time there was a cat who sat by the door, and the door was old."
    for _ in range(2):  # the second finds the first's full blocks cached
        embedded = client.embeddings.create(
            model=MODEL, input=text, extra_headers={"X-Request-Id": "e-1"}
        )
    line = logged(stack_log, r"request e-1 \(embeddings\) 200: .*\(16 cached\).*")
    assert f"{embedded.usage.prompt_tokens} prompt tokens" in line and ", 0 generated" in line


def test_the_scheduler_logs_vllms_stats_line_while_it_works(
    client: openai.OpenAI, stack_log: Path
) -> None:
    start = len(stack_log.read_text())
    client.completions.create(
        model=MODEL, prompt="Once", max_tokens=64, temperature=0, extra_body={"ignore_eos": True}
    )
    pattern = (r"Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: "
               r"([\d.]+) tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: "
               r"[\d.]+%")  # fmt: skip
    for _ in range(50):
        rates = [float(r) for r in re.findall(pattern, stack_log.read_text()[start:])]
        if any(rates):
            break
        time.sleep(0.1)
    assert any(rate > 0 for rate in rates), "no stats line counted the 64 tokens"


def test_metrics_under_vllms_names_read_as_vllms_dashboards_query_them(
    client: openai.OpenAI, service: Server
) -> None:
    """--metrics-names vllm: every series vllm:..., labelled with the model's name and engine 0
    as vLLM's, in a text Prometheus's own parser reads; a request is counted under them."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(**GREEDY, prompt="Count me")
    time.sleep(0.6)  # the scheduler's series are written every half second
    with urllib.request.urlopen(f"{service.url}/metrics") as response:
        text = response.read().decode()
    assert "turnstile:" not in text
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prompt_tokens_total", "generation_tokens_total", "request_success_total",
                 "time_to_first_token_seconds_count", "e2e_request_latency_seconds_count",
                 "inter_token_latency_seconds_count"):  # fmt: skip
        labels = samples[f"vllm:{name}"].labels
        assert labels["model_name"] == MODEL and labels["engine"] == "0", name
    assert samples["vllm:generation_tokens_total"].value >= 4
