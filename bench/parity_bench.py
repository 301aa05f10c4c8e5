"""`turnstile bench parity`: how many greedy tokens match Hugging Face transformers (fp32, each
prompt alone) when Turnstile runs the prompts together in float32 and in bfloat16, on the CPU or
(`turnstile bench gpu`) a GPU, both sides on the same device."""

from __future__ import annotations

import torch

from turnstile.bench import hf_baseline
from turnstile.executor_svc.runner_config import RunnerConfig
from turnstile.offline import OfflineEngine
from turnstile.shared.model_info import embedded_model_path, read_model_info
from turnstile.shared.protocol import AddRequest, pack_ids
from turnstile.shared.settings import build
from turnstile.shared.tokenizer import Tokenizer

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "woman who knew the names of every tree and every bird, and the children",
    "def fibonacci(n):",
    "Q: What is the boiling point of water at sea level?\nA:",
    "List three primary colors, then explain how to mix them:",
    "In 1969, the first humans landed on the Moon. The mission was called",
    "Translate to French: I would like a cup of coffee, please.",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
    "The quick brown fox jumps over the lazy dog. Write a short poem about a fox and a dog who "
    "become friends after a long winter, in the style of a nursery rhyme:",
    "Hi",
]


PAD = 2  # the embedded model's end of text


def prompt_ids(tokenizer: Tokenizer | None = None) -> list[list[int]]:
    """The prompts in `tokenizer`'s ids, the embedded model's by default."""
    if tokenizer is None:
        path = embedded_model_path()
        tokenizer = Tokenizer(path, read_model_info(path))
    return [tokenizer.encode(prompt) for prompt in PROMPTS]


def hf_greedy(
    prompts: list[list[int]], new_tokens: int, device: str = "cpu", batched: bool = False
) -> list[list[int]]:
    """HF's greedy tokens for each prompt alone, or (`batched`) for all of them in one
    left-padded `generate`: on the embedded model's 9 prompts the same 576 tokens in a third
    of the time (session 54), since each step reads the weights once for every prompt."""
    model = hf_baseline.load_model(embedded_model_path(), torch.float32).to(device)
    groups = [prompts] if batched else [[ids] for ids in prompts]
    outputs = []
    with torch.inference_mode():
        for group in groups:
            longest = max(map(len, group))
            padded = [[PAD] * (longest - len(ids)) + ids for ids in group]
            mask = [[0] * (longest - len(ids)) + [1] * len(ids) for ids in group]
            generated = model.generate(
                torch.tensor(padded, device=device),
                attention_mask=torch.tensor(mask, device=device),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=PAD,
            )
            outputs += generated[:, longest:].tolist()
    return outputs


def greedy_requests(prompts: list[list[int]], new_tokens: int) -> list[AddRequest]:
    return [
        AddRequest(req_id=i, prompt_ids=pack_ids(ids), max_tokens=new_tokens, ignore_eos=True)
        for i, ids in enumerate(prompts)
    ]


def agreement(new_tokens: int = 64, device: str = "cpu") -> dict[str, tuple[int, int, int]]:
    """Per dtype: (prompts identical to HF, tokens before the first divergence, tokens)."""
    prompts = prompt_ids()
    reference = hf_greedy(prompts, new_tokens, device)
    report = {}
    for dtype in ("float32", "bfloat16"):
        config = build(RunnerConfig, dtype=dtype, device=device, num_blocks=512)
        engine = OfflineEngine(config)
        results = engine.generate(greedy_requests(prompts, new_tokens))
        same_prefix = 0
        for ours, theirs in zip(results, reference, strict=True):
            same_prefix += next(
                (i for i, (a, b) in enumerate(zip(ours.token_ids, theirs, strict=True)) if a != b),
                new_tokens,
            )
        identical = sum(r.token_ids == t for r, t in zip(results, reference, strict=True))
        report[dtype] = (identical, same_prefix, new_tokens * len(prompts))
    return report
