"""A JSON schema's answer with and without prompt-lookup drafts, offline on the embedded model:
eight objects of the same two keys, greedy, one stream. Prints each engine's median seconds over
`ROUNDS` runs (after a warm-up), the tokens and finish reason, and the drafts that stood.
    usage: python -m turnstile.bench.speculative_grammar [ROUNDS=5]"""

from __future__ import annotations

import json
import statistics
import sys
import time

from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.offline import OfflineEngine
from turnstile.shared.config import SchedulingConfig
from turnstile.shared.protocol import AddRequest, Grammar, SamplingParams, pack_ids
from turnstile.shared.settings import build
from turnstile.shared.tokenizer import Tokenizer

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                    "prompt_lookup_min": 2})  # fmt: skip
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "id": {"type": "integer"}},
          "required": ["name", "id"], "additionalProperties": False}  # fmt: skip
SCHEMA = {"type": "array", "items": PERSON, "minItems": 8, "maxItems": 8}
TEXT = 'Eight people as JSON, like [{"name": "Ann", "id": 1}, {"name": "Bob", "id": 2}]:'


def main(rounds: int) -> None:
    config = build(RunnerConfig, max_num_seqs=8)
    engines = {
        "plain": OfflineEngine(config, SchedulingConfig(async_scheduling=False)),
        "speculating": OfflineEngine(config, SchedulingConfig(speculative_config=NGRAM)),
    }
    prompt = pack_ids(Tokenizer(config.model_path, engines["plain"].runner.info).encode(TEXT))
    sampling = SamplingParams(grammar=Grammar("json", json.dumps(SCHEMA)))
    for name, engine in engines.items():
        engine.generate([AddRequest(0, prompt, 200, sampling)])  # the grammar compiled
        stats = engine.scheduler.stats
        drafted, stood = stats.spec_draft_tokens, stats.spec_accepted_tokens
        seconds = []
        for _ in range(rounds):
            started = time.perf_counter()
            [answer] = engine.generate([AddRequest(0, prompt, 200, sampling)])
            seconds.append(time.perf_counter() - started)
        print(f"{name}: {statistics.median(seconds):.3f} s, {len(answer.token_ids)} tokens, "
              f"{answer.finish_reason}; drafts that stood: {stats.spec_accepted_tokens - stood} "
              f"of {stats.spec_draft_tokens - drafted}")  # fmt: skip


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
