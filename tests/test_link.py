"""The link state machine, as a specification (rules 1-8 at the top of link.py).

Two kinds of test, both without sockets:

* one `Link` driven by hand-made frames from a scripted peer, for exact control
  over the order and content of what it receives;
* two `Link`s on two `NodeCore`s pumping bytes to each other, for the behaviour of
  a real pair (token passing, deltas, sync, reconnection).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from convergenced.core.errors import LocalProtocolError, RemoteProtocolError
from convergenced.core.facts import Commit, Declare
from convergenced.core.interval_set import IntervalSet
from convergenced.core.link import (
    TRANSITIONS,
    Closed,
    Established,
    Ev,
    ExchangeDone,
    Link,
    LinkConfig,
    LinkEvent,
    LinkState,
    RecordsMerged,
    Role,
)
from convergenced.core.messages import Bye, Hello, Message, Nudge, Tick, Tock
from convergenced.core.node import NodeCore
from convergenced.core.records import Record
from convergenced.core.spec import Policy, StreamSpec
from convergenced.core.wire import (
    FrameDecoder,
    WireLimits,
    decode_message,
    encode_message,
)

S = LinkState
CLUSTER = "test-cluster"
OPEN_STATES = (S.START, S.HELLO_SENT, S.HOLDING, S.TICK_SENT, S.WAITING, S.ANSWERING)
RECV_EVENTS = (Ev.RECV_HELLO, Ev.RECV_TICK, Ev.RECV_TOCK, Ev.RECV_NUDGE, Ev.RECV_BYE)
SEND_EVENT = {
    Hello: Ev.SEND_HELLO,
    Tick: Ev.SEND_TICK,
    Tock: Ev.SEND_TOCK,
    Nudge: Ev.SEND_NUDGE,
    Bye: Ev.SEND_BYE,
}
RECV_EVENT = {
    Hello: Ev.RECV_HELLO,
    Tick: Ev.RECV_TICK,
    Tock: Ev.RECV_TOCK,
    Nudge: Ev.RECV_NUDGE,
    Bye: Ev.RECV_BYE,
}


# -- helpers ------------------------------------------------------------------


def decode_all(data: bytes, limits: WireLimits | None = None) -> list[Message]:
    """Every frame in ``data`` (which must hold whole frames only)."""
    dec = FrameDecoder(limits)
    dec.feed(data)
    out: list[Message] = []
    while (frame := dec.next_frame()) is not None:
        out.append(decode_message(frame[0], frame[1], limits))
    assert dec.buffered == 0, "a partial frame was queued"
    return out


def drain(link: Link) -> list[LinkEvent]:
    """All pending events of ``link``."""
    out: list[LinkEvent] = []
    while (ev := link.next_event()) is not None:
        out.append(ev)
    return out


def relayed(origin: str, version: int = 1, stream: str = "relayed") -> Record:
    """A record of some other node, as a node would hold and relay it."""
    return Record(
        stream=stream,
        origin=origin,
        incarnation=1,
        version=version,
        spec_digest=bytes(32),
        recoverable=IntervalSet.span(0, version),
    )


def make_node(node_id: str, records: list[Record] | None = None) -> NodeCore:
    """A node whose view holds ``records``."""
    node = NodeCore(node_id, incarnation=1)
    node.receive(records or [])
    return node


def config(**overrides: object) -> LinkConfig:
    """A link config for the test cluster."""
    return LinkConfig(cluster=CLUSTER, **overrides)  # type: ignore[arg-type]


# -- a single link and a scripted peer ------------------------------------------


def peer_hello(node: NodeCore, *, name: str = "b", cluster: str = CLUSTER) -> Hello:
    """A HELLO from a peer whose view equals ``node``'s (so nothing is owed)."""
    return Hello(cluster, name, 1, node.view.digest, ())


def feed(link: Link, *msgs: Message) -> list[Message]:
    """Deliver ``msgs`` to ``link``; return what it sent in response."""
    link.receive_data(b"".join(encode_message(m) for m in msgs))
    return decode_all(link.data_to_send())


def opened(role: Role, node: NodeCore | None = None, **cfg: object) -> Link:
    """A link past its HELLOs, in sync with the scripted peer, nothing pending."""
    node = node or make_node("a")
    link = Link(node, role, config(**cfg))
    link.start()
    assert isinstance(decode_all(link.data_to_send())[0], Hello)
    assert feed(link, peer_hello(node)) == []
    assert [type(e) for e in drain(link)] == [Established]
    return link


