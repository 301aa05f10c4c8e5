"""The LoRA adapters an executor holds. A request names its adapter as a `LoraRef`; the first
time one is named, its folder is read, checked to hold the files the gateway checked (their
digest), and its weights get a slot of `LoraWeights`. Beyond `--max-loras`, the least recently
named adapter that no row runs is dropped, and read again when named again. An adapter that
cannot be loaded refuses its request: the row computes on the base model for the step it joined
in, and the scheduler drops its tokens and its blocks."""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

import numpy as np

from turnstile.executor_svc.model.lora import LoraWeights
from turnstile.shared.lora import LoraConfig, parse_adapter, read_files
from turnstile.shared.model_info import ModelInfo
from turnstile.shared.protocol import LoraRef, NewRequest

log = logging.getLogger(__name__)


class Adapters:
    def __init__(self, config: LoraConfig, info: ModelInfo, weights: LoraWeights | None) -> None:
        self.config, self.info, self.weights = config, info, weights
        self.slots: OrderedDict[str, int] = OrderedDict()  # digest -> slot, least recent first
        self._refused: list[tuple[int, str, str]] = []

    def preload(self, refs: list[LoraRef]) -> None:
        """`--lora-modules`, as many as stay loaded; raises ValueError for one that fails."""
        for ref in refs[: self.config.kept_loaded]:
            self._load(ref, set())

    def slots_for(self, new: list[NewRequest], in_use: np.ndarray) -> dict[int, int]:
        """The slot of each joining request's adapter, by request id, loading those not held;
        `in_use`: the slots of the rows already running, which stay loaded."""
        found: dict[int, int] = {}
        busy = set(in_use.tolist())
        for request in new:
            if request.lora is None:
                continue
            slot = self.slots.get(request.lora.digest)
            if slot is not None:
                self.slots.move_to_end(request.lora.digest)
            else:
                try:
                    slot = self._load(request.lora, busy)
                except ValueError as exc:
                    log.warning("refused request %d: %s", request.req_id, exc)
                    self._refused.append((request.req_id, "adapter", str(exc)))
                    continue
            found[request.req_id] = slot
            busy.add(slot)
        return found

    def take_refused(self) -> list[tuple[int, str, str]]:
        """(req_id, "adapter", why) for the requests whose adapter could not be loaded."""
        refused, self._refused = self._refused, []
        return refused

    def _load(self, ref: LoraRef, busy: set[int]) -> int:
        if self.weights is None:
            raise ValueError(f"the LoRA adapter {ref.name!r}: this executor runs none")
        path = Path(ref.path)
        config, raw = read_files(ref.name, path, "the LoRA adapter ")
        adapter = parse_adapter(
            ref.name, path, config, raw, self.config.max_lora_rank, self.info, "the LoRA adapter "
        )
        if adapter.digest != ref.digest:
            raise ValueError(
                f"the LoRA adapter {ref.name!r}: its files in {path} changed since it was "
                "loaded; load it again"
            )
        self._make_room(busy)
        slot = min(set(range(1, len(self.slots) + 2)) - set(self.slots.values()))
        try:
            self.weights.add(slot, adapter, raw)
        except Exception as exc:  # safetensors' own error type among them
            self.weights.drop(slot)
            raise ValueError(f"the LoRA adapter {ref.name!r} does not load: {exc!r}") from None
        self.slots[ref.digest] = slot
        log.info("loaded the LoRA adapter %s from %s into slot %d", ref.name, path, slot)
        return slot

    def _make_room(self, busy: set[int]) -> None:
        """Drop the least recently named idle adapters down to one fewer than are kept."""
        idle = [digest for digest, slot in self.slots.items() if slot not in busy]
        while len(self.slots) >= self.config.kept_loaded and idle:
            slot = self.slots.pop(idle.pop(0))
            assert self.weights is not None
            self.weights.drop(slot)
            log.info("dropped the LoRA adapter in slot %d (--max-loras %d)", slot,
                     self.config.kept_loaded)  # fmt: skip
