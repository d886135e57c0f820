"""Virtual time for the simulator: one heap of events, one seeded random source.

Time is an integer count of virtual microseconds, and events run in (time,
sequence) order, so a run is a pure function of seed, configuration and code. The
trace hash digests every event that happens (`trace`); the last few lines are kept
to show what led to a violation.
"""

from __future__ import annotations

import hashlib
import heapq
import random
from collections import deque
from collections.abc import Callable
from typing import Any

TRACE_TAIL = 30


class EventLoop:
    """The clock, the event heap, the random source and the trace of one run."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.now = 0
        self.events_run = 0
        self._q: list[tuple[int, int, Callable[..., object], tuple[Any, ...]]] = []
        self._seq = 0
        self._trace = hashlib.sha256()
        self._unhashed: list[str] = []
        """Traced lines not yet fed to the hash: hashing them in batches gives the same
        digest (SHA-256 of the concatenation) for a fraction of the calls."""
        self._tail: deque[str] = deque(maxlen=TRACE_TAIL)

    def at(self, t: int, fn: Callable[..., object], *args: Any) -> None:
        """Schedule ``fn(*args)`` at virtual time ``t`` (never in the past)."""
        self._seq += 1
        heapq.heappush(self._q, (max(t, self.now), self._seq, fn, args))

    def after(self, delay: int, fn: Callable[..., object], *args: Any) -> None:
        """Schedule ``fn(*args)`` ``delay`` microseconds from now."""
        self.at(self.now + delay, fn, *args)

    def trace(self, text: str) -> None:
        """Record an event in the trace hash and the short tail shown on failure."""
        line = f"{self.now} {text}"
        self._unhashed.append(line)
        if len(self._unhashed) >= 4096:
            self._hash_lines()
        self._tail.append(line)

    def _hash_lines(self) -> None:
        self._trace.update("".join(self._unhashed).encode())
        self._unhashed.clear()

    @property
    def trace_hash(self) -> str:
        """The digest of every traced event so far (16 hex digits)."""
        self._hash_lines()
        return self._trace.hexdigest()[:16]

    @property
    def trace_tail(self) -> list[str]:
        """The last traced events."""
        return list(self._tail)

    def run_until(self, t_end: int, stop: Callable[[], bool] | None = None) -> None:
        """Run events up to virtual time ``t_end``, or until ``stop()`` after one."""
        q = self._q
        while q and q[0][0] <= t_end:
            t, _, fn, args = heapq.heappop(q)
            self.now = t
            self.events_run += 1
            fn(*args)
            if stop is not None and stop():
                return
        self.now = t_end
