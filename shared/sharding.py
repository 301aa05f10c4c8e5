"""Which models a number of tensor-parallel ranks can split evenly: checked by `serve` before any
service starts, and by each executor rank (`executor_svc/tensor_parallel.py`)."""

from __future__ import annotations

from turnstile.shared.model_info import ModelInfo


class ShardingError(ValueError):
    """A model that cannot be split this many ways; raised at start, naming the shape."""


def check_sharding(info: ModelInfo, size: int) -> None:
    """Refuse, by name, a model `size` ranks cannot split evenly."""
    if info.encoder_only and size > 1:
        raise ShardingError(f"--tensor-parallel-size {size}: {info.name} is an encoder, which "
                            "runs on one rank")  # fmt: skip
    if info.qk_norm == "all" and size > 1:  # each rank would norm over its own heads only
        raise ShardingError(f"--tensor-parallel-size {size}: q and k normed across all their "
                            "heads (OLMo 2) are not split")  # fmt: skip
    if info.num_heads % size:
        raise ShardingError(
            f"--tensor-parallel-size {size} does not divide the {info.num_heads} query heads"
        )
    kv = info.num_kv_heads
    if (size <= kv and kv % size) or (size > kv and size % kv):
        raise ShardingError(
            f"--tensor-parallel-size {size} and the {kv} KV heads: one must divide the other"
        )
    for width, what in ((info.intermediate_size, "MLP's"),
                        (info.expert_intermediate_size, "experts'"),
                        (info.shared_expert_size, "shared experts'")):  # fmt: skip
        if width % size:
            raise ShardingError(
                f"--tensor-parallel-size {size} does not divide the {what} {width} "
                "intermediate dims"
            )
