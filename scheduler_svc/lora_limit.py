"""vLLM's `--max-loras` as its scheduler holds it: a step runs at most that many LoRA adapters.
A waiting request whose adapter would be one more is passed over, keeping its place, for the
requests behind it; it joins once a running adapter's requests have all left."""

from __future__ import annotations

from collections.abc import Iterable

from turnstile.scheduler_svc.request import Request


class AdapterLimit:
    def __init__(self, max_loras: int, running: Iterable[Request | None]) -> None:
        """`max_loras`: 0 where no request names an adapter; `running`: the batch's requests."""
        self.max_loras = max_loras
        self.adapters = {req.lora.digest for req in running if req is not None and req.lora}

    def admits(self, req: Request) -> bool:
        if req.lora is None or req.lora.digest in self.adapters:
            return True
        return len(self.adapters) < self.max_loras

    def add(self, req: Request) -> None:
        if req.lora is not None:
            self.adapters.add(req.lora.digest)
