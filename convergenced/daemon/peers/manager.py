"""Which peers this daemon talks to: accepting their connections and dialling its own.

Small clusters are a full mesh, larger ones a log-degree overlay (`core.overlay`):
the overlay says which configured peers this node dials; the others dial it. An
accepted connection is refused past ``limits.max_connections`` (counting those
still in their TLS handshake: exactly what an unauthenticated flood would hold
open) or when its TLS handshake fails; otherwise it becomes a `PeerSession` whose
HELLO must name the node its certificate names. A reload (`start_dialers` with the
new configuration) starts and stops dialers to match, and closes the links of
peers that are gone.
"""

from __future__ import annotations

import trio

from convergenced.core.credentials import CredentialBook
from convergenced.core.link import LinkConfig, Role
from convergenced.core.overlay import dial_targets
from convergenced.core.wire import CREDENTIALS_VERSION, PROTOCOL_VERSION, WireLimits
from convergenced.daemon.config import Config, Peer
from convergenced.daemon.peers.dialer import dial_forever
from convergenced.daemon.peers.session import PeerHub, PeerSession
from convergenced.daemon.peers.transport import PeerTransport, TransportError
from convergenced.daemon.telemetry import TOO_MANY_CONNECTIONS


def link_config(cfg: Config, credentials: CredentialBook | None = None) -> LinkConfig:
    """The link settings a configuration implies. With CA-bound trust any node whose
    certificate the cluster CA issued (and nobody revoked) may link, and the links
    speak version 3 to carry ``credentials``."""
    ca = cfg.fleet.ca_trust
    allowed = None if ca else frozenset([cfg.node_id, *(p.node_id for p in cfg.peers)])
    return LinkConfig(
        cluster=cfg.cluster,
        idle_ticks=cfg.idle_ticks,
        dead_ticks=cfg.dead_ticks,
        allowed_peers=allowed,
        wire_version=CREDENTIALS_VERSION if ca else PROTOCOL_VERSION,
        credentials=credentials if ca else None,
        limits=WireLimits(
            max_frame_bytes=cfg.limits.max_frame_bytes,
            max_records=cfg.limits.max_records_per_message,
        ),
    )


def dial_plan(cfg: Config) -> list[Peer]:
    """The configured peers this node dials (the overlay decides; see `overlay`)."""
    ids = [cfg.node_id, *(p.node_id for p in cfg.peers)]
    targets = set(dial_targets(ids, cfg.node_id, cfg.mesh_limit))
    return [p for p in cfg.peers if p.node_id in targets]


def overlay_peers(cfg: Config) -> frozenset[str]:
    """The configured peers the overlay links this node to, whichever side dials.

    Every peer in a mesh; past ``mesh_limit``, those this node dials and those that
    dial it, which can only be the nodes ``2^k`` before it in the sorted ids (see
    `core.overlay`), so this asks `dial_targets` of a logarithmic number of nodes.
    """
    ids = [cfg.node_id, *(p.node_id for p in cfg.peers)]
    linked = {p.node_id for p in dial_plan(cfg)}
    order = sorted(set(ids))
    n, i = len(order), order.index(cfg.node_id)
    candidates = order[:i] if n <= cfg.mesh_limit else [
        order[(i - 2**k) % n] for k in range(max(1, (n - 1).bit_length()))
    ]  # fmt: skip
    for other in candidates:
        if other != cfg.node_id and cfg.node_id in dial_targets(ids, other, cfg.mesh_limit):
            linked.add(other)
    return frozenset(linked)


class PeerManager:
    """The accepting and dialling side of one daemon's peer links."""

    def __init__(self, hub: PeerHub, transport: PeerTransport, config: Config) -> None:
        self.hub = hub
        self.transport = transport
        self.config = config
        self.dialers: dict[str, trio.CancelScope] = {}
        self.overlay = overlay_peers(config)
        """The peers a link is expected to (`overlay_peers`), for the status."""
        self._handshaking = 0

    async def accept(self, tcp: trio.SocketStream) -> None:
        """Serve one accepted connection until its link closes."""
        limits = self.config.limits
        telemetry = self.hub.telemetry
        if len(self.hub.sessions) + self._handshaking >= limits.max_connections:
            telemetry.connection_refused(TOO_MANY_CONNECTIONS)
            await tcp.aclose()
            return
        try:
            host, port = tcp.socket.getpeername()[:2]
            address = f"{host}:{port}"
        except OSError:
            address = "?"
        self._handshaking += 1
        try:
            stream, authenticated = await self.transport.accept(tcp)
        except TransportError as exc:
            telemetry.connection_refused(exc.reason, address, str(exc))
            return
        finally:
            self._handshaking -= 1
        session = PeerSession(
            self.hub,
            stream,
            Role.ACCEPTOR,
            address=address,
            expected_peer=authenticated,
            handshake_timeout=limits.handshake_timeout_s,
        )
        await session.run()  # which logs the link going down

    def start_dialers(
        self, nursery: trio.Nursery, cfg: Config, extra: frozenset[str] = frozenset()
    ) -> None:
        """Dial the peers ``cfg``'s plan names, and the peers in ``extra`` (a learned
        fleet's bootstrap links, `fleet`); stop dialling (and close the links of)
        those no longer named."""
        self.config = cfg
        self.overlay = overlay_peers(cfg)
        wanted = {p.node_id: p for p in dial_plan(cfg)}
        wanted.update({p.node_id: p for p in cfg.peers if p.node_id in extra})
        for node_id in list(self.dialers):
            if node_id not in wanted:
                self.dialers.pop(node_id).cancel()
                for session in self.hub.sessions:
                    if session.peer == node_id:
                        session.link.close("peer removed from configuration")
                        session.wake()
        for node_id, peer in wanted.items():
            if node_id not in self.dialers:
                scope = trio.CancelScope()
                self.dialers[node_id] = scope
                nursery.start_soon(self._dial, scope, peer)

    def stop_dialers(self) -> None:
        """Stop every dialer (shutdown)."""
        for scope in self.dialers.values():
            scope.cancel()

    async def _dial(self, scope: trio.CancelScope, peer: Peer) -> None:
        with scope:
            await dial_forever(
                self.hub,
                peer,
                connect=self.transport.dial,
                connect_timeout=self.config.limits.handshake_timeout_s,
            )
