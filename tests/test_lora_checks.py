"""LoRA adapters checked on their files alone: what `serve` refuses at start, by name; how many
adapters an executor keeps loaded (`executor_svc/adapters.py`), never dropping one a row runs,
and its refusal of an adapter whose files changed; how many a step runs (the scheduler's
`--max-loras`); and an adapter on the embedded model's GGUF blocks, through a real stack, where
vLLM's runtime endpoints are not served without the flag."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from conftest import MODEL

from turnstile.bench import random_llama
from turnstile.bench.server_process import launched_server
from turnstile.executor_svc.adapters import Adapters
from turnstile.executor_svc.model.lora import LoraWeights
from turnstile.shared.lora import LoraConfig, adapters, read_adapter
from turnstile.shared.model_info import ModelInfo, embedded_model_path, read_model_info
from turnstile.shared.protocol import LoraRef, NewRequest

SHAPE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip


def changed(folder: Path, into: Path, **fields: object) -> Path:
    """A copy of an adapter with `fields` of its adapter_config.json changed."""
    shutil.copytree(folder, into)
    config = json.loads((into / "adapter_config.json").read_text())
    (into / "adapter_config.json").write_text(json.dumps(config | fields))
    return into


@pytest.fixture(scope="module")
def info(tmp_path_factory: pytest.TempPathFactory) -> ModelInfo:
    return read_model_info(random_llama.write(tmp_path_factory.mktemp("base"), **SHAPE))


@pytest.fixture(scope="module")
def adapter_dirs(info: ModelInfo, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three random adapters, each of its own rank (so of its own files)."""
    return {f"r{rank}": random_llama.lora(tmp_path_factory.mktemp(f"r{rank}"), info, rank=rank)
            for rank in (2, 4, 8)}  # fmt: skip


def test_what_serve_refuses_at_start_names_the_adapter(
    info: ModelInfo, adapter_dirs: dict[str, Path], tmp_path: Path
) -> None:
    first = f"first={adapter_dirs['r8']}"

    def refusal(*modules: str, **settings: object) -> str:
        config = LoraConfig(**{"enable_lora": True, "lora_modules": list(modules)} | settings)
        with pytest.raises(ValueError) as refused:
            adapters(config, info)
        return str(refused.value)

    found = adapters(LoraConfig(enable_lora=True, lora_modules=[first]), info)[0]
    assert found.ref == LoraRef("first", str(adapter_dirs["r8"]), found.digest)
    assert len(found.digest) == 32 and found.rank == 8 and found.scaling == 2.0
    assert "needs --enable-lora" in refusal(first, enable_lora=False)
    assert "--allow-runtime-lora-updating needs --enable-lora" in refusal(
        enable_lora=False, allow_runtime_lora_updating=True
    )
    assert "--lora-resolver-cache-dir needs --allow-runtime-lora-updating" in refusal(
        lora_resolver_cache_dir=str(tmp_path)
    )
    assert "--lora-resolver-cache-dir /nowhere: not a folder" in refusal(
        lora_resolver_cache_dir="/nowhere", allow_runtime_lora_updating=True
    )
    assert "rank 8 is over --max-lora-rank 4" in refusal(first, max_lora_rank=4)
    assert "--max-loras 0: at least 1" in refusal(first, max_loras=0)
    assert "a name given twice" in refusal(first, first)
    assert "expected NAME=PATH" in refusal(str(adapter_dirs["r8"]))
    assert "--lora-modules x: cannot read the PEFT adapter in" in refusal(f"x={tmp_path}")
    dora = changed(adapter_dirs["r8"], tmp_path / "dora", use_dora=True)
    assert "--lora-modules x: use_dora True is not supported" in refusal(f"x={dora}")
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "adapter_config.json").write_text('{"r": 4}')
    (tmp_path / "torn" / "adapter_model.safetensors").write_bytes(b"\xff" * 16)
    assert "is not a safetensors file" in refusal(f"x={tmp_path / 'torn'}")
    # A base model of another shape: each tensor's is checked against this one's.
    other = read_model_info(random_llama.write(tmp_path / "wide", **SHAPE | {"hidden_size": 96}))
    with pytest.raises(
        ValueError, match=r"--lora-modules first: .*: tensor .*: shape \[\d+, \d+\], expected"
    ):
        adapters(LoraConfig(enable_lora=True, lora_modules=[first]), other)


