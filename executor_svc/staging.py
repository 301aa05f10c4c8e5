"""A step's host arrays onto the device in one copy: packed into one int64 buffer (pinned on
CUDA, so the copy is asynchronous and overlaps the host's next work), then split into views
there. Float arrays travel as their float64 bits."""

from __future__ import annotations

import math

import numpy as np
import torch


class Staging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.int64)

    def upload(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Each array as a tensor on the device, int64 or float64, in its shape. On CUDA the
        buffer is new each time: the next step is staged while this one's copy may still be
        queued, and torch's pinned allocator hands a buffer out again only once its copies
        are done. Elsewhere a step has run before the next is staged: one buffer serves all."""
        total = sum(array.size for array in arrays.values())
        if self._pinned:
            self._host = torch.empty(max(total, 1), dtype=torch.int64, pin_memory=True)
        elif total > self._host.numel():
            size = max(total, 2 * self._host.numel(), 1024)
            self._host = torch.empty(size, dtype=torch.int64)
        host = self._host.numpy()
        spans = []
        offset = 0
        for name, array in arrays.items():
            flat = array.reshape(-1)
            floating = flat.dtype.kind == "f"
            flat = flat.astype(np.float64).view(np.int64) if floating else flat
            host[offset : offset + flat.size] = flat
            spans.append((name, offset, array.shape, floating))
            offset += flat.size
        device = self._host[:offset].to(self.device, non_blocking=True)
        out = {}
        for name, start, shape, floating in spans:
            view = device[start : start + math.prod(shape)].view(shape)
            out[name] = view.view(torch.float64) if floating else view
        return out
