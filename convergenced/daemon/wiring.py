"""Assembling a daemon: the core, its gate and log, the peer hub, the local API.

`assemble` builds every part of a running daemon from its configuration and its
opened log, in the one order that keeps the durability promise: the node is
rebuilt from the log *before* anything can talk to it, and everything that can send
bytes (peer sessions, local clients) gets its output from the same `OutputGate`,
whose positions the same `GroupCommit` makes durable. `Running` holds the parts;
`status` reads them for the local API and the metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from convergenced import __version__
from convergenced.core.admission import Admission
from convergenced.core.facts import ComponentReport
from convergenced.core.gate import OutputGate
from convergenced.core.node import NodeCore
from convergenced.daemon.config import Config
from convergenced.daemon.durability.entries import Entry, Incarnation
from convergenced.daemon.durability.group_commit import GroupCommit
from convergenced.daemon.durability.log_file import FactLog
from convergenced.daemon.localapi.operations import LocalOperations
from convergenced.daemon.localapi.server import LocalApiServer
from convergenced.daemon.peers.fleet import Fleet
from convergenced.daemon.peers.manager import PeerManager, link_config, overlay_peers
from convergenced.daemon.peers.security import INSECURE_WARNING, PeerSecurity
from convergenced.daemon.peers.session import PeerHub
from convergenced.daemon.telemetry import Telemetry
from convergenced.daemon.verification.drills import Drills
from convergenced.daemon.verification.verifier import Verifier


@dataclass
class Running:
    """Every part of one running daemon."""

    config: Config
    node: NodeCore
    gate: OutputGate
    commits: GroupCommit
    telemetry: Telemetry
    security: PeerSecurity
    hub: PeerHub
    peers: PeerManager
    operations: LocalOperations
    api: LocalApiServer
    fleet: Fleet
    verifier: Verifier
    drills: Drills
    started: float = field(default_factory=trio.current_time)
    peer_port: int | None = None
    metrics_port: int | None = None

    # -- the metrics' view (`metrics.StateSource`) --------------------------------

    def streams(self) -> list[str]:
        """Streams declared on this node."""
        return self.node.streams()

    def stream_state(self, stream: str) -> dict[str, Any]:
        """The ``state`` of ``stream``."""
        return self.operations.state(stream)

    def node_id(self) -> str:
        """This node."""
        return self.config.node_id

    def peer_links(self) -> list[tuple[str, bool]]:
        """Every configured peer, and whether a link to it is established."""
        linked = self.node.neighbours
        return [(p.node_id, p.node_id in linked) for p in self.fleet.members()]

    def wal_bytes(self) -> int | None:
        """Size of the log on disk."""
        return self.commits.log.synced_bytes

    def local_clients(self) -> int:
        """Connected local clients."""
        return len(self.api.sessions)

    def restore_point_age(self, stream: str) -> float | None:
        """Seconds since the restore point of ``stream`` last moved."""
        return self.telemetry.restore_point_age(stream)

    def versions(self) -> dict[str, Any]:
        """The version handshakes of every job (``versions`` of the local API)."""
        return self.operations.versions(None)

    # -- status --------------------------------------------------------------------

    def summary(self) -> str:
        """One line for systemd's STATUS= and logs."""
        streams = self.node.streams()
        points = ", ".join(f"{s}@{self.node.restore_point(s)}" for s in streams[:3])
        more = f" (+{len(streams) - 3})" if len(streams) > 3 else ""
        return (
            f"{len(self.node.neighbours)}/{len(self.config.peers)} peers linked, "
            f"{len(streams)} streams{': ' + points if points else ''}{more}"
        )

    def status(self) -> dict[str, Any]:
        """The ``status`` result of the local API."""
        cfg = self.config
        links = [
            {
                "peer": s.peer,
                "address": s.address,
                "role": s.link.role.value,
                "state": s.link.state.value,
                "in_sync": s.link.in_sync,
                "mutual": s.link.mutual,
                "frames_sent": s.link.frames_sent,
                "frames_received": s.link.frames_received,
            }
            for s in sorted(self.hub.sessions, key=lambda s: (s.peer or "", s.address))
        ]
        connected = {entry["peer"] for entry in links}
        return {
            "node": cfg.node_id,
            "cluster": cfg.cluster,
            "labels": dict(cfg.labels),
            "insecure": cfg.insecure,
            "warnings": [INSECURE_WARNING] if cfg.insecure else [],
            "version": __version__,
            "incarnation": self.node.incarnation,
            "uptime_s": round(trio.current_time() - self.started, 3),
            "peer_port": self.peer_port,
            "metrics_port": self.metrics_port,
            "summary": self.summary(),
            "socket": str(cfg.socket_path),
            "peers": [
                {
                    "id": p.node_id,
                    "address": f"{p.host}:{p.port}",
                    "connected": p.node_id in connected,
                    "dialled": p.node_id in self.peers.dialers,
                    "overlay_link": p.node_id in self.peers.overlay,
                }
                for p in self.fleet.members()
            ],
            "links": links,
            "fleet": self.fleet.describe(),
            "clients": len(self.api.sessions),
            "streams": self.node.streams(),
            "stored_bytes": {
                stream: {d: st.bytes for d, st in self.node.stored(stream).items()}
                for stream in self.node.streams()
            },
            "counters": self.telemetry.counters(),
        }

    def snapshot(self) -> list[Entry]:
        """What a compaction writes: the incarnation, then the node's compacted facts."""
        return [self.node.incarnation_fact(), *self.node.compacted_facts()]


