"""gpt-oss's MXFP4 experts kept in their blocks on the cpu backend (quantized.h's QFP4: each
e2m1 code read as 2 e2m1 + 12 through a table, d half the block's power of two, m = -12 d):
the kept blocks are the values transformers dequantizes, the native product on them is the
torch reference on every ISA, and a checkpoint served with its experts kept follows
transformers' logprobs within the int8 activations' rounding, a token alike alone and
batched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from turnstile.kernels import cpu_native
from turnstile.kernels.mxfp4_weights import mxfp4_blocks, mxfp4_values
from turnstile.kernels.quantized_weights import FP4, pack, reference_linear

needs_native = pytest.mark.skipif(cpu_native.library() is None, reason="no native CPU kernels")


def _blocks(rows: int, groups: int, low: int = 110, high: int = 135, seed: int = 0):
    draw = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows, groups, 16), dtype=torch.uint8, generator=draw)
    return blocks, torch.randint(low, high, (rows, groups), dtype=torch.uint8, generator=draw)


def test_kept_mxfp4_blocks_hold_the_checkpoints_values() -> None:
    """Exactly, packed and unpacked again too; a scale float16 cannot hold is not kept."""
    blocks, scales = _blocks(40, 3)
    kept = mxfp4_blocks(blocks, scales)
    assert kept is not None and kept.bits == FP4 and kept.group == 32
    values = mxfp4_values(blocks, scales).float()
    assert torch.equal(kept.dequantize(), values)
    packed = pack(kept)
    assert torch.equal(packed.dequantize(), values)
    assert torch.equal(packed.unpack(torch.arange(40)).codes, kept.codes)
    for scale, kept in ((103, False), (104, True), (140, True), (141, False)):
        # d = 2^(scale - 128): 2^-25 is under float16's least; m = -12 d at 141 past its most
        assert (mxfp4_blocks(blocks[:1], torch.full_like(scales[:1], scale)) is not None) == kept


@needs_native
def test_the_native_product_on_mxfp4_blocks_is_the_reference_on_every_isa() -> None:
    blocks, scales = _blocks(37, 4, seed=1)
    weight = mxfp4_blocks(blocks, scales)
    assert weight is not None
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(2))
    expected = reference_linear(x, weight)
    packed = pack(weight).panels
    results = [cpu_native.linear_quantized(x, packed, 37, FP4, isa=isa)
               for isa in cpu_native.usable_isas()]  # fmt: skip
    for result in results:
        torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(result, results[0])


@pytest.mark.slow  # loads transformers
@needs_native
def test_a_served_mxfp4_gpt_oss_keeps_its_experts_in_their_blocks(tmp_path: Path) -> None:
    import transformers
    from conftest import fixed_length_requests
    from test_gpt_oss import _as_mxfp4, _gpt_oss
    from test_model_families import PROMPTS
    from test_quantized_checkpoints import _teacher_forced

    from turnstile.executor_svc.backends.block_experts import BlockExperts
    from turnstile.executor_svc.runner_config import RunnerConfig
    from turnstile.offline import OfflineEngine
    from turnstile.shared.protocol import SamplingParams
    from turnstile.shared.settings import build

    _gpt_oss(tmp_path / "dense")
    _as_mxfp4(tmp_path / "dense", tmp_path / "mxfp4")
    model = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "mxfp4",
                                                           dtype=torch.float32)  # fmt: skip
    engine = OfflineEngine(build(RunnerConfig, model=str(tmp_path / "mxfp4"), num_blocks=64))
    layers = engine.runner.model.layers
    assert engine.runner.quantized
    assert all(isinstance(layer.experts, BlockExperts) for layer in layers)
    assert {bits for layer in layers for _, bits in layer.experts.packed._tensors[0]} == {FP4}
    with torch.inference_mode():
        full = [model.eval().generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0]
                for ids in PROMPTS]  # fmt: skip
    requests = fixed_length_requests([ids.tolist() for ids in full],
                                     SamplingParams(prompt_logprobs=0), 1)  # fmt: skip
    results = engine.generate(requests)
    ours = torch.cat([torch.tensor(result.prompt_logprobs) for result in results])
    theirs = _teacher_forced(model, full)
    assert (ours - theirs).abs().mean() < 0.1 and (ours - theirs).abs().max() < 1.0
    alone = [engine.generate([request])[0] for request in requests]
    assert [r.prompt_logprobs for r in alone] == [r.prompt_logprobs for r in results]
