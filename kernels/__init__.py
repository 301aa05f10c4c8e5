"""Attention and KV-cache kernels: Triton for CUDA; on the CPU the native kernels where they
build, else the torch reference.

All three modules offer the same functions: `write_kv`, `plan_decode` (once a step) with
`paged_decode_attention` (every layer), and `paged_prefill_attention`.
"""

from __future__ import annotations

from types import ModuleType

import torch


def attention_backend(
    name: str, device_type: str, dtype: torch.dtype, head_dim: int = 64
) -> ModuleType:
    """ "auto" picks Triton on CUDA, and on the CPU the native kernels where they build (for a
    float32 cache and heads of whole AVX vectors), else the torch reference; "triton" on the
    CPU needs TRITON_INTERPRET=1 (slow, for tests)."""
    if name == "auto" and device_type == "cuda":
        name = "triton"
    elif name == "auto":
        from kernels import cpu_native

        native = dtype == torch.float32 and head_dim % 8 == 0
        name = "native" if native and cpu_native.library() is not None else "torch"
    if name == "triton":
        from kernels import triton_attention

        return triton_attention
    if name == "native":
        from kernels import native_attention

        return native_attention
    if name == "torch":
        from kernels import reference

        return reference
    raise ValueError(f"unknown attention backend {name!r}")
