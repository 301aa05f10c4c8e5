"""LoRA adapters served beside their base model (`--enable-lora --lora-modules`), through a real
stack and the official openai client: each adapter's greedy tokens match PEFT's own model on
transformers, token for token, with the base model's and both adapters' requests batched
together and their prompts chunked; no KV block is shared across adapters; `/v1/models` lists
them. What `serve` refuses at start, by name, is checked on the files alone."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from conftest import MODEL

from turnstile.bench import random_llama
from turnstile.bench.server_process import Server, launched_server
from turnstile.shared.lora import LoraConfig, adapters
from turnstile.shared.model_info import embedded_model_path, read_model_info

pytestmark = pytest.mark.slow  # starts a stack, runs transformers and PEFT

SHAPE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The first adapts every projection; the second only q, v and up (so its fused projections
# have parts without a LoRA), at another rank, with rsLoRA's scaling.
ADAPTERS = {
    "first": dict(r=8, lora_alpha=16, target_modules=ALL_MODULES),
    "second": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                   use_rslora=True),
}  # fmt: skip
PROMPTS = [[5 + i for i in range(40)], [300, 7, 9, 11], [42] * 20]  # the first chunked
TOKENS = 12


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_llama.write(tmp_path_factory.mktemp("lora-base"), **SHAPE)


@pytest.fixture(scope="module")
def adapter_dirs(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each adapter's PEFT folder, as `save_pretrained` writes it, with random A and B (PEFT's
    `init_lora_weights=False`: an adapter that changes the answers)."""
    import peft
    import torch
    import transformers

    folders = {}
    for seed, (name, fields) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed + 1)
        model = transformers.AutoModelForCausalLM.from_pretrained(base)
        config = peft.LoraConfig(init_lora_weights=False, **fields)  # type: ignore[arg-type]
        folder = tmp_path_factory.mktemp(f"lora-{name}")
        peft.get_peft_model(model, config).save_pretrained(folder)
        folders[name] = folder
    return folders


def greedy(model: object, prompt: list[int]) -> list[int]:
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(TOKENS):
            logits = model(ids).logits[0, -1]  # type: ignore[operator]
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def expected(base: Path, adapter_dirs: dict[str, Path]) -> dict[str, list[list[int]]]:
    """PEFT's greedy tokens for each prompt, by model name ("base": none)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    answers = {"base": [greedy(model, p) for p in PROMPTS]}
    for name, folder in adapter_dirs.items():
        hf = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
        adapted = peft.PeftModel.from_pretrained(hf, folder).eval()
        answers[name] = [greedy(adapted, p) for p in PROMPTS]
    assert answers["first"] != answers["base"] != answers["second"]  # else this proves little
    return answers


@pytest.fixture(scope="module")
def server(base: Path, adapter_dirs: dict[str, Path]) -> Iterator[Server]:
    modules = [f"{name}={folder}" for name, folder in adapter_dirs.items()]
    with launched_server(
        "--model", str(base), "--dtype", "float32", "--served-model-name", "base",
        "--enable-lora", "--lora-modules", *modules, "--max-lora-rank", "8",
        "--max-num-seqs", "16", "--max-num-batched-tokens", "32",
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def complete(client: openai.OpenAI, model: str, prompt: list[int]) -> object:
    return client.completions.create(
        model=model, prompt=prompt, max_tokens=TOKENS, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip


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
    assert set(cards) == {"base", "first", "second"}
    assert cards["first"].parent == "base" and cards["first"].root == str(adapter_dirs["first"])  # type: ignore[attr-defined]
    assert cards["base"].parent is None  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError) as refused:
        complete(client, "third", PROMPTS[1])
    assert refused.value.body["param"] == "model"  # type: ignore[index]


def changed(folder: Path, into: Path, **fields: object) -> Path:
    """A copy of an adapter with `fields` of its adapter_config.json changed."""
    shutil.copytree(folder, into)
    config = json.loads((into / "adapter_config.json").read_text())
    (into / "adapter_config.json").write_text(json.dumps(config | fields))
    return into


def test_what_serve_refuses_at_start_names_the_adapter(
    base: Path, adapter_dirs: dict[str, Path], tmp_path: Path
) -> None:
    info = read_model_info(base)
    first = f"first={adapter_dirs['first']}"

    def refusal(*modules: str, tp: int = 1, **settings: object) -> str:
        config = LoraConfig(**{"enable_lora": True, "lora_modules": list(modules)} | settings)
        with pytest.raises(ValueError) as refused:
            adapters(config, info, tp)
        return str(refused.value)

    assert adapters(LoraConfig(enable_lora=True, lora_modules=[first]), info)[0].slot == 1
    assert "needs --enable-lora" in refusal(first, enable_lora=False)
    assert "rank 8 is over --max-lora-rank 4" in refusal(first, max_lora_rank=4)
    assert "--tensor-parallel-size 1 only" in refusal(first, tp=2)
    assert "--max-loras 1" in refusal(first, f"other={adapter_dirs['second']}", max_loras=1)
    assert "a name given twice" in refusal(first, first)
    assert "expected NAME=PATH" in refusal(str(adapter_dirs["first"]))
    assert "no PEFT adapter_config.json" in refusal(f"x={tmp_path}")
    dora = changed(adapter_dirs["first"], tmp_path / "dora", use_dora=True)
    assert "--lora-modules x: use_dora True is not supported" in refusal(f"x={dora}")
    # A base model of another shape: each tensor's is checked against this one's.
    other = read_model_info(random_llama.write(tmp_path / "wide", **SHAPE | {"hidden_size": 96}))
    with pytest.raises(
        ValueError, match=r"--lora-modules first: tensor .*: shape \[\d+, \d+\], expected"
    ):
        adapters(LoraConfig(enable_lora=True, lora_modules=[first]), other)


def test_an_adapter_on_the_embedded_models_quantized_blocks(tmp_path: Path) -> None:
    """On the GGUF file's own blocks (the cpu backend's default), a step with an adapter's rows
    runs them, and the base model's beside them, through the layers: each answer is its own,
    alone or batched."""
    folder = random_llama.lora(tmp_path / "adapter", read_model_info(embedded_model_path()))
    prompt = "Write a list of fruits:"
    with launched_server("--enable-lora", "--lora-modules", f"fruity={folder}") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)

        def text(model: str) -> str:
            answer = client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=24,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return answer.choices[0].text

        alone = text("fruity")
        with ThreadPoolExecutor(5) as pool:
            batched = list(pool.map(text, ["fruity", *[MODEL] * 4]))
    assert batched[0] == alone and len(alone) > 20
    assert all(other == batched[1] != alone for other in batched[1:])
