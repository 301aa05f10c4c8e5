"""Compile every Triton kernel ahead of time for NVIDIA targets, with no GPU present:
`python -m turnstile.kernels.compile_check 90 80` catches code that only the interpreter accepts.
Must run without TRITON_INTERPRET (the interpreter replaces the kernels)."""

from __future__ import annotations

import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from turnstile.kernels import triton_attention as kernels

_ATTENTION_SCALARS = {
    "scale": "fp32",
    "window": "i32",
    **{
        name: "i32"
        for name in (
            "stride_q_token", "stride_q_head", "stride_o_token", "stride_o_head",
            "stride_table", "stride_c_block", "stride_c_slot", "stride_c_head",
        )
    },
}  # fmt: skip


def _sources(dtype: str) -> dict[str, ASTSource]:
    data = f"*{dtype}"
    # Gemma 2's soft cap and gpt-oss's sinks in the bf16 builds (their dtype), none in the fp32
    # ones: both branches.
    shape = {"GROUP": 3, "BLOCK_SIZE": 16, "HEAD_DIM": 64, "DIM_PAD": 64,
             "SOFTCAP": 50.0 if dtype == "bf16" else 0.0, "SINKS": dtype == "bf16"}  # fmt: skip
    attention = {"out": data, "query": data, "k_cache": data, "v_cache": data, "sinks": "*fp32"}
    tables = {"block_tables": "*i64", "seq_lens": "*i64"}
    return {
        "write_kv": ASTSource(
            kernels.write_kv_kernel,
            {
                "key": data, "value": data, "k_cache": data, "v_cache": data,
                "slot_mapping": "*i64", "stride_key": "i32", "stride_value": "i32",
                "ROW": "constexpr", "ROW_PAD": "constexpr",
            },
            {"ROW": 192, "ROW_PAD": 256},
        ),
        "paged_decode": ASTSource(
            kernels.paged_decode_kernel,
            {**attention, **tables, **_ATTENTION_SCALARS, **dict.fromkeys(shape, "constexpr")},
            shape,
        ),
        "paged_prefill": ASTSource(
            kernels.paged_prefill_kernel,
            {
                **attention, **tables, "query_start_loc": "*i64", **_ATTENTION_SCALARS,
                **dict.fromkeys([*shape, "BLOCK_M", "TENSOR_CORES"], "constexpr"),
            },
            {**shape, "BLOCK_M": 16, "TENSOR_CORES": dtype != "fp32"},
        ),
    }  # fmt: skip


def compile_all(capability: int) -> dict[str, int]:
    """Cubin size of each kernel and cache dtype, compiled for sm_<capability>."""
    sizes = {}
    for dtype in ("fp32", "bf16"):
        for name, source in _sources(dtype).items():
            compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32))
            sizes[f"{name}[{dtype}]"] = len(compiled.asm["cubin"])
    return sizes


if __name__ == "__main__":
    print(json.dumps({cap: compile_all(int(cap)) for cap in sys.argv[1:] or ["90", "80"]}))
