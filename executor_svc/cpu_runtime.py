"""Process settings that make the CPU executor fast."""

from __future__ import annotations

import ctypes
import math
import mmap
import os

import torch

from turnstile.kernels import cpu_native, native_build

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory() -> None:
    """glibc returns large freed blocks to the OS, so each step's big temporaries would
    page-fault again (docs/benchmarks.md, "Behind the code's reasons"). Keep them in the heap."""
    _mallopt(trim=2**31 - 1, mmap=2**30)


def return_freed_memory() -> None:
    """While a model loads: each buffer of a megabyte or more its own mapping, returned when
    freed, so that a tensor's unpacking transients do not stay in the heap between the packed
    weights (docs/benchmarks.md, session 52)."""
    _mallopt(trim=2**20, mmap=2**20)


def _mallopt(trim: int, mmap: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(_M_TRIM_THRESHOLD, trim)
    libc.mallopt(_M_MMAP_THRESHOLD, mmap)


def zero_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on fresh anonymous pages, which the kernel zeroes as each is first
    touched: a KV cache of gigabytes costs nothing at start (torch.zeros wrote this machine's
    1.6 GB in 2.2 s) and only the blocks ever used become resident."""
    count = math.prod(shape)
    pages = mmap.mmap(-1, count * dtype.itemsize)  # not the heap: its freed pages are not zero
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)


def return_loading_memory() -> None:
    """Loading unpacks each tensor before packing it; with `keep_freed_memory` glibc would keep
    those freed pages for good (twice a quantized model's size). Trim the heap once, loaded."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        return


def pin_rank(rank: int, size: int) -> None:
    """Give tensor-parallel rank `rank` of `size` its own share of this process's cores (and
    torch as many threads), so ranks on one CPU do not fight over cores."""
    if size == 1:
        return
    cores = sorted(os.sched_getaffinity(0))
    share = cores[rank * len(cores) // size : (rank + 1) * len(cores) // size]
    share = share or [cores[rank % len(cores)]]  # more ranks than cores: they share
    os.sched_setaffinity(0, share)
    torch.set_num_threads(len(share))


def native_bf16_matmul(device: torch.device) -> bool:
    """Whether torch multiplies bf16 in hardware here (CUDA, AVX512-BF16, AMX): on an AVX2-only
    CPU its bf16 matmul runs at 1-16 GFLOP/s against 70-90 in fp32."""
    return device.type == "cuda" or bool(native_build.cpu_flags() & {"avx512_bf16", "amx_bf16"})


def best_dtype(device: torch.device) -> str:
    """bfloat16 where the hardware multiplies it natively, or on a CPU where the native kernels
    stream bf16 weights and widen them to fp32 arithmetic (half the bytes a token reads, fp32
    activations and KV cache); float32 elsewhere."""
    if native_bf16_matmul(device) or cpu_native.multiplies(device, torch.bfloat16):
        return "bfloat16"
    return "float32"
