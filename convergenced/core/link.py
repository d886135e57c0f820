"""The link state machine: an OAE-style token exchange between two nodes.

Everything that affects the link's state and its transitions lives in this module
(as in h11's ``_state.py``). The rules:

1. Both sides send HELLO as soon as the connection is up. HELLO names the cluster,
   the node and its incarnation, and carries a summary of the record stamps the
   sender holds, so neither side replays what the other already has.
2. After the HELLOs the *initiator* (the side that dialled) holds the token.
3. Only the token holder may start an exchange, by sending TICK (its deltas for
   the peer and its view digest). The other side merges and answers TOCK (its own
   deltas and the digest of its merged view). The token then passes to the side
   that answered. So exactly one exchange is in flight, the token alternates, and
   every message acknowledges the one before it (TICK seqs count up by one per
   exchange; a TOCK repeats its TICK's seq).
4. The holder sends TICK at once when it has deltas or was nudged, and otherwise
   after ``idle_ticks`` timer ticks: that is the heartbeat. A side waiting for the
   token with deltas of its own sends one NUDGE per token period.
5. A side that has received nothing for ``dead_ticks`` timer ticks declares the
   link down (missed toggles, counted in ticks, never read from a clock).
6. When, after merging the peer's message, our digest equals the digest in it,
   both hold the same state (*in sync*); when the peer's message also said it had
   matched our previous digest, we know that it knows (*mutual*).
7. Any message not allowed in the current state is a `RemoteProtocolError`; any
   send not allowed is a `LocalProtocolError`. Both name the state and the event,
   and the link is CLOSED afterwards. BYE, failure detection and the loss of the
   connection close from any open state.
8. After a reconnect a new Link starts from rule 1; replayed records are harmless
   because merge is idempotent.

The table `TRANSITIONS` is the whole state machine; the `Link` class only decides
*when* to take a transition and what the messages carry.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from convergenced.core.credentials import CredentialBook, CredentialExchange
from convergenced.core.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from convergenced.core.messages import Bye, Hello, Message, Nudge, Tick, Tock
from convergenced.core.node import NodeCore
from convergenced.core.packing import pack
from convergenced.core.records import Record, RecordKey
from convergenced.core.wire import (
    CREDENTIALS_VERSION,
    PROTOCOL_VERSION,
    FrameDecoder,
    WireLimits,
    decode_message,
    encode_message,
)


class Role(Enum):
    """Which side of the connection we are."""

    INITIATOR = "initiator"
    """We dialled; we hold the token first."""
    ACCEPTOR = "acceptor"
    """We accepted; the peer holds the token first."""


class LinkState(Enum):
    """States of a link."""

    START = "START"
    """Connected, nothing sent yet."""
    HELLO_SENT = "HELLO_SENT"
    """Our HELLO is out; waiting for the peer's."""
    HOLDING = "HOLDING"
    """We hold the token and no exchange is in flight."""
    TICK_SENT = "TICK_SENT"
    """Our TICK is in flight; waiting for its TOCK."""
    WAITING = "WAITING"
    """The peer holds the token (or its TICK is in flight)."""
    ANSWERING = "ANSWERING"
    """We received a TICK and owe its TOCK (transient, inside one call)."""
    CLOSED = "CLOSED"
    """Closed by BYE, error or failure detection; final."""


class Ev(Enum):
    """Events of the state machine: a message sent or received, or a timeout."""

    SEND_HELLO = "send HELLO"
    RECV_HELLO = "recv HELLO"
    SEND_TICK = "send TICK"
    RECV_TICK = "recv TICK"
    SEND_TOCK = "send TOCK"
    RECV_TOCK = "recv TOCK"
    SEND_NUDGE = "send NUDGE"
    RECV_NUDGE = "recv NUDGE"
    SEND_BYE = "send BYE"
    RECV_BYE = "recv BYE"
    DEAD = "link dead"
    """Failure detection (rule 5) or the connection was lost."""


S = LinkState
_OPEN = (S.START, S.HELLO_SENT, S.HOLDING, S.TICK_SENT, S.WAITING, S.ANSWERING)


