"""Log compaction: the shortest list of facts that rebuilds a node's local state.

`Compaction` is `NodeCore`'s part of it (a mixin: it reads the node's state). The
daemon rewrites its log from `compacted_facts` when the log grows; the simulator
does so every few writes, so replaying compacted logs is checked under every fault.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from convergenced.core.facts import (
    CloseGenerations,
    ComponentReport,
    Declare,
    Fact,
    Freeze,
    HighWater,
    Horizon,
    RolloutNote,
    Settled,
)
from convergenced.core.lives import PastLives
from convergenced.core.stream_state import StreamState


class Compaction:
    """`NodeCore`'s log compaction (see the module docstring)."""

    _streams: dict[str, StreamState]
    _generation_floors: dict[str, int]
    _high_water_floors: dict[str, int]
    undeclared_high_water_fact: Callable[[str, int], HighWater]  # Declarations'
    _lives: PastLives
    _reports: dict[str, ComponentReport]
    _rollout_notes: deque[str]

    def compacted_facts(self) -> list[Fact]:
        """The shortest list of facts whose `replay` rebuilds this node's local state.

        Used by log compaction: per stream, the declaration, one `RankState` per
        (rank, domain), the digests and sizes held (as commits), the open frozen sets,
        the generation closure, and one high-water mark carrying the merged evidence;
        then the generation floor and the high-water mark of every stream undeclared
        here.
        Replaying them gives the same facts, the same refusals (retired epochs stay
        retired), the same repeats and, after a restart, the same protection against
        stale records as replaying the full log.
        """
        out: list[Fact] = [self._reports[c] for c in sorted(self._reports)]
        out.extend(RolloutNote(text) for text in self._rollout_notes)
        for name in sorted(self._streams):
            f = self._streams[name].facts
            out.append(Declare(f.spec))
            taken = f.generations.taken_below
            if (self._lives.unsure and self._streams[name].settled) or taken:
                out.append(Settled(name, taken))
            out.extend(f.compacted())
            # The digests and sizes held, as commits, each before the frozen sets of
            # the generations frozen after it was applied (see `Content.after`).
            commits = f.content_commits()
            for g, s in f.generations.open_sets():
                out.extend(c for after, c in commits if after is None or after < g)
                commits = [(after, c) for after, c in commits if after is not None and after >= g]
                out.append(Freeze(name, g, s))
            out.extend(c for _, c in commits)
            if f.generations.closed_below:
                out.append(CloseGenerations(name, f.generations.closed_below))
            if f.high_water is not None:
                evidence = tuple((m, i, v) for m, (i, v) in sorted(f.evidence.items()))
                mhw = f.membership_high_water
                # An adopted mark (this node in its evidence) never stands in, so one
                # this life also reached is written twice, or replay would lose the
                # membership mark (`NodeCore._apply_high_water`).
                if mhw == f.high_water and not f.high_water_adopted:
                    out.append(HighWater(name, f.high_water, evidence, f.spec.membership))
                else:
                    out.append(HighWater(name, f.high_water, evidence, None))
                    if mhw is not None:
                        out.append(HighWater(name, mhw, (), f.spec.membership))
            if f.horizon is not None:
                out.append(Horizon(name, f.horizon))
        out.extend(CloseGenerations(n, b) for n, b in sorted(self._generation_floors.items()))
        out.extend(self.undeclared_high_water_fact(n, e)
                   for n, e in sorted(self._high_water_floors.items()))  # fmt: skip
        return out
