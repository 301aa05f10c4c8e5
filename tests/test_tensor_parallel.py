"""Tensor parallelism through real stacks: ranks over torch.distributed (gloo) give exactly the
single executor's tokens, greedy and seeded, with prompts chunked and preempted; a killed rank
takes its group down and back, and every stream still ends as undisturbed; a rank whose shape
differs from its group's is refused by name."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from test_failures import run_with_fault, wait_until_whole

from turnstile.bench import random_llama
from turnstile.bench.server_process import Server, launched_server
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.executor_svc.tensor_parallel import TensorParallel
from turnstile.offline import OfflineEngine
from turnstile.scheduler_svc.executor_link import ExecutorLink
from turnstile.shared.config import SchedulingConfig
from turnstile.shared.model_info import embedded_model_path, read_model_info
from turnstile.shared.protocol import (
    PROTOCOL_VERSION,
    AddRequest,
    Register,
    SamplingParams,
    pack_ids,
)
from turnstile.shared.settings import build
from turnstile.shared.sharding import ShardingError

pytestmark = pytest.mark.slow  # starts stacks

PROMPTS = [
    [(7 * i + 3 * j) % 500 + 5 for j in range(length)] for i, length in enumerate((3, 40, 17, 90))
]
# A small cache and budget: prompts go in chunks and rows are preempted.
ENGINE = dict(dtype="float32", num_blocks=16, block_size=8, max_num_seqs=4)
BUDGET = 32  # --max-num-batched-tokens
TIGHT = (*(part for name, value in ENGINE.items()
           for part in (f"--{name.replace('_', '-')}", str(value))),
         "--max-num-batched-tokens", str(BUDGET))  # fmt: skip


def tiny_llama(folder: Path, family: str = "Llama", **features: object) -> Path:
    """4 query heads, 2 KV heads, random weights, written by transformers."""
    return random_llama.write(
        folder, family, vocab_size=512, hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.2, **features,
    )  # fmt: skip


def _randomize_biases(file: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(file)
    for name, weight in weights.items():
        if name.endswith(("bias", "sinks")):
            weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    save_file(weights, file, metadata={"format": "pt"})


def answers(server: Server, model: str) -> list[tuple[int, ...]]:
    """Each prompt's tokens greedy, then seeded, all sent at once."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)

    async def all_at_once() -> list[tuple[int, ...]]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        ids = {"return_token_ids": True}
        greedy = [aclient.completions.create(model=model, prompt=p, max_tokens=24, temperature=0,
                                             extra_body={**ids, "ignore_eos": True})
                  for p in PROMPTS]  # fmt: skip
        seeded = [aclient.completions.create(model=model, prompt=p, max_tokens=24,
                                             temperature=0.9, seed=i, extra_body=ids)
                  for i, p in enumerate(PROMPTS)]  # fmt: skip
        done = await asyncio.gather(*greedy, *seeded)
        return [tuple(c.choices[0].token_ids) for c in done]  # type: ignore[attr-defined]

    assert client.models.list().data
    return asyncio.run(all_at_once())


def single_executor(folder: Path) -> list[tuple[int, ...]]:
    """What `answers` gets from one executor, computed in this process: a stack's start is
    most of a test's time here, and served answers are the engine's (test_api.py)."""
    engine = OfflineEngine(build(RunnerConfig, model=str(folder), **ENGINE),
                           SchedulingConfig(max_num_batched_tokens=BUDGET))  # fmt: skip
    greedy = [AddRequest(i, pack_ids(prompt), 24, ignore_eos=True)
              for i, prompt in enumerate(PROMPTS)]  # fmt: skip
    seeded = [AddRequest(len(PROMPTS) + i, pack_ids(prompt), 24,
                         SamplingParams(temperature=0.9, seed=i))
              for i, prompt in enumerate(PROMPTS)]  # fmt: skip
    return [tuple(done.token_ids) for done in engine.generate(greedy + seeded)]


