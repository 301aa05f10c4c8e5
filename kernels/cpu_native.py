"""The CPU's native kernels (`kernels/native/*.c`): built once per machine (`native_build.py`)
and called through ctypes.

They link the OpenMP runtime torch has already loaded (same soname), so both share one thread
pool. Where they cannot run (no AVX2 and FMA, no C compiler) `library()` is None and callers
keep torch's own ops.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import shutil
import subprocess
from collections.abc import Callable

import torch

from turnstile.kernels.native_build import build, cpu_flags, library_path
from turnstile.kernels.native_structs import DecodeLayer, DecodeStep, NativeWeight

log = logging.getLogger(__name__)

PANEL = 16  # output features per weight panel, as in gemm.c
PROFILE_LABEL = "native::linear"  # what `turnstile bench step` finds it by

_PTR, _LONG, _FLOAT = ctypes.c_void_p, ctypes.c_long, ctypes.c_float


_SIGNATURES = {
    "linear_f32": [_PTR] * 5 + [_LONG] * 3,
    "linear_bf16": [_PTR] * 5 + [_LONG] * 3,
    "linear_bf16_tiles": [_PTR] * 5 + [_LONG] * 3,
    "paged_decode_attention": [
        *[_PTR] * 3,
        _LONG,  # the caches' format
        _PTR,
        _LONG,
        _PTR,
        _PTR,
        *[_LONG] * 5,
        _FLOAT,
        _LONG,
        _FLOAT,
        _PTR,  # each head's sink, or NULL
        _LONG,  # the ISA, numbered as ISAS
        _LONG,  # a bf16 cache on AMX tiles
    ],
    "decode_layer": [_PTR, ctypes.POINTER(DecodeLayer), _PTR, ctypes.POINTER(DecodeStep)],
    "decode_layer_scratch": [_LONG] * 6,
    "round_kv": [_PTR, _PTR, _LONG, _LONG, _LONG],
    "argmax_rows": [_PTR, _LONG, _LONG, _PTR],
    "race_rows": [_PTR, _LONG, _LONG, _PTR, _PTR],
    "linear_quantized": [_PTR] * 5 + [_LONG] * 4 + [ctypes.c_int] * 2,
    "linear_weight": [_PTR] * 5 + [_LONG] * 4,
    "gated_int8_tiles": [_PTR] * 4 + [_LONG] * 3,
    "gated_bf16_tiles": [_PTR] * 3 + [_LONG] * 3,
    "expert_tiles": [_PTR, _PTR, _LONG, _LONG, _PTR, _PTR, _PTR],
    "quantized_experts": [_PTR, _PTR, _LONG, _LONG, _PTR, _PTR, _PTR, _LONG],
    "silu_and_multiply": [_PTR, _PTR, _LONG, _LONG],
    "rms_norm_rows": [_PTR, _PTR, _PTR, _LONG, _LONG, _FLOAT],
}
# What the functions that do not answer a status (0, or -1 where they could not allocate) answer.
_VOID = ("linear_f32", "linear_bf16", "round_kv", "argmax_rows", "race_rows",
         "silu_and_multiply", "rms_norm_rows")  # fmt: skip
_RESULTS = dict.fromkeys(_VOID) | {"decode_layer_scratch": _LONG}
# The quantized product's tiles, as simd.h numbers them: 256-bit without VNNI, 256-bit
# VNNI (AVX-VNNI, or AVX512-VL's encoding of it), 512-bit VNNI.
ISAS = ("avx2", "avx_vnni", "avx512_vnni")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernels, built if need be; None where they cannot run or be built here."""
    if not {"avx2", "fma", "f16c"} <= cpu_flags():
        log.warning("native CPU kernels unavailable: this CPU lacks AVX2, FMA or F16C")
        return None
    if not library_path().exists() and shutil.which("cc") is None:
        log.warning("native CPU kernels unavailable: no C compiler (cc) to build them")
        return None
    try:
        path = build()
    except subprocess.CalledProcessError as error:
        log.warning("native CPU kernels failed to build:\n%s", error.stderr)
        return None
    lib = ctypes.CDLL(str(path))
    for name, argtypes in _SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
    for name in _SIGNATURES:
        getattr(lib, name).restype = _RESULTS.get(name, ctypes.c_int)
    return lib


