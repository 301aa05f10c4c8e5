"""A MoE GGUF file's experts kept in their blocks on the cpu backend (`block_experts.py`):
Qwen3-MoE's in Q8_0 and Mixtral's (llama.cpp's llama architecture) in Q4_0, as llama.cpp's
converter stacks them. Their bytes stay the file's; a token generates alike alone and batched
(the experts dequantized to torch's grouped matmuls do not); the tokens and logprobs stay
near those of the same file with its experts dequantized (the products' int8 activations
differ). Such a mixture, or bf16 experts on AMX tiles, runs in the fused decode layers
(decode_mixture.c) as the model's layers run it. The kernel against torch's arithmetic on every
block format: test_quantized_experts.py."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from conftest import fixed_length_requests
from gguf_convert import write_gguf
from test_model_families import PROMPTS, _checkpoint

from turnstile.executor_svc.backends.block_experts import BlockExperts
from turnstile.executor_svc.backends.tiled_experts import TiledExperts
from turnstile.executor_svc.model.experts import Experts
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.kernels import cpu_native
from turnstile.offline import OfflineEngine
from turnstile.shared.config import SchedulingConfig
from turnstile.shared.protocol import SamplingParams
from turnstile.shared.settings import build

pytestmark = [
    pytest.mark.slow,  # loads transformers
    pytest.mark.skipif(cpu_native.library() is None, reason="needs the native kernels"),
]
Q = gguf.GGMLQuantizationType
NEW_TOKENS = 16


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNSTILE_CACHE", str(tmp_path / "cache"))


def _engine(path: Path, **settings: str) -> OfflineEngine:
    config = build(RunnerConfig, model=str(path), num_blocks=64, max_num_seqs=4, **settings)
    return OfflineEngine(config, SchedulingConfig(max_num_batched_tokens=64))


def _generate(engine: OfflineEngine, prompts: list[list[int]]) -> list:
    return engine.generate(fixed_length_requests(prompts, SamplingParams(logprobs=5), NEW_TOKENS))


@pytest.mark.parametrize(("family", "kind"), [("qwen3_moe", Q.Q8_0), ("mixtral", Q.Q4_0)])
def test_a_moe_gguf_files_experts_compute_on_their_blocks(
    family: str, kind: Q, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _checkpoint(family, dense_layers=()).save_pretrained(tmp_path / "hf")
    path = write_gguf(tmp_path / "hf", tmp_path / "moe.gguf", kind)
    engine = _engine(path)
    layers = engine.runner.model.layers
    assert all(isinstance(layer.experts, BlockExperts) for layer in layers)
    kept = sum(t.nbytes for layer in layers for t, _ in layer.experts.packed._tensors[0])
    stored = sum(t.n_bytes for t in gguf.GGUFReader(path).tensors if "_exps." in t.name)
    elements = sum(t.n_elements for t in gguf.GGUFReader(path).tensors if "_exps." in t.name)
    assert stored <= kept <= 1.15 * stored < 4 * elements / 3  # float32's a third
    batched = _generate(engine, PROMPTS)
    alone = [_generate(engine, [prompt])[0] for prompt in PROMPTS]
    assert [(r.token_ids, r.logprobs) for r in alone] == [
        (r.token_ids, r.logprobs) for r in batched
    ]

    monkeypatch.setattr(BlockExperts, "takes", staticmethod(lambda weights: False))
    dense_engine = _engine(path)
    assert all(isinstance(layer.experts, Experts) for layer in dense_engine.runner.model.layers)
    dense = _generate(dense_engine, PROMPTS)
    assert sum(r.token_ids[0] == d.token_ids[0] for r, d in zip(batched, dense, strict=True)) >= 3
    for result, theirs in zip(batched, dense, strict=True):
        ours, expected = ([logprob for _, logprob in r.logprobs[0]] for r in (result, theirs))
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(expected), atol=0.15, rtol=0)


@pytest.mark.parametrize("kind", ["blocks", "tiles"])
def test_a_mixture_in_the_fused_decode_layers_generates_what_the_model_layers_do(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every step of a Q8_0 Qwen3-MoE file (experts on their blocks), or of a bf16 Mixtral
    (experts on AMX tiles), through decode_layer.c, against the model's layers: the same
    tokens, logprobs within the router's softmax in C against torch's (a few ulps), or
    int8's rounding on the blocks."""
    from test_fused_decode_layers import INT8_ROUNDING, fused_generates_what_the_layers_do

    if kind == "tiles" and not cpu_native.amx_tiles():
        pytest.skip("bf16 experts take the tiles on a CPU with AMX-BF16 only")
    family = "qwen3_moe" if kind == "blocks" else "mixtral"
    _checkpoint(family, dense_layers=()).save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf"
    if kind == "blocks":
        path = write_gguf(tmp_path / "hf", tmp_path / "moe.gguf", Q.Q8_0)
    settings = {"dtype": "bfloat16"} if kind == "tiles" else {}
    experts = BlockExperts if kind == "blocks" else TiledExperts
    atol = INT8_ROUNDING if kind == "blocks" else 1e-3
    engines = fused_generates_what_the_layers_do(
        monkeypatch, lambda: _engine(path, **settings), atol=atol
    )
    for engine in engines:
        assert all(isinstance(layer.experts, experts) for layer in engine.runner.model.layers)
