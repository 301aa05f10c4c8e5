"""Waiting queues: first come first served, or by priority. Aborted requests leave lazily."""

from __future__ import annotations

import heapq
from collections import deque

from turnstile.scheduler_svc.request import Request, Status


class _LazyQueue:
    """Counts live requests; an aborted one stays stored until it reaches the head."""

    def __init__(self) -> None:
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def discard(self, req: Request) -> None:
        """Forget an aborted request; it is skipped when it reaches the head."""
        self._live -= 1


class FcfsQueue(_LazyQueue):
    def __init__(self) -> None:
        super().__init__()
        self._queue: deque[Request] = deque()

    def push(self, req: Request) -> None:
        self._queue.append(req)
        self._live += 1

    def push_front(self, req: Request) -> None:
        """A preempted request resumes before anything that arrived after it was admitted."""
        self._queue.appendleft(req)
        self._live += 1

    def peek(self) -> Request | None:
        while self._queue and self._queue[0].status is not Status.WAITING:
            self._queue.popleft()
        return self._queue[0] if self._queue else None

    def pop(self) -> Request:
        req = self.peek()
        if req is None:
            raise IndexError("pop from an empty waiting queue")
        self._live -= 1
        return self._queue.popleft()


class PriorityQueue(_LazyQueue):
    """Lowest (priority, arrival) first; a preempted request keeps its place by that key."""

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple[int, Request]] = []

    def push(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.rank(by_priority=True), req))
        self._live += 1

    push_front = push

    def peek(self) -> Request | None:
        while self._heap and self._heap[0][1].status is not Status.WAITING:
            heapq.heappop(self._heap)
        return self._heap[0][1] if self._heap else None

    def pop(self) -> Request:
        req = self.peek()
        if req is None:
            raise IndexError("pop from an empty waiting queue")
        self._live -= 1
        return heapq.heappop(self._heap)[1]
