"""Attention and KV-cache kernels: Triton for CUDA, the torch reference for the CPU.

Both modules offer the same functions: `write_kv`, `plan_decode` (once a step) with
`paged_decode_attention` (every layer), and `paged_prefill_attention`.
"""

from __future__ import annotations

from types import ModuleType


def attention_backend(name: str, device_type: str) -> ModuleType:
    """ "auto" picks Triton on CUDA and the torch reference elsewhere; "triton" on the CPU
    needs TRITON_INTERPRET=1 (slow, for tests)."""
    if name == "auto":
        name = "triton" if device_type == "cuda" else "torch"
    if name == "triton":
        from kernels import triton_attention

        return triton_attention
    if name == "torch":
        from kernels import reference

        return reference
    raise ValueError(f"unknown attention backend {name!r}")