def multiplies(device: torch.device, weight_dtype: torch.dtype) -> bool:
    """Whether `linear` takes weights of this dtype on this device here."""
    native_dtype = weight_dtype in (torch.float32, torch.bfloat16)
    return device.type == "cpu" and native_dtype and library() is not None


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] (float32 or bfloat16) into panels of 16 output features, zero-padded to whole
    panels: the layout `linear` streams. A float32 panel is [in][16]; a bfloat16 one
    [in / 2][16][2], inputs k and k + 1 of an output side by side (the inputs padded to whole
    pairs): AMX-BF16's B tiles, which gemm.c widens into fp32 with a shift or a mask."""
    out_features, in_features = weight.shape
    panels = -(-out_features // PANEL)
    pairs = weight.dtype == torch.bfloat16
    inputs = in_features + (in_features % 2 if pairs else 0)
    padded = weight
    if (panels * PANEL, inputs) != weight.shape:
        padded = weight.new_zeros(panels * PANEL, inputs)
        padded[:out_features, :in_features] = weight
    if pairs:
        return padded.view(panels, PANEL, inputs // 2, 2).transpose(1, 2).contiguous()
    return padded.view(panels, PANEL, inputs).transpose(1, 2).contiguous()


def _product(
    kernel: Callable[..., int | None],
    x: torch.Tensor,
    weight: int,
    out_features: int,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    *extra: int,
) -> torch.Tensor:
    """Calls one of the `linear*` kernels (x, weight, y, bias, residual, M, N, K, *extra),
    `weight` the address of its panels (or of its `NativeWeight`)."""
    x = x.contiguous()
    if residual is not None:
        residual = residual.contiguous()  # bound here: a temporary would be freed before the call
    rows, in_features = x.shape
    out = x.new_empty(rows, out_features)
    with torch.profiler.record_function(PROFILE_LABEL):
        failed = kernel(
            x.data_ptr(),
            weight,
            out.data_ptr(),
            None if bias is None else bias.data_ptr(),
            None if residual is None else residual.data_ptr(),
            rows,
            out_features,
            in_features,
            *extra,
        )
    if failed:
        raise MemoryError("a native product could not allocate its buffers")
    return out


def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    tiles: bool = False,
) -> torch.Tensor:
    """`x @ weight.T (+ bias) (+ residual)` in float32, `packed` from `pack_weight`; `tiles`:
    a bf16 weight's on AMX-BF16 tiles, x rounded to bf16 (`bf16_tiles.c`; in features a
    multiple of 32)."""
    lib = library()
    assert lib is not None
    kernel = lib.linear_bf16 if packed.dtype == torch.bfloat16 else lib.linear_f32
    if tiles:
        assert packed.dtype == torch.bfloat16 and x.shape[1] % 32 == 0 and amx_tiles()
        kernel = lib.linear_bf16_tiles
    return _product(kernel, x, packed.data_ptr(), out_features, bias, residual)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`F.rms_norm` over the last dim of float32 `x` ([..., n]) by float32 `weight` [n], as
    the fused layers norm (`rms_norm.c`)."""
    lib = library()
    assert lib is not None
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.shape[-1]
    lib.rms_norm_rows(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // n, n, eps)
    return out


@functools.cache
def best_isa() -> str:
    """The widest of `ISAS` this CPU runs."""
    return usable_isas()[-1]


def _amx(features: set[str]) -> bool:
    """Whether the CPU has these AMX `features` and Linux lends the tiles' state here."""
    lib = library()
    return features <= cpu_flags() and lib is not None and bool(lib.amx_ready())


@functools.cache
def amx_int8() -> bool:
    """Whether projections can run on AMX-INT8 tiles here (int8_tiles.c)."""
    return _amx({"amx_tile", "amx_int8", "avx512f", "avx512bw", "avx512vl", "avx512dq"})


@functools.cache
def amx_tiles() -> bool:
    """Whether attention over a bf16 cache can run on AMX-BF16 tiles here (attention_tiles.c)."""
    return _amx({"amx_tile", "amx_bf16", "avx512_bf16", "avx512f", "avx512bw", "avx512vl",
                 "avx512vbmi"})  # fmt: skip


def usable_isas() -> tuple[str, ...]:
    """Every ISA of `ISAS` this CPU runs: AVX2, and the VNNI tiles where it has VNNI."""
    flags = cpu_flags()
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags
    return tuple(
        isa
        for isa, runs in zip(ISAS, (True, avx512 or "avx_vnni" in flags, avx512), strict=True)
        if runs
    )


def linear_quantized(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bits: int,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    isa: str | None = None,
) -> torch.Tensor:
    """`x @ weight.T (+ bias) (+ residual)`, `packed` from `quantized_weights.pack`, `x`
    quantized per block of 32 to int8 on the way (quantized.c); on `isa` (default the best)."""
    lib = library()
    assert lib is not None
    isa_index = ISAS.index(isa or best_isa())
    return _product(lib.linear_quantized, x, packed.data_ptr(), out_features, bias, residual,
                    out_features, bits, isa_index)  # fmt: skip


def linear_weight(
    x: torch.Tensor,
    weight: NativeWeight,
    out_features: int,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ weight.T (+ bias) (+ residual)` on any packed weight, its parts chained, on the best
    ISA: the product the fused decode layers run."""
    lib = library()
    assert lib is not None
    isa_index = ISAS.index(best_isa())
    address = ctypes.addressof(weight)
    return _product(lib.linear_weight, x, address, out_features, bias, residual, isa_index)
