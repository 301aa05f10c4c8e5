from __future__ import annotations

import os

# Read when @triton.jit runs, so before any kernel module is imported: the Triton kernels run
# on the CPU through the interpreter here (tests/test_kernels.py).
os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from hypothesis import HealthCheck, settings

from turnstile.bench.server_process import Server, launched_server
from turnstile.shared.protocol import AddRequest, SamplingParams, pack_ids

settings.register_profile(
    "turnstile",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=bool(os.environ.get("CI")),
)
settings.load_profile("turnstile")

MODEL = "SmolLM2-135M-Instruct"
EVERY_CORE = os.sched_getaffinity(0)


@pytest.fixture(autouse=True)
def every_core() -> Iterator[None]:
    """A test that builds a tensor-parallel rank's backend in this process has it pinned to the
    rank's share of the cores (`cpu_runtime.pin_rank`, as a rank's own process is); the tests
    after it, and the processes they start, get every core back."""
    yield
    if os.sched_getaffinity(0) != EVERY_CORE:
        os.sched_setaffinity(0, EVERY_CORE)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(len(EVERY_CORE))


def fixed_length_requests(
    prompts: list[list[int]], sampling: SamplingParams, max_tokens: int
) -> list[AddRequest]:
    """One request per prompt (ids 0, 1, ...), each generating exactly `max_tokens`."""
    return [
        AddRequest(
            req_id=i,
            prompt_ids=pack_ids(ids),
            max_tokens=max_tokens,
            sampling=sampling,
            ignore_eos=True,
        )
        for i, ids in enumerate(prompts)
    ]


@pytest.fixture(scope="session")
def service() -> Iterator[Server]:
    """A stack of real processes that the test modules share (a start costs seconds; a module
    needing other flags defines its own `service`). A small KV cache (256 blocks of 16 tokens)
    so that load really shares it."""
    with launched_server("--num-blocks", "256", "--max-num-seqs", "32") as running:
        yield running


@pytest.fixture(scope="module")
def client(service: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{service.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def stack_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where a module's own stack writes its log, for tests that read it."""
    return tmp_path_factory.mktemp("serve") / "serve.log"


@contextlib.contextmanager
def logged_stack(log: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    """A stack with `flags` (and `env`) whose INFO log goes to `log`."""
    with launched_server(*flags, log=log, env={"TURNSTILE_LOG": "INFO", **(env or {})}) as running:
        yield running
