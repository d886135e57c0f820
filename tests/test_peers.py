"""Peer sessions and dialling: nodes agree over their links, a relay carries records
between nodes that are not linked, a protocol violation closes only that link, a
closed peer ends the session with its reason, and the dialler backs off and redials.

This is the adapters' logic, so it runs over trio memory streams under `MockClock`
(heartbeats and timeouts take no real time); real TCP and TLS are exercised by the
daemon tests (tests/test_daemon.py, tests/test_secure_daemon.py, tests/test_hostile.py).
"""

from __future__ import annotations

import random

import pytest
import trio
import trio.testing

from convergenced.core.facts import Commit, Declare
from convergenced.core.gate import OutputGate
from convergenced.core.link import LinkConfig, Role
from convergenced.core.node import NodeCore
from convergenced.core.spec import Policy, StreamSpec
from convergenced.daemon.config import DEFAULT_DEAD_TICKS, DEFAULT_IDLE_TICKS, DEFAULT_TICK_MS, Peer
from convergenced.daemon.peers.dialer import Backoff, dial_forever
from convergenced.daemon.peers.session import PeerHub, PeerSession
from convergenced.daemon.telemetry import Telemetry

SPEC = StreamSpec.create("job", {"a": [0], "b": [1], "c": [2]}, Policy.all_of("nvme"))
TICK = 0.02


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


def _hub(name: str, spec: StreamSpec = SPEC, config: LinkConfig | None = None,
         tick: float = TICK) -> PeerHub:  # fmt: skip
    node = NodeCore(name, 1)
    gate = OutputGate(node)
    gate.apply(Declare(spec))

    async def durable(position: int) -> None:  # no log here: the log has its own tests
        gate.synced(gate.take_unlogged()[1])

    config = config or LinkConfig(cluster="test", dead_ticks=50)
    return PeerHub(node, gate, durable, config, Telemetry(), tick_seconds=tick)


def _link(a: PeerHub, b: PeerHub, nursery: trio.Nursery) -> tuple[PeerSession, PeerSession]:
    """Connect ``a`` (dialling) to ``b`` over a memory stream pair."""
    left, right = trio.testing.memory_stream_pair()
    sa = PeerSession(a, left, Role.INITIATOR)
    sb = PeerSession(b, right, Role.ACCEPTOR)
    nursery.start_soon(sa.run)
    nursery.start_soon(sb.run)
    return sa, sb


def _commit(hub: PeerHub, rank: int, epoch: int) -> None:
    hub.gate.apply(Commit("job", rank, "nvme", epoch))
    hub.view_changed()


async def _until(predicate: object) -> None:
    assert callable(predicate)
    while not predicate():
        await trio.sleep(0.005)


async def test_three_nodes_agree_on_the_restore_point(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a, b, c = _hub("a"), _hub("b"), _hub("c")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.run_timer)
            nursery.start_soon(b.run_timer)
            nursery.start_soon(c.run_timer)
            _link(a, b, nursery)
            _link(a, c, nursery)
            _link(b, c, nursery)
            for epoch in (1, 2, 3):
                for rank, hub in enumerate((a, b, c)):
                    _commit(hub, rank, epoch)
            await _until(lambda: all(h.node.restore_point("job") == 3 for h in (a, b, c)))
            # ... and the views become identical once the last proposals settle.
            await _until(lambda: a.node.view.digest == b.node.view.digest == c.node.view.digest)
            assert a.node.neighbours == {"b", "c"}
            nursery.cancel_scope.cancel()


async def test_a_relay_carries_records_between_nodes_that_are_not_linked(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a, b, c = _hub("a"), _hub("b"), _hub("c")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.run_timer)
            nursery.start_soon(b.run_timer)
            nursery.start_soon(c.run_timer)
            _link(a, b, nursery)
            _link(c, b, nursery)  # a - b - c: b relays
            for rank, hub in enumerate((a, b, c)):
                _commit(hub, rank, 7)
            await _until(lambda: all(h.node.restore_point("job") == 7 for h in (a, b, c)))
            nursery.cancel_scope.cancel()


async def test_a_peer_that_sends_garbage_is_closed_and_the_others_carry_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a, b = _hub("a"), _hub("b")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.run_timer)
            nursery.start_soon(b.run_timer)
            rogue, theirs = trio.testing.memory_stream_pair()
            nursery.start_soon(PeerSession(b, theirs, Role.ACCEPTOR).run)
            await rogue.send_all(b"GET / HTTP/1.1\r\n\r\n")
            reply = b""
            while chunk := await rogue.receive_some(4096):  # HELLO, BYE, then EOF
                reply += chunk
            assert b"bad_magic" in reply
            assert b.telemetry.counters() == {"peer_rejected_bad_magic": 1}
            _link(a, b, nursery)
            _commit(a, 0, 1)
            await _until(lambda: b.node.view.get(("job", "a")) is not None)
            nursery.cancel_scope.cancel()


