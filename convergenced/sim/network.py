"""The simulated network: connections that carry the real frames of real links.

A `Connection` is a simulated TCP connection between two `SimNode`s: one real
`Link` per side, and in-order delivery of bytes after a latency (drawn per send in
the faulty phase, stretched while the connection is slowed or clogged). Bytes a
link produces go into its node's gated output first and leave only when the gate
releases them, so the network carries exactly what a daemon would put on the wire,
when it would. TCP's ordering is kept: a held or blocked chunk holds back what
follows it.

`Network` owns the connections and the partition (the directed pairs that cannot
talk), and tells the world, through callbacks, when a node received something
(``on_change``), which records a link merged (``on_merged``, for the replay fault)
and what each node sent (``on_sent``, for the gate's oracle check).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from convergenced.core.errors import ProtocolError
from convergenced.core.gate import GatedOutput
from convergenced.core.link import Closed, Link, LinkConfig, RecordsMerged, Role
from convergenced.core.records import Record
from convergenced.sim.loop import EventLoop
from convergenced.sim.node import SimNode
from convergenced.sim.oracle import InvariantViolation

STREAM = "job"


def pair(a: str, b: str) -> tuple[str, str]:
    """The key of the connection between ``a`` and ``b`` (sorted)."""
    return (a, b) if a < b else (b, a)


class Connection:
    """A simulated TCP connection: two Links, gated outputs, in-order delivery."""

    def __init__(self, a: SimNode, b: SimNode, config: LinkConfig) -> None:
        assert a.core is not None and b.core is not None
        self.a, self.b = a.id, b.id
        self.alive = True
        self.links = {a.id: Link(a.core, Role.INITIATOR, a.link_config(config)),
                      b.id: Link(b.core, Role.ACCEPTOR, b.link_config(config))}  # fmt: skip
        self.outputs: dict[str, GatedOutput] = {a.id: a.output(), b.id: b.output()}
        self.sent_records: dict[str, deque[Record | None]] = {a.id: deque(), b.id: deque()}
        """Per side and per held chunk, the sender's own record when the chunk was
        queued: the newest version of it the chunk can carry (for the oracle)."""
        self.last_delivery = {a.id: 0, b.id: 0}  # per receiving side
        self.inflight: dict[str, deque[tuple[int, bytes]]] = {a.id: deque(), b.id: deque()}
        self.slow_until = 0
        self.slow_factor = 1
        self.timing = {a.id: 0, b.id: 0}
        """Bumped when in-flight bytes are re-timed: older delivery events lapse."""
        self.established_at: int | None = None

    def other(self, side: str) -> str:
        """The node at the other end from ``side``."""
        return self.b if side == self.a else self.a


class Network:
    """Every connection of the simulated cluster."""

    def __init__(
        self,
        loop: EventLoop,
        nodes: dict[str, SimNode],
        config: LinkConfig,
        latency_us: int,
        *,
        on_change: Callable[[str], None],
        on_merged: Callable[[tuple[Record, ...]], None],
        on_sent: Callable[[str, Record | None], None],
    ) -> None:
        self.loop = loop
        self.nodes = nodes
        self.config = config
        self.latency_us = latency_us
        self.on_change = on_change
        self.on_merged = on_merged
        self.on_sent = on_sent
        self.conns: dict[tuple[str, str], Connection] = {}
        self.blocked: set[tuple[str, str]] = set()
        """Directed pairs (src, dst) that cannot talk (a partition)."""
        self.blocked_until = 0
        self.calm = False
        """After healing: no random latency, no slowed paths."""
        self.messages = 0
        self.bytes = 0

    def live(self) -> list[Connection]:
        """Connections that are up, in a stable order."""
        return [c for _, c in sorted(self.conns.items()) if c.alive]

    def get(self, a: str, b: str) -> Connection | None:
        """The live connection between ``a`` and ``b``, if any."""
        conn = self.conns.get(pair(a, b))
        return conn if conn is not None and conn.alive else None

    def reachable(self, a: str, b: str) -> bool:
        """Whether the partition lets ``a`` and ``b`` talk both ways."""
        return (a, b) not in self.blocked and (b, a) not in self.blocked

    # -- connecting ------------------------------------------------------------------

    def connect(self, a: str, b: str) -> None:
        """Open the connection ``a`` dials to ``b``, or back off and try again."""
        loop = self.loop
        if self.get(a, b) is not None:
            return
        na, nb = self.nodes[a], self.nodes[b]
        if not na.up or not nb.up or not self.reachable(a, b) or na.paused_until > loop.now:
            back = min(na.backoff.get(b, 10_000) * 2, 160_000)
            na.backoff[b] = back
            if na.up:
                loop.after(back // 2 + loop.rng.randint(0, back // 2), self.connect, a, b)
            return
        na.backoff[b] = 10_000
        conn = Connection(na, nb, self.config)
        self.conns[pair(a, b)] = conn
        loop.trace(f"connect {a} {b}")
        conn.links[a].start()
        conn.links[b].start()
        self.flush(conn, a)
        self.flush(conn, b)

    def reconnect_later(self, conn: Connection) -> None:
        """Dial ``conn``'s pair again after a short while."""
        self.loop.after(self.loop.rng.randint(5_000, 20_000), self.connect, conn.a, conn.b)

    def teardown(self, conn: Connection, why: str) -> None:
        """Close both sides of ``conn`` (held bytes are lost) and dial again later."""
        if not conn.alive:
            return
        conn.alive = False
        self.loop.trace(f"teardown {conn.a} {conn.b} ({why})")
        for side in (conn.a, conn.b):
            self._drop_side(conn, side)
        self.reconnect_later(conn)

    def node_down(self, nid: str, peers: list[str]) -> None:
        """``nid`` crashed: its connections die, the other ends see EOF."""
        for peer in peers:
            conn = self.get(nid, peer)
            if conn is not None:
                conn.alive = False
                self._drop_side(conn, peer)
                conn.links[nid].connection_lost("crashed")
                self.reconnect_later(conn)

    @staticmethod
    def _drop_side(conn: Connection, side: str) -> None:
        link = conn.links[side]
        link.connection_lost()
        while link.next_event() is not None:
            pass

    # -- sending -----------------------------------------------------------------------

    def flush(self, conn: Connection, side: str) -> None:
        """Queue what ``side``'s link produced behind its gate; send what may leave."""
        link = conn.links[side]
        if not link.has_output:  # the common case: a poll that had nothing to say
            if len(conn.outputs[side]):
                self.release(conn, side)
            return
        data = link.data_to_send()
        if data and conn.alive:
            core = self.nodes[side].core
            conn.outputs[side].send(data)
            own = core.own_record(STREAM) if core else None
            # Only a record of this life: one of a life lost with its disk is relayed
            # as it was (it was durable then, on the disk it had).
            mine = own if own is not None and core and own.incarnation == core.incarnation else None
            conn.sent_records[side].append(mine)
        if len(conn.outputs[side]):  # else there is nothing to release
            self.release(conn, side)
        self._drain_events(conn, side)

    def release(self, conn: Connection, side: str) -> None:
        """Put on the wire what ``side``'s gate lets leave now."""
        chunks = conn.outputs[side].release()
        if not chunks or not conn.alive:
            return
        notes = conn.sent_records[side]
        for _ in chunks:
            self.on_sent(side, notes.popleft())
        loop = self.loop
        dst = conn.other(side)
        lat = self.latency_us
        if not self.calm:
            lat += loop.rng.randint(0, self.latency_us)
            if conn.slow_until > loop.now:
                lat *= conn.slow_factor
        t = max(loop.now + lat, conn.last_delivery[dst] + 1)
        conn.last_delivery[dst] = t
        conn.inflight[dst].append((t, b"".join(chunks)))
        loop.at(t, self.deliver, conn, dst, conn.timing[dst])

    def _drain_events(self, conn: Connection, side: str) -> None:
        link = conn.links[side]
        while (ev := link.next_event()) is not None:
            if isinstance(ev, RecordsMerged):
                self.on_merged(ev.records)
            elif isinstance(ev, Closed):
                if ev.error is not None:
                    raise InvariantViolation(
                        "protocol", f"{side} closed its link to {conn.other(side)}: {ev.error}"
                    )
                self.teardown(conn, f"{side}: {ev.reason}")
        if conn.alive and conn.established_at is None:
            la, lb = conn.links[conn.a], conn.links[conn.b]
            if la.peer is not None and lb.peer is not None:
                conn.established_at = self.loop.now

    # -- receiving -----------------------------------------------------------------------

    def deliver(self, conn: Connection, dst: str, timing: int) -> None:
        """The next in-flight chunk for ``dst`` arrives (unless held back)."""
        if not conn.alive or not conn.inflight[dst] or timing != conn.timing[dst]:
            return
        loop = self.loop
        node = self.nodes[dst]
        src = conn.other(dst)
        if node.paused_until > loop.now or (src, dst) in self.blocked:
            # Held back (TCP keeps order): everything behind it waits too.
            # Look again soon: a heal or the liveness phase may release it early.
            loop.after(1_000, self.deliver, conn, dst, timing)
            return
        _, data = conn.inflight[dst].popleft()
        self.bytes += len(data)
        loop.trace(f"deliver {src}->{dst} {len(data)}")
        link = conn.links[dst]
        frames_before = link.frames_received
        try:
            link.receive_data(data)
        except ProtocolError as err:
            raise InvariantViolation(
                "protocol", f"{dst} rejected bytes from {src}: {err}"
            ) from None
        self.messages += link.frames_received - frames_before
        self.flush(conn, dst)
        if conn.alive:
            self.on_change(dst)

    def deliver_prefix_and_reset(self, conn: Connection) -> None:
        """The reset fault: one side receives part of a chunk in flight, then EOF."""
        rng = self.loop.rng
        for side in (conn.a, conn.b):
            if conn.inflight[side]:
                _, data = conn.inflight[side][0]
                cut = rng.randint(1, max(1, len(data) - 1))
                conn.inflight[side].clear()
                if not conn.links[side].closed and self.nodes[side].up:
                    try:
                        conn.links[side].receive_data(data[:cut])
                    except ProtocolError as err:
                        raise InvariantViolation("protocol", f"prefix rejected: {err}") from None
                break
        self.loop.trace(f"fault reset {conn.a} {conn.b}")
        self.teardown(conn, "reset")

    def heal(self) -> None:
        """The liveness phase: no partition, no slowed path, and what a clogged path
        held arrives now, in order, instead of at its clogged delivery times."""
        self.calm = True
        self.blocked.clear()
        loop = self.loop
        for conn in self.live():
            conn.slow_until = 0
            for dst in (conn.a, conn.b):
                conn.timing[dst] += 1
                when = loop.now
                for i, (_, data) in enumerate(conn.inflight[dst]):
                    when = loop.now + self.latency_us + i
                    conn.inflight[dst][i] = (when, data)
                    loop.at(when, self.deliver, conn, dst, conn.timing[dst])
                conn.last_delivery[dst] = when