# Mixtral: each expert's intermediate dims split, as a dense MLP's. gpt-oss: its sinks split by
# heads, o's and the experts' down biases added by one rank (its biases and sinks made to count).
# GLM-4.5: its shared expert split as a dense MLP, its grouped router whole on each rank;
# Qwen2-MoE's alike, its gate on each rank's share.
FEATURES: dict[str, dict[str, object]] = {
    "Llama": {},
    "Mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "GptOss": dict(num_local_experts=4, num_experts_per_tok=2),
    "Glm4Moe": dict(n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                    moe_intermediate_size=64, first_k_dense_replace=1, attention_bias=True),
    "Qwen2Moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                     shared_expert_intermediate_size=96),
}  # fmt: skip


@pytest.mark.parametrize("family", list(FEATURES))
def test_two_ranks_give_the_single_executors_tokens_on_a_tiny_model(
    family: str, tmp_path: Path
) -> None:
    folder = tiny_llama(tmp_path, family, **FEATURES[family])
    if family != "Llama":
        _randomize_biases(folder / "model.safetensors")
    with launched_server("--model", str(folder), "--tensor-parallel-size", "2",
                         *TIGHT) as server:  # fmt: skip
        served = answers(server, folder.name)
        assert server.service("executor 1").is_running()  # a rank of its own
        assert server.scrape()["turnstile:num_preemptions_total"] >= 1
    assert served == single_executor(folder)
    assert len(set(served)) > 4  # not degenerate


def test_three_ranks_give_the_single_executors_tokens_with_one_kv_head_each(
    tmp_path: Path,
) -> None:
    """The embedded model's head layout (9 query heads on 3 KV heads: one KV head a rank) and a
    tied embedding split by vocabulary, on a tiny random model: three ranks of the embedded
    model's 30 float32 layers on two cores took 37 s of the suite."""
    folder = random_llama.write(
        tmp_path / "tiny", "Llama", vocab_size=513, hidden_size=144, intermediate_size=288,
        num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
        max_position_embeddings=512, tie_word_embeddings=True, initializer_range=0.2,
    )  # fmt: skip
    with launched_server("--model", str(folder), "--tensor-parallel-size", "3",
                         *TIGHT) as server:  # fmt: skip
        served = answers(server, folder.name)
        assert server.service("executor 2").is_running()
    assert served == single_executor(folder)
    assert len(set(served)) > 4  # not degenerate


def test_a_killed_rank_restarts_its_group_and_every_stream_finishes_as_undisturbed(
    tmp_path: Path,
) -> None:
    folder = tiny_llama(tmp_path)
    with launched_server("--model", str(folder), "--served-model-name", "SmolLM2-135M-Instruct",
                         "--tensor-parallel-size", "2", "--dtype", "float32",
                         "--num-blocks", "256") as server:  # fmt: skip
        undisturbed = asyncio.run(run_with_fault(server.url, None))
        assert all(text and not errors for text, errors in undisturbed)

        def kill_rank_1() -> None:
            os.kill(server.service("executor 1").pid, signal.SIGKILL)

        rank_0 = server.service("executor").pid
        disturbed = asyncio.run(run_with_fault(server.url, kill_rank_1))
        assert disturbed == undisturbed
        assert server.service("executor").pid != rank_0  # the whole group was restarted
        wait_until_whole(server)


def register(rank: int, num_blocks: int) -> Register:
    return Register(PROTOCOL_VERSION, rank, "m", 512, num_blocks, 16, 8, 256)


def test_a_rank_that_differs_from_its_group_is_refused_by_name() -> None:
    link = ExecutorLink("inproc://tp-test", 16, 8, "m", 512, tensor_parallel_size=2)
    first = register(0, 100)
    assert link.refusal(first) == ""
    link.peers[0], link.offers[0] = b"rank0", first
    assert "num_blocks 90 where rank 0 has 100" in link.refusal(register(1, 90))
    assert link.refusal(register(1, 100)) == ""
    assert "ranks 0 to 1" in link.refusal(register(2, 100))


