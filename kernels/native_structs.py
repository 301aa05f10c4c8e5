"""The native kernels' structs as ctypes lays them out, field for field as the C declares
them (`kernels/native/*.c`)."""

from __future__ import annotations

import ctypes

_PTR, _LONG = ctypes.c_void_p, ctypes.c_long


class NativeWeight(ctypes.Structure):
    """decode_layer.c's `Weight`: a projection's packed weight and the bits of a value there;
    quantized parts in different formats chained (`rows` features here, then `next`'s); int8
    tiles with their scales a feature (`scales`); bf16 panels on AMX-BF16 tiles (`tiles`)."""


NativeWeight._fields_ = [
    ("data", _PTR), ("bits", _LONG), ("rows", _LONG), ("next", ctypes.POINTER(NativeWeight)),
    ("scales", _PTR), ("tiles", _LONG),
]  # fmt: skip


class Mixture(ctypes.Structure):
    """decode_mixture.c's `Mixture`: a decode layer's router and experts."""

    _fields_ = [
        *((name, _PTR) for name in ("router", "router_bias", "experts")),
        *((name, _LONG) for name in ("tiles", "count", "top_k", "normalize")),
        ("correction", _PTR),
        *((name, _LONG) for name in ("groups", "kept_groups")),
        ("scale", ctypes.c_float),
    ]


class DecodeLayer(ctypes.Structure):
    """decode_layer.c's `Layer`: a layer's weights, NULL where the model has none."""

    _fields_ = [
        ("input_norm", _PTR),
        ("qkv", ctypes.POINTER(NativeWeight)),
        *((name, _PTR) for name in ("qkv_bias", "qk_norm")),
        ("o_proj", ctypes.POINTER(NativeWeight)),
        *((name, _PTR) for name in ("o_bias", "sinks", "post_norm")),
        *((name, ctypes.POINTER(NativeWeight)) for name in ("gate_up", "down")),
        ("mixture", ctypes.POINTER(Mixture)),
        ("shared_gate", _PTR),
        ("shared_inner", _LONG),
    ]


class DecodeStep(ctypes.Structure):
    """decode_layer.c's `Step`: the shapes and per-step inputs every layer of a step shares."""

    _fields_ = [
        *((name, _LONG) for name in ("rows", "hidden", "intermediate", "heads", "kv_heads", "dim")),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("k_cache", _PTR),
        ("v_cache", _PTR),
        ("kv_format", _LONG),
        *((name, _PTR) for name in ("slots", "rotations", "block_tables")),
        ("width", _LONG),
        ("block_size", _LONG),
        ("seq_lens", _PTR),
        ("scratch", _PTR),
        ("window", _LONG),
        ("isa", _LONG),
        ("tiles", _LONG),
        ("adapters", _PTR),
    ]


class LoraPair(ctypes.Structure):
    """lora.c's `LoraPair`: an adapter's A [rank][in] and B transposed [rank][out], float32."""

    _fields_ = [("a", _PTR), ("bt", _PTR), ("rank", _LONG)]
