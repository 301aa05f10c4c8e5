"""The LoRA tests' stack: a tiny random Llama, two PEFT adapters saved by PEFT itself (random A
and B), PEFT's own greedy tokens for each, and `turnstile serve` with both named at start, vLLM's
runtime endpoints and a resolver folder (`--lora-resolver-cache-dir`, empty at start). Test
modules import the fixtures they use."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from turnstile.bench import random_llama
from turnstile.bench.server_process import Server, launched_server

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
def resolved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`--lora-resolver-cache-dir`: empty at start."""
    return tmp_path_factory.mktemp("resolved")


@pytest.fixture(scope="module")
def server(base: Path, adapter_dirs: dict[str, Path], resolved: Path) -> Iterator[Server]:
    modules = [f"{name}={folder}" for name, folder in adapter_dirs.items()]
    with launched_server(
        "--model", str(base), "--dtype", "float32", "--served-model-name", "base",
        "--enable-lora", "--lora-modules", *modules, "--max-lora-rank", "8",
        "--max-num-seqs", "16", "--max-num-batched-tokens", "32",
        "--allow-runtime-lora-updating", "--max-loras", "2", "--lora-resolver-cache-dir",
        str(resolved),
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


def post(server: Server, path: str, **body: object) -> tuple[int, str]:
    """vLLM's runtime LoRA endpoints answer in plain text: the status and the text."""
    request = urllib.request.Request(
        f"{server.url}/v1/{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def error_of(text: str) -> dict[str, str]:
    return json.loads(text)["error"]
