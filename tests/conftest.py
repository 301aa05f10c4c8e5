from __future__ import annotations

import os

# Read when @triton.jit runs, so before any kernel module is imported: the Triton kernels run
# on the CPU through the interpreter here (tests/test_kernels.py).
os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Iterator

import openai
import pytest
from hypothesis import HealthCheck, settings

from turnstile.bench.server_process import Server, launched_server

settings.register_profile(
    "turnstile",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=bool(os.environ.get("CI")),
)
settings.load_profile("turnstile")

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def service() -> Iterator[Server]:
    """A stack of real processes for a test module. A small KV cache (256 blocks of 16 tokens)
    so that load really shares it."""
    with launched_server("--num-blocks", "256", "--max-num-seqs", "32") as running:
        yield running


@pytest.fixture(scope="module")
def client(service: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{service.url}/v1", api_key="unused", max_retries=0)
