"""LoRA adapters served beside their base model (`--enable-lora --lora-modules`, and loaded at
run time through vLLM's `/v1/load_lora_adapter`), through a real stack and the official openai
client: each adapter's greedy tokens match PEFT's own model on transformers, token for token,
with the base model's and the adapters' requests batched together, their prompts chunked, and
more adapters named than the executor keeps loaded; no KV block is shared across adapters, or
across an adapter's files before and after they change; `/v1/models` lists them. What is refused
at start and on the files alone: `test_lora_checks.py`."""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from turnstile.bench import random_llama
from turnstile.bench.server_process import Server, launched_server

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
        "--allow-runtime-lora-updating", "--max-loras", "2",
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
    assert set(cards) == {"base", "first", "second"}  # none loaded at run time is left
    assert cards["first"].parent == "base" and cards["first"].root == str(adapter_dirs["first"])  # type: ignore[attr-defined]
    assert cards["base"].parent is None  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError) as refused:
        complete(client, "third", PROMPTS[1])
    assert refused.value.body["param"] == "model"  # type: ignore[index]


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


def test_an_adapter_loaded_at_run_time_matches_peft_and_unloads(
    server: Server, client: openai.OpenAI, adapter_dirs: dict[str, Path],
    expected: dict[str, list[list[int]]],
) -> None:  # fmt: skip
    """vLLM's endpoints: a third name for the second adapter's folder. With --max-loras 2 and
    three adapters asked for at once, the executor drops and reads adapters again as they are
    named; every answer stays its adapter's."""
    status, text = post(
        server, "load_lora_adapter", lora_name="third", lora_path=str(adapter_dirs["second"])
    )
    assert (status, text) == (200, "Success: LoRA adapter 'third' added successfully.")
    cards = {card.id: card for card in client.models.list().data}
    assert cards["third"].root == str(adapter_dirs["second"]) and cards["third"].parent == "base"  # type: ignore[attr-defined]
    asks = [(name, i) for name in ("third", "first", "base", "third") for i in range(len(PROMPTS))]
    for _ in range(2):
        with ThreadPoolExecutor(len(asks)) as pool:
            answers = list(pool.map(lambda ask: complete(client, ask[0], PROMPTS[ask[1]]), asks))
        for (name, i), answer in zip(asks, answers, strict=True):
            want = expected["second" if name == "third" else name][i]
            assert answer.choices[0].token_ids == want, (name, i)  # type: ignore[attr-defined]
            assert answer.model == name  # type: ignore[attr-defined]
        assert complete(client, "second", PROMPTS[0]).choices[0].token_ids == expected["second"][0]  # type: ignore[attr-defined]
    status, text = post(server, "unload_lora_adapter", lora_name="third")
    assert status == 200 and "'third' removed" in text
    with pytest.raises(openai.NotFoundError) as refused:
        complete(client, "third", PROMPTS[1])
    assert refused.value.body["param"] == "model"  # type: ignore[index]
    status, text = post(server, "unload_lora_adapter", lora_name="third")
    assert status == 404 and error_of(text)["param"] == "lora_name"