def incarnation_after(entries: list[Entry], floor: int = 0) -> int:
    """The incarnation of a daemon starting on a log holding ``entries``, with this
    incarnation floor (`durability.floor`): one above both."""
    return 1 + max([floor, *(e.number for e in entries if isinstance(e, Incarnation))])


def cluster_members(cfg: Config, fleet: Fleet | None = None) -> frozenset[str]:
    """The nodes a stream declared here may name as members: this node, its peers, its
    trust list and, with CA-bound trust, the nodes with a valid credential
    (`core.admission`; reloads and credentials update it)."""
    known = fleet.known_nodes() if fleet is not None else frozenset()
    return frozenset(
        {cfg.node_id, *(p.node_id for p in cfg.peers), *(n for n, _ in cfg.trust), *known}
    )


def planned_links(cfg: Config, fleet: Fleet) -> list[str] | None:
    """Whom a node unsure of its past waits for (`core.lives`): its overlay links, or,
    while the members are learned and few enough for a full mesh, every member of
    each stream (None): a plan drawn from a partial list of members must not let it
    skip one."""
    if fleet.dynamic and len(cfg.peers) < cfg.mesh_limit:
        return None
    return sorted(overlay_peers(cfg))


def assemble(
    cfg: Config,
    log: FactLog,
    entries: list[Entry],
    telemetry: Telemetry,
    security: PeerSecurity,
    *,
    on_log_failure: Callable[[BaseException], None],
    floor: int = 0,
) -> Running:
    """Rebuild the node from ``entries`` and build every part around it."""
    # A log without any incarnation is a first start, or a lost state directory: the
    # node then waits to hear of its earlier lives before publishing (`core.lives`).
    fresh = not any(isinstance(e, Incarnation) for e in entries)
    node = NodeCore(cfg.node_id, incarnation_after(entries, floor), sign=security.sign,
                    verify=security.verify, unsure_of_past=fresh,
                    catalogues=[c.catalogue for c in cfg.components])  # fmt: skip
    fleet = Fleet(cfg, security, telemetry)
    node.plan_links(planned_links(cfg, fleet))
    node.replay(entries)
    for _ in iter(node.next_event, None):
        pass  # what replay reports is old news
    gate = OutputGate(node)
    commits = GroupCommit(
        log,
        gate,
        telemetry,
        on_failure=on_log_failure,
        one_by_one=not cfg.wal_group_commit,
        compact_bytes=cfg.wal_compact_bytes,
    )
    hub = PeerHub(node, gate, commits.durable, link_config(cfg, fleet.book), telemetry,
                  tick_seconds=cfg.tick_ms / 1000)  # fmt: skip
    admission = Admission(node, gate, max_streams=cfg.limits.max_streams,
                          max_members=cfg.limits.max_members,
                          cluster=cluster_members(cfg, fleet))  # fmt: skip
    for c in cfg.components:
        # The configuration seeds a report the log does not hold; a report made
        # since (convergencectl report-version) is newer, and stands.
        if c.running is not None and c.catalogue.component not in node.reports():
            admission.submit(ComponentReport(c.catalogue.component, c.running, c.accepts))

    def status() -> dict[str, Any]:
        return running.status()  # bound below, before anyone can ask

    operations = LocalOperations(node, admission, hub, telemetry,
                                 durable=commits.durable, status=status)  # fmt: skip
    server = LocalApiServer(operations, gate, commits.durable, cfg.limits, telemetry,
                            allowed_uids=cfg.allowed_uids,
                            allowed_gids=cfg.allowed_gids)  # fmt: skip
    peers = PeerManager(hub, security.transport, cfg)
    verifier = Verifier(node, operations.submit, operations.durable, telemetry.registry,
                        cfg.verification)  # fmt: skip
    operations.verification = verifier.describe
    drills = Drills(node, verifier, telemetry.registry, cfg.drill, cfg.state_dir)
    operations.drill, operations.last_drill = drills.drill, drills.describe
    running = Running(cfg, node, gate, commits, telemetry, security, hub, peers,
                      operations, server, fleet, verifier, drills)  # fmt: skip
    return running
