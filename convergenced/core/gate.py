"""The output gate: no byte leaves before the fsync that covers every fact it reveals.

A daemon applies a fact to its `NodeCore` as soon as it arrives and makes it
durable later, in a group with others (group commit). Meanwhile anything the node
sends may already reveal the fact: a reply to a client, a record to a peer, a
refusal that only makes sense given an earlier declaration. If such bytes left
before the fsync and the daemon then crashed, a client would hold an
acknowledgement the log does not, or a peer would hold a restore point or
high-water mark the node forgot, and peers delete checkpoints on the strength of
that mark (S4). So every byte leaves through this gate, for the daemon and the
simulator alike.

**Positions.** Every fact the node applies takes the next position in the log, in
order: the facts an adapter applies through `OutputGate.apply` (declarations,
commits, frozen sets...) and the facts the core produces itself (high-water marks,
generation closures), which the gate takes from the node each time it is asked for
a position. Bytes handed to an output are tagged with the position reached at that
moment: they may reveal any fact up to it and none after it (tagging when the
bytes are taken, not when a link produced them, is later and therefore safe). The
log takes the facts it must write with `take_unlogged` and reports what is durable
with `synced`; each output then releases its bytes in order, up to the first whose
position is not durable yet. Bytes that reveal nothing new (a heartbeat, a reply
to a read of durable state) leave at once, without an fsync.

The gate does no I/O and keeps no clock: the daemon's group commit and the
simulator's virtual disk drive it the same way.
"""

from __future__ import annotations

from collections import deque

from convergenced.core.facts import Fact
from convergenced.core.node import NodeCore


class OutputGate:
    """The log positions of one node's facts, and the outputs they hold back."""

    def __init__(self, node: NodeCore) -> None:
        self._node = node
        self._appended = 0
        self._durable = 0
        self._unlogged: list[Fact] = []

    @property
    def durable(self) -> int:
        """The position the log has made durable."""
        return self._durable

    def apply(self, fact: Fact) -> None:
        """Apply ``fact`` to the node and give it the next position in the log.

        Raises:
            FactError, SpecError, SpecConflictError: the node refused it; nothing
                changed and nothing is logged.
        """
        self._absorb()  # facts the core produced earlier come first
        self._node.apply(fact)
        self._unlogged.append(fact)
        self._appended += 1
        self._absorb()  # and those this one just produced, after it

    def position(self) -> int:
        """The position that covers everything applied so far.

        Bytes taken from the node now may reveal up to this position: tag them with
        it (`GatedOutput.send` does).
        """
        self._absorb()
        return self._appended

    def pending(self) -> bool:
        """Whether some applied fact is not durable yet."""
        return self.position() > self._durable

    def take_unlogged(self) -> tuple[list[Fact], int]:
        """The facts to write to the log now, in order, and the position the log
        reaches once they are durable (pass it to `synced` then)."""
        self._absorb()
        facts, self._unlogged = self._unlogged, []
        return facts, self._appended

    def synced(self, position: int) -> None:
        """The log made everything up to ``position`` durable."""
        self._durable = max(self._durable, position)

    def output(self) -> GatedOutput:
        """A new output (one per connection) held back by this gate."""
        return GatedOutput(self)

    def _absorb(self) -> None:
        for fact in self._node.take_pending_facts():
            self._unlogged.append(fact)
            self._appended += 1


class GatedOutput:
    """The bytes of one connection, each chunk held until its position is durable."""

    def __init__(self, gate: OutputGate) -> None:
        self._gate = gate
        self._held: deque[tuple[int, bytes]] = deque()

    def __len__(self) -> int:
        """Chunks held (durable or not) and not yet released."""
        return len(self._held)

    def send(self, data: bytes) -> None:
        """Queue ``data``, which may reveal anything applied so far."""
        if data:
            self._held.append((self._gate.position(), data))

    @property
    def waiting_for(self) -> int:
        """The position the log must reach for every held chunk to leave (0: none)."""
        return self._held[-1][0] if self._held else 0

    def releasable(self) -> int:
        """How many held chunks may leave now."""
        durable = self._gate.durable
        n = 0
        for position, _ in self._held:
            if position > durable:
                break
            n += 1
        return n

    def discard(self) -> list[bytes]:
        """Take every held chunk, durable or not: they will never be sent (the log
        failed, or the connection is gone)."""
        out = [data for _, data in self._held]
        self._held.clear()
        return out

    def release(self) -> list[bytes]:
        """Take the chunks that may leave now, in order."""
        durable = self._gate.durable
        out: list[bytes] = []
        held = self._held
        while held and held[0][0] <= durable:
            out.append(held.popleft()[1])
        return out
