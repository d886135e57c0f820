"""What the log says about links: up, down and reconnecting at info with peer, address
and reason; failed dials with their reason, at most once per peer and reason per
interval (`WARN_INTERVAL_S`), saying how many failed since the last line.

The adapters' logic, so over trio memory streams under `MockClock` (tests/test_peers.py
does the same for what the links carry).
"""

from __future__ import annotations

import errno
import random
import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import structlog.testing
import trio
import trio.testing

from convergenced.core.gate import OutputGate
from convergenced.core.link import LinkConfig, Role
from convergenced.core.node import NodeCore
from convergenced.daemon.config import Peer
from convergenced.daemon.peers.dialer import Backoff, dial_failure_reason, dial_forever
from convergenced.daemon.peers.session import PeerHub, PeerSession
from convergenced.daemon.peers.transport import TransportError
from convergenced.daemon.telemetry import WARN_INTERVAL_S, Telemetry

TICK = 0.02
Logs = list[dict[str, Any]]


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


@pytest.fixture
def logs() -> Iterator[Logs]:
    with structlog.testing.capture_logs() as captured:
        yield captured


def _hub(name: str, incarnation: int = 1) -> PeerHub:
    node = NodeCore(name, incarnation)
    gate = OutputGate(node)

    async def durable(position: int) -> None:  # no log here: the log has its own tests
        gate.synced(gate.take_unlogged()[1])

    config = LinkConfig(cluster="test", dead_ticks=50)
    return PeerHub(node, gate, durable, config, Telemetry(), tick_seconds=TICK)


def _events(logs: Logs, event: str) -> Logs:
    return [e for e in logs if e["event"] == event]


async def _until(predicate: Callable[[], bool]) -> None:
    while not predicate():
        await trio.sleep(0.005)


def _refused() -> OSError:
    """What trio.open_tcp_stream raises when every address refused the connection."""
    err = OSError("all attempts to connect to b.example:1 failed")
    err.__cause__ = ExceptionGroup("attempts", [ConnectionRefusedError(errno.ECONNREFUSED, "")])
    return err


# -- links up and down ---------------------------------------------------------------


async def test_a_link_coming_up_is_logged_with_peer_address_role_and_incarnation(
    autojump_clock: trio.testing.MockClock, logs: Logs
) -> None:
    a, b = _hub("a"), _hub("b", incarnation=7)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.run_timer)
            nursery.start_soon(b.run_timer)
            left, right = trio.testing.memory_stream_pair()
            nursery.start_soon(PeerSession(a, left, Role.INITIATOR, address="b.example:1").run)
            nursery.start_soon(PeerSession(b, right, Role.ACCEPTOR, address="a.example:2").run)
            await _until(lambda: len(_events(logs, "link up")) == 2)
            nursery.cancel_scope.cancel()
    up = {e["peer"]: e for e in _events(logs, "link up")}
    fields = ("log_level", "address", "role", "incarnation")
    assert tuple(up["b"][f] for f in fields) == ("info", "b.example:1", "initiator", 7)
    assert tuple(up["a"][f] for f in fields) == ("info", "a.example:2", "acceptor", 1)


async def test_a_link_going_down_is_logged_with_its_reason(
    autojump_clock: trio.testing.MockClock, logs: Logs
) -> None:
    a, b = _hub("a"), _hub("b")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.run_timer)
            nursery.start_soon(b.run_timer)
            left, right = trio.testing.memory_stream_pair()
            ours = PeerSession(a, left, Role.INITIATOR, address="b.example:1")
            theirs = PeerSession(b, right, Role.ACCEPTOR)
            nursery.start_soon(ours.run)
            nursery.start_soon(theirs.run)
            await _until(lambda: ours.peer == "b")
            await theirs.close("maintenance")
            await _until(lambda: any(e["peer"] == "b" for e in _events(logs, "link down")))
            nursery.cancel_scope.cancel()
    down = next(e for e in _events(logs, "link down") if e["peer"] == "b")
    assert down["log_level"] == "info" and down["address"] == "b.example:1"
    assert "maintenance" in down["reason"]