def link_in(role: Role, state: LinkState) -> Link:
    """A link of ``role`` brought to ``state`` by legal messages only."""
    if state is S.START:
        return Link(make_node("a"), role, config())
    if state is S.HELLO_SENT:
        link = Link(make_node("a"), role, config())
        link.start()
        link.data_to_send()
        return link
    link = opened(role)
    digest = link.node.view.digest
    if role is Role.ACCEPTOR and state in (S.HOLDING, S.TICK_SENT):
        feed(link, Tick(1, digest, True, ()))  # answered with TOCK: we hold the token
    if role is Role.INITIATOR and state is S.WAITING:
        link.on_timer()  # heartbeat TICK
        link.data_to_send()
        feed(link, Tock(1, digest, True, ()))
    if state is S.TICK_SENT:
        link.on_timer()
        link.data_to_send()
    drain(link)
    assert link.state is state
    return link


def message_for(event: Ev, link: Link) -> Message:
    """A message that is well-formed and carries the right seq, for ``event``."""
    digest = link.node.view.digest
    if event is Ev.RECV_HELLO:
        return peer_hello(link.node)
    if event is Ev.RECV_TICK:
        return Tick(link.seq + 1, digest, True, ())
    if event is Ev.RECV_TOCK:
        return Tock(max(link.seq, 1), digest, True, ())
    if event is Ev.RECV_NUDGE:
        return Nudge()
    assert event is Ev.RECV_BYE
    return Bye("test")


# -- the table ------------------------------------------------------------------


def test_transitions_cover_every_role_and_state() -> None:
    assert set(TRANSITIONS) == set(Role)
    for table in TRANSITIONS.values():
        assert set(table) == set(LinkState)
        for events in table.values():
            assert all(isinstance(e, Ev) and isinstance(t, LinkState) for e, t in events.items())


def test_transitions_are_the_documented_state_machine() -> None:
    # Rules 1-3 as data; the close events are checked separately.
    for role, first in ((Role.INITIATOR, S.HOLDING), (Role.ACCEPTOR, S.WAITING)):
        table = {
            state: {e: t for e, t in events.items() if t is not S.CLOSED}
            for state, events in TRANSITIONS[role].items()
        }
        assert table == {
            S.START: {Ev.SEND_HELLO: S.HELLO_SENT},
            S.HELLO_SENT: {Ev.RECV_HELLO: first},
            S.HOLDING: {Ev.SEND_TICK: S.TICK_SENT, Ev.RECV_NUDGE: S.HOLDING},
            S.TICK_SENT: {Ev.RECV_TOCK: S.WAITING, Ev.RECV_NUDGE: S.TICK_SENT},
            S.WAITING: {Ev.RECV_TICK: S.ANSWERING, Ev.SEND_NUDGE: S.WAITING},
            S.ANSWERING: {Ev.SEND_TOCK: S.HOLDING},
            S.CLOSED: {},
        }


@pytest.mark.parametrize("role", list(Role))
def test_bye_and_failure_close_every_open_state(role: Role) -> None:
    for state in OPEN_STATES:
        for event in (Ev.SEND_BYE, Ev.RECV_BYE, Ev.DEAD):
            assert TRANSITIONS[role][state][event] is S.CLOSED


@pytest.mark.parametrize("role", list(Role))
def test_closed_is_final(role: Role) -> None:
    assert TRANSITIONS[role][S.CLOSED] == {}
    for state, events in TRANSITIONS[role].items():
        if state is not S.CLOSED:
            assert state in OPEN_STATES
            assert S.START not in events.values(), "nothing leads back to START"


# -- illegal messages and sends (rule 7) ------------------------------------------

ILLEGAL_RECEIVES = [
    pytest.param(role, state, event, id=f"{role.value}-{state.value}-{event.name}")
    for role, state, event in itertools.product(
        Role, (S.START, S.HELLO_SENT, S.HOLDING, S.TICK_SENT, S.WAITING), RECV_EVENTS
    )
    if event not in TRANSITIONS[role][state]
]
LEGAL_RECEIVES = [
    pytest.param(role, state, event, id=f"{role.value}-{state.value}-{event.name}")
    for role, state, event in itertools.product(
        Role, (S.START, S.HELLO_SENT, S.HOLDING, S.TICK_SENT, S.WAITING), RECV_EVENTS
    )
    if event in TRANSITIONS[role][state]
]


def test_every_reachable_state_rejects_some_message() -> None:
    states = {p.values[1] for p in ILLEGAL_RECEIVES}
    assert states == {S.START, S.HELLO_SENT, S.HOLDING, S.TICK_SENT, S.WAITING}


@pytest.mark.parametrize(("role", "state", "event"), ILLEGAL_RECEIVES)
def test_illegal_message_is_a_remote_error_and_closes(
    role: Role, state: LinkState, event: Ev
) -> None:
    link = link_in(role, state)
    with pytest.raises(RemoteProtocolError) as info:
        link.receive_data(encode_message(message_for(event, link)))
    err = info.value
    assert err.reason == "out_of_order"
    assert str(err) == f"{event.value} is not allowed in state {state.value}"
    assert link.state is S.CLOSED
    sent = decode_all(link.data_to_send())
    assert len(sent) == 1
    assert isinstance(sent[0], Bye)
    assert sent[0].reason.startswith("out_of_order: ")
    assert str(err) in sent[0].reason
    events = drain(link)
    assert isinstance(events[-1], Closed)
    assert events[-1].error is err


