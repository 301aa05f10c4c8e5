"""vLLM's runtime LoRA endpoints, served with `--allow-runtime-lora-updating` (vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING). `POST /v1/load_lora_adapter` checks a PEFT folder against the
base model as `serve` checks `--lora-modules`, and gives it its name; `POST
/v1/unload_lora_adapter` forgets the name (requests under way finish with it). The executor reads
an adapter's weights when a request first names it. Names are this gateway process's, as vLLM's
are its API server's. With `--lora-resolver-cache-dir`, a request naming an adapter not loaded
finds it as that folder's sub-folder of the name (`FolderResolver`, vLLM's filesystem
resolver)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import msgspec
from aiohttp import web

from turnstile.gateway_svc.errors import ApiError
from turnstile.gateway_svc.openai_api import parse_body
from turnstile.gateway_svc.request_types import refuse_unsupported, refused
from turnstile.gateway_svc.served_models import ServedModels
from turnstile.shared.lora import CONFIG_FILE, Adapter, read_adapter
from turnstile.shared.model_info import ModelInfo

log = logging.getLogger(__name__)


class LoadLoraAdapter(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace an adapter of the same name
    is_3d_lora_weight: refused("false") = False  # vLLM's MoE experts' adapters


class UnloadLoraAdapter(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    lora_name: str
    lora_int_id: refused("null") = None  # vLLM's numbering, which it does not read either


class LoraUpdates:
    def __init__(self, served: ServedModels, info: ModelInfo, max_rank: int) -> None:
        self.served, self.info, self.max_rank = served, info, max_rank
        self._lock = asyncio.Lock()  # one change at a time: a check, then the name

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)

    async def load(self, http: web.Request) -> web.Response:
        request = parse_body(await http.read(), LoadLoraAdapter)
        refuse_unsupported(request, {"is_3d_lora_weight": (False,)})
        if not request.lora_name or not request.lora_path:
            raise ApiError(400, "both lora_name and lora_path must be given",
                           param="lora_name" if not request.lora_name else "lora_path")  # fmt: skip
        path = Path(request.lora_path)
        if not path.is_dir():
            raise ApiError(404, f"no LoRA adapter folder at {path}", "not_found_error",
                           param="lora_path")  # fmt: skip
        async with self._lock:
            try:
                adapter = await asyncio.to_thread(
                    read_adapter, request.lora_name, path, self.max_rank, self.info,
                    "the LoRA adapter ",
                )  # fmt: skip
            except ValueError as exc:
                raise ApiError(400, str(exc), param="lora_path") from None
            self.served.add(adapter, request.load_inplace)
        log.info("loaded the LoRA adapter %s from %s", adapter.name, path)
        return web.Response(text=f"Success: LoRA adapter '{adapter.name}' added successfully.")

    async def unload(self, http: web.Request) -> web.Response:
        request = parse_body(await http.read(), UnloadLoraAdapter)
        refuse_unsupported(request, {"lora_int_id": (None,)})
        async with self._lock:
            self.served.remove(request.lora_name)
        log.info("unloaded the LoRA adapter %s", request.lora_name)
        return web.Response(
            text=f"Success: LoRA adapter '{request.lora_name}' removed successfully."
        )


class FolderResolver:
    """vLLM's filesystem resolver: the adapter `name` is `folder / name`, if that holds a PEFT
    LoRA whose `base_model_name_or_path` is one of `base` (the --model given, the served
    names); else None. One that is there and cannot be served is a 400 naming `model`."""

    def __init__(self, folder: Path, base: set[str], info: ModelInfo, max_rank: int) -> None:
        self.folder, self.base, self.info, self.max_rank = folder, base, info, max_rank

    def __call__(self, name: str) -> Adapter | None:
        if Path(name).name != name or name in (".", ".."):  # one folder below, no further
            return None
        path = self.folder / name
        try:
            config = json.loads((path / CONFIG_FILE).read_bytes())
            found = config.get("peft_type") == "LORA"
            found &= config.get("base_model_name_or_path") in self.base
        except (OSError, ValueError, AttributeError):
            return None
        if not found:
            return None
        try:
            adapter = read_adapter(name, path, self.max_rank, self.info, "the LoRA adapter ")
        except ValueError as exc:
            raise ApiError(400, str(exc), param="model") from None
        log.info("found the LoRA adapter %s in %s", name, path)
        return adapter