def test_an_adapter_whose_files_change_is_another_adapter(
    server: Server, client: openai.OpenAI, adapter_dirs: dict[str, Path],
    expected: dict[str, list[list[int]]], tmp_path: Path,
) -> None:  # fmt: skip
    """Its files' digest is its identity: reloaded in place with other weights it answers as
    they do, finding none of the KV its old weights made; changed on disk before the executor
    reads it, a request naming it is refused (never run on other weights than those checked),
    and the refused row's blocks all come back."""
    folder = tmp_path / "mutable"
    shutil.copytree(adapter_dirs["first"], folder)
    assert post(server, "load_lora_adapter", lora_name="mutable", lora_path=str(folder))[0] == 200
    prompt = [400 + i for i in range(48)]  # three full blocks, in no other test's prompt

    def ask() -> tuple[list[int], int]:
        answer = complete(client, "mutable", prompt)
        return answer.choices[0].token_ids, answer.usage.prompt_tokens_details.cached_tokens  # type: ignore[attr-defined]

    first, cached = ask()
    assert cached == 0 and ask() == (first, 32)
    shutil.rmtree(folder)
    shutil.copytree(adapter_dirs["second"], folder)
    status, text = post(server, "load_lora_adapter", lora_name="mutable", lora_path=str(folder))
    assert status == 400 and "load_inplace" in error_of(text)["message"]
    replaced, _ = post(server, "load_lora_adapter", lora_name="mutable", lora_path=str(folder),
                    load_inplace=True)  # fmt: skip
    assert replaced == 200
    second, cached = ask()
    assert cached == 0 and second != first  # none of the first weights' KV
    assert complete(client, "mutable", PROMPTS[2]).choices[0].token_ids == expected["second"][2]  # type: ignore[attr-defined]
    # Loaded by the gateway, then changed before the executor reads it (its alpha: a copy of
    # the first's files would be the first adapter, held).
    fleeting = tmp_path / "fleeting"
    shutil.copytree(adapter_dirs["first"], fleeting)
    config = json.loads((fleeting / "adapter_config.json").read_text())
    (fleeting / "adapter_config.json").write_text(json.dumps(config | {"lora_alpha": 3}))
    assert (
        post(server, "load_lora_adapter", lora_name="fleeting", lora_path=str(fleeting))[0] == 200
    )
    (fleeting / "adapter_config.json").write_text(json.dumps(config | {"lora_alpha": 1}))
    with pytest.raises(openai.BadRequestError) as refused:
        complete(client, "fleeting", [9, 8, 7] * 12)
    assert refused.value.body["param"] == "model"  # type: ignore[index]
    assert "changed since it was loaded" in refused.value.message
    # Its files as checked again: it runs, and the refused row left no KV cached for it.
    (fleeting / "adapter_config.json").write_text(json.dumps(config | {"lora_alpha": 3}))
    assert (
        complete(client, "fleeting", [9, 8, 7] * 12).usage.prompt_tokens_details.cached_tokens == 0
    )  # type: ignore[attr-defined]
    assert complete(client, "first", PROMPTS[1]).choices[0].token_ids == expected["first"][1]  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while (series := server.scrape())["turnstile:num_requests_running"] or (
        series["turnstile:kv_cache_free_blocks"] != series["turnstile:kv_cache_total_blocks"]
    ):
        assert time.monotonic() < deadline, "a block is still held"
        time.sleep(0.2)
    for name in ("mutable", "fleeting"):
        assert post(server, "unload_lora_adapter", lora_name=name)[0] == 200


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        ({"lora_name": "x", "lora_path": "/nonexistent"}, 404, "lora_path", "no LoRA adapter"),
        ({"lora_name": "base", "lora_path": "FIRST"}, 400, "lora_name", "served base model"),
        ({"lora_name": "first", "lora_path": "FIRST"}, 400, "lora_name", "already loaded"),
        ({"lora_name": "", "lora_path": "FIRST"}, 400, "lora_name", "must be given"),
        ({"lora_name": "x", "lora_path": "DORA"}, 400, "lora_path", "use_dora True is not"),
        ({"lora_name": "x", "lora_path": "FIRST", "is_3d_lora_weight": True}, 400,
         "is_3d_lora_weight", "not supported"),
        ({"lora_name": "x", "lora_path": "FIRST", "base_model_name": "y"}, 400,
         "base_model_name", "unknown field"),
    ],
)  # fmt: skip
def test_a_load_that_cannot_be_served_is_refused_by_name(
    server: Server, adapter_dirs: dict[str, Path], tmp_path: Path,
    body: dict[str, object], status: int, param: str, words: str,
) -> None:  # fmt: skip
    dora = tmp_path / "dora"
    shutil.copytree(adapter_dirs["first"], dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    paths = {"FIRST": str(adapter_dirs["first"]), "DORA": str(dora)}
    body = body | {"lora_path": paths.get(str(body["lora_path"]), body["lora_path"])}
    answered, text = post(server, "load_lora_adapter", **body)
    error = error_of(text)
    assert (answered, error["param"]) == (status, param) and words in error["message"]
    answered, text = post(server, "unload_lora_adapter", lora_name="first", lora_int_id=1)
    assert answered == 400 and error_of(text)["param"] == "lora_int_id"