@pytest.mark.parametrize(("role", "state", "event"), LEGAL_RECEIVES)
def test_legal_message_follows_the_table(role: Role, state: LinkState, event: Ev) -> None:
    # Replaying what the link received and then sent through TRANSITIONS must give the
    # state the link is in: the table is the whole state machine.
    link = link_in(role, state)
    sent = feed(link, message_for(event, link))
    expected = TRANSITIONS[role][state][event]
    for msg in sent:
        expected = TRANSITIONS[role][expected][SEND_EVENT[type(msg)]]
    assert link.state is expected


def test_closed_link_ignores_further_bytes() -> None:
    link = opened(Role.INITIATOR)
    feed(link, Bye("done"))
    link.receive_data(b"garbage that would otherwise be refused")
    link.on_timer()
    assert link.closed
    assert link.data_to_send() == b""


def test_starting_twice_is_a_local_error() -> None:
    link = Link(make_node("a"), Role.INITIATOR, config())
    link.start()
    with pytest.raises(LocalProtocolError) as info:
        link.start()
    assert str(info.value) == "send HELLO is not allowed in state HELLO_SENT"
    assert info.value.reason == "out_of_order"
    assert link.closed
    closed = drain(link)[-1]
    assert isinstance(closed, Closed)
    assert closed.error is info.value


def test_starting_an_open_link_is_a_local_error() -> None:
    link = opened(Role.ACCEPTOR)
    with pytest.raises(LocalProtocolError, match="send HELLO is not allowed in state WAITING"):
        link.start()
    assert link.closed


def test_starting_a_closed_link_is_a_local_error() -> None:
    link = Link(make_node("a"), Role.INITIATOR, config())
    link.close()
    with pytest.raises(LocalProtocolError, match="send HELLO is not allowed in state CLOSED"):
        link.start()


def test_malformed_frame_closes_with_bye_naming_the_reason() -> None:
    link = opened(Role.ACCEPTOR)
    with pytest.raises(RemoteProtocolError) as info:
        link.receive_data(b"CVGD\x02\x02\x00\x00\x00\x00\x00\x01\xc1")
    assert info.value.reason == "malformed_body"
    assert link.closed
    [bye] = decode_all(link.data_to_send())
    assert isinstance(bye, Bye)
    assert bye.reason.startswith("malformed_body: TICK: malformed msgpack body")


def test_bye_reason_is_cut_to_the_wire_limit() -> None:
    link = opened(Role.ACCEPTOR, allowed_peers=frozenset({"b"}))
    link.close("x" * 1000)
    [bye] = decode_all(link.data_to_send())
    assert bye == Bye("x" * 256)


# -- HELLO (rules 1, 2 and 8) -----------------------------------------------------


def test_both_sides_send_hello_first() -> None:
    for role in Role:
        node = make_node("a", [relayed("z")])
        link = Link(node, role, config())
        link.start()
        [hello] = decode_all(link.data_to_send())
        assert hello == Hello(CLUSTER, "a", 1, node.view.digest, (("relayed", "z", 1, 1),))


def test_established_names_the_peer() -> None:
    link = Link(make_node("a"), Role.ACCEPTOR, config())
    link.start()
    link.receive_data(encode_message(Hello(CLUSTER, "b", 7, bytes(16), ())))
    assert drain(link) == [Established("b", 7)]
    assert (link.peer, link.peer_incarnation) == ("b", 7)


def test_repeated_hello_is_rejected() -> None:
    link = opened(Role.INITIATOR)
    with pytest.raises(RemoteProtocolError, match="recv HELLO is not allowed in state HOLDING"):
        feed(link, peer_hello(link.node))
    assert link.closed


@pytest.mark.parametrize(
    ("hello", "cfg", "reason", "text"),
    [
        pytest.param(
            Hello("other-cluster", "b", 1, bytes(16), ()),
            {},
            "wrong_cluster",
            "HELLO.cluster: 'other-cluster', expected 'test-cluster'",
            id="wrong-cluster",
        ),
        pytest.param(
            Hello(CLUSTER, "a", 1, bytes(16), ()),
            {},
            "self_connection",
            "HELLO.node: 'a' is ourselves",
            id="self-connection",
        ),
        pytest.param(
            Hello(CLUSTER, "c", 1, bytes(16), ()),
            {"expected_peer": "b"},
            "unexpected_peer",
            "HELLO.node: 'c', expected 'b'",
            id="unexpected-peer",
        ),
        pytest.param(
            Hello(CLUSTER, "z", 1, bytes(16), ()),
            {"allowed_peers": frozenset({"b", "c"})},
            "unknown_node",
            "HELLO.node: 'z' is not in the cluster",
            id="unknown-node",
        ),
    ],
)
def test_hello_from_the_wrong_peer_is_rejected(
    hello: Hello, cfg: dict[str, object], reason: str, text: str
) -> None:
    link = Link(make_node("a"), Role.INITIATOR, config(**cfg))
    link.start()
    link.data_to_send()
    with pytest.raises(RemoteProtocolError) as info:
        link.receive_data(encode_message(hello))
    assert info.value.reason == reason
    assert str(info.value) == text
    assert link.closed
    assert link.peer is None
    [bye] = decode_all(link.data_to_send())
    assert isinstance(bye, Bye)
    assert bye.reason == f"{reason}: {text}"
    assert [type(e) for e in drain(link)] == [Closed]


