"""The executor's grammar matchers on the real model, in process (the offline engine): a batch
mixing constrained and free rows, preempted and recomputed, gives the same tokens as with room
for all, and every constrained answer keeps to its grammar; a grammar that waits for a token
constrains only what follows it."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from turnstile.executor_svc.grammar import Grammars
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.offline import Completion, OfflineEngine
from turnstile.shared.config import SchedulingConfig
from turnstile.shared.model_info import embedded_model_path, read_model_info
from turnstile.shared.protocol import ID_DTYPE, AddRequest, Grammar, SamplingParams, pack_ids
from turnstile.shared.settings import build
from turnstile.shared.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # loads the model

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3}},
    "required": ["name", "age", "pets"],
}  # fmt: skip
GRAMMARS = [
    Grammar("json", json.dumps(SCHEMA)),
    None,
    Grammar("regex", r"[a-z]{3,8}-\d{2,4}"),
    Grammar("ebnf", 'root ::= "yes" | "no" | "maybe so"'),
    Grammar("json", json.dumps(SCHEMA), any_whitespace=False),
    None,
]


def run(num_blocks: int) -> tuple[list[Completion], int, Tokenizer]:
    model = embedded_model_path()
    tokenizer = Tokenizer(model, read_model_info(model))
    engine = OfflineEngine(
        build(RunnerConfig, dtype="float32", num_blocks=num_blocks, max_num_seqs=6),
        SchedulingConfig(max_num_batched_tokens=48),
    )
    requests = []
    for i, grammar in enumerate(GRAMMARS):
        text = f"<|im_start|>user\nTell me about person {i}.<|im_end|>\n<|im_start|>assistant\n"
        sampling = SamplingParams(temperature=0.9, seed=i, grammar=grammar)
        requests.append(AddRequest(
            req_id=i, prompt_ids=pack_ids(tokenizer.encode(text)), max_tokens=64,
            sampling=sampling,
        ))  # fmt: skip
    return engine.generate(requests), engine.scheduler.stats.num_preemptions, tokenizer


def test_constrained_rows_survive_preemption_and_keep_to_their_grammars() -> None:
    roomy, none, tokenizer = run(num_blocks=64)
    tight, preemptions, _ = run(num_blocks=8)  # 6 prompts of a block each, growing
    assert none == 0 and preemptions > 0
    assert [c.token_ids for c in tight] == [c.token_ids for c in roomy]
    texts = [tokenizer.decode(c.token_ids) for c in roomy]
    for i, completion in enumerate(roomy):
        assert completion.finish_reason == "stop" or GRAMMARS[i] is None
    for i in (0, 4):
        person = json.loads(texts[i])
        assert set(person) == {"name", "age", "pets"} and 0 <= person["age"] <= 120
    assert texts[4] == json.dumps(json.loads(texts[4]))  # one space after , and :, no more
    assert re.fullmatch(r"[a-z]{3,8}-\d{2,4}", texts[2])
    assert texts[3] in ("yes", "no", "maybe so")


def test_a_thinking_answer_is_constrained_only_after_its_end() -> None:
    """SamplingParams.think_end (a reasoning model's </think>, here "!"): no grammar mask until
    it is sampled, and a request preempted past it replays only what followed it; a spent
    thinking_budget allows that token alone, also counted across a preemption."""
    model = embedded_model_path()
    info = read_model_info(model)
    tokenizer = Tokenizer(model, info)
    grammars = Grammars(model, info)
    (bang,), (word,), (ab,), (c,) = (tokenizer.encode(t) for t in ("!", "Hello", "ab", "c"))
    regex = SamplingParams(grammar=Grammar("regex", r"[a-z]{3,8}-\d{2,4}"), think_end=bang)
    budget = SamplingParams(think_end=bang, thinking_budget=3)
    grammars.join(1, regex, np.array([word], dtype=ID_DTYPE))  # still thinking
    grammars.join(2, regex, np.array([word, bang, ab], dtype=ID_DTYPE))  # preempted past it
    grammars.join(3, budget, np.array([word], dtype=ID_DTYPE))  # 2 tokens of thinking left
    grammars.join(4, budget, np.array([word] * 5, dtype=ID_DTYPE))  # preempted over budget
    req_ids = np.array([1, 2, 3, 4], dtype=np.int64)

    def allowed(mask: np.ndarray, row: int, token: int) -> bool:
        return bool(mask[row, token // 32] >> (token % 32) & 1)

    rows, mask = grammars.bitmask(req_ids)
    assert rows.tolist() == [1, 3]  # 1 and 3 are free
    assert allowed(mask, 0, c) and not allowed(mask, 0, bang)  # "ab" replayed: a third letter
    assert [t for t in range(info.vocab_size) if allowed(mask, 1, t)] == [bang]
    grammars.accept(req_ids, np.array([bang, c, word, bang]))
    rows, mask = grammars.bitmask(req_ids)
    assert rows.tolist() == [0, 1]  # 1's grammar starts after its "!"; 3 has one token left
    grammars.accept(req_ids, np.array([c, c, word, word]))
    rows, mask = grammars.bitmask(req_ids)
    assert rows.tolist() == [0, 1, 2]  # 3's budget is spent; 4's thinking ended
    assert [t for t in range(info.vocab_size) if allowed(mask, 2, t)] == [bang]
    grammars.join(5, SamplingParams(think_end=63, thinking_budget=0), np.array([], ID_DTYPE))
    rows, mask = grammars.bitmask(np.array([5]))  # a word's last bit: int32's sign
    assert [t for t in range(info.vocab_size) if allowed(mask, 0, t)] == [63]
    assert grammars.take_refused() == []
