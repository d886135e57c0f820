"""One declared stream at one node: its facts, its agreement, its last decision.

`NodeCore` keeps one `StreamState` per stream it declared; `lives` needs the same
view of it, hence a module of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from convergenced.core.agreement import Decision, StreamAgreement
from convergenced.core.facts import StreamFacts
from convergenced.core.generations import Generations


@dataclass(slots=True)
class StreamState:
    """The node's state of one stream."""

    facts: StreamFacts
    agreement: StreamAgreement
    decision: Decision | None = None
    settled: bool = True
    """False while this node, unsure of its past, still waits to hear from members
    before publishing anything of this stream (see `lives`)."""

    @property
    def generations(self) -> Generations:
        """The stream's recovery generations."""
        return self.facts.generations
