"""The fleet simulation's clock: a heap of timed events, run in time order.

Events at the same time run in the order they were scheduled (a sequence number breaks
ties), so a run is deterministic for a seed: a step that ends when a request arrives ends
first if it was scheduled first, as a real replica's step would.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class EventQueue:
    """``at(time, action, *args)`` schedules ``action(*args)``; :meth:`run` calls them in
    order of time, then of scheduling, advancing :attr:`now`."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._seq = 0
        self.processed = 0

    def at(self, time: float, action: Callable[..., Any], *args: Any) -> None:
        if time < self.now:
            raise ValueError(f"event at {time} is in the past (now {self.now})")
        heapq.heappush(self._heap, (time, self._seq, action, args))
        self._seq += 1

    def after(self, delay: float, action: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + delay, action, *args)

    def __len__(self) -> int:
        return len(self._heap)

    def run(self, until: float | None = None) -> None:
        """Run events until none is left (or the next is past ``until``)."""
        heap = self._heap
        while heap:
            if until is not None and heap[0][0] > until:
                self.now = until
                return
            time, _, action, args = heapq.heappop(heap)
            self.now = time
            self.processed += 1
            action(*args)