def test_hello_from_the_expected_and_allowed_peer_is_accepted() -> None:
    link = opened(Role.INITIATOR, expected_peer="b", allowed_peers=frozenset({"b", "c"}))
    assert link.peer == "b"
    assert link.state is S.HOLDING


def test_hello_summary_is_cut_to_fit_a_frame() -> None:
    # A HELLO above the peer's frame limit would be refused and the link could never
    # come up; the summary is only an optimisation, so it is cut instead.
    limits = WireLimits(max_frame_bytes=2048)
    node = make_node("a", [relayed(f"origin-{i:04d}") for i in range(200)])
    link = Link(node, Role.INITIATOR, config(limits=limits))
    link.start()
    data = link.data_to_send()
    assert len(data) <= 12 + limits.max_frame_bytes
    [hello] = decode_all(data, limits)
    assert isinstance(hello, Hello)
    assert 0 < len(hello.summary) < 200


def test_hello_summary_is_cut_to_max_summary() -> None:
    node = make_node("a", [relayed(f"o{i}") for i in range(10)])
    link = Link(node, Role.INITIATOR, config(limits=WireLimits(max_summary=4)))
    link.start()
    [hello] = decode_all(link.data_to_send())
    assert isinstance(hello, Hello)
    assert len(hello.summary) == 4


# -- the token (rules 2, 3 and 4) ----------------------------------------------------


def test_initiator_holds_the_token_first() -> None:
    initiator, acceptor = opened(Role.INITIATOR), opened(Role.ACCEPTOR)
    assert initiator.state is S.HOLDING
    assert acceptor.state is S.WAITING
    # The acceptor never starts an exchange, however long it waits...
    acceptor.on_timer()
    assert acceptor.data_to_send() == b""
    # ...while the initiator's heartbeat is a TICK.
    initiator.on_timer()
    [tick] = decode_all(initiator.data_to_send())
    assert tick == Tick(1, initiator.node.view.digest, True, (), ("b",))


def test_tick_is_answered_by_tock_with_the_same_seq_and_the_token_passes() -> None:
    link = opened(Role.ACCEPTOR)
    sent = feed(link, Tick(1, link.node.view.digest, True, ()))
    assert sent == [Tock(1, link.node.view.digest, True, (), ("b",))]
    assert link.state is S.HOLDING
    assert drain(link) == [ExchangeDone(1, True)]


def test_tock_ends_the_exchange_and_the_token_passes() -> None:
    link = opened(Role.INITIATOR)
    link.on_timer()
    link.data_to_send()
    assert feed(link, Tock(1, link.node.view.digest, True, ())) == []
    assert link.state is S.WAITING
    assert drain(link) == [ExchangeDone(1, True)]


def test_tock_with_the_wrong_seq_is_rejected() -> None:
    link = opened(Role.INITIATOR)
    link.on_timer()
    link.data_to_send()
    with pytest.raises(RemoteProtocolError) as info:
        feed(link, Tock(2, link.node.view.digest, True, ()))
    assert str(info.value) == "TOCK.seq: 2, expected 1"
    assert link.closed
    assert isinstance(decode_all(link.data_to_send())[-1], Bye)


@pytest.mark.parametrize("seq", [1, 3, 4])
def test_tick_seq_must_be_the_next_one(seq: int) -> None:
    link = opened(Role.INITIATOR)
    link.on_timer()  # TICK 1
    feed(link, Tock(1, link.node.view.digest, True, ()))
    with pytest.raises(RemoteProtocolError) as info:
        feed(link, Tick(seq, link.node.view.digest, True, ()))
    assert str(info.value) == f"TICK.seq: {seq}, expected 2"
    assert link.closed


def test_heartbeat_after_idle_ticks() -> None:
    link = opened(Role.INITIATOR, idle_ticks=3)
    for _ in range(2):
        link.on_timer()
        assert link.data_to_send() == b""
    link.on_timer()
    assert decode_all(link.data_to_send()) == [Tick(1, link.node.view.digest, True, (), ("b",))]


