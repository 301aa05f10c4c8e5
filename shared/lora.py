"""LoRA adapters served beside the base model, as vLLM serves them (`--enable-lora
--lora-modules name=path`): PEFT folders, read and checked here without torch, so that `serve`
refuses an adapter it would run wrongly, naming it, before any service starts. A request asks for
one by its name as `model`; it travels as its slot (1, 2, ... in the flag's order; 0: the base
model). The executor loads the weights (`executor_svc/model/lora.py`)."""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from turnstile.shared.model_info import ModelInfo
from turnstile.shared.settings import setting

# The projections an adapter may adapt, by PEFT's module names, and where each lives.
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(slots=True, frozen=True)
class LoraConfig:
    """LoRA adapters served beside the base model (vLLM's flags)"""

    enable_lora: bool = setting(False, "serve the --lora-modules adapters")
    lora_modules: list[str] | None = setting(
        None,
        'NAME=PATH of a PEFT LoRA folder (or vLLM\'s JSON form, {"name": ..., "path": ...}); '
        "a request names its adapter as `model`",
    )
    max_lora_rank: int = setting(16, "the largest rank an adapter may have")
    max_loras: int | None = setting(
        None,
        "adapters held at once; every one of --lora-modules stays loaded, so at least their "
        "number (none: their number)",
    )


@dataclass(slots=True, frozen=True)
class Adapter:
    name: str
    path: Path
    slot: int  # on the wire (`AddRequest.lora`): 1, 2, ... as the flag lists them
    rank: int
    scaling: float  # lora_alpha / rank (/ sqrt(rank) with rsLoRA), folded into B at load
    tensors: dict[str, tuple[int, str, str]] = field(repr=False)  # key: (layer, module, A|B)


def adapters(config: LoraConfig, info: ModelInfo, tensor_parallel_size: int = 1) -> list[Adapter]:
    """The adapters `config` names, each checked against the base model `info`; raises
    ValueError naming the flag, the adapter and what it holds that would run wrongly."""
    modules = config.lora_modules or []
    if not config.enable_lora:
        if modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return []
    if tensor_parallel_size > 1:
        raise ValueError("--enable-lora runs with --tensor-parallel-size 1 only")
    if config.max_loras is not None and config.max_loras < len(modules):
        raise ValueError(
            f"--max-loras {config.max_loras}: all {len(modules)} --lora-modules stay loaded"
        )
    found = [_read(spec, slot, config.max_lora_rank, info) for slot, spec in
             enumerate(modules, start=1)]  # fmt: skip
    names = [a.name for a in found]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules: a name given twice ({names})")
    return found


def module_shapes(info: ModelInfo) -> dict[str, tuple[int, int]]:
    """Each adaptable module's (in, out) features in a model of `info`'s shape."""
    q, kv = info.num_heads * info.head_dim, info.num_kv_heads * info.head_dim
    h, inner = info.hidden_size, info.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inner), "up_proj": (h, inner), "down_proj": (inner, h)}  # fmt: skip


def _parse(spec: str) -> tuple[str, Path]:
    if spec.lstrip().startswith("{"):
        given = json.loads(spec)
        if not isinstance(given, dict) or not {"name", "path"} <= given.keys():
            raise ValueError(f"--lora-modules {spec}: the JSON form needs name and path")
        return str(given["name"]), Path(given["path"])
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {spec}: expected NAME=PATH")
    return name, Path(path)


def _read(spec: str, slot: int, max_rank: int, info: ModelInfo) -> Adapter:
    name, path = _parse(spec)
    where = f"--lora-modules {name}"
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where}: no PEFT adapter_config.json in {path} ({exc})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {config['peft_type']}, not LORA")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") != "none",
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
    }
    for key, present in unsupported.items():
        if present:
            raise ValueError(f"{where}: {key} {config[key]!r} is not supported")
    rank = int(config["r"])
    if not 0 < rank <= max_rank:
        raise ValueError(f"{where}: rank {rank} is over --max-lora-rank {max_rank}")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    tensors = _check_tensors(path / WEIGHTS_FILE, where, rank, info)
    return Adapter(name, path, slot, rank, scaling, tensors)


def _check_tensors(
    file: Path, where: str, rank: int, info: ModelInfo
) -> dict[str, tuple[int, str, str]]:
    """Every tensor of the file, named and shaped as a LoRA of one of the base model's dense
    projections; read from the safetensors header alone."""
    try:
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise ValueError(f"{where}: cannot read {file} ({exc})") from None
    header.pop("__metadata__", None)
    shapes = module_shapes(info)
    found = {}
    for key, entry in header.items():
        match = _KEY.fullmatch(key)
        layer, block, module, side = match.groups() if match else (0, "", "", "")
        where_key = f"{where}: tensor {key}"
        if module not in (ATTENTION if block == "self_attn" else MLP):
            raise ValueError(f"{where_key}: only {', '.join(ATTENTION + MLP)} are adapted")
        if int(layer) >= info.num_layers or (block == "mlp" and int(layer) in info.expert_layers):
            raise ValueError(f"{where_key}: the base model has no such dense layer")
        shape = tuple(entry["shape"])
        fan_in, fan_out = shapes[module]
        want = (rank, fan_in) if side == "A" else (fan_out, rank)
        if shape != want:
            raise ValueError(f"{where_key}: shape {list(shape)}, expected {list(want)}")
        found[key] = (int(layer), module, side)
    if not found:
        raise ValueError(f"{where}: {file} holds no LoRA weights")
    return found
