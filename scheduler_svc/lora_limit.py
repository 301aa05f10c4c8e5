"""vLLM's `--max-loras` as its scheduler holds it: a step runs at most that many LoRA adapters.
A waiting request whose adapter would be one more is passed over, keeping its place, for the
requests behind it; it joins once a running adapter's requests have all left."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from turnstile.scheduler_svc.request import Request


class AdapterLimit:
    def __init__(self, max_loras: int, running: Callable[[], Iterable[Request | None]]) -> None:
        """`running`: the batch's requests, read only once a waiting request names an adapter
        (steady steps of requests without one never walk the batch)."""
        self.max_loras = max_loras
        self._running = running
        self._adapters: set[str] | None = None

    @property
    def adapters(self) -> set[str]:
        if self._adapters is None:
            running = self._running()
            self._adapters = {req.lora.digest for req in running if req is not None and req.lora}
        return self._adapters

    def admits(self, req: Request) -> bool:
        if req.lora is None:
            return True
        return req.lora.digest in self.adapters or len(self.adapters) < self.max_loras

    def add(self, req: Request) -> None:
        if req.lora is not None:
            self.adapters.add(req.lora.digest)