def test_heartbeat_bounds_our_own_silence() -> None:
    # The peer's dead timer counts ticks since it last heard from us, so the heartbeat
    # counts ticks since we last sent, not since we last received.
    node = make_node("a")
    link = Link(node, Role.INITIATOR, config(idle_ticks=3))
    link.start()
    link.data_to_send()
    link.on_timer()
    link.on_timer()
    assert feed(link, peer_hello(node)) == []
    link.on_timer()
    assert decode_all(link.data_to_send()) == [Tick(1, node.view.digest, True, (), ("b",))]


def test_holder_with_deltas_ticks_at_once() -> None:
    link = opened(Role.INITIATOR, idle_ticks=100)
    rec = relayed("z")
    link.node.receive([rec])
    link.poll()
    [tick] = decode_all(link.data_to_send())
    assert isinstance(tick, Tick)
    assert tick.records == (rec,)
    assert link.records_sent == 1


def test_nudge_makes_an_idle_holder_tick() -> None:
    link = opened(Role.INITIATOR, idle_ticks=100)
    assert feed(link, Nudge()) == [Tick(1, link.node.view.digest, True, (), ("b",))]
    assert link.state is S.TICK_SENT


def test_second_nudge_in_one_token_period_is_rejected() -> None:
    link = opened(Role.INITIATOR, idle_ticks=100)
    feed(link, Nudge())
    with pytest.raises(RemoteProtocolError) as info:
        feed(link, Nudge())
    assert str(info.value) == (
        "recv NUDGE in state TICK_SENT: more than one NUDGE per token period"
    )
    assert info.value.reason == "out_of_order"
    assert link.closed
    assert isinstance(decode_all(link.data_to_send())[-1], Bye)


def test_nudge_is_allowed_again_in_the_next_token_period() -> None:
    link = opened(Role.INITIATOR, idle_ticks=100)
    digest = link.node.view.digest
    feed(link, Nudge())  # -> TICK 1
    feed(link, Tock(1, digest, True, ()))
    assert feed(link, Tick(2, digest, True, ())) == [Tock(2, digest, True, (), ("b",))]
    assert feed(link, Nudge()) == [Tick(3, digest, True, (), ("b",))]


def test_waiting_side_with_deltas_nudges_once_per_token_period() -> None:
    link = opened(Role.ACCEPTOR)
    rec = relayed("z")
    link.node.receive([rec])
    link.poll()
    assert decode_all(link.data_to_send()) == [Nudge()]
    link.poll()
    link.on_timer()
    assert link.data_to_send() == b"", "one NUDGE per token period"
    # The peer's TICK carries the token: the deltas ride on our TOCK.
    [tock] = feed(link, Tick(1, bytes(16), False, ()))
    assert isinstance(tock, Tock)
    assert tock.records == (rec,)


# -- failure detection and closing (rules 5 and 7) ---------------------------------


def test_silence_for_dead_ticks_closes_the_link() -> None:
    link = opened(Role.ACCEPTOR, dead_ticks=4)
    for _ in range(3):
        link.on_timer()
    assert not link.closed
    link.on_timer()
    assert link.closed
    [closed] = drain(link)
    assert isinstance(closed, Closed)
    assert closed.error is None
    assert "no message for 4 ticks" in closed.reason


def test_any_message_resets_the_dead_timer() -> None:
    link = opened(Role.ACCEPTOR, dead_ticks=3)
    digest = link.node.view.digest
    for seq in (1, 3, 5):
        link.on_timer()
        link.on_timer()
        feed(link, Tick(seq, digest, True, ()))
        link.on_timer()  # heartbeat TICK
        link.on_timer()
        feed(link, Tock(seq + 1, digest, True, ()))
    assert not link.closed


def test_waiting_for_hello_counts_toward_dead() -> None:
    link = link_in(Role.INITIATOR, S.HELLO_SENT)
    for _ in range(10):
        link.on_timer()
    assert link.closed


def test_bye_closes_the_link() -> None:
    link = opened(Role.ACCEPTOR)
    assert feed(link, Bye("maintenance")) == []
    assert link.closed
    assert drain(link) == [Closed("peer said goodbye: maintenance")]


def test_frames_after_bye_are_ignored() -> None:
    link = opened(Role.ACCEPTOR)
    assert feed(link, Bye("done"), Nudge(), Nudge()) == []
    assert link.closed
    assert drain(link) == [Closed("peer said goodbye: done")]


def test_close_sends_bye() -> None:
    link = opened(Role.INITIATOR)
    link.close("restarting")
    assert decode_all(link.data_to_send()) == [Bye("restarting")]
    assert drain(link) == [Closed("restarting")]
    link.close("again")
    assert link.data_to_send() == b""


