"""Speculative decoding by prompt lookup (`--speculative-config`, vLLM's "ngram" method): the
scheduler drafts from a row's own tokens, the executor verifies the drafts in one step, and every
answer is the one plain decoding gives, token for token, greedy or seeded."""

from __future__ import annotations

import json
import time

import numpy as np
import openai
import pytest
from conftest import MODEL
from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler_harness import Harness, expected_output

from turnstile.bench.server_process import launched_server
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.offline import Completion, OfflineEngine
from turnstile.scheduler_svc.ngram_drafter import lookup
from turnstile.scheduler_svc.request import may_speculate
from turnstile.shared.config import SchedulerConfig, SchedulingConfig
from turnstile.shared.protocol import AddRequest, Grammar, SamplingParams, pack_ids
from turnstile.shared.settings import build
from turnstile.shared.speculative import Speculation, parse_speculation
from turnstile.shared.tokenizer import Tokenizer

NGRAM = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
)


def test_lookup_drafts_what_followed_the_latest_longest_match() -> None:
    tokens = np.array([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3], dtype=np.int32)
    assert lookup(tokens, 2, 1, 3).tolist() == [4, 9]  # [1 2 3] at the start beats [2 3]
    assert lookup(tokens, 2, 1, 2).tolist() == [5, 6]  # [2 3]: its latest appearance
    assert lookup(tokens, 9, 4, 4).tolist() == []  # no earlier [2 3 ... ] of four tokens
    assert lookup(np.array([7, 8, 9]), 3, 1, 3).tolist() == []
    assert lookup(np.array([5, 5, 5]), 3, 1, 2).tolist() == [5]  # overlapping, cut at the end


def test_which_requests_draft() -> None:
    """A grammar's rows draft, and a reasoning model's answer does unless the executor follows
    its thinking token by token (a budget, or a grammar waiting for the thinking's end)."""
    grammar = Grammar("regex", "[0-9]+")
    drafting = [SamplingParams(), SamplingParams(grammar=grammar), SamplingParams(think_end=5),
                SamplingParams(bad_words=[[1, 2]], min_tokens=3)]  # fmt: skip
    assert all(may_speculate(sampling) for sampling in drafting)
    plain = [
        SamplingParams(think_end=5, grammar=grammar), SamplingParams(prompt_logprobs=1),
        SamplingParams(think_end=5, thinking_budget=9), SamplingParams(embed=True),
    ]  # fmt: skip
    assert not any(may_speculate(sampling) for sampling in plain)


def test_settings_are_vllms_and_what_is_not_served_is_refused() -> None:
    assert parse_speculation(None) is None
    assert parse_speculation('{"method": "ngram", "num_speculative_tokens": 4}') == Speculation(
        4, 5, 5
    )
    assert parse_speculation(
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'
    ) == Speculation(2, 3, 3)
    refused = {
        '{"method": "eagle", "num_speculative_tokens": 2}': "method 'eagle'",
        '{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}': "model",
        '{"method": "ngram"}': "num_speculative_tokens",
        '{"method": "ngram", "num_speculative_tokens": 99}': "num_speculative_tokens",
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
        '"prompt_lookup_max": 2}': "prompt_lookup_min",
        "ngram": "not JSON",
    }
    for text, named in refused.items():
        with pytest.raises(ValueError, match=named):
            parse_speculation(text)
    with pytest.raises(ValueError, match="--static-batching"):
        SchedulingConfig(speculative_config=NGRAM, static_batching="padded")


@pytest.mark.parametrize("stop", [False, True])
@given(seed=st.integers(0, 2**16))
@settings(max_examples=15)
def test_drafted_steps_keep_every_output_exact_and_every_block_accounted(
    stop: bool, seed: int
) -> None:
    """Each prompt is its request's own scripted answer, so drafts from it stand until the
    script's EOS (or a stop token) turns one down; few blocks, so rows are also preempted."""
    lengths = {i: 8 + (seed + i) % 16 for i in range(6)}
    harness = Harness(
        build(SchedulerConfig, num_blocks=10, block_size=4, max_num_seqs=6,
              max_num_batched_tokens=16, max_model_len=64, speculative_config=NGRAM),
        lengths,
    )  # fmt: skip
    expected = {}
    for i in range(6):
        prompt = expected_output(i, 10**6, 12)[0]
        max_tokens = 12 + (seed + 2 * i) % 16
        tokens, reason = expected_output(i, lengths[i], max_tokens)
        stop_ids = (prompt[2],) if stop else ()
        if stop and prompt[2] in tokens:
            tokens, reason = tokens[: tokens.index(prompt[2]) + 1], "stop"
        expected[i] = (tokens, [reason])
        harness.add(i, prompt, max_tokens=max_tokens, stop_token_ids=stop_ids)
    harness.run()
    for i in range(6):
        assert (harness.tokens[i], harness.endings[i]) == expected[i], i
    stats = harness.scheduler.stats
    assert stats.spec_accepted_tokens > 0
    if not stop:  # the rows run long enough for an EOS to turn drafts down, and to preempt
        assert stats.spec_accepted_tokens < stats.spec_draft_tokens
        assert stats.num_preemptions > 0
    assert harness.scheduler.pool.num_used == 0


