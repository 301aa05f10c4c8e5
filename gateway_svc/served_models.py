"""The names a request may give as `model`: the base model's (`--served-model-name`, the first
reported) and each LoRA adapter's (`--lora-modules`, and those loaded at run time through
`/v1/load_lora_adapter`), which runs the base model with it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from turnstile.gateway_svc.errors import ApiError
from turnstile.shared.lora import Adapter
from turnstile.shared.protocol import LoraRef


class ServedModels:
    def __init__(
        self, names: list[str], adapters: list[Adapter], max_model_len: int,
        resolve: Callable[[str], Adapter | None] | None = None,
    ) -> None:  # fmt: skip
        self.names = names
        self.adapters = {adapter.name: adapter for adapter in adapters}
        self.max_model_len = max_model_len
        self.resolve = resolve  # an adapter not loaded, found by its name (`FolderResolver`)

    async def find(self, model: str | None) -> None:
        """Where a resolver is set, an adapter `model` names that is not loaded yet, loaded."""
        if self.resolve is None or model in (None, "", *self.names, *self.adapters):
            return
        adapter = await asyncio.to_thread(self.resolve, model)  # type: ignore[arg-type]
        if adapter is not None:
            self.adapters.setdefault(adapter.name, adapter)

    @property
    def base(self) -> str:
        return self.names[0]

    def lora(self, model: str | None) -> LoraRef | None:
        """The adapter `model` names, None for the base model or no name; else a 404."""
        if model in (None, "", *self.names):
            return None
        adapter = self.adapters.get(model)  # type: ignore[arg-type]
        if adapter is None:
            raise ApiError(
                404, f"the model {model!r} does not exist", "not_found_error", "model_not_found",
                param="model",
            )  # fmt: skip
        return adapter.ref

    def reported(self, model: str | None) -> str:
        """The name an answer gives: the adapter's where one was asked for (as vLLM)."""
        return model if model in self.adapters else self.base  # type: ignore[return-value]

    def add(self, adapter: Adapter, in_place: bool) -> None:
        """A LoRA adapter loaded at run time; `in_place`: it may replace one of its name."""
        if adapter.name in self.names:
            raise ApiError(
                400, f"the LoRA adapter {adapter.name!r} would take a served base model's name",
                param="lora_name",
            )  # fmt: skip
        if adapter.name in self.adapters and not in_place:
            raise ApiError(
                400, f"the LoRA adapter {adapter.name!r} is already loaded; load_inplace: true "
                "replaces it", param="lora_name",
            )  # fmt: skip
        self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> None:
        """A LoRA adapter no request may name any more (those under way finish with it)."""
        if self.adapters.pop(name, None) is None:
            raise ApiError(
                404, f"the LoRA adapter {name!r} is not loaded", "not_found_error",
                param="lora_name",
            )  # fmt: skip

    def cards(self) -> list[dict[str, Any]]:
        """`/v1/models`: each name, then each adapter with its base model as `parent`."""
        card = {"object": "model", "created": 0, "owned_by": "turnstile",
                "max_model_len": self.max_model_len}  # fmt: skip
        names = [card | {"id": name, "root": self.base, "parent": None} for name in self.names]
        return names + [
            card | {"id": name, "root": str(adapter.path), "parent": self.base}
            for name, adapter in self.adapters.items()
        ]

    def all_names(self) -> list[str]:
        return [*self.names, *self.adapters]