def test_close_before_start_sends_nothing() -> None:
    link = Link(make_node("a"), Role.INITIATOR, config())
    link.close()
    assert link.closed
    assert link.data_to_send() == b""


def test_peer_eof_closes_the_link() -> None:
    link = opened(Role.INITIATOR)
    link.receive_data(b"")
    assert link.closed
    assert drain(link) == [Closed("connection closed by peer")]
    assert link.data_to_send() == b""


# -- two real links -------------------------------------------------------------------


@dataclass
class Wire:
    """Two links with a perfect in-order pipe between them, and a log of frames."""

    a: Link
    b: Link
    trickle: bool = False
    log: list[tuple[str, Message]] = field(default_factory=list)

    def pump(self, limit: int = 1000) -> None:
        """Deliver queued bytes both ways until both sides are quiet."""
        for _ in range(limit):
            moved = False
            for src, dst, name in ((self.a, self.b, "a"), (self.b, self.a, "b")):
                data = src.data_to_send()
                if not data:
                    continue
                moved = True
                self.log += [(name, m) for m in decode_all(data, src.config.limits)]
                if self.trickle:
                    for i in range(len(data)):
                        dst.receive_data(data[i : i + 1])
                else:
                    dst.receive_data(data)
            if not moved:
                return
        raise AssertionError("links never went quiet")

    def tick(self, n: int = 1) -> None:
        """``n`` timer ticks on both sides, pumping after each."""
        for _ in range(n):
            self.a.on_timer()
            self.b.on_timer()
            self.pump()

    def sent(self, name: str, kind: type[Message]) -> list[Message]:
        """Messages of type ``kind`` sent by side ``name``."""
        return [m for n, m in self.log if n == name and isinstance(m, kind)]


def connect(node_a: NodeCore, node_b: NodeCore, *, trickle: bool = False, **cfg: object) -> Wire:
    """Start a link pair (``a`` dials ``b``) and exchange the HELLOs."""
    wire = Wire(
        Link(node_a, Role.INITIATOR, config(**cfg)),
        Link(node_b, Role.ACCEPTOR, config(**cfg)),
        trickle=trickle,
    )
    wire.a.start()
    wire.b.start()
    wire.pump()
    return wire


def synced(wire: Wire) -> bool:
    """Both views equal and both links say so, mutually."""
    a, b = wire.a, wire.b
    same = a.node.view.digest == b.node.view.digest
    return same and a.in_sync and b.in_sync and a.mutual and b.mutual


SPEC = StreamSpec.create("job", {"a": [0], "b": [1]}, Policy.all_of("nvme"))


def training_node(node_id: str, rank: int, epochs: range, incarnation: int = 1) -> NodeCore:
    """A member of SPEC that committed ``epochs`` for its rank."""
    node = NodeCore(node_id, incarnation)
    node.apply(Declare(SPEC))
    for e in epochs:
        node.apply(Commit("job", rank, "nvme", e))
    return node


def test_pair_converges_on_a_restore_point() -> None:
    a, b = training_node("a", 0, range(0, 8)), training_node("b", 1, range(3, 12))
    wire = connect(a, b)
    wire.tick(6)
    assert synced(wire)
    assert a.restore_point("job") == b.restore_point("job") == 7


def test_token_alternates_and_seq_counts_exchanges() -> None:
    wire = connect(make_node("a", [relayed("x")]), make_node("b", [relayed("y")]))
    wire.tick(6)
    exchanges = [(n, m) for n, m in wire.log if isinstance(m, Tick | Tock)]
    assert len(exchanges) >= 8
    for i, (sender, msg) in enumerate(exchanges):
        seq = i // 2 + 1
        holder = "a" if seq % 2 else "b"  # the initiator ticks first, then turns alternate
        if i % 2 == 0:
            assert (sender, type(msg), msg.seq) == (holder, Tick, seq)
        else:
            assert (sender, type(msg), msg.seq) == ("b" if holder == "a" else "a", Tock, seq)
    assert wire.a.seq == wire.b.seq == len(exchanges) // 2


def test_in_sync_and_mutual_after_quiet_exchanges() -> None:
    a = Link(make_node("a", [relayed("x")]), Role.INITIATOR, config())
    b = Link(make_node("b", [relayed("y")]), Role.ACCEPTOR, config())
    a.start()
    b.start()
    hello_a, hello_b = a.data_to_send(), b.data_to_send()
    b.receive_data(hello_a)
    a.receive_data(hello_b)
    assert (a.in_sync, a.mutual, b.in_sync, b.mutual) == (False, False, False, False)
    wire = Wire(a, b)
    wire.tick(4)
    assert synced(wire)
    # A local change breaks the agreement until it has been exchanged again.
    wire.b.node.receive([relayed("x", version=2)])
    wire.b.poll()
    wire.pump()
    wire.tick(4)
    assert synced(wire)
    assert wire.a.node.view.get(("relayed", "x")) == relayed("x", version=2)


