"""Tensor parallelism over torch.distributed (gloo on the CPU, NCCL on CUDA), as vLLM and SGLang
split a Llama: query and KV heads, and the MLP's (each expert's) intermediate dims, divided among
the ranks (column-parallel qkv and gate-up, row-parallel o and down, whose partial sums one
all-reduce adds up), the embedding and lm_head divided by vocabulary. Where the ranks outnumber
the KV heads, each KV head is kept by several ranks (vLLM's replication).

Every rank samples the same tokens from the same full logits, with the same seeds (each row's
noise comes from its seed; the seeds of unseeded rows from a generator every rank seeds alike),
so sampling runs identically everywhere and nothing but the logits is gathered.
"""

from __future__ import annotations

import datetime
import secrets
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from turnstile.shared.model_info import ModelInfo
from turnstile.shared.sharding import check_sharding


@dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    @property
    def first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, in place."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def gather_vocab(self, x: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Every rank's slice of the last (vocabulary) dim, side by side, trimmed to the
        vocabulary (the slices are padded to one width)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)[..., :vocab_size]

    def shared_seed(self, device: torch.device) -> int:
        """A random seed, the same on every rank (rank 0's)."""
        seed = secrets.randbits(62)
        if self.size > 1:
            shared = torch.tensor([seed], device=device)
            dist.broadcast(shared, 0)
            seed = int(shared)
        return seed

    def fewest(self, count: int, device: torch.device) -> int:
        """The smallest of every rank's `count` (each sizes its KV cache from its own memory)."""
        if self.size == 1:
            return count
        least = torch.tensor([count], device=device)
        dist.all_reduce(least, op=dist.ReduceOp.MIN)
        return int(least)

    # Shapes of this rank's share.

    def heads(self, info: ModelInfo) -> tuple[slice, slice]:
        """The query heads and the KV heads this rank computes."""
        per_rank = info.num_heads // self.size
        queries = slice(self.rank * per_rank, (self.rank + 1) * per_rank)
        if self.size <= info.num_kv_heads:
            kv = info.num_kv_heads // self.size
            return queries, slice(self.rank * kv, (self.rank + 1) * kv)
        head = self.rank * info.num_kv_heads // self.size  # replicated
        return queries, slice(head, head + 1)

    def vocab(self, vocab_size: int) -> slice:
        width = -(-vocab_size // self.size)
        return slice(self.rank * width, (self.rank + 1) * width)

    def padded_vocab(self, weight: Any, vocab_size: int) -> Any:
        """This rank's rows of a vocabulary-sized weight, padded with zero rows to the common
        width; a quantized weight as it is (those are not split across ranks)."""
        share = self.vocab(vocab_size)
        width = share.stop - share.start
        if not isinstance(weight, torch.Tensor) or weight.shape[0] == width:
            return weight
        return torch.cat((weight, weight.new_zeros(width - weight.shape[0], weight.shape[1])))

    def intermediate(self, size: int) -> slice:
        width = size // self.size
        return slice(self.rank * width, (self.rank + 1) * width)

    def check(self, info: ModelInfo) -> None:
        """Refuse, by name, a model this many ranks cannot split evenly."""
        check_sharding(info, self.size)


def broke_group(error: BaseException) -> bool:
    """Whether `error` is a collective failing (a rank died or stopped answering): torch's own
    error type, or gloo's and NCCL's runtime errors."""
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and any(
        mark in str(error) for mark in ("gloo/transport", "NCCL", "ProcessGroup")
    )


SINGLE = TensorParallel()  # no tensor parallelism: the whole model on one executor


def join_group(
    rank: int, size: int, init_method: str, device: torch.device, timeout_s: float
) -> TensorParallel:
    """Join the ranks' process group; a collective that waits longer than `timeout_s` fails
    (a rank that died), so no rank hangs forever."""
    if size == 1:
        return SINGLE
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return TensorParallel(rank, size)
