"""Greedy and random token choice on the CPU (`kernels/native/argmax.c`, `race.c`)."""

from __future__ import annotations

import torch

from turnstile.kernels.cpu_native import library


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` for [rows, vocab] logits, the same indices (the first largest;
    the first NaN), natively for float32 on this CPU."""
    lib = library() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if lib is None or logits.dim() != 2:
        return logits.argmax(dim=-1)
    logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr())
    return out


def race(probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """`sampler.hashed_race` for float32 [rows, vocab] probabilities on this CPU: the same
    noise, a log taken only for the tokens that can still win."""
    lib = library()
    assert lib is not None and probs.device.type == "cpu" and probs.dtype == torch.float32
    probs, seeds = probs.contiguous(), seeds.to(torch.int64).contiguous()
    out = torch.empty(probs.shape[0], dtype=torch.int64)
    lib.race_rows(probs.data_ptr(), probs.shape[0], probs.shape[1], seeds.data_ptr(),
                  out.data_ptr())  # fmt: skip
    return out