def test_mutual_needs_the_peer_to_have_matched_too() -> None:
    link = opened(Role.ACCEPTOR)
    digest = link.node.view.digest
    # Same digest, but the peer says it had not matched ours: we know, it may not.
    [tock] = feed(link, Tick(1, digest, False, ()))
    assert (link.in_sync, link.mutual) == (True, False)
    assert tock == Tock(1, digest, True, (), ("b",))
    link.on_timer()
    link.data_to_send()
    feed(link, Tock(2, digest, True, ()))
    assert (link.in_sync, link.mutual) == (True, True)
    # A differing digest clears both.
    feed(link, Tick(3, b"\x01" * 16, True, ()))
    assert (link.in_sync, link.mutual) == (False, False)


def test_records_merged_events_report_what_changed_the_view() -> None:
    rec = relayed("x")
    wire = connect(make_node("a", [rec]), make_node("b"))
    wire.tick(2)
    merged = [e for e in drain(wire.b) if isinstance(e, RecordsMerged)]
    assert merged == [RecordsMerged((rec,))]
    assert not [e for e in drain(wire.a) if isinstance(e, RecordsMerged)]


def test_records_are_sent_once() -> None:
    records = [relayed(f"o{i}") for i in range(20)]
    wire = connect(make_node("a", records), make_node("b", records[:5]))
    wire.tick(5)
    assert synced(wire)
    assert wire.a.records_sent == 15, "the HELLO summary says b holds five already"
    assert wire.b.records_sent == 0


def test_backlog_above_max_records_is_sent_over_several_exchanges() -> None:
    limits = WireLimits(max_records=3)
    records = [relayed(f"o{i}") for i in range(10)]
    wire = connect(make_node("a", records), make_node("b"), limits=limits, idle_ticks=100)
    for _ in range(10):
        wire.tick()
    assert wire.b.node.view.digest == wire.a.node.view.digest
    batches = [len(m.records) for n, m in wire.log if n == "a" and isinstance(m, Tick | Tock)]
    assert [n for n in batches if n] == [3, 3, 3, 1]
    assert wire.a.records_sent == 10
    # With idle_ticks=100 no heartbeat ran: the backlog moved by NUDGE alone.
    assert wire.sent("a", Nudge)


def test_backlog_above_the_frame_budget_is_sent_over_several_exchanges() -> None:
    limits = WireLimits(max_frame_bytes=1024)
    records = [relayed(f"origin-{i:03d}") for i in range(40)]
    wire = connect(make_node("a", records), make_node("b"), limits=limits)
    wire.tick(40)
    assert synced(wire)
    assert wire.a.records_sent == 40
    assert all(len(encode_message(m)) <= 12 + 1024 for _, m in wire.log)


def test_reconnection_replays_only_what_changed() -> None:
    a, b = training_node("a", 0, range(0, 5)), training_node("b", 1, range(0, 5))
    a.receive([relayed(f"o{i}") for i in range(10)])
    first = connect(a, b)
    first.tick(4)
    assert synced(first)
    assert first.a.records_sent >= 11, "first contact: all ten relayed records and its own"
    first.a.close("network blip")
    first.pump()
    assert first.a.closed
    assert first.b.closed
    # While apart, a commits one more epoch: only its own record changed.
    a.apply(Commit("job", 0, "nvme", 5))
    second = connect(a, b)
    second.tick(4)
    assert synced(second)
    assert second.a.records_sent == 1
    assert second.b.records_sent == 0
    assert b.view.get(("job", "a")) == a.view.get(("job", "a"))


def test_reconnection_after_a_restart_ends_in_sync() -> None:
    a, b = training_node("a", 0, range(0, 5)), training_node("b", 1, range(0, 5))
    first = connect(a, b)
    first.tick(4)
    first.a.receive_data(b"")  # the connection dropped
    first.b.receive_data(b"")
    # b restarts: new incarnation, same facts; its old record is superseded.
    b2 = training_node("b", 1, range(0, 5), incarnation=2)
    second = connect(a, b2)
    second.tick(6)
    assert synced(second)
    record_of_b = a.view.get(("job", "b"))
    assert record_of_b is not None
    assert record_of_b.incarnation == 2
    assert a.restore_point("job") == b2.restore_point("job") == 4


def test_links_fed_one_byte_at_a_time_behave_the_same() -> None:
    records = [relayed(f"o{i}") for i in range(5)]
    whole = connect(make_node("a", records), make_node("b"))
    whole.tick(4)
    trickled = connect(make_node("a", records), make_node("b"), trickle=True)
    trickled.tick(4)
    assert synced(trickled)
    assert trickled.log == whole.log


# -- random schedules -------------------------------------------------------------------