async def test_a_connection_that_never_said_hello_logs_no_link(
    autojump_clock: trio.testing.MockClock, logs: Logs
) -> None:
    a = _hub("a")
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.run_timer)
            rogue, ours = trio.testing.memory_stream_pair()
            nursery.start_soon(PeerSession(a, ours, Role.ACCEPTOR).run)
            await rogue.send_all(b"GET / HTTP/1.1\r\n\r\n")
            while await rogue.receive_some(4096):
                pass
            nursery.cancel_scope.cancel()
    assert _events(logs, "link up") == _events(logs, "link down") == []
    assert _events(logs, "peer broke the protocol; link closed")


# -- dialling --------------------------------------------------------------------------


async def test_a_lost_link_is_logged_as_reconnecting_with_reason_and_retry(
    autojump_clock: trio.testing.MockClock, logs: Logs
) -> None:
    a, b = _hub("a"), _hub("b")
    theirs: list[PeerSession] = []

    async def connect(peer: Peer) -> trio.abc.Stream:
        left, right = trio.testing.memory_stream_pair()
        theirs.append(PeerSession(b, right, Role.ACCEPTOR))
        nursery.start_soon(theirs[-1].run)
        return left

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.run_timer)
            nursery.start_soon(b.run_timer)
            nursery.start_soon(lambda: dial_forever(a, Peer("b", "b.example", 1), connect=connect))
            await _until(lambda: a.node.neighbours == {"b"})
            await theirs[0].close("restart")
            await _until(lambda: len(theirs) == 2 and a.node.neighbours == {"b"})
            nursery.cancel_scope.cancel()
    (again,) = _events(logs, "reconnecting")
    assert again["log_level"] == "info"
    assert (again["peer"], again["address"]) == ("b", "b.example:1")
    assert "restart" in again["reason"] and again["retry_in"] > 0
    assert [e["peer"] for e in _events(logs, "link up")].count("b") == 2


async def _dial_failing(
    hub: PeerHub, seconds: float, fail: Callable[[float], BaseException]
) -> None:
    """Dial a peer that fails every attempt (``fail`` of the time) for ``seconds``."""

    async def connect(peer: Peer) -> trio.abc.Stream:
        raise fail(trio.current_time())

    backoff = Backoff(initial=0.1, maximum=1.0, rng=random.Random(5))
    with trio.move_on_after(seconds):
        await dial_forever(hub, Peer("b", "b.example", 1), connect=connect, backoff=backoff)


async def test_failed_dials_are_logged_once_per_peer_and_reason_per_interval(
    autojump_clock: trio.testing.MockClock, logs: Logs
) -> None:
    a = _hub("a")
    await _dial_failing(a, 2.5 * WARN_INTERVAL_S, lambda now: _refused())
    lines = _events(logs, "dial failed")
    assert len(lines) == 3  # at 0, after one interval, after two
    assert all(e["log_level"] == "info" for e in lines)
    assert {(e["peer"], e["address"], e["reason"]) for e in lines} == {
        ("b", "b.example:1", "connection_refused")
    }
    assert lines[0]["failures"] == 1
    assert lines[1]["failures"] > 5  # a new attempt about every second, counted


async def test_a_new_reason_for_a_failed_dial_is_logged_at_once(
    autojump_clock: trio.testing.MockClock, logs: Logs
) -> None:
    def fail(now: float) -> BaseException:
        if now < 1.0:
            return _refused()
        return TransportError("tls_wrong_peer", "peer presented a certificate of 'c'")

    a = _hub("a")
    await _dial_failing(a, 2.0, fail)
    lines = _events(logs, "dial failed")
    assert [(e["reason"], e["log_level"]) for e in lines] == [
        ("connection_refused", "info"),
        ("tls_wrong_peer", "warning"),  # a certificate to fix, not a peer still down
    ]
    assert a.telemetry.counters()["peer_refused_tls_wrong_peer"] >= 1


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (_refused(), "connection_refused"),
        (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), "connection_refused"),
        (OSError(errno.EHOSTUNREACH, "no route"), "host_unreachable"),
        (OSError(errno.EPERM, "not permitted"), "eperm"),
        (socket.gaierror(socket.EAI_NONAME, "Name or service not known"), "unresolved_host"),
        (trio.TooSlowError(), "connect_timeout"),
        (TransportError("tls_handshake_failed", "bad certificate"), "tls_handshake_failed"),
    ],
)
def test_a_failed_dial_is_named_by_a_short_reason(exc: BaseException, reason: str) -> None:
    assert dial_failure_reason(exc) == reason
