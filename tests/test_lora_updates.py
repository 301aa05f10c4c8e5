"""LoRA adapters loaded at run time through vLLM's `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter`, and found by name in a resolver folder (vLLM's filesystem resolver),
through a real stack and the official openai client: each answer is PEFT's, token for token,
with more adapters named than the executor keeps loaded; an in-place reload with other weights
finds none of the old weights' KV; a folder changed before the executor reads it is refused,
never run; each refusal of the endpoints names its field."""

from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from lora_stack import (
    PROMPTS,
    adapter_dirs,
    base,
    client,
    complete,
    error_of,
    expected,
    post,
    resolved,
    server,
)

from turnstile.bench.server_process import Server

pytestmark = pytest.mark.slow  # starts a stack, runs transformers and PEFT
# Fixtures pytest hands the tests by name; imported, so each module has its own stack.
FIXTURES = (adapter_dirs, base, client, expected, resolved, server)


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


def test_an_adapter_is_found_in_the_resolver_folder_by_its_name(
    client: openai.OpenAI, server: Server, base: Path, adapter_dirs: dict[str, Path],
    expected: dict[str, list[list[int]]], resolved: Path,
) -> None:  # fmt: skip
    """vLLM's filesystem resolver: a request naming an adapter not loaded finds the folder's
    sub-folder of that name, if it is a LoRA of this base model (as PEFT saved it: the --model
    given); one of another model, or a name reaching outside the folder, does not exist."""
    shutil.copytree(adapter_dirs["first"], resolved / "fourth")
    assert complete(client, "fourth", PROMPTS[1]).choices[0].token_ids == expected["first"][1]  # type: ignore[attr-defined]
    cards = {card.id: card for card in client.models.list().data}
    assert cards["fourth"].root == str(resolved / "fourth")  # type: ignore[attr-defined]
    for name, fields in (("other", {"base_model_name_or_path": "someone/else"}),
                         ("torn", {"use_dora": True})):  # fmt: skip
        folder = shutil.copytree(adapter_dirs["second"], resolved / name)
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps(config | fields))
    with pytest.raises(openai.NotFoundError):
        complete(client, "other", PROMPTS[1])
    with pytest.raises(openai.NotFoundError):
        complete(client, f"../{resolved.name}/fourth", PROMPTS[1])
    with pytest.raises(openai.BadRequestError) as refused:
        complete(client, "torn", PROMPTS[1])
    assert refused.value.body["param"] == "model" and "use_dora" in refused.value.message  # type: ignore[index]
    assert json.loads((resolved / "fourth" / "adapter_config.json").read_text())[
        "base_model_name_or_path"
    ] == str(base)
    assert post(server, "unload_lora_adapter", lora_name="fourth")[0] == 200


def test_the_adapters_of_running_requests_are_a_series_as_vllms(
    client: openai.OpenAI, server: Server
) -> None:
    """`turnstile:lora_requests_info` (vLLM's `vllm:lora_requests_info`, which LoRA-aware
    routers read): the adapters of the running and waiting requests as labels, the value when
    they were seen."""

    def seen() -> list[str]:
        return [name for name in server.scrape() if name.startswith("turnstile:lora_requests_info")]

    long = [300 + i % 50 for i in range(60)]
    deadline = time.monotonic() + 60
    with ThreadPoolExecutor(4) as pool:
        while not any('running_lora_adapters="first,second"' in name for name in seen()):
            assert time.monotonic() < deadline, seen()
            asks = [pool.submit(client.completions.create, model=name, prompt=long,
                                max_tokens=150, extra_body={"ignore_eos": True})
                    for name in ("first", "second")]  # fmt: skip
            for ask in asks:
                ask.result()
    assert all('max_lora="2"' in name for name in seen())
