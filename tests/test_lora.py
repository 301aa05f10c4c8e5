"""LoRA adapters served beside their base model (`--enable-lora --lora-modules`), through a real
stack (`lora_stack.py`) and the official openai client: each adapter's greedy tokens match
PEFT's own model on transformers, token for token, with the base model's and both adapters'
requests batched together and their prompts chunked; no KV block is shared across adapters;
`/v1/models` lists them. Loaded at run time: `test_lora_updates.py`; what is refused at start
and on the files alone: `test_lora_checks.py`."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from lora_stack import PROMPTS, adapter_dirs, base, client, complete, expected, resolved, server

from turnstile.bench.server_process import launched_server

pytestmark = pytest.mark.slow  # starts a stack, runs transformers and PEFT
# Fixtures pytest hands the tests by name; imported, so each module has its own stack.
FIXTURES = (adapter_dirs, base, client, expected, resolved, server)


def test_each_adapter_matches_peft_batched_with_the_others(
    client: openai.OpenAI, expected: dict[str, list[list[int]]]
) -> None:
    asks = [(name, i) for name in expected for i in range(len(PROMPTS))] * 2
    with ThreadPoolExecutor(len(asks)) as pool:
        answers = list(pool.map(lambda ask: complete(client, ask[0], PROMPTS[ask[1]]), asks))
    for (name, i), answer in zip(asks, answers, strict=True):
        assert answer.choices[0].token_ids == expected[name][i], (name, i)  # type: ignore[attr-defined]
        assert answer.model == name  # type: ignore[attr-defined]


def test_no_kv_block_is_shared_across_adapters(client: openai.OpenAI) -> None:
    prompt = [200 + i for i in range(48)]  # three full blocks, in no other test's prompt

    def cached(model: str) -> int:
        usage = complete(client, model, prompt).usage  # type: ignore[attr-defined]
        return usage.prompt_tokens_details.cached_tokens

    assert cached("base") == 0
    assert cached("first") == 0  # the base model's KV is not the adapter's
    assert cached("second") == 0
    assert cached("first") == 32  # its own blocks are found (the last is recomputed)


def test_models_lists_the_adapters_and_an_unknown_name_is_refused(
    client: openai.OpenAI, adapter_dirs: dict[str, Path]
) -> None:
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {"base", "first", "second"}  # none loaded at run time is left
    assert cards["first"].parent == "base" and cards["first"].root == str(adapter_dirs["first"])  # type: ignore[attr-defined]
    assert cards["base"].parent is None  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError) as refused:
        complete(client, "third", PROMPTS[1])
    assert refused.value.body["param"] == "model"  # type: ignore[index]


@pytest.mark.parametrize("ranks", [2, 4])  # 4: more ranks than KV heads, each kept by two
def test_tensor_parallel_ranks_run_each_adapter_as_peft_does(
    base: Path, adapter_dirs: dict[str, Path], expected: dict[str, list[list[int]]], ranks: int
) -> None:
    """Each rank keeps its share of an adapter's pairs as of the base weights: B's rows of its
    heads and intermediate dims, A's columns of its input to o and down."""
    modules = [f"{name}={folder}" for name, folder in adapter_dirs.items()]
    with launched_server(
        "--model", str(base), "--dtype", "float32", "--served-model-name", "base",
        "--enable-lora", "--lora-modules", *modules, "--max-lora-rank", "8",
        "--tensor-parallel-size", str(ranks),
    ) as server:  # fmt: skip
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        asks = [(name, i) for name in expected for i in range(len(PROMPTS))]
        with ThreadPoolExecutor(len(asks)) as pool:
            answers = list(pool.map(lambda ask: complete(client, ask[0], PROMPTS[ask[1]]), asks))
    for (name, i), answer in zip(asks, answers, strict=True):
        assert answer.choices[0].token_ids == expected[name][i], (name, i)  # type: ignore[attr-defined]


def test_turnstile_generate_runs_each_lines_adapter(
    base: Path, adapter_dirs: dict[str, Path], expected: dict[str, list[list[int]]],
    tmp_path: Path,
) -> None:  # fmt: skip
    """Offline, a line's `model` names its adapter, as served; a name not served, and a field
    the output has no place for, are that line's error."""
    lines = [
        {"model": model, "prompt": PROMPTS[i], "max_tokens": 12, "temperature": 0,
         "ignore_eos": True} for model in ("first", "second", None) for i in (0, 1)
    ]  # fmt: skip
    lines += [lines[0] | {"model": "third"}, lines[0] | {"logprobs": 2},
              lines[3] | {"prompt": [9, 9, *PROMPTS[1]], "truncate_prompt_tokens": 4}]  # fmt: skip
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    modules = [f"{name}={folder}" for name, folder in adapter_dirs.items()]
    subprocess.run(
        [sys.executable, "-m", "turnstile.cli", "generate", "--input", str(source),
         "--output", str(target), "--model", str(base), "--dtype", "float32", "--enable-lora",
         "--lora-modules", *modules, "--max-lora-rank", "8"],
        check=True, timeout=300,
    )  # fmt: skip
    results = [json.loads(line) for line in target.read_text().splitlines()]
    for line, result in zip(lines[:6], results[:6], strict=True):
        assert (
            result["token_ids"] == expected[line["model"] or "base"][PROMPTS.index(line["prompt"])]
        )
    assert "does not exist" in results[6]["error"] and "logprobs" in results[7]["error"]
    assert results[8]["token_ids"] == results[3]["token_ids"]  # its last 4 tokens: PROMPTS[1]
