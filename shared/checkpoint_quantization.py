"""A Hugging Face checkpoint's `quantization_config`: GPTQ and AWQ, the two vLLM serves on a CPU,
fp8 (vLLM's own: e4m3 weights with a scale per tensor or per block), compressed-tensors
(llm-compressor's: int weights packed or in int8, fp8 weights), bitsandbytes (4 bits, as
transformers saves it) and MXFP4 (gpt-oss's experts), read and checked as vLLM checks them; any
other method, or a setting of these the executor does not compute, refused at start by name.
Activations are computed as the executor computes them (its dtype, or its own int8 products
where weights stay quantized): a checkpoint's activation scheme is not read."""

from __future__ import annotations

from typing import Any

from turnstile.shared.model_support import UnsupportedModel

METHODS = ("gptq", "awq", "fp8", "compressed-tensors", "bitsandbytes", "mxfp4")
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
    if method == "compressed-tensors":
        return compressed_tensors(quant, source)
    if method == "bitsandbytes":
        return _bitsandbytes(quant, source)
    if method == "mxfp4":  # gpt-oss's experts, as OpenAI ships them; dequantized at load
        if config.get("model_type") != "gpt_oss":
            _refuse(source, "quant_method", method, "MXFP4 experts of gpt-oss only")
        return {"quantization": "mxfp4", "weight_bits": 4, "weight_type": "mxfp4"}
    bits = quant.get("bits", quant.get("w_bit"))
    group = int(quant.get("group_size", quant.get("q_group_size", -1)))
    if group == 0 or group < -1:
        _refuse(source, "group_size", group, "a positive number of inputs, or -1 for a row")
    if method == "gptq":
        _check_gptq(quant, bits, source)
    else:
        _check_awq(quant, bits, source)
    return {"quantization": method, "weight_bits": int(bits), "weight_group": max(group, 0),
            "weight_type": "int"}  # fmt: skip


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
    return {"quantization": "fp8", "weight_bits": 8, "weight_block": tuple(block or ()),
            "weight_type": "float"}  # fmt: skip


# llm-compressor's formats: int codes packed into int32 or one an int8, fp8 codes one a byte.
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
CT_STRATEGIES = {"int": ("group", "channel", "tensor"), "float": ("tensor", "channel", "block")}


def compressed_tensors(quant: dict[str, Any], source: str) -> dict[str, Any]:
    """Every config group's weights alike (which modules a group targets is read from the
    tensors the checkpoint holds): int in 4 or 8 bits, with or without zero points, a scale a
    group (act order too), a row or a tensor; or fp8 (e4m3) with a scale a tensor, a row or a
    block. Sparse, rotated (`transform_config`) or fp8-KV checkpoints are refused."""
    status = quant.get("quantization_status", "compressed")
    if status != "compressed":
        _refuse(source, "quantization_status", status, "compressed checkpoints only")
    for field in ("kv_cache_scheme", "transform_config"):
        if quant.get(field):
            _refuse(source, field, "{...}", "not implemented")
    sparsity = (quant.get("sparsity_config") or {}).get("format", "dense")
    if sparsity != "dense":
        _refuse(source, "sparsity_config.format", sparsity, "dense weights only")
    groups = quant.get("config_groups") or {}
    if not groups:
        _refuse(source, "config_groups", groups, "at least one group of quantized weights")
    schemes = {
        _ct_scheme(group, quant.get("format"), f"config_groups.{name}", source)
        for name, group in groups.items()
    }
    if len(schemes) > 1:
        _refuse(source, "config_groups", "{...}", "one weights scheme for every group")
    bits, kind, group, block = schemes.pop()
    return {"quantization": "compressed-tensors", "weight_bits": bits, "weight_type": kind,
            "weight_group": group, "weight_block": block}  # fmt: skip


def _ct_scheme(
    group: dict[str, Any], default_format: object, field: str, source: str
) -> tuple[int, str, int, tuple[int, ...]]:
    form = group.get("format") or default_format
    if form not in CT_FORMATS:
        _refuse(source, f"{field}.format", form, f"supported: {', '.join(CT_FORMATS)}")
    if group.get("output_activations"):
        _refuse(source, f"{field}.output_activations", "{...}", "not implemented")
    inputs = group.get("input_activations") or {}
    if inputs and inputs.get("num_bits") != 8:
        _refuse(source, f"{field}.input_activations.num_bits", inputs.get("num_bits"),
                "activations of 8 bits (computed as the executor computes them)")  # fmt: skip
    weights = group.get("weights") or {}
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    field += ".weights"
    if kind not in CT_STRATEGIES or (kind == "float") != (form == "float-quantized"):
        _refuse(source, f"{field}.type", kind, f"int weights, or float in float-quantized ({form})")
    if bits not in ((4, 8) if kind == "int" else (8,)):
        _refuse(source, f"{field}.num_bits", bits, "int weights in 4 or 8 bits, float in 8")
    if strategy not in CT_STRATEGIES[kind]:
        _refuse(source, f"{field}.strategy", strategy, f"{kind}: {', '.join(CT_STRATEGIES[kind])}")
    if weights.get("dynamic"):
        _refuse(source, f"{field}.dynamic", True, "weights with stored scales")
    if kind == "float" and not weights.get("symmetric", True):
        _refuse(source, f"{field}.symmetric", False, "fp8 weights without zero points")
    size = int(weights.get("group_size") or 0) if strategy == "group" else 0
    block = tuple(weights.get("block_structure") or ()) if strategy == "block" else ()
    if strategy == "group" and size <= 0:
        _refuse(source, f"{field}.group_size", size, "a positive number of inputs")
    if strategy == "block" and (len(block) != 2 or min(block) <= 0):
        _refuse(source, f"{field}.block_structure", block, "two positive sizes")
    return bits, kind, size, block


def _bitsandbytes(quant: dict[str, Any], source: str) -> dict[str, Any]:
    """transformers' BitsAndBytesConfig in 4 bits (NF4 or FP4, double quantization or not),
    bytes holding the codes; served dequantized."""
    if quant.get("load_in_8bit") or quant.get("_load_in_8bit"):
        _refuse(source, "load_in_8bit", True, "bitsandbytes in 4 bits only (LLM.int8 is not)")
    kind = quant.get("bnb_4bit_quant_type", "fp4")
    if kind not in ("nf4", "fp4"):
        _refuse(source, "bnb_4bit_quant_type", kind, "nf4 or fp4")
    storage = quant.get("bnb_4bit_quant_storage", "uint8")
    if storage != "uint8":
        _refuse(source, "bnb_4bit_quant_storage", storage, "codes stored in bytes (uint8)")
    return {"quantization": "bitsandbytes", "weight_bits": 4, "weight_type": kind}


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
