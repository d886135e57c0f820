"""Prometheus metrics: one registry per daemon.

Two kinds of metric, for two reasons:

* **Event metrics** (counters, histograms) are updated where the event happens:
  commits by domain and outcome, rejections by reason, fsync durations, exchange
  round trips, reconnects, rollbacks. They are cheap increments on paths that already
  do much more work.
* **State metrics** (restore point, skew, divergence, ages, link state, bytes) are read
  from the daemon when Prometheus scrapes, by `DaemonCollector`: nothing is kept up to
  date on the hot path, and a scrape always shows the state as it is.

Names carry the ``convergenced_`` prefix and base units; labels are bounded
(stream, domain, peer, reason, type, direction: all from configuration or fixed
sets; never an epoch). The full list is in the README's metrics table.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from convergenced import __version__
from convergenced.core import api

if TYPE_CHECKING:  # the collector reads the daemon; the daemon owns the metrics
    from convergenced.daemon.app import Daemon

RTT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
FSYNC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)
KNOWLEDGE = {"incomplete": 0, "interval": 1, "proposed": 2, "published": 3}


class Metrics:
    """The daemon's registry and its event metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        info = Gauge(
            "convergenced_build_info", "Build information (value 1).", ["version"], registry=r
        )
        info.labels(version=__version__).set(1)
        self.commits = Counter(
            "convergenced_commits",
            "Commits received, by domain and outcome "
            "(accepted: durable and acknowledged; rejected: refused, nothing changed).",
            ["domain", "outcome"],
            registry=r,
        )
        self.retractions = Counter(
            "convergenced_retractions",
            "Epochs reported lost or corrupt (retract).",
            ["stream"],
            registry=r,
        )
        self.rollbacks = Counter(
            "convergenced_rollbacks",
            "Times the restore point moved backwards (after a loss).",
            ["stream"],
            registry=r,
        )
        self.api_errors = Counter(
            "convergenced_api_errors",
            "Local API error replies, by reason.",
            ["reason"],
            registry=r,
        )
        self.frames_rejected = Counter(
            "convergenced_frames_rejected",
            "Peer connections closed for breaking the "
            "protocol or failing the handshake, by reason.",
            ["reason"],
            registry=r,
        )
        self.records_rejected = Counter(
            "convergenced_records_rejected",
            "Records dropped before merging (unknown origin, unsigned, bad signature).",
            ["reason"],
            registry=r,
        )
        self.reconnects = Counter(
            "convergenced_peer_reconnects",
            "Links re-established after a loss, by peer.",
            ["peer"],
            registry=r,
        )
        self.exchange_rtt = Histogram(
            "convergenced_peer_exchange_rtt_seconds",
            "Round trip of one TICK/TOCK exchange this node started, by peer.",
            ["peer"],
            buckets=RTT_BUCKETS,
            registry=r,
        )
        self.fsync = Histogram(
            "convergenced_wal_fsync_duration_seconds",
            "Write plus fsync of one group commit of the write-ahead log.",
            buckets=FSYNC_BUCKETS,
            registry=r,
        )
        self.recovery = Gauge(
            "convergenced_recovery_seconds",
            "Last recovery generation: from this node's "
            "first request to the agreed answer (RTO as this daemon sees it).",
            ["stream"],
            registry=r,
        )
        self.frames = Counter(
            "convergenced_peer_frames",
            "Peer frames, by peer, message type and direction.",
            ["peer", "type", "direction"],
            registry=r,
        )
        self.bytes = Counter(
            "convergenced_peer_bytes",
            "Peer bytes on the wire (after TLS framing is removed), by peer and direction.",
            ["peer", "direction"],
            registry=r,
        )


class DaemonCollector(Collector):
    """State metrics, read from the daemon at scrape time."""

    def __init__(self, daemon: Daemon, clock: Callable[[], float] = time.monotonic) -> None:
        self.daemon = daemon
        self.clock = clock

    def describe(self) -> Iterable[Metric]:
        return []  # unchecked collector: names are documented in the README

    def collect(self) -> Iterator[Metric]:
        d = self.daemon
        node = d.node
        if node is None:
            return
        g: dict[str, GaugeMetricFamily] = {}

        def gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
            if name not in g:
                g[name] = GaugeMetricFamily(name, doc, labels=labels)
            return g[name]

        now = self.clock()
        for stream in node.streams():
            s = api.status_to_wire(node.status(stream))
            rp = s["restore_point"]
            if rp is not None:
                gauge(
                    "convergenced_restore_point_epoch", "The agreed restore point.", ["stream"]
                ).add_metric([stream], rp)
            if s["proposal"] is not None:
                gauge(
                    "convergenced_proposal_epoch", "This node's proposal.", ["stream"]
                ).add_metric([stream], s["proposal"])
            ci = s["convergence"]
            if ci:
                gauge(
                    "convergenced_convergence_low_epoch",
                    "Oldest epoch of the convergence interval.",
                    ["stream"],
                ).add_metric([stream], ci[0][0])
                gauge(
                    "convergenced_convergence_high_epoch",
                    "Newest epoch of the convergence interval.",
                    ["stream"],
                ).add_metric([stream], ci[-1][1])
            if s["skew"] is not None:
                gauge(
                    "convergenced_epoch_skew",
                    "Max minus min over members of their newest recoverable epoch.",
                    ["stream"],
                ).add_metric([stream], s["skew"])
            for domain, spread in s["domain_skew"].items():
                gauge(
                    "convergenced_domain_divergence",
                    "Max minus min over members of their newest epoch in the domain.",
                    ["stream", "domain"],
                ).add_metric([stream, domain], spread)
            gauge(
                "convergenced_knowledge_level",
                "How far agreement got: 0 incomplete, 1 interval, 2 proposed, 3 published.",
                ["stream"],
            ).add_metric([stream], KNOWLEDGE.get(s["knowledge"], 0))
            since = d.restore_point_since.get(stream)
            if rp is not None and since is not None:
                gauge(
                    "convergenced_restore_point_age_seconds",
                    "Time since the restore point last changed.",
                    ["stream"],
                ).add_metric([stream], now - since)
            own = s["newest"].get(node.node_id, {})
            if rp is not None and own:
                gauge(
                    "convergenced_rpo_epochs",
                    "Epochs between this node's newest commit and the restore point.",
                    ["stream"],
                ).add_metric([stream], max(0, max(own.values()) - rp))
        up = gauge(
            "convergenced_peer_up", "1 while an established link to the peer is up.", ["peer"]
        )
        linked = set(node.neighbours)
        for peer in d.config.peers:
            up.add_metric([peer.node_id], 1.0 if peer.node_id in linked else 0.0)
        journal = d.journal
        if journal is not None:
            gauge("convergenced_wal_bytes", "Size of the write-ahead log on disk.", []).add_metric(
                [], journal.wal.synced_bytes
            )
        if d.api is not None:
            gauge("convergenced_local_clients", "Connected local API clients.", []).add_metric(
                [], len(d.api.sessions)
            )
        yield from g.values()


def register(metrics: Metrics, daemon: Any) -> None:
    """Attach the state collector of ``daemon`` to the registry."""
    metrics.registry.register(DaemonCollector(daemon))