TEXT = (
    "Continuous batching schedules work one iteration at a time. When a sequence finishes, "
    "its KV blocks are freed and a waiting request takes its place in the next forward pass."
)


@pytest.fixture(scope="module")
def engines() -> tuple[OfflineEngine, OfflineEngine, Tokenizer]:
    """The embedded model, decoding plainly and speculating (two drafts at most, so most
    steps turn some down)."""
    config = build(RunnerConfig, max_num_seqs=8)
    plain = OfflineEngine(config, SchedulingConfig(async_scheduling=False))
    speculating = OfflineEngine(
        config,
        SchedulingConfig(
            speculative_config=NGRAM.replace(
                '"num_speculative_tokens": 3', '"num_speculative_tokens": 2'
            )
        ),
    )
    return plain, speculating, Tokenizer(config.model_path, plain.runner.info)


@pytest.mark.slow
def test_answers_equal_plain_decodings_token_for_token(
    engines: tuple[OfflineEngine, OfflineEngine, Tokenizer],
) -> None:
    plain, speculating, tokenizer = engines
    copy = pack_ids(tokenizer.encode(f"Text: {TEXT}\nThe same text again: {TEXT}\nAgain:"))
    count = pack_ids(tokenizer.encode("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"))
    asks = {
        "greedy": (copy, SamplingParams(), 60, []),
        "seeded": (copy, SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seed=11), 60, []),
        "logprobs": (count, SamplingParams(logprobs=3), 30, []),
        # a draft's penalties count the drafts ahead of it
        "penalized": (copy, SamplingParams(frequency_penalty=0.3, presence_penalty=0.2), 40, []),
        "repeating": (copy, SamplingParams(repetition_penalty=1.1), 40, []),
        "cut": (copy, SamplingParams(), 13, []),
        # a grammar's row drafts too: each position masked as the drafts before it leave it
        "grammar": (count, SamplingParams(grammar=Grammar("regex", "( [0-9]+,){1,9}")), 20, []),
    }
    first = plain.generate([AddRequest(0, copy, 60)])[0].token_ids
    stop = next(t for i, t in enumerate(first) if i >= 6 and t not in first[:i])
    # a bad word's last token is banned only after the rest, which a draft may hold
    asks["bad words"] = (copy, SamplingParams(bad_words=[first[8:11]]), 40, [])
    eos = list(plain.runner.info.all_eos_token_ids)
    asks["min_tokens"] = (count, SamplingParams(min_tokens=25, min_tokens_stop_ids=eos), 30, [])
    asks["stopped"] = (copy, SamplingParams(), 60, [stop])

    def run(engine: OfflineEngine) -> list[Completion]:
        return engine.generate(
            [
                AddRequest(i, prompt, tokens, sampling, stop_token_ids=stops)
                for i, (prompt, sampling, tokens, stops) in enumerate(asks.values())
            ]
        )

    before = speculating.scheduler.stats.spec_accepted_tokens
    for name, ours, theirs in zip(asks, run(speculating), run(plain), strict=True):
        assert (ours.token_ids, ours.finish_reason) == (theirs.token_ids, theirs.finish_reason), (
            name
        )
        for mine, other in zip(ours.logprobs, theirs.logprobs, strict=True):
            assert [t for t, _ in mine] == [t for t, _ in other], name
            assert [v for _, v in mine] == pytest.approx([v for _, v in other], abs=1e-4), name
    assert len(run(plain)[-1].token_ids) < 60  # the stop token ended it, inside a draft or not
    stats = speculating.scheduler.stats
    assert 0 < stats.spec_accepted_tokens - before < stats.spec_draft_tokens
    assert speculating.scheduler.pool.num_used == 0


