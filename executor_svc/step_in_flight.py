"""A launched step whose tokens are still on their way to the host. The executor launches the
next plan before this step ends (that plan's inputs take this step's tokens on the device, see
`Carry`) and answers the scheduler once the copy lands: the device never waits for the host's
loop between two steps."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from turnstile.executor_svc.sampler import Logprobs, Sampled
from turnstile.shared.protocol import StepResult


class PendingStep(Protocol):
    step: int

    def done(self) -> bool:
        """Whether `result` would return at once."""

    def wait(self) -> None:
        """Block until the device has finished the step; touches nothing else, so any thread
        may call it."""

    def result(self) -> StepResult:
        """The step's answer, once; the executor's own thread only."""


@dataclass(slots=True)
class ReadyStep:
    """A step whose answer is known at launch (no rows, or a device that computes at once)."""

    step: int
    answer: StepResult

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        pass

    def result(self) -> StepResult:
        return self.answer


class HostCopy:
    """A device tensor's copy to the host, started without waiting: on CUDA into pinned memory,
    non-blocking, with an event to ask and to wait on; on the CPU it is the tensor itself."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.event: torch.cuda.Event | None = None
        if tensor.device.type == "cuda":
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(tensor.device))
        else:
            self.host = tensor.cpu()

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()  # releases the GIL while it waits

    def numpy(self) -> np.ndarray:
        self.wait()
        return self.host.numpy()


@dataclass(slots=True, frozen=True)
class Carry:
    """A step's input tokens that the step before it samples: which of the step's tokens
    (`to`), from which of that step's sampling rows (`source`), on the device (`tokens`)."""

    to: np.ndarray
    source: np.ndarray
    tokens: torch.Tensor


class StepInFlight:
    """A model step on its device: its sampled tokens there, and their copy to the host."""

    def __init__(
        self,
        step: int,
        sampled: Sampled,
        rows: np.ndarray,
        finish: Callable[[np.ndarray, Logprobs], StepResult],
    ) -> None:
        """`rows`: the batch slots of the sampled tokens; `finish`: the runner's bookkeeping
        once they are on the host."""
        self.step = step
        self.sampled = sampled
        self.rows = rows
        self._copy = HostCopy(sampled.packed())
        self._finish = finish
        self._answer: StepResult | None = None

    @property
    def settled(self) -> bool:
        return self._answer is not None

    def done(self) -> bool:
        return self._answer is not None or self._copy.done()

    def wait(self) -> None:
        self._copy.wait()

    def result(self) -> StepResult:
        if self._answer is None:
            self._answer = self._finish(*self.sampled.unpack(self._copy.numpy()))
        return self._answer