@dataclass
class Pipe:
    """One direction of a connection: bytes in flight, delivered in order, in any chunks."""

    src: Link
    dst: Link
    buf: bytearray = field(default_factory=bytearray)

    def collect(self) -> None:
        self.buf += self.src.data_to_send()

    def deliver(self, n: int) -> None:
        self.collect()
        chunk, self.buf[:n] = bytes(self.buf[:n]), b""
        if chunk:
            self.dst.receive_data(chunk)


def chain(nodes: list[NodeCore]) -> list[Pipe]:
    """Links between neighbours of ``nodes`` (a line), both directions as pipes."""
    pipes: list[Pipe] = []
    for left, right in itertools.pairwise(nodes):
        a = Link(left, Role.INITIATOR, config(idle_ticks=2, dead_ticks=1000))
        b = Link(right, Role.ACCEPTOR, config(idle_ticks=2, dead_ticks=1000))
        a.start()
        b.start()
        pipes += [Pipe(a, b), Pipe(b, a)]
    return pipes


operations = st.lists(
    st.one_of(
        st.tuples(st.just("change"), st.integers(0, 2), st.integers(0, 3), st.integers(1, 4)),
        st.tuples(st.just("tick"), st.just(0), st.just(0), st.just(0)),
        st.tuples(st.just("deliver"), st.integers(0, 3), st.integers(1, 200), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(operations)
def test_any_schedule_ends_in_sync_once_quiet(ops: list[tuple[str, int, int, int]]) -> None:
    # Three nodes in a line, a - b - c: b relays. Local changes, timer ticks and
    # partial deliveries interleave arbitrarily; no rule may be broken, and once the
    # changes stop every view and every link converges.
    nodes = [make_node(name) for name in "abc"]
    pipes = chain(nodes)
    links = [p.src for p in pipes]
    for op, x, y, z in ops:
        if op == "change":
            nodes[x].receive([relayed(f"o{y}", version=z)])
            for link in links:
                if link.node is nodes[x]:
                    link.poll()
        elif op == "tick":
            for link in links:
                link.on_timer()
        else:
            pipes[x].deliver(y)
    for _ in range(30):
        for link in links:
            link.on_timer()
        for _ in range(20):
            for pipe in pipes:
                pipe.deliver(1 << 20)
    assert not any(link.closed for link in links)
    assert nodes[0].view.digest == nodes[1].view.digest == nodes[2].view.digest
    assert all(link.in_sync and link.mutual for link in links)


# -- relaying and the peer's links ---------------------------------------------------------


def test_links_are_announced_and_counted_while_established() -> None:
    node = make_node("a")
    link = opened(Role.INITIATOR, node)
    assert node.neighbours == {"b"}
    link.on_timer()  # heartbeat
    [tick] = decode_all(link.data_to_send())
    assert isinstance(tick, Tick) and tick.links == ("b",)
    link.close("bye")
    assert node.neighbours == frozenset()


def test_a_reconnect_that_overlaps_its_predecessor_keeps_the_peer_linked() -> None:
    node = make_node("a")
    old = opened(Role.INITIATOR, node)
    new = opened(Role.INITIATOR, node)
    old.connection_lost()
    assert node.neighbours == {"b"}  # the new link still stands
    new.connection_lost()
    new.connection_lost()  # a second loss of the same link counts once
    assert node.neighbours == frozenset()


def test_records_of_nodes_the_peer_is_linked_to_are_not_relayed() -> None:
    node = make_node("a")
    link = opened(Role.ACCEPTOR, node)
    # The peer (b) says it is linked to c, and to us; answering passes us the token.
    [tock] = feed(link, Tick(1, node.view.digest, True, (), ("a", "c")))
    assert isinstance(tock, Tock) and tock.records == ()
    node.receive([relayed("c"), relayed("d")])
    link.poll()
    [tick] = decode_all(link.data_to_send())
    assert isinstance(tick, Tick)
    assert [r.origin for r in tick.records] == ["d"]  # c's record is c's to send
    # Once the peer reports its link to c gone, c's record is owed after all.
    assert feed(link, Tock(2, bytes(16), False, (), ("a",))) == [Nudge()]
    [tock] = feed(link, Tick(3, bytes(16), False, (), ("a",)))
    assert isinstance(tock, Tock) and [r.origin for r in tock.records] == ["c"]


def test_our_own_records_are_sent_even_though_the_peer_lists_us() -> None:
    node = make_node("a")
    link = opened(Role.ACCEPTOR, node)
    feed(link, Tick(1, node.view.digest, True, (), ("a",)))
    own = Record(
        stream="s",
        origin="a",
        incarnation=1,
        version=1,
        spec_digest=bytes(32),
        recoverable=IntervalSet.span(0, 1),
    )
    node.view.merge(own)
    link.poll()
    [tick] = decode_all(link.data_to_send())
    assert isinstance(tick, Tick) and [r.origin for r in tick.records] == ["a"]