def _table(role: Role) -> dict[LinkState, dict[Ev, LinkState]]:
    first = S.HOLDING if role is Role.INITIATOR else S.WAITING
    t: dict[LinkState, dict[Ev, LinkState]] = {
        S.START: {Ev.SEND_HELLO: S.HELLO_SENT},
        S.HELLO_SENT: {Ev.RECV_HELLO: first},
        S.HOLDING: {Ev.SEND_TICK: S.TICK_SENT, Ev.RECV_NUDGE: S.HOLDING},
        S.TICK_SENT: {Ev.RECV_TOCK: S.WAITING, Ev.RECV_NUDGE: S.TICK_SENT},
        S.WAITING: {Ev.RECV_TICK: S.ANSWERING, Ev.SEND_NUDGE: S.WAITING},
        S.ANSWERING: {Ev.SEND_TOCK: S.HOLDING},
        S.CLOSED: {},
    }
    for state in _OPEN:
        t[state].update({Ev.SEND_BYE: S.CLOSED, Ev.RECV_BYE: S.CLOSED, Ev.DEAD: S.CLOSED})
    return t


TRANSITIONS: dict[Role, dict[LinkState, dict[Ev, LinkState]]] = {
    role: _table(role) for role in Role
}
"""``TRANSITIONS[role][state][event] -> next state``; anything absent is illegal."""


# -- configuration and events ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class LinkConfig:
    """Per-link settings; durations are in timer ticks, never in seconds."""

    cluster: str
    idle_ticks: int = 1
    """Heartbeat: an idle holder sends TICK after this many timer ticks."""
    dead_ticks: int = 10
    """Nothing received for this many timer ticks: the link is down."""
    expected_peer: str | None = None
    """When dialling a known node, the node id the HELLO must carry."""
    allowed_peers: frozenset[str] | None = None
    """The cluster's node ids (None: any name is admitted)."""
    limits: WireLimits = field(default_factory=WireLimits)
    wire_version: int = PROTOCOL_VERSION
    """The version this side sends: 2, or 3 with credentials (CA-bound trust)."""
    credentials: CredentialBook | None = None
    """The node's credentials, shared by all its links (sent in version 3 only)."""


@dataclass(frozen=True, slots=True)
class Established:
    """HELLOs exchanged: the peer is ``peer`` at ``incarnation``."""

    peer: str
    incarnation: int


@dataclass(frozen=True, slots=True)
class RecordsMerged:
    """Records from the peer that changed our view."""

    records: tuple[Record, ...]


@dataclass(frozen=True, slots=True)
class ExchangeDone:
    """An exchange completed (we received the TOCK of our TICK, or sent one)."""

    seq: int
    in_sync: bool


@dataclass(frozen=True, slots=True)
class Closed:
    """The link is closed; ``error`` is set when a rule was broken."""

    reason: str
    error: ProtocolError | None = None


LinkEvent = Established | RecordsMerged | ExchangeDone | Closed


# -- the link -----------------------------------------------------------------


