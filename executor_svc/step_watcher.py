"""Wakes the executor's loop when a launched step ends on its device. A thread waits on each
step in turn and rings an in-process socket that the loop polls beside the scheduler's, so the
loop sleeps until a plan arrives or a step ends, whichever comes first: the next plan can be
launched behind a running step, and a result leaves as soon as its step is done."""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading

import zmq

from turnstile.executor_svc.step_in_flight import PendingStep

_names = itertools.count()


class StepWatcher:
    def __init__(self, context: zmq.Context) -> None:
        address = f"inproc://turnstile-step-watcher-{next(_names)}"
        self.bell = context.socket(zmq.PAIR)
        self.bell.bind(address)
        ringer = context.socket(zmq.PAIR)
        ringer.connect(address)
        self._steps: queue.SimpleQueue[PendingStep] = queue.SimpleQueue()
        threading.Thread(target=self._watch, args=(ringer,), daemon=True).start()

    def watch(self, step: PendingStep) -> None:
        """Ring once `step` (and every step watched before it) has ended."""
        self._steps.put(step)

    def heard(self) -> None:
        """Take one ring off the bell (one watched step ended)."""
        self.bell.recv()

    def _watch(self, ringer: zmq.Socket) -> None:
        while True:
            step = self._steps.get()
            with contextlib.suppress(Exception):  # `result()` raises it again, in the loop
                step.wait()
            ringer.send(b"")
