"""A Hugging Face checkpoint's `quantization_config`: GPTQ and AWQ, the two vLLM serves on a CPU,
and fp8 (vLLM's own: e4m3 weights with a scale per tensor or per block), read and checked as
vLLM checks them; any other method, or a setting of these the executor does not compute,
refused at start by name."""

from __future__ import annotations

from typing import Any

from turnstile.shared.model_support import UnsupportedModel

METHODS = ("gptq", "awq", "fp8")
# vLLM's: GPTQ symmetric in 4 or 8 bits (its uint4b8 and uint8b128), AWQ in 4 with zero points.
GPTQ_BITS = (4, 8)
AWQ_BITS = (4,)


def checkpoint_quantization(config: dict[str, Any], source: str) -> dict[str, Any]:
    """`ModelInfo`'s quantization fields for config.json's `quantization_config` ({} where it
    has none): the method, the bits a weight and the inputs a scale covers (0: a whole row)."""
    quant = config.get("quantization_config")
    if not quant:
        return {}
    method = str(quant.get("quant_method", "")).lower()
    if method not in METHODS:
        _refuse(source, "quant_method", method,
                f"supported: {', '.join(METHODS)}; GGUF files' blocks too")  # fmt: skip
    if method == "fp8":
        return _fp8(quant, source)
    bits = quant.get("bits", quant.get("w_bit"))
    group = int(quant.get("group_size", quant.get("q_group_size", -1)))
    if group == 0 or group < -1:
        _refuse(source, "group_size", group, "a positive number of inputs, or -1 for a row")
    if method == "gptq":
        _check_gptq(quant, bits, source)
    else:
        _check_awq(quant, bits, source)
    return {"quantization": method, "weight_bits": int(bits), "weight_group": max(group, 0)}


def _fp8(quant: dict[str, Any], source: str) -> dict[str, Any]:
    """vLLM's fp8: `weight` in float8_e4m3fn times `weight_scale` (a tensor's) or, with
    `weight_block_size`, `weight_scale_inv` (a block's); both kinds of activation scheme, as the
    executor computes activations in its own dtype."""
    form = quant.get("fmt", "e4m3")
    if form != "e4m3":
        _refuse(source, "fmt", form, "fp8 weights in e4m3 only, as vLLM")
    block = quant.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) <= 0):
        _refuse(source, "weight_block_size", block, "two positive sizes: output and input")
    return {"quantization": "fp8", "weight_bits": 8, "weight_block": tuple(block or ())}


def _check_gptq(quant: dict[str, Any], bits: object, source: str) -> None:
    if bits not in GPTQ_BITS:
        _refuse(source, "bits", bits, "GPTQ in 4 or 8 bits")
    if not quant.get("sym", True):
        _refuse(source, "sym", False, "GPTQ's zero points: symmetric weights only, as vLLM")
    form = quant.get("checkpoint_format", "gptq")
    if form != "gptq":
        _refuse(source, "checkpoint_format", form, "the gptq format only")
    if quant.get("dynamic"):
        _refuse(source, "dynamic", "{...}", "per-module settings are not implemented")


def _check_awq(quant: dict[str, Any], bits: object, source: str) -> None:
    if bits not in AWQ_BITS:
        _refuse(source, "bits", bits, "AWQ in 4 bits")
    if not quant.get("zero_point", True):
        _refuse(source, "zero_point", False, "AWQ with zero points only, as vLLM")
    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm":
        _refuse(source, "version", version, "AWQ's GEMM layout only")


def _refuse(source: str, field: str, value: object, why: str) -> None:
    raise UnsupportedModel(
        f"{source}: quantization_config.{field} = {value!r} is not supported ({why})"
    )
