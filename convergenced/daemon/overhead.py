"""The checkpoint overhead fraction: how much of a job's time its saves block training.

An integration that drives the saves from the training loop (the DCP checkpointer,
torchtitan's manager) times, on each rank, the part of each save the loop waits for
and the time since that rank's previous save started, and reports both with the
local API's ``report_save``. `SaveOverheads` keeps the recent saves of each rank of
each stream in memory and sums them into one figure per stream:

    overhead = sum(blocking seconds) / sum(intervals)

over the last `SAVES_PER_RANK` save cycles of a rank, taking the worst rank of this
node: the slowest rank sets the pace of a synchronous job. A cycle runs from the start
of one save to the start of the next: its interval is what the later save reports, its
blocking what the earlier one reported, so a cycle's blocking lies within it and the
figure stays between 0 and 1. A rank's first save (no interval) opens a cycle only.

It is not a protocol fact: nothing is logged or gossiped, a restart forgets it, and a
stream no integration reports for has no figure.

Memory is bounded: `SAVES_PER_RANK` saves per rank, `MAX_RANKS` ranks per stream
(the least recently reported is dropped first), and only declared streams (the
caller checks the stream and the rank against the spec before `add`, and `prune`
drops streams undeclared since).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

SAVES_PER_RANK = 16
"""Save cycles of one rank the figure is taken over: recent enough to follow a change
of the save interval, many enough to smooth one slow save."""
MAX_RANKS = 4096
"""Ranks of one stream kept per node (a node hosts far fewer)."""


@dataclass(frozen=True, slots=True)
class Save:
    """One save of one rank, as its integration timed it."""

    blocking_s: float
    """Seconds the training loop waited for the save."""
    interval_s: float | None
    """Seconds since the rank's previous save started (None: its first save)."""


@dataclass(frozen=True, slots=True)
class RankOverhead:
    """The figure of one rank over its recent saves."""

    rank: int
    saves: int
    """Save cycles the figure is taken over."""
    blocking_s: float
    interval_s: float

    @property
    def ratio(self) -> float:
        """Blocking seconds over interval seconds (0 when the intervals sum to 0)."""
        return self.blocking_s / self.interval_s if self.interval_s > 0 else 0.0


class SaveOverheads:
    """The recent saves of this node's ranks, per stream (see the module docstring)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        """``clock``: seconds, to tell how long ago the last report came (the
        adapter's clock; never used for anything but that age)."""
        self._clock = clock
        self._saves: dict[str, OrderedDict[int, deque[Save]]] = {}
        self._last: dict[str, float] = {}

    def add(self, stream: str, rank: int, blocking_s: float, interval_s: float | None) -> None:
        """Record one save of ``rank`` (a rank of this node in ``stream``, checked)."""
        ranks = self._saves.setdefault(stream, OrderedDict())
        saves = ranks.get(rank)
        if saves is None:
            if len(ranks) >= MAX_RANKS:
                ranks.popitem(last=False)  # the rank heard from least recently
            saves = ranks[rank] = deque(maxlen=SAVES_PER_RANK + 1)  # + 1 opens the oldest
        else:
            ranks.move_to_end(rank)
        saves.append(Save(blocking_s, interval_s))
        self._last[stream] = self._clock()

    def tracks(self, stream: str) -> bool:
        """Whether saves of ``stream`` are kept."""
        return stream in self._saves

    def prune(self, declared: Iterable[str]) -> None:
        """Forget the streams not in ``declared`` (undeclared since they reported)."""
        keep = set(declared)
        for stream in [s for s in self._saves if s not in keep]:
            del self._saves[stream]
            self._last.pop(stream, None)

    def ranks(self, stream: str) -> list[RankOverhead]:
        """The figure of each rank of ``stream`` that has at least one whole cycle."""
        out = []
        for rank, saves in self._saves.get(stream, {}).items():
            cycles = [(before.blocking_s, after.interval_s)
                      for before, after in zip(saves, list(saves)[1:], strict=False)
                      if after.interval_s is not None]  # fmt: skip
            if cycles:
                blocking = sum(b for b, _ in cycles)
                interval = sum(i for _, i in cycles)
                out.append(RankOverhead(rank, len(cycles), blocking, interval))
        return out

    def describe(self, stream: str) -> dict[str, Any] | None:
        """The ``overhead`` part of a stream's state map: the worst rank's figure,
        or None while no rank has reported two saves in a row (since the daemon
        started)."""
        ranks = self.ranks(stream)
        if not ranks:
            return None
        worst = max(ranks, key=lambda r: (r.ratio, -r.rank))
        return {
            "ratio": worst.ratio,
            "rank": worst.rank,
            "saves": worst.saves,
            "blocking_s": worst.blocking_s / worst.saves,
            "interval_s": worst.interval_s / worst.saves,
            "ranks": len(ranks),
            "age_s": self._clock() - self._last[stream],
        }