@pytest.mark.slow  # starts a stack
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
        # vLLM's runtime endpoints exist only with --allow-runtime-lora-updating.
        body = json.dumps({"lora_name": "x", "lora_path": str(folder)}).encode()
        with pytest.raises(urllib.error.HTTPError) as absent:
            urllib.request.urlopen(f"{server.url}/v1/load_lora_adapter", body, timeout=30)
        assert absent.value.code == 404
        with ThreadPoolExecutor(5) as pool:
            batched = list(pool.map(text, ["fruity", *[MODEL] * 4]))
    assert batched[0] == alone and len(alone) > 20
    assert all(other == batched[1] != alone for other in batched[1:])


def joining(req_id: int, ref: LoraRef) -> NewRequest:
    return NewRequest(req_id, b"", 1, 0, 1, b"", lora=ref)


def test_the_executor_keeps_max_loras_adapters_and_never_drops_one_a_row_runs(
    info: ModelInfo, adapter_dirs: dict[str, Path], tmp_path: Path
) -> None:
    refs = [read_adapter(name, path, 8, info).ref for name, path in adapter_dirs.items()]
    weights = LoraWeights(info, torch.float32, torch.device("cpu"))
    held = Adapters(LoraConfig(enable_lora=True, max_loras=2, max_lora_rank=8), info, weights)
    none = np.empty(0, dtype=np.int32)
    assert held.slots_for([joining(0, refs[0]), joining(1, refs[1])], none) == {0: 1, 1: 2}
    assert held.slots_for([joining(2, refs[0])], none) == {2: 1}  # held: named again
    # A third while slot 1's runs: the other, idle, is dropped and its slot taken.
    assert held.slots_for([joining(3, refs[2])], np.array([1])) == {3: 2}
    assert list(held.slots) == [refs[0].digest, refs[2].digest]
    assert weights.layers[0]["qkv"][2][0].shape == (16, 64)  # rank 8: q's and v's A rows
    # Every adapter held runs: one more is loaded beyond --max-loras rather than drop one.
    assert held.slots_for([joining(4, refs[1])], np.array([1, 2])) == {4: 3}
    assert len(held.slots) == 3 and not held.take_refused()
    # Files changed since the gateway read them: the request is refused, nothing loaded.
    # (Its own alpha first: a copy of a held adapter's files is that adapter, by digest.)
    moved = changed(adapter_dirs["r2"], tmp_path / "moved", lora_alpha=3)
    ref = read_adapter("moved", moved, 8, info).ref
    config = json.loads((moved / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(json.dumps(config | {"lora_alpha": 1}))
    assert held.slots_for([joining(5, ref)], np.array([1, 2, 3])) == {}
    [(req_id, reason, why)] = held.take_refused()
    assert (req_id, reason) == (5, "adapter") and "changed since it was loaded" in why
    assert len(held.slots) == 3


def test_a_step_runs_at_most_max_loras_adapters() -> None:
    """As vLLM's scheduler holds `--max-loras`: with two adapters running, a third adapter's
    request waits while the requests behind it (of a running adapter, of the base model) are
    admitted; it keeps its place, ahead of later arrivals, and joins once the first adapter's
    requests have all left."""
    from scheduler_harness import Harness

    from turnstile.shared.config import SchedulerConfig
    from turnstile.shared.protocol import unpack_ids
    from turnstile.shared.settings import build

    config = build(SchedulerConfig, num_blocks=64, block_size=4, max_num_seqs=4,
                   max_num_batched_tokens=64, max_model_len=128, max_loras=2)  # fmt: skip
    ends = {1: 3, 2: 30, 3: 30, 4: 6, 5: 30, 6: 30, 7: 30}  # the tokens each stops after
    harness = Harness(config, ends)
    named = {1: "a", 2: "b", 3: "c", 4: "a", 5: None, 6: None, 7: None}

    def add(req_id: int) -> None:
        name = named[req_id]
        ref = LoraRef(name, f"/adapters/{name}", name * 8) if name else None
        harness.add(req_id, [5, 6, 7], max_tokens=30, lora=ref)

    for req_id in range(1, 6):
        add(req_id)
    harness.step()
    add(6)
    add(7)
    harness.run()
    assert harness.endings == {i: ["stop"] for i in named}
    running: set[int] = set()
    adapters_a_step, joined = [], {}
    for index, plan in enumerate(harness.plans):
        running -= set(unpack_ids(plan.removed).tolist())
        running |= {new.req_id for new in plan.new}
        joined.update({new.req_id: index for new in plan.new})
        adapters_a_step.append({named[i] for i in running} - {None})
    assert max(len(adapters) for adapters in adapters_a_step) == 2
    assert joined[1] == joined[2] == joined[4] == joined[5] == 0
    assert 0 < joined[6] < joined[3] < joined[7]
    assert "a" not in adapters_a_step[joined[3]]
    harness.check_invariants()
