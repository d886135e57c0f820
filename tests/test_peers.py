"""Peer sessions over real loopback TCP: two and three nodes agree, links survive
a peer going away, and a protocol violation closes only that link."""

from __future__ import annotations

import random
from functools import partial

import trio

from convergenced.core.facts import Commit, Declare
from convergenced.core.gate import OutputGate
from convergenced.core.link import LinkConfig, Role
from convergenced.core.node import NodeCore
from convergenced.core.spec import Policy, StreamSpec
from convergenced.daemon.peers.dialer import Backoff
from convergenced.daemon.peers.session import PeerHub, PeerSession
from convergenced.daemon.telemetry import Telemetry

SPEC = StreamSpec.create("job", {"a": [0], "b": [1], "c": [2]}, Policy.all_of("nvme"))
TICK = 0.02


def _hub(name: str, spec: StreamSpec = SPEC) -> PeerHub:
    node = NodeCore(name, 1)
    gate = OutputGate(node)
    gate.apply(Declare(spec))

    async def durable(position: int) -> None:  # no log here: the log has its own tests
        gate.synced(gate.take_unlogged()[1])

    config = LinkConfig(cluster="test", dead_ticks=50)
    return PeerHub(node, gate, durable, config, Telemetry(), tick_seconds=TICK)


async def _serve(hub: PeerHub, nursery: trio.Nursery) -> int:
    async def handler(stream: trio.SocketStream) -> None:
        await PeerSession(hub, stream, Role.ACCEPTOR).run()

    listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    return int(listeners[0].socket.getsockname()[1])


async def _dial(hub: PeerHub, port: int, nursery: trio.Nursery) -> PeerSession:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    session = PeerSession(hub, stream, Role.INITIATOR)
    nursery.start_soon(session.run)
    return session


def _commit(hub: PeerHub, rank: int, epoch: int) -> None:
    hub.gate.apply(Commit("job", rank, "nvme", epoch))
    hub.view_changed()


async def _until(predicate: object) -> None:
    assert callable(predicate)
    while not predicate():
        await trio.sleep(0.005)


async def test_three_nodes_over_tcp_agree_on_the_restore_point() -> None:
    a, b, c = _hub("a"), _hub("b"), _hub("c")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port_b = await _serve(b, nursery)
            port_c = await _serve(c, nursery)
            await _dial(a, port_b, nursery)
            await _dial(a, port_c, nursery)
            await _dial(b, port_c, nursery)
            for epoch in (1, 2, 3):
                for rank, hub in enumerate((a, b, c)):
                    _commit(hub, rank, epoch)
            await _until(lambda: all(h.node.restore_point("job") == 3 for h in (a, b, c)))
            # ... and the views become identical once the last proposals settle.
            await _until(lambda: a.node.view.digest == b.node.view.digest == c.node.view.digest)
            nursery.cancel_scope.cancel()


async def test_a_relay_carries_records_between_nodes_that_are_not_linked() -> None:
    a, b, c = _hub("a"), _hub("b"), _hub("c")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port_b = await _serve(b, nursery)
            await _dial(a, port_b, nursery)
            await _dial(c, port_b, nursery)  # a - b - c: b relays
            for rank, hub in enumerate((a, b, c)):
                _commit(hub, rank, 7)
            await _until(lambda: all(h.node.restore_point("job") == 7 for h in (a, b, c)))
            nursery.cancel_scope.cancel()


async def test_a_peer_that_sends_garbage_is_closed_and_the_others_carry_on() -> None:
    a, b = _hub("a"), _hub("b")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port_b = await _serve(b, nursery)
            async with await trio.open_tcp_stream("127.0.0.1", port_b) as rogue:
                await rogue.send_all(b"GET / HTTP/1.1\r\n\r\n")
                reply = b""
                while chunk := await rogue.receive_some(4096):  # HELLO, BYE, then EOF
                    reply += chunk
            assert b"bad_magic" in reply
            await _dial(a, port_b, nursery)
            _commit(a, 0, 1)
            await _until(lambda: b.node.view.get(("job", "a")) is not None)
            nursery.cancel_scope.cancel()


async def test_a_closed_peer_ends_the_session_with_a_reason() -> None:
    a, b = _hub("a"), _hub("b")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port_b = await _serve(b, nursery)
            session = await _dial(a, port_b, nursery)
            await _until(lambda: session.peer == "b")
            for s in list(b.sessions):
                await s.close("maintenance")
            await _until(lambda: session.closed_reason is not None)
            assert "maintenance" in (session.closed_reason or "")
            nursery.cancel_scope.cancel()


def test_backoff_grows_with_jitter_caps_and_resets() -> None:
    b = Backoff(initial=0.1, maximum=1.0, rng=random.Random(1))
    waits = [b.next() for _ in range(8)]
    steps = [min(1.0, 0.1 * 2**i) for i in range(8)]
    assert all(s / 2 <= w <= s for w, s in zip(waits, steps, strict=True))
    assert max(waits[5:]) <= 1.0
    b.reset()
    assert b.next() <= 0.1