async def test_a_closed_peer_ends_the_session_with_a_reason(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a, b = _hub("a"), _hub("b")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.run_timer)
            nursery.start_soon(b.run_timer)
            session, theirs = _link(a, b, nursery)
            await _until(lambda: session.peer == "b")
            await theirs.close("maintenance")
            await _until(lambda: session.closed_reason is not None)
            assert "maintenance" in (session.closed_reason or "")
            assert a.node.neighbours == frozenset()
            nursery.cancel_scope.cancel()


async def test_a_silent_peer_is_declared_down_after_dead_ticks(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = _hub("a")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.run_timer)
            ours, silent = trio.testing.memory_stream_pair()
            session = PeerSession(a, ours, Role.INITIATOR)
            nursery.start_soon(session.run)
            started = trio.current_time()
            await _until(lambda: session.closed_reason is not None)
            assert "link declared down" in (session.closed_reason or "")
            dead = a.link_config.dead_ticks * TICK
            assert dead <= trio.current_time() - started < dead + 2 * TICK
            nursery.cancel_scope.cancel()
            await silent.aclose()


class _Stallable(trio.abc.Stream):
    """A stream whose owner can stall, as a stopped or starved process does: once
    stalled, it neither sends nor reads, and the connection stays open."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.stalled = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self.stalled:
            await trio.sleep_forever()
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if self.stalled:
            await trio.sleep_forever()
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_the_default_timer_heartbeats_each_second_and_finds_a_stalled_peer_in_2_s(
    autojump_clock: trio.testing.MockClock,
) -> None:
    tick = DEFAULT_TICK_MS / 1000
    config = LinkConfig(
        cluster="test", idle_ticks=DEFAULT_IDLE_TICKS, dead_ticks=DEFAULT_DEAD_TICKS
    )
    a, b = _hub("a", config=config, tick=tick), _hub("b", config=config, tick=tick)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.run_timer)
            nursery.start_soon(b.run_timer)
            left, right = trio.testing.memory_stream_pair()
            theirs = _Stallable(right)
            ours = PeerSession(a, left, Role.INITIATOR)
            nursery.start_soon(ours.run)
            nursery.start_soon(PeerSession(b, theirs, Role.ACCEPTOR).run)
            await _until(lambda: ours.peer == "b")
            # Idle: each side hears from the other about once a second.
            sent, received = ours.link.frames_sent, ours.link.frames_received
            await trio.sleep(10.0)
            assert 9 <= ours.link.frames_sent - sent <= 13
            assert 9 <= ours.link.frames_received - received <= 13
            assert ours.closed_reason is None
            # The peer stalls: its link is declared down within 2 s of the last frame.
            theirs.stalled = True
            heard, last = ours.link.frames_received, trio.current_time()
            while ours.closed_reason is None:
                if ours.link.frames_received != heard:
                    heard, last = ours.link.frames_received, trio.current_time()
                await trio.sleep(0.005)
            assert "link declared down" in ours.closed_reason
            silence = trio.current_time() - last
            assert (DEFAULT_DEAD_TICKS - 1) * tick <= silence <= 2.0 + 0.01
            nursery.cancel_scope.cancel()


async def test_the_dialler_backs_off_after_failures_and_redials_a_lost_link(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a, b = _hub("a"), _hub("b")
    attempts: list[float] = []
    theirs: list[PeerSession] = []

    async def connect(peer: Peer) -> trio.abc.Stream:
        attempts.append(trio.current_time())
        if len(attempts) <= 2:
            raise OSError(111, "Connection refused")
        left, right = trio.testing.memory_stream_pair()
        session = PeerSession(b, right, Role.ACCEPTOR)
        theirs.append(session)
        nursery.start_soon(session.run)
        return left

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.run_timer)
            nursery.start_soon(b.run_timer)
            backoff = Backoff(initial=0.1, maximum=1.0, rng=random.Random(3))
            nursery.start_soon(lambda: dial_forever(a, Peer("b", "b.example", 1), connect=connect,
                                                    backoff=backoff))  # fmt: skip
            await _until(lambda: a.node.neighbours == {"b"})
            assert attempts[1] - attempts[0] >= 0.05 and attempts[2] - attempts[1] >= 0.1
            await theirs[0].close("restart")  # the peer goes away: a dials again
            await _until(lambda: len(theirs) == 2 and a.node.neighbours == {"b"})
            assert a.telemetry.counters()["peer_reconnects"] == 1
            nursery.cancel_scope.cancel()


def test_backoff_grows_with_jitter_caps_and_resets() -> None:
    b = Backoff(initial=0.1, maximum=1.0, rng=random.Random(1))
    waits = [b.next() for _ in range(8)]
    steps = [min(1.0, 0.1 * 2**i) for i in range(8)]
    assert all(s / 2 <= w <= s for w, s in zip(waits, steps, strict=True))
    assert max(waits[5:]) <= 1.0
    b.reset()
    assert b.next() <= 0.1
