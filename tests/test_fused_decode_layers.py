"""The cpu backend's fused decode layers (decode_layer.c, one call a layer) against the same
backend's model layers, on every route a step can take."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import fixed_length_requests

from turnstile.executor_svc import step_layout
from turnstile.executor_svc.backend import Backend
from turnstile.executor_svc.backends.native_decode import NativeDecode
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.executor_svc.step_layout import SHORT_PREFILL_TOKENS
from turnstile.offline import OfflineEngine
from turnstile.shared.config import SchedulingConfig
from turnstile.shared.protocol import SamplingParams
from turnstile.shared.settings import build

# Where a product rounds its activations to int8 (GGUF and MXFP4 blocks off AMX-INT8 tiles), the
# two routes' last-bit differences (attention, RoPE, norms and the router's softmax computed
# apart) can flip a rounding, and a flip moves a logprob by hundredths: 0.06 on a random MoE on
# an Ice Lake Xeon (docs/benchmarks.md, "A CPU without AMX or AVX512-BF16").
INT8_ROUNDING = 0.1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype"),
    [("float32", "auto"), ("bfloat16", "auto"), ("float32", "bfloat16")],
)
@pytest.mark.parametrize("short_prefill_tokens", [SHORT_PREFILL_TOKENS, 0])
def test_fused_decode_layers_generate_what_the_torch_layers_generate(
    dtype: str, kv_cache_dtype: str, short_prefill_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded model through decode_layer.c (one call a layer, where the route allows)
    against the same backend and weights through the model's layer code. A 16-token budget chunks
    the 40-token prompt while the others decode, so steps mix prefill and decode rows; with
    short prefills allowed, every token of them is a row of the fused layers, else the prefill
    rows take the model's layers beside."""
    from turnstile.shared.protocol import AddRequest, pack_ids

    monkeypatch.setattr(step_layout, "SHORT_PREFILL_TOKENS", short_prefill_tokens)
    prompts = [[504, 3575, 282, 4649, 314], list(range(1000, 1040)), [1, 2, 3]]
    outputs = {}
    routes: dict[str, set[str]] = {}
    for run in ("fused", "unfused"):
        with monkeypatch.context() as patch:
            if run == "unfused":
                patch.setattr(NativeDecode, "supports", staticmethod(lambda *_: False))
            engine = OfflineEngine(
                build(
                    RunnerConfig,
                    dtype=dtype,
                    kv_cache_dtype=kv_cache_dtype,
                    cpu_bf16_products="rows",  # on AMX-BF16 tiles every token is fused
                    num_blocks=32,
                    max_num_seqs=4,
                ),
                SchedulingConfig(max_num_batched_tokens=16),
            )
        assert engine.runner.backend.name == "cpu"
        # auto: the activations' dtype, float32 on the cpu backend
        kv_dtype = torch.bfloat16 if kv_cache_dtype == "bfloat16" else torch.float32
        assert engine.runner.kv_dtype == kv_dtype
        routes[run] = _record_routes(monkeypatch, engine.runner.backend)
        requests = [
            AddRequest(req_id=i, prompt_ids=pack_ids(p), max_tokens=12, ignore_eos=True)
            for i, p in enumerate(prompts)
        ]
        outputs[run] = [result.token_ids for result in engine.generate(requests)]
    assert outputs["fused"] == outputs["unfused"]
    assert all(len(tokens) == 12 for tokens in outputs["fused"])
    assert routes["unfused"] == {"layers"}
    expected = {"fused"} if short_prefill_tokens else {"layers", "split", "fused"}
    assert routes["fused"] == expected


def fused_generates_what_the_layers_do(
    monkeypatch: pytest.MonkeyPatch,
    engine: Callable[[], OfflineEngine],
    new_tokens: int = 16,
    atol: float = 1e-3,
) -> list[OfflineEngine]:
    """Every step of a model through decode_layer.c, against the model's layers (both engines
    returned): the same tokens on PROMPTS, logprobs within `atol` (the C softmaxes against
    torch's: a few ulps; `INT8_ROUNDING` where activations are rounded to int8)."""
    from test_model_families import PROMPTS

    results, routes, engines = {}, {}, []
    for fused in (True, False):
        with monkeypatch.context() as patch:
            if not fused:
                patch.setattr(NativeDecode, "supports", staticmethod(lambda *_: False))
            engines.append(engine())
        routes[fused] = _record_routes(monkeypatch, engines[-1].runner.backend)
        requests = fixed_length_requests(PROMPTS, SamplingParams(logprobs=5), new_tokens)
        results[fused] = engines[-1].generate(requests)
    assert routes == {True: {"fused"}, False: {"layers"}}
    same_generations(results[True], results[False], atol=atol)
    return engines


def same_generations(ours: list[Any], theirs: list[Any], atol: float) -> None:
    """Two engines' results: the same tokens; at each step the same top ids, their logprobs
    within `atol`, but for ids within `atol` of the end of the other's list (trading places
    there)."""
    for mine, other in zip(ours, theirs, strict=True):
        assert mine.token_ids == other.token_ids
        for a, b in zip(mine.logprobs, other.logprobs, strict=True):
            first, second = dict(a), dict(b)
            for token in first.keys() & second.keys():
                assert abs(first[token] - second[token]) <= atol, (token, a, b)
            for one, another in ((first, second), (second, first)):
                for token in one.keys() - another.keys():
                    assert one[token] <= min(another.values()) + atol, (token, a, b)


def _record_routes(monkeypatch: pytest.MonkeyPatch, backend: Backend) -> set[str]:
    """The route of every step the backend runs."""
    seen: set[str] = set()
    route = backend.route

    def recording_route(*args: object) -> object:
        chosen = route(*args)  # type: ignore[arg-type]
        seen.add(chosen.value)
        return chosen

    monkeypatch.setattr(backend, "route", recording_route)
    return seen
