"""Attention and KV-cache kernels: Triton for CUDA (`triton_attention.py`, as torch ops in
`triton_ops.py`), native C for the CPU (`cpu_native.py`, `native_attention.py`), and the torch
reference (`reference.py`). Each offers `write_kv`, `paged_decode_attention` over a
`DecodePlan` and `paged_prefill_attention` over a `PrefillPlan`, with the same arguments."""
