"""Configuration shared by the services, with the defaults a single-host CPU deployment wants."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Policy = Literal["fcfs", "priority"]
# Static batching, the baseline continuous batching is measured against: a new batch is admitted
# only once the previous one has completely finished. "padded" keeps a finished row computing
# (its tokens discarded) until its batch's longest is done, as Hugging Face `generate` and the
# static servers do; "compact" lets it leave, a stronger baseline on hardware whose step cost
# grows with the batch.
StaticBatching = Literal["padded", "compact"]


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    policy: Policy = "fcfs"
    enable_prefix_caching: bool = True
    static_batching: StaticBatching | None = None
    static_fill_timeout: float = 1.0  # seconds a static batch waits to fill

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.num_blocks <= 0:
            raise ValueError("block_size and num_blocks must be positive")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running decode gets its token each step only if the budget covers them all.
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {self.policy!r}")
        if self.static_batching not in (None, "padded", "compact"):
            raise ValueError(f"unknown static batching mode {self.static_batching!r}")

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)
