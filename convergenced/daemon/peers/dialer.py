"""Dialling a peer, forever: connect, run the link, back off, try again.

The delay after a failure grows exponentially from ``initial`` to ``maximum`` and is
jittered (each wait is drawn from the upper half of the current step), so a
cluster restarting together does not reconnect in lockstep. A link that stayed up
for a while resets the delay: the next failure is a new incident, not a streak.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable

import structlog
import trio

from convergenced.core.link import Role
from convergenced.daemon.config import Peer
from convergenced.daemon.peers.session import PeerHub, PeerSession
from convergenced.errors import ConvergencedError

log = structlog.get_logger("convergenced.peers")


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
    retried like any other failure.
    """
    backoff = backoff or Backoff()
    address = f"{peer.host}:{peer.port}"
    connected_before = False
    while True:
        try:
            with trio.fail_after(connect_timeout * 2):
                stream = await connect(peer)
        except (OSError, trio.TooSlowError, ConvergencedError) as exc:
            reason = getattr(exc, "reason", None)
            if reason is not None:
                hub.telemetry.connection_refused(reason)
            delay = backoff.next()
            # A refused handshake is a configuration problem worth seeing; a peer that
            # is simply down is not (backoff already spaces these lines out).
            (log.warning if reason is not None else log.debug)(
                "dial failed",
                peer=peer.node_id,
                address=address,
                error=str(exc),
                retry_in=round(delay, 3),
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
        log.info(
            "link closed",
            peer=peer.node_id,
            address=address,
            reason=reason,
            retry_in=round(delay, 3),
        )
        await trio.sleep(delay)