@pytest.mark.slow
def test_a_grammars_drafts_stand_and_its_answer_is_plain_decodings(
    engines: tuple[OfflineEngine, OfflineEngine, Tokenizer],
) -> None:
    """A JSON schema's answer repeats its keys, so its drafts stand often: each drafted
    position's mask is the matcher's after the drafts before it (taken, then rolled back)."""
    plain, speculating, tokenizer = engines
    person = {"type": "object", "properties": {"name": {"type": "string"}, "id": {"type":
              "integer"}}, "required": ["name", "id"], "additionalProperties": False}  # fmt: skip
    schema = {"type": "array", "items": person, "minItems": 4, "maxItems": 4}
    text = 'Four people as JSON, like [{"name": "Ann", "id": 1}, {"name": "Bob", "id": 2}]:'
    sampling = SamplingParams(grammar=Grammar("json", json.dumps(schema)))
    stats = speculating.scheduler.stats
    before = stats.spec_draft_tokens, stats.spec_accepted_tokens
    ours, theirs = (
        engine.generate([AddRequest(0, pack_ids(tokenizer.encode(text)), 120, sampling)])[0]
        for engine in (speculating, plain)
    )
    assert (ours.token_ids, ours.finish_reason) == (theirs.token_ids, theirs.finish_reason)
    assert ours.finish_reason == "stop" and len(json.loads(tokenizer.decode(ours.token_ids))) == 4
    assert stats.spec_accepted_tokens - before[1] > 0 and stats.spec_draft_tokens > before[0]
    assert speculating.scheduler.pool.num_used == 0


@pytest.mark.slow
def test_served_answers_stream_whole_and_metrics_count_the_drafts(
    engines: tuple[OfflineEngine, OfflineEngine, Tokenizer],
) -> None:
    plain, _, tokenizer = engines
    prompt = tokenizer.encode(f"Text: {TEXT}\nThe same text again:")
    expected = plain.generate([AddRequest(0, pack_ids(prompt), 40)])[0].token_ids
    with launched_server("--speculative-config", NGRAM, "--max-num-seqs", "8") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        ask = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0}
        whole = client.completions.create(**ask, extra_body={"return_token_ids": True})
        streamed = client.completions.create(
            **ask, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(streamed)
        drafts = "turnstile:spec_decode_num_drafts_total"
        deadline = time.monotonic() + 30  # the counters reach /metrics with a later status
        while (series := server.scrape()).get(drafts, 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
    assert whole.choices[0].token_ids == expected  # type: ignore[attr-defined]
    assert whole.usage is not None and whole.usage.completion_tokens == len(expected)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(expected)
    accepted = series["turnstile:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted < series["turnstile:spec_decode_num_draft_tokens_total"]
    assert series[drafts] > 0


def drafting(requests: int) -> Harness:
    """Requests whose prompts are their scripts' first 12 tokens (drafts stand), each to run
    20 tokens of a 30-token script."""
    harness = Harness(
        build(SchedulerConfig, num_blocks=64, block_size=4, max_num_seqs=4,
              max_num_batched_tokens=16, max_model_len=64, speculative_config=NGRAM),
        {i: 30 for i in range(requests)},
    )  # fmt: skip
    for i in range(requests):
        harness.add(i, expected_output(i, 10**6, 12)[0], max_tokens=20)
    return harness


def test_a_drafted_step_lost_with_its_executor_leaves_no_draft_behind() -> None:
    """The step verifying drafts never answers: its rows resume from their verified tokens."""
    harness = drafting(3)
    while harness.step().drafts is None:
        pass
    assert harness.scheduler.schedule().drafts is not None  # lost with the executor
    harness.scheduler.restart(harness.scheduler.pool.num_blocks, failure="lost")
    harness.replace_executor()
    harness.run()
    for i in range(3):
        assert (harness.tokens[i], harness.endings[i]) == (
            expected_output(i, 30, 20)[0],
            ["length"],
        )


def test_a_row_aborted_while_its_drafts_are_verified_leaves_nothing_behind() -> None:
    harness = drafting(2)
    while (plan := harness.send()).drafts is None:
        harness.step_sent(plan)
    harness.abort(0)  # the gateway's client left: its drafts' step still runs
    harness.step_sent(plan)
    harness.run()
    assert harness.endings[0] == ["abort"] and harness.endings[1] == ["length"]
    assert harness.tokens[1] == expected_output(1, 30, 20)[0]
    assert harness.tokens[0] == expected_output(0, 30, 20)[0][: len(harness.tokens[0])]
    assert harness.scheduler.pool.num_used == 0
