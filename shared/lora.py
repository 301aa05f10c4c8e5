"""LoRA adapters served beside the base model, as vLLM serves them (`--enable-lora
--lora-modules name=path`, and at run time `/v1/load_lora_adapter`): PEFT folders, read and
checked here without torch, so that `serve` (or the gateway, loading one) refuses an adapter it
would run wrongly, naming it. A request asks for one by its name as `model`; it travels as a
`LoraRef`: its folder and its files' digest, which keys the executor's copy and the prefix cache,
so an adapter whose files change is another adapter. The executor loads the weights
(`executor_svc/adapters.py`)."""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from turnstile.shared.model_info import ModelInfo
from turnstile.shared.protocol import LoraRef
from turnstile.shared.settings import setting

# The projections an adapter may adapt, by PEFT's module names, and where each lives.
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


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
        "adapters an executor keeps loaded: beyond them the least recently used one no running "
        "request needs is dropped, and read again when asked for (none: the number of "
        "--lora-modules, at least 1)",
    )
    allow_runtime_lora_updating: bool = setting(
        False,
        "serve /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING): a client may then have any folder the server can "
        "read loaded",
    )

    lora_resolver_cache_dir: str | None = setting(
        None,
        "a request naming an adapter not loaded finds it as this folder's sub-folder of that "
        "name, if its adapter_config.json names --model (vLLM's VLLM_LORA_RESOLVER_CACHE_DIR; "
        "needs --allow-runtime-lora-updating)",
    )

    @property
    def kept_loaded(self) -> int:
        return self.max_loras or max(len(self.lora_modules or ()), 1)


@dataclass(slots=True, frozen=True)
class Adapter:
    name: str
    path: Path
    digest: str  # of its config and weights files: the adapter's identity
    rank: int
    scaling: float  # lora_alpha / rank (/ sqrt(rank) with rsLoRA), folded into B at load
    tensors: dict[str, tuple[int, str, str]] = field(repr=False)  # key: (layer, module, A|B)

    @property
    def ref(self) -> LoraRef:
        """How a request names it on the wire."""
        return LoraRef(self.name, str(self.path), self.digest)


def adapters(config: LoraConfig, info: ModelInfo) -> list[Adapter]:
    """The adapters `config` names, each checked against the base model `info`; raises
    ValueError naming the flag, the adapter and what it holds that would run wrongly."""
    modules = config.lora_modules or []
    if not config.enable_lora:
        given = {"--lora-modules": modules, "--lora-resolver-cache-dir":
                 config.lora_resolver_cache_dir, "--allow-runtime-lora-updating":
                 config.allow_runtime_lora_updating}  # fmt: skip
        for flag in (flag for flag, value in given.items() if value):
            raise ValueError(f"{flag} needs --enable-lora")
        return []
    if info.encoder_only:
        raise ValueError(f"--enable-lora: {info.name} is an encoder; LoRA adapters run on decoders")
    folder = config.lora_resolver_cache_dir
    if folder is not None and not config.allow_runtime_lora_updating:
        raise ValueError("--lora-resolver-cache-dir needs --allow-runtime-lora-updating")
    if folder is not None and not Path(folder).is_dir():
        raise ValueError(f"--lora-resolver-cache-dir {folder}: not a folder")
    if config.max_loras is not None and config.max_loras < 1:
        raise ValueError(f"--max-loras {config.max_loras}: at least 1")
    found = []
    for spec in modules:
        name, path = _parse(spec)
        found.append(read_adapter(name, path, config.max_lora_rank, info, "--lora-modules "))
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


def read_adapter(name: str, path: Path, max_rank: int, info: ModelInfo, where: str = "") -> Adapter:
    """The PEFT folder `path` as the adapter `name`, checked against the base model `info`;
    raises ValueError naming `where` (a flag) and the adapter."""
    return parse_adapter(name, path, *read_files(name, path, where), max_rank, info, where)


def read_files(name: str, path: Path, where: str = "") -> tuple[bytes, bytes]:
    """An adapter folder's config and weights, read once: what is checked is what is loaded."""
    try:
        return (path / CONFIG_FILE).read_bytes(), (path / WEIGHTS_FILE).read_bytes()
    except OSError as exc:
        raise ValueError(f"{where}{name}: cannot read the PEFT adapter in {path} ({exc})") from None


def parse_adapter(
    name: str, path: Path, raw: bytes, weights: bytes, max_rank: int, info: ModelInfo,
    where: str = "",
) -> Adapter:  # fmt: skip
    """`read_adapter` on the files' bytes."""
    where = f"{where}{name}"
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{where}: {CONFIG_FILE} in {path} is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: {CONFIG_FILE} is not a JSON object")
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
    try:
        rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {CONFIG_FILE} has no integer rank r ({exc!r})") from None
    if not 0 < rank <= max_rank:
        raise ValueError(f"{where}: rank {rank} is over --max-lora-rank {max_rank}")
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    tensors = _check_tensors(weights, f"{where}: {path / WEIGHTS_FILE}", rank, info)
    hashed = hashlib.sha256(len(raw).to_bytes(8, "little") + raw + weights)
    return Adapter(name, path, hashed.hexdigest()[:32], rank, scaling, tensors)


def _check_tensors(
    weights: bytes, where: str, rank: int, info: ModelInfo
) -> dict[str, tuple[int, str, str]]:
    """Every tensor of the safetensors file, named and shaped as a LoRA of one of the base
    model's dense projections; read from its header."""
    try:
        (size,) = struct.unpack("<Q", weights[:8])
        header = json.loads(weights[8 : 8 + size])
        header.pop("__metadata__", None)
        entries = [(key, tuple(entry["shape"])) for key, entry in header.items()]
    except (ValueError, struct.error, AttributeError, KeyError, TypeError) as exc:
        raise ValueError(f"{where} is not a safetensors file ({exc!r})") from None
    shapes = module_shapes(info)
    found = {}
    for key, shape in entries:
        match = _KEY.fullmatch(key)
        layer, block, module, side = match.groups() if match else (0, "", "", "")
        where_key = f"{where}: tensor {key}"
        if module not in (ATTENTION if block == "self_attn" else MLP):
            raise ValueError(f"{where_key}: only {', '.join(ATTENTION + MLP)} are adapted")
        if int(layer) >= info.num_layers or (block == "mlp" and int(layer) in info.expert_layers):
            raise ValueError(f"{where_key}: the base model has no such dense layer")
        fan_in, fan_out = shapes[module]
        want = (rank, fan_in) if side == "A" else (fan_out, rank)
        if shape != want:
            raise ValueError(f"{where_key}: shape {list(shape)}, expected {list(want)}")
        found[key] = (int(layer), module, side)
    if not found:
        raise ValueError(f"{where} holds no LoRA weights")
    return found
