"""Dialling a peer, forever: connect, run the link, back off, try again.

The delay after a failure grows exponentially from ``initial`` to ``maximum`` and is
jittered (each wait is drawn from the upper half of the current step), so a
cluster restarting together does not reconnect in lockstep. A link that stayed up
for a while resets the delay: the next failure is a new incident, not a streak.
"""

from __future__ import annotations

import errno
import random
import socket
from collections.abc import Awaitable, Callable

import trio

from convergenced.core.link import Role
from convergenced.daemon.config import Peer
from convergenced.daemon.peers.session import PeerHub, PeerSession
from convergenced.errors import ConvergencedError


class Backoff:
    """Exponential backoff with jitter; `next` returns the seconds to wait."""

    def __init__(
        self,
        initial: float = 0.05,
        maximum: float = 5.0,
        factor: float = 2.0,
        rng: random.Random | None = None,
    ) -> None:
        self.initial = initial
        self.maximum = maximum
        self.factor = factor
        self.attempts = 0
        self._rng = rng or random.Random()

    def next(self) -> float:
        """The wait before the next attempt (and count this attempt)."""
        step = min(self.maximum, self.initial * self.factor**self.attempts)
        self.attempts += 1
        return step / 2 + self._rng.uniform(0, step / 2)

    def reset(self) -> None:
        """Start again from ``initial``."""
        self.attempts = 0


Connect = Callable[[Peer], Awaitable[trio.abc.Stream]]

_ERRNO_REASONS = {
    errno.ECONNREFUSED: "connection_refused",
    errno.ECONNRESET: "connection_reset",
    errno.EHOSTUNREACH: "host_unreachable",
    errno.ENETUNREACH: "network_unreachable",
    errno.ETIMEDOUT: "connect_timeout",
}


def dial_failure_reason(exc: BaseException) -> str:
    """A short label for why a dial failed: the transport's reason (a TLS refusal),
    ``connect_timeout``, ``unresolved_host``, ``connection_refused``, ... ."""
    reason = getattr(exc, "reason", None)
    if isinstance(reason, str):
        return reason
    if isinstance(exc, trio.TooSlowError):
        return "connect_timeout"
    if isinstance(exc, socket.gaierror):
        return "unresolved_host"
    # trio.open_tcp_stream raises one OSError without an errno for all its attempts,
    # caused by a group holding each attempt's error.
    cause = exc.__cause__
    if isinstance(exc, OSError) and exc.errno is None and isinstance(cause, BaseExceptionGroup):
        return dial_failure_reason(cause.exceptions[0])
    if isinstance(exc, OSError) and exc.errno is not None:
        return _ERRNO_REASONS.get(exc.errno) or errno.errorcode.get(exc.errno, "os_error").lower()
    return type(exc).__name__.lower()


async def _tcp(peer: Peer) -> trio.abc.Stream:
    return await trio.open_tcp_stream(peer.host, peer.port)


async def dial_forever(
    hub: PeerHub,
    peer: Peer,
    *,
    connect: Connect = _tcp,
    connect_timeout: float = 5.0,
    stable_after: float = 10.0,
    backoff: Backoff | None = None,
) -> None:
    """Keep a link to ``peer`` up until cancelled.

    ``connect`` opens a secured stream (see `transport`); an error with a ``reason``
    attribute (a refused TLS handshake) is counted as a refused connection and
    retried like any other failure. Failures are logged by `Telemetry.dial_failed`
    (rate-limited per peer and reason), a lost link by the session (``link down``)
    and here (``reconnecting``).
    """
    backoff = backoff or Backoff()
    address = f"{peer.host}:{peer.port}"
    connected_before = False
    while True:
        try:
            with trio.fail_after(connect_timeout * 2):
                stream = await connect(peer)
        except (OSError, trio.TooSlowError, ConvergencedError) as exc:
            delay = backoff.next()
            hub.telemetry.dial_failed(
                peer.node_id, address, dial_failure_reason(exc), str(exc), delay
            )
            await trio.sleep(delay)
            continue
        if connected_before:
            hub.telemetry.reconnected(peer.node_id)
        connected_before = True
        session = PeerSession(
            hub, stream, Role.INITIATOR, expected_peer=peer.node_id, address=address
        )
        started = trio.current_time()
        reason = await session.run()
        if trio.current_time() - started >= stable_after:
            backoff.reset()
        delay = backoff.next()
        hub.telemetry.reconnecting(peer.node_id, address, reason, delay)
        await trio.sleep(delay)