def test_a_model_the_ranks_cannot_split_is_refused_naming_its_shape() -> None:
    info = read_model_info(embedded_model_path())  # 9 query heads, 3 KV heads
    TensorParallel(0, 3).check(info)
    with pytest.raises(ShardingError, match="9 query heads"):
        TensorParallel(0, 2).check(info)
    # serve refuses it before any service starts, not after its executor dies at load
    started = subprocess.run(
        [sys.executable, "-m", "turnstile.cli", "serve", "--tensor-parallel-size", "2",
         "--port", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert started.returncode != 0 and "does not divide the 9 query heads" in started.stderr
    assert "executor" not in started.stderr


def test_olmo2s_norms_across_heads_are_refused_across_ranks() -> None:
    from dataclasses import replace

    info = replace(read_model_info(embedded_model_path()), qk_norm="all")
    TensorParallel(0, 1).check(info)
    with pytest.raises(ShardingError, match="normed across all their heads"):
        TensorParallel(0, 3).check(info)


def test_a_rank_started_with_other_num_blocks_is_refused_by_name(tmp_path: Path) -> None:
    """Real processes: a scheduler for two ranks, and two executors whose --num-blocks differ.
    Whichever registers second is refused, and says why."""
    import subprocess
    import sys

    from turnstile.launcher import free_port

    folder = tiny_llama(tmp_path / "model")
    common = ["--model", str(folder), "--tensor-parallel-size", "2",
              "--scheduler-address", f"ipc://{tmp_path}/s.sock",
              "--executors-address", f"ipc://{tmp_path}/e.sock"]  # fmt: skip
    meet = ["--distributed-init-method", f"tcp://127.0.0.1:{free_port()}", "--dtype", "float32"]

    def turnstile(*args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "turnstile.cli", *args],
                                stderr=subprocess.PIPE, text=True)  # fmt: skip

    processes = [turnstile("scheduler", *common)]
    ranks = [turnstile("executor", *common, *meet, "--rank", str(rank), "--num-blocks", blocks)
             for rank, blocks in ((0, "64"), (1, "32"))]  # fmt: skip
    processes += ranks
    try:
        deadline = time.monotonic() + 90
        while all(rank.poll() is None for rank in ranks):
            assert time.monotonic() < deadline, "neither rank was refused"
            time.sleep(0.2)
        refused = next(rank for rank in ranks if rank.poll() is not None)
        assert refused.returncode != 0
        error = refused.stderr.read()
        assert "refused this executor" in error and "disagrees with its group" in error
        assert "num_blocks 32 where rank 0 has 64" in error or (
            "num_blocks 64 where rank 1 has 32" in error)  # fmt: skip
    finally:
        for process in processes:
            process.kill()
            process.wait()


def test_ranks_sized_by_their_memory_agree_on_the_fewest_blocks(tmp_path: Path) -> None:
    """`--gpu-memory-utilization` on a CPU: each rank gets its share of the machine less what
    its own process holds, which differs between ranks; they size their caches alike, the
    fewest blocks any one could hold, so the scheduler takes both (it refuses ranks that
    differ). A share of 1.5 GiB a rank: the cache's pages become resident only as used."""
    import torch

    from turnstile.executor_svc.kv_cache_size import GIB, device_memory

    folder = tiny_llama(tmp_path)
    fraction = 2 * 1.5 * GIB / device_memory(torch.device("cpu"))[0]
    share = ("--gpu-memory-utilization", f"{fraction:.4f}")
    with launched_server("--model", str(folder), "--tensor-parallel-size", "2", "--dtype",
                         "float32", *share) as server:  # fmt: skip
        blocks = server.scrape()["turnstile:kv_cache_total_blocks"]
        assert answers(server, folder.name)[0]
    per_block = 2 * 2 * 16 * 1 * 32 * 4  # K and V, 2 layers, 16 tokens, a KV head a rank, fp32
    assert 0.5 * GIB < blocks * per_block < 1.5 * GIB