class Link:
    """One side of one peer connection, driven by bytes in and timer ticks.

    Usage (h11 style): `start`, then feed `receive_data` and `on_timer`, call `poll`
    after local changes, and after each call send `data_to_send()` and drain
    `next_event()`.
    """

    def __init__(self, node: NodeCore, role: Role, config: LinkConfig) -> None:
        self.node = node
        self.role = role
        self.config = config
        self.state = S.START
        self.peer: str | None = None
        self.peer_incarnation: int | None = None
        self.seq = 0
        """Seq of the last exchange (TICK/TOCK pair) on this link."""
        self.in_sync = False
        self.mutual = False
        self.frames_sent = 0
        self.frames_received = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.records_sent = 0
        self.frame_counts: dict[tuple[str, str], int] = {}
        """Frames by (direction, message type): ("sent", "TICK"), ("received", "TOCK")..."""
        self._decoder = FrameDecoder(config.limits)
        self._out = bytearray()
        self._events: deque[LinkEvent] = deque()
        self._peer_known: dict[RecordKey, tuple[int, int]] = {}
        self._sent_seq = 0
        self._backlog: list[Record] = []
        self._ticks_since_recv = 0
        self._ticks_since_sent = 0
        self._nudged = False  # we sent NUDGE this token period
        self._nudge_received = False  # peer nudged us this token period
        self._peer_matched = False  # peer's last message said it matched our digest
        self._told_all = False
        self._credentials = CredentialExchange(
            config.credentials, config.wire_version >= CREDENTIALS_VERSION
        )
        self._peer_links: frozenset[str] = frozenset()
        """Origins whose records we do not send on this link: the nodes the peer last
        said it is linked to (their records are theirs to send) and the peer itself."""

    # -- transitions ----------------------------------------------------------

    def _fire(self, event: Ev) -> None:
        nxt = TRANSITIONS[self.role][self.state].get(event)
        if nxt is None:
            remote = event.value.startswith("recv")
            cls = RemoteProtocolError if remote else LocalProtocolError
            err = cls(f"{event.value} is not allowed in state {self.state.value}",
                      reason="out_of_order")  # fmt: skip
            self._close_with(err)
            raise err
        self.state = nxt

    def _close_with(self, err: ProtocolError) -> None:
        if self.state is not S.CLOSED:
            if isinstance(err, RemoteProtocolError):
                self._emit(Bye(reason=f"{err.reason}: {err}"[:256]))
            self.state = S.CLOSED
            self._closed(str(err), err)

    # -- public API -------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once the link reached CLOSED (final)."""
        return self.state is S.CLOSED

    @property
    def would_send(self) -> bool:
        """True when `poll` would send something now (a TICK with deltas, one a NUDGE
        asked for, a heartbeat that is due, or a NUDGE of ours); changes nothing."""
        if self.state is S.HOLDING:
            return (
                self._nudge_received
                or self._ticks_since_sent >= self.config.idle_ticks
                or self._has_deltas()
            )
        return self.state is S.WAITING and not self._nudged and self._has_deltas()

    @property
    def has_output(self) -> bool:
        """True when bytes or events wait to be taken (`data_to_send`, `next_event`)."""
        return bool(self._out) or bool(self._events)

    def start(self) -> None:
        """Send our HELLO (call once the connection is up)."""
        self._fire(Ev.SEND_HELLO)
        self._emit(self._hello())

    def receive_data(self, data: bytes) -> None:
        """Feed bytes from the peer; ``b""`` means the peer closed the connection.

        Raises:
            RemoteProtocolError: the peer broke a rule; the link is now CLOSED.
        """
        if self.state is S.CLOSED:
            return
        if not data:
            self.connection_lost("connection closed by peer")
            return
        self.bytes_received += len(data)
        self._decoder.feed(data)
        while not self.closed:
            try:
                frame = self._decoder.next_frame()
                if frame is None:
                    break
                version = self._decoder.last_version
                msg = decode_message(frame[0], frame[1], self.config.limits, version)
            except RemoteProtocolError as err:
                self._close_with(err)
                raise
            self.frames_received += 1
            key = ("received", frame[0].name)
            self.frame_counts[key] = self.frame_counts.get(key, 0) + 1
            self._ticks_since_recv = 0
            self._handle(msg)
        self.poll()

    def on_timer(self) -> None:
        """One timer tick elapsed: heartbeat and failure detection."""
        if self.state is S.CLOSED:
            return
        self._ticks_since_recv += 1
        self._ticks_since_sent += 1
        if self._ticks_since_recv >= self.config.dead_ticks:
            self._fire(Ev.DEAD)
            self._closed(f"no message for {self._ticks_since_recv} ticks: link declared down")
            return
        self.poll()

    def poll(self) -> None:
        """Send what the rules call for now (after local changes, or any input)."""
        if self.state is S.HOLDING:
            creds = self._credential_deltas()  # before the records that need them
            deltas = self._deltas()
            idle = self._ticks_since_sent >= self.config.idle_ticks
            if deltas or creds or self._nudge_received or idle:
                self._send_tick(deltas, creds)
        elif self.state is S.WAITING and not self._nudged and self._has_deltas():
            self._fire(Ev.SEND_NUDGE)
            self._nudged = True
            self._emit(Nudge())

    def connection_lost(self, reason: str = "connection lost") -> None:
        """The connection is gone (or its owner stopped driving this link): close
        without a BYE. Every owner calls this, or `close`, before dropping a link,
        so the node never keeps counting a link that no longer exists."""
        if self.state is S.CLOSED:
            return
        self._fire(Ev.DEAD)
        self._closed(reason)

    def close(self, reason: str = "shutting down") -> None:
        """Send BYE and close (no-op when already closed)."""
        if self.state is S.CLOSED:
            return
        if self.state is not S.START:
            self._emit(Bye(reason=reason[:256]))
        self._fire(Ev.SEND_BYE)
        self._closed(reason)

    def data_to_send(self) -> bytes:
        """Bytes queued for the peer since the last call."""
        out = bytes(self._out)
        self._out.clear()
        return out

    def next_event(self) -> LinkEvent | None:
        """The next event, or None."""
        return self._events.popleft() if self._events else None

    # -- handlers ---------------------------------------------------------------

    def _handle(self, msg: Message) -> None:
        if isinstance(msg, Hello):
            self._fire(Ev.RECV_HELLO)
            self._on_hello(msg)
        elif isinstance(msg, Tick):
            self._fire(Ev.RECV_TICK)
            if msg.seq != self.seq + 1:
                self._protocol_violation(f"TICK.seq: {msg.seq}, expected {self.seq + 1}")
            self.seq = msg.seq
            self._nudged = False
            self._note_peer_links(msg.links)
            self._credentials.take(msg.credentials, self.peer)
            self._take(msg.records, msg.digest, msg.match)
            creds = self._credential_deltas()  # before the records that need them
            records = self._deltas()
            self._fire(Ev.SEND_TOCK)
            view = self.node.view
            self._emit(Tock(self.seq, view.digest, self.in_sync, tuple(records), self._links(),
                            creds))  # fmt: skip
            self._mark_sent(records)
            self._nudge_received = False
            self._events.append(ExchangeDone(self.seq, self.in_sync))
        elif isinstance(msg, Tock):
            self._fire(Ev.RECV_TOCK)
            if msg.seq != self.seq:
                self._protocol_violation(f"TOCK.seq: {msg.seq}, expected {self.seq}")
            self._note_peer_links(msg.links)
            self._credentials.take(msg.credentials, self.peer)
            self._take(msg.records, msg.digest, msg.match)
            self._nudge_received = False
            self._events.append(ExchangeDone(self.seq, self.in_sync))
        elif isinstance(msg, Nudge):
            self._fire(Ev.RECV_NUDGE)
            if self._nudge_received:
                self._protocol_violation(
                    f"{Ev.RECV_NUDGE.value} in state {self.state.value}: "
                    "more than one NUDGE per token period"
                )
            self._nudge_received = True
        else:
            self._fire(Ev.RECV_BYE)
            self._closed(f"peer said goodbye: {msg.reason}")

    def _protocol_violation(self, text: str, reason: str = "out_of_order") -> None:
        err = RemoteProtocolError(text, reason=reason)
        self._close_with(err)
        raise err

    def _on_hello(self, hello: Hello) -> None:
        cfg = self.config
        if hello.cluster != cfg.cluster:
            self._protocol_violation(
                f"HELLO.cluster: {hello.cluster!r}, expected {cfg.cluster!r}", "wrong_cluster"
            )
        if hello.node == self.node.node_id:
            self._protocol_violation(f"HELLO.node: {hello.node!r} is ourselves", "self_connection")
        if cfg.expected_peer is not None and hello.node != cfg.expected_peer:
            self._protocol_violation(
                f"HELLO.node: {hello.node!r}, expected {cfg.expected_peer!r}", "unexpected_peer"
            )
        if cfg.allowed_peers is not None and hello.node not in cfg.allowed_peers:
            self._protocol_violation(f"HELLO.node: {hello.node!r} is not in the cluster",
                                     "unknown_node")  # fmt: skip
        self.peer = hello.node
        self.peer_incarnation = hello.incarnation
        self._credentials.take(hello.credentials, hello.node)
        self._credentials.peer_is(hello.node)
        for stream, origin, inc, ver in hello.summary:
            self._note_known((stream, origin), (inc, ver))
        # Deltas start from the whole view, filtered by what the summary says.
        self._sent_seq = 0
        self.in_sync = hello.digest == self.node.view.digest
        self._events.append(Established(hello.node, hello.incarnation))
        self.node.link_up(hello.node)
        self.node.hello_from(hello.node, hello.incarnation, hello.summary)

    def _closed(self, reason: str, err: ProtocolError | None = None) -> None:
        self._events.append(Closed(reason, err))
        if self.peer is not None:  # established: the node counted us among its links
            self.node.link_down(self.peer)

    def _note_peer_links(self, links: tuple[str, ...]) -> None:
        # Never skip our own records (the peer is linked to us, of course). The peer's
        # own records are not skipped either: the known stamps keep its current ones
        # from bouncing back, and any we hold that it lacks are from a life it lost
        # (see `lives`), which it must hear of.
        me = self.node.node_id
        skip = set(links)
        skip.discard(me)
        if self.peer is not None:
            skip.discard(self.peer)
        gone = self._peer_links - skip
        self._peer_links = frozenset(skip)
        if gone:
            # The peer lost its link to these origins: what we skipped of theirs is
            # owed again (the known stamps filter out what the peer already has).
            self._backlog.extend(r for r in self.node.view if r.origin in gone)

    def _links(self) -> tuple[str, ...]:
        return tuple(sorted(self.node.neighbours))

    def _take(self, records: tuple[Record, ...], digest: bytes, peer_matched: bool) -> None:
        for rec in records:
            self._note_known(rec.key, rec.stamp)
        kept = self.node.receive(records, via=self.peer) if records else []
        if kept:
            self._events.append(RecordsMerged(tuple(kept)))
        self.in_sync = digest == self.node.view.digest
        if not self._told_all and self.peer is not None:
            me = self.node.node_id
            if self.in_sync or not any(r.origin == me for r in records):
                # The peer sends our own records first: none in this message means it
                # holds no more of them (or our views are equal).
                self._told_all = True
                self.node.told_all_of_ours(self.peer)
        if self.in_sync:
            # The peer held, when it sent this, exactly our view now: nothing changed
            # before this point needs sending, whatever our bookkeeping says.
            self._sent_seq = self.node.view.seq
            self._backlog = []
        self._peer_matched = peer_matched
        self.mutual = self.in_sync and peer_matched

    def _send_tick(self, records: list[Record], creds: tuple[bytes, ...]) -> None:
        self._fire(Ev.SEND_TICK)
        self.seq += 1
        view = self.node.view
        self._emit(Tick(self.seq, view.digest, self.in_sync, tuple(records), self._links(), creds))
        self._mark_sent(records)

    # -- deltas -------------------------------------------------------------------

    def _note_known(self, key: RecordKey, stamp: tuple[int, int]) -> None:
        old = self._peer_known.get(key)
        if old is None or stamp > old:
            self._peer_known[key] = stamp

    def _credential_deltas(self) -> tuple[bytes, ...]:
        return self._credentials.deltas(self.config.limits.max_frame_bytes // 4)

    def _has_deltas(self) -> bool:
        if self._credentials.pending():
            return True
        if any(not self._credentials.owed(r.origin, self.peer) for r in self._backlog):
            return True
        return self.node.view.any_changed_since(self._sent_seq, self._peer_known, self._peer_links)

    def _deltas(self) -> list[Record]:
        """Records the peer lacks as far as we know, within the frame budget."""
        view = self.node.view
        known = self._peer_known
        fresh = view.changed_since(self._sent_seq)
        self._sent_seq = view.seq
        pending = self._backlog + fresh
        # The peer's own records first (rarely any: only those of a life it lost), so
        # that a message without one tells it we hold no more of them (see `lives`).
        pending.sort(key=lambda r: r.origin != self.peer)
        me = self.node.node_id
        made_here = self.node.made_here_record
        out: list[Record] = []
        budget = self.config.limits.max_frame_bytes // 2
        limit = self.config.limits.max_records
        self._backlog = []
        seen: set[RecordKey] = set()
        owed: list[Record] = []  # their origin's credential has not gone out yet
        for i, rec in enumerate(pending):
            current = view.get(rec.key) or rec
            if current.key in seen or current.origin in self._peer_links:
                continue
            if self._credentials.owed(current.origin, self.peer):
                owed.append(current)
                continue
            if current.origin == me and not made_here(current):
                continue  # from a life of ours we lost: it would pass for our current one
            s = known.get(current.key)
            if s is not None and current.stamp <= s:
                continue
            size = len(current.packed())
            if len(out) >= limit or size > budget:
                self._backlog = [r for r in pending[i:] if r.key not in seen]
                break
            budget -= size
            seen.add(current.key)
            out.append(current)
        self._backlog += owed
        return out

    def _mark_sent(self, records: list[Record]) -> None:
        # TCP delivers in order or the connection (and this Link) dies, so what we
        # sent is what the peer will hold.
        for rec in records:
            self._note_known(rec.key, rec.stamp)
        self.records_sent += len(records)

    def _hello(self) -> Hello:
        # The summary is only an optimisation (what it leaves out is sent again, which
        # merge makes harmless), so it is cut to fit both the entry limit and, like
        # the records of a TICK, half a frame: a HELLO over the peer's frame limit
        # would be refused and the link could never come up.
        view = self.node.view
        cap = self.config.limits.max_summary
        budget = self.config.limits.max_frame_bytes // 2
        summary: list[tuple[str, str, int, int]] = []
        # The peer's own records first: a cut summary must never hide from a node
        # that lost its state the records of its that we hold (see `lives`).
        for entry in self.node.hello_summary(first=self.config.expected_peer):
            budget -= len(pack(list(entry)))
            if len(summary) >= cap or budget < 0:
                break
            summary.append(entry)
        return Hello(
            self.config.cluster,
            self.node.node_id,
            self.node.incarnation,
            view.digest,
            tuple(summary),
            self._credentials.own(self.node.node_id),
        )

    def _emit(self, msg: Message) -> None:
        frame = encode_message(msg, self.config.wire_version)
        self._out += frame
        self.frames_sent += 1
        self.bytes_sent += len(frame)
        key = ("sent", type(msg).__name__.upper())
        self.frame_counts[key] = self.frame_counts.get(key, 0) + 1
        self._ticks_since_sent = 0
