"""Peer links over TCP: a thin trio adapter around the sans-IO `Link`.

One `PeerSession` per connection. It owns two small tasks, as trio-websocket
does: a reader (bytes in, `Link.receive_data`) and a waker (the node's view changed
elsewhere, or the timer produced a heartbeat: `Link.poll`). The link timer
(heartbeat and failure detection, counted in ticks by the core) is one task per
daemon, `PeerHub.run_timer`, not one per link: it ticks every link in turn and wakes
only the sessions whose link has something to send, so an idle daemon with many
links wakes once per tick instead of once per link per tick. Every path that may
have produced bytes ends in `_flush`, which hands them to the session's gated output
the moment they are taken from the link, waits until the log is durable up to the
position they were tagged with, and sends what the gate releases, under one lock. So
bytes produced while an earlier fsync runs wait for the next one: nothing leaves
before the fsync that covers every fact it may reveal (`convergenced.core.gate`).

A session that ends for any reason (closed, lost, cancelled, failed) tells its link
the connection is gone, so the node never keeps counting a link that no longer
exists (peers would otherwise stop relaying that origin's records to us). A link is
logged when it comes up (HELLOs exchanged) and when it goes down, with the reason; a
connection that ends before its HELLO was refused, and that is logged where it was
(`Telemetry.peer_violation`, `Telemetry.connection_refused`, the dialer).

`PeerHub` is what the sessions of one daemon share: the node, its gate and the way
to wait for durability, the link settings, the telemetry, the live sessions, the
link timer, and the wake-up of every other session when one of them changed the
view.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace

import trio

from convergenced.core.errors import ProtocolError, RemoteProtocolError
from convergenced.core.gate import OutputGate
from convergenced.core.link import (
    Closed,
    Established,
    ExchangeDone,
    Link,
    LinkConfig,
    LinkState,
    RecordsMerged,
    Role,
)
from convergenced.core.node import NodeCore
from convergenced.daemon.telemetry import Telemetry

Durable = Callable[[int], Awaitable[None]]
"""Waits until the log is durable up to a position of the gate (`GroupCommit.durable`)."""


class PeerHub:
    """State shared by every peer session of one daemon."""

    def __init__(
        self,
        node: NodeCore,
        gate: OutputGate,
        durable: Durable,
        link_config: LinkConfig,
        telemetry: Telemetry,
        *,
        tick_seconds: float,
    ) -> None:
        self.node = node
        self.gate = gate
        self.durable = durable
        self.link_config = link_config
        self.telemetry = telemetry
        self.tick_seconds = tick_seconds
        self.sessions: set[PeerSession] = set()
        self._changed = trio.Event()

    def view_changed(self, source: PeerSession | None = None) -> None:
        """Let every session but ``source`` send the new records, and wake everyone in
        `wait_changed`.

        Only a session whose link would send something is woken (`Link.would_send`):
        in a full mesh most changes (another origin's record, which its own links
        carry) give most links nothing to send, and a wake-up per link per change was
        most of a busy daemon's CPU. The link is polled by its session's task, not
        here: by then the task that changed the view has merged all it read, so one
        TICK carries every record of the burst instead of the first one.
        """
        for session in self.sessions:
            if session is not source and session.link.would_send:
                session.wake()
        self._changed.set()
        self._changed = trio.Event()

    def dialled_by(self) -> frozenset[str]:
        """The peers with an established link that they dialled."""
        return frozenset(
            s.peer for s in self.sessions if s.peer is not None and s.link.role is Role.ACCEPTOR
        )

    async def wait_changed(self) -> None:
        """Return after the next view change."""
        await self._changed.wait()

    async def run_timer(self) -> None:
        """The link timer of every session, forever: one tick each ``tick_seconds``.

        Ticks are counted by the links (`Link.on_timer`), never read from a clock, so a
        late wake-up only makes heartbeats and failure detection later, never wrong.
        """
        while True:
            await trio.sleep(self.tick_seconds)
            for session in list(self.sessions):
                session.tick()


class PeerSession:
    """One live connection to one peer."""

    def __init__(
        self,
        hub: PeerHub,
        stream: trio.abc.Stream,
        role: Role,
        *,
        expected_peer: str | None = None,
        address: str = "",
        handshake_timeout: float | None = None,
    ) -> None:
        self.hub = hub
        self.stream = stream
        self.address = address
        """Where the peer is (for status and logs)."""
        config = hub.link_config
        if expected_peer is not None:
            config = replace(config, expected_peer=expected_peer)
        self.link = Link(hub.node, role, config)
        self.handshake_timeout = handshake_timeout
        """Seconds the peer has to complete its HELLO (slowloris guard)."""
        self.closed_reason: str | None = None
        self.error: ProtocolError | None = None
        self._out = hub.gate.output()
        self._send_lock = trio.Lock()
        self._tick_sent_at: dict[int, float] = {}
        self._reported_frames: dict[tuple[str, str], int] = {}
        self._reported_bytes = (0, 0)
        self._wake = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._up = False

    @property
    def peer(self) -> str | None:
        """The peer's node id, once its HELLO arrived."""
        return self.link.peer

    def wake(self) -> None:
        """Ask the session to `poll` its link soon."""
        self._wake.set()

    def tick(self) -> None:
        """One timer tick (`PeerHub.run_timer`): the link's heartbeat and failure
        detection, and the traffic counters brought up to date. The session is woken
        only when the link has something to send or to report (a heartbeat, or its
        own closing)."""
        if self._nursery is None or self.link.closed:
            return
        self.link.on_timer()
        self._report_traffic()
        if self.link.has_output:
            self.wake()

    async def run(self) -> str:
        """Drive the link until it closes; return why it closed."""
        self.hub.sessions.add(self)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.link.start()
                await self._flush()
                nursery.start_soon(self._reader)
                nursery.start_soon(self._waker)
                if self.handshake_timeout is not None:
                    nursery.start_soon(self._handshake_deadline, self.handshake_timeout)
        finally:
            self.hub.sessions.discard(self)
            self.link.connection_lost(self.closed_reason or "session ended")
            self._report_traffic()  # what the last ticks did not count yet
            self.closed_reason = self.closed_reason or "session ended"
            if self._up and self.peer is not None:
                self.hub.telemetry.link_down(self.peer, self.address, self.closed_reason)
            with trio.CancelScope(shield=True):
                # A TLS close_notify can block on a peer that stopped reading.
                with trio.move_on_after(1) as bounded:
                    await self.stream.aclose()
                if bounded.cancelled_caught:
                    await trio.aclose_forcefully(self.stream)
        return self.closed_reason

    async def close(self, reason: str = "shutting down") -> None:
        """Say BYE and end the session."""
        if not self.link.closed:
            self.link.close(reason)
            await self._flush()

    # -- tasks ------------------------------------------------------------------

    def _violation(self, err: ProtocolError) -> None:
        self.error = err
        self.hub.telemetry.peer_violation(err, self.peer, self.address)

    async def _reader(self) -> None:
        while not self.link.closed:
            try:
                data = bytes(await self.stream.receive_some(65536))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            try:
                self.link.receive_data(data)
            except ProtocolError as err:
                self._violation(err)
            await self._flush()

    async def _handshake_deadline(self, seconds: float) -> None:
        await trio.sleep(seconds)
        if self.link.peer is None and not self.link.closed:
            err = RemoteProtocolError(f"no HELLO within {seconds:g} s", reason="handshake_timeout")
            self._violation(err)
            self.link.close(str(err))
            await self._flush()

    async def _waker(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            self.link.poll()
            await self._flush()  # which ends the session once the link is closed

    # -- output -------------------------------------------------------------------

    async def _flush(self) -> None:
        # Uncontended (nearly always), take the lock without a trip through the
        # scheduler: `Lock.acquire` always yields, and a flush runs per frame.
        try:
            self._send_lock.acquire_nowait()
        except trio.WouldBlock:
            await self._send_lock.acquire()
        try:
            await self._flush_locked()
        finally:
            self._send_lock.release()

    async def _flush_locked(self) -> None:
        changed = False
        while (ev := self.link.next_event()) is not None:
            if isinstance(ev, RecordsMerged):
                changed = True
            elif isinstance(ev, Closed):
                self.closed_reason = ev.reason
            elif isinstance(ev, ExchangeDone):
                self._exchange_done(ev.seq)
            elif isinstance(ev, Established):
                # A HELLO can settle a node unsure of its past (`core.lives`)
                # without merging a record: wake what waits for that too.
                changed = True
                self._up = True
                self.hub.telemetry.link_up(
                    ev.peer, self.address, self.link.role.value, ev.incarnation
                )
        # Tagged now, with every fact applied so far: see the module docstring.
        self._out.send(self.link.data_to_send())
        try:
            await self.hub.durable(self._out.waiting_for)
        except OSError as exc:
            # The log failed: nothing may leave (the daemon is stopping).
            self.closed_reason = f"write-ahead log failed: {exc}"
            self._end()
            return
        data = b"".join(self._out.release())
        if data:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.link.connection_lost()
                self.closed_reason = self.closed_reason or "connection lost"
        if self.link.state is LinkState.TICK_SENT and self.link.seq not in self._tick_sent_at:
            self._tick_sent_at[self.link.seq] = trio.current_time()
        if changed:
            self.hub.view_changed(source=self)
        if self.link.closed:
            self._end()

    def _end(self) -> None:
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    def _exchange_done(self, seq: int) -> None:
        started = self._tick_sent_at.pop(seq, None)  # only exchanges we started
        if started is not None and self.peer is not None:
            self.hub.telemetry.exchanged(self.peer, trio.current_time() - started)

    def _report_traffic(self) -> None:
        if self.peer is None:  # unauthenticated: counted by reason only
            return
        link = self.link
        deltas = []
        for key, n in link.frame_counts.items():
            delta = n - self._reported_frames.get(key, 0)
            if delta:
                deltas.append((key, delta))
                self._reported_frames[key] = n
        sent, received = self._reported_bytes
        self.hub.telemetry.traffic(
            self.peer, deltas, link.bytes_sent - sent, link.bytes_received - received
        )
        self._reported_bytes = (link.bytes_sent, link.bytes_received)
