"""Every Prometheus metric the daemon exports, in one catalog, and the state collector.

`CATALOG` is the one list of metrics: their names, types, labels and meaning. The
event metrics (`Telemetry`) are created from it, the state metrics (`StateCollector`)
are emitted under its names and help texts, and the table in docs/operations.md is
generated from it (``python -m convergenced.daemon.metrics --write
docs/operations.md``); tests hold the exported metrics, and the docs, to it.

Two kinds of metric, for two reasons:

* **event metrics** (counters, histograms) are incremented where the event happens,
  by `Telemetry`: cheap increments on paths that already do much more work;
* **state metrics** (restore point, skew, divergence, ages, bytes stored, links, log
  size) are read when Prometheus scrapes, by `StateCollector`, through the narrow
  `StateSource` interface: nothing is kept up to date on the hot path, and a scrape
  shows the state as it is.

Names carry the ``convergenced_`` prefix and base units; labels are bounded (stream,
domain, peer, reason, type, direction, outcome: from the configuration, declared
streams or fixed sets; never an epoch).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One exported metric."""

    name: str
    """Without the ``_total`` suffix Prometheus adds to counters."""
    kind: str
    """``counter``, ``gauge`` or ``histogram``."""
    labels: tuple[str, ...]
    help: str

    @property
    def exported(self) -> str:
        """The name as it appears on /metrics (counters get ``_total``)."""
        return self.name + "_total" if self.kind == "counter" else self.name


def _m(name: str, kind: str, labels: tuple[str, ...], text: str) -> MetricSpec:
    return MetricSpec("convergenced_" + name, kind, labels, text)


S, D, P, R = ("stream",), ("domain",), ("peer",), ("reason",)
CATALOG: tuple[MetricSpec, ...] = (
    _m("build_info", "gauge", ("version",), "1, with the version"),
    # -- state of each stream (read at scrape time)
    _m("restore_point_epoch", "gauge", S, "the agreed restore point"),
    _m("proposal_epoch", "gauge", S, "this node's proposal"),
    _m("convergence_low_epoch", "gauge", S, "oldest epoch of the convergence interval"),
    _m("convergence_high_epoch", "gauge", S, "newest epoch of the convergence interval"),
    _m("epoch_skew", "gauge", S, "max - min over members of their newest recoverable epoch: "
       "the one to watch"),
    _m("domain_divergence", "gauge", ("stream", "domain"),
       "max - min over members of their newest epoch in one domain"),
    _m("restore_point_age_seconds", "gauge", S, "time since the restore point last moved"),
    _m("rpo_epochs", "gauge", S, "epochs between this node's newest commit and the restore "
       "point (RPO in epochs)"),
    _m("knowledge_level", "gauge", S, "how far agreement got: 0 incomplete, 1 interval, "
       "2 proposed, 3 published"),
    _m("stored_bytes", "gauge", ("stream", "domain"), "bytes this node's ranks hold in the "
       "domain: the sizes their commits stated, of the epochs committed and neither "
       "retracted nor retired (a commit without a size counts 0)"),
    _m("stored_epochs", "gauge", ("stream", "domain"), "epochs at least one of this node's "
       "ranks holds in the domain (committed, neither retracted nor retired): what GC "
       "keeps, to compare with the retention"),
    _m("drain_safe", "gauge", S, "1 when draining this node now would lose no epoch it holds "
       "of the stream: its newest recoverable epoch is the restore point and every member "
       "published it (what `convergencectl gate` waits for; 0 blocks a drain)"),
    _m("checkpoint_requested", "gauge", S, "1 while a drain of this node waits for the job "
       "to save a new checkpoint"),
    # -- version handshake of each job (read at scrape time; components <= 8)
    _m("component_running", "gauge", ("component", "version"), "1, with the version of the "
       "component this node reports running (versions of the configured catalogue only)"),
    _m("versions_compatible", "gauge", ("stream", "component"), "1 when every member of the "
       "job accepts every version its members run, 0 when some member runs one another "
       "does not accept (absent until every member reported)"),
    _m("version_knowledge", "gauge", ("stream", "component"), "how far the version "
       "handshake got: 0 incomplete, 1 every member's accepted set known, 2 every member "
       "accepts the acknowledged version, 3 every member acknowledged it"),
    # -- events of each stream
    _m("recovery_seconds", "gauge", S, "last recovery generation, first request to agreed "
       "answer (RTO as this daemon sees it)"),
    _m("commits", "counter", ("domain", "outcome"), "commits accepted (durable and "
       "acknowledged) or rejected (refused, nothing changed); the ratio is the commit "
       "success ratio per domain"),
    _m("facts", "counter", ("type",), "facts submitted by local clients and applied, by type"),
    _m("repeated_facts", "counter", ("type",), "facts sent again that this node already held "
       "(a client retrying after a reconnect): acknowledged once durable, neither applied, "
       "logged, nor counted in commits or facts"),
    _m("rollbacks", "counter", S, "backward moves of the restore point (after losses)"),
    _m("retractions", "counter", S, "epochs reported lost or corrupt"),
    _m("spec_conflicts", "counter", S, "members seen publishing a different spec for the "
       "stream (declared, or refused and noticed)"),
    _m("membership_changes", "counter", S, "new member maps this node moved to (a spare "
       "replaced a host, the job shrank or grew); the log line `membership changed` names "
       "the members that left, joined and replaced others"),
    _m("incomplete_recoveries", "counter", S, "recovery generations whose restore point one "
       "of this node's ranks retracted before any of them committed again: it could not be "
       "restored and the job needed another generation (each node whose ranks failed it "
       "counts it: max by stream counts generations)"),
    _m("drain_requests", "counter", ("outcome",), "drain gate requests answered: `safe`, "
       "or `timeout` (not safe in time: the gate failed closed)"),
    _m("state_losses", "counter", (), "times this node learned of a life of its own it did not "
       "remember (its state directory was lost) and rose above it"),
    # -- background verification (docs/verification.md)
    _m("verifications", "counter", ("domain", "outcome"), "checkpoints of this node's ranks "
       "read again and checked against their commit: `ok`, `mismatch`, `missing` or "
       "`corrupt` (each retracted at once), `unreadable` or `unchecked` (no evidence: "
       "kept)"),
    _m("verified_bytes", "counter", D, "bytes the verifier read"),
    _m("restore_point_verified_age_seconds", "gauge", ("stream", "domain"), "seconds since "
       "the restore point last passed verification in the domain, or since it became the "
       "restore point if it has not yet (only where this node's ranks hold it with a "
       "location)"),
    _m("drills", "counter", ("outcome",), "drills (test restores) run here: `passed`, or "
       "`failed` (a checkpoint did not match its commit, or the hook failed); with "
       "`verifications` the restore success ratio"),
    _m("drill_load_bytes_per_second", "gauge", D, "load bandwidth of the last drill that "
       "restored every rank's checkpoint in the domain"),
    _m("checkpoint_overhead_ratio", "gauge", S, "fraction of the job's time its saves block "
       "training: over a rank's last 16 save cycles (one save's start to the next's), the "
       "seconds its saves blocked over the cycles' length, for the worst rank of this node; "
       "only where an integration times the saves (`report_save`), and absent until a rank "
       "reported two saves"),
    # -- peers
    _m("peer_up", "gauge", P, "1 while an established link to the peer is up"),
    _m("peer_exchange_rtt_seconds", "histogram", P,
       "round trip of TICK/TOCK exchanges this node started"),
    _m("peer_reconnects", "counter", P, "links re-established after a loss"),
    _m("peer_frames", "counter", ("peer", "type", "direction"),
       "frames by message type, sent and received"),
    _m("peer_bytes", "counter", ("peer", "direction"), "protocol bytes, sent and received"),
    _m("frames_rejected", "counter", R,
       "peer connections refused or closed for a protocol violation"),
    _m("records_rejected", "counter", R, "records dropped before merging (`unknown_origin`, "
       "`unsigned`, `bad_signature`)"),
    _m("credentials_refused", "counter", R, "peer credentials not admitted (CA-bound trust: "
       "`malformed`, `wrong_cluster`, `untrusted_certificate`, `wrong_node`, `expired`, "
       "`revoked`, `bad_signature`)"),
    _m("fleet_members", "gauge", (), "peers this node knows of (configured, discovered, "
       "and vouched for by credentials)"),
    # -- the local API and the log
    _m("api_errors", "counter", R, "local API error replies"),
    _m("local_clients", "gauge", (), "connected local clients"),
    _m("wal_fsync_duration_seconds", "histogram", (), "write plus fsync of one group commit"),
    _m("wal_entries", "counter", (), "entries made durable in the write-ahead log"),
    _m("wal_compactions", "counter", (), "rewrites of the write-ahead log from the live state"),
    _m("wal_compactions_deferred", "counter", (),
       "compactions that could not open or write their new file (EMFILE, ENOSPC): the old "
       "log goes on, and the next try waits for it to double"),
    _m("wal_bytes", "gauge", (), "size of the write-ahead log"),
)  # fmt: skip
"""Every metric the daemon exports."""

BY_NAME = {m.name: m for m in CATALOG}
KNOWLEDGE = {"incomplete": 0, "interval": 1, "proposed": 2, "published": 3}


def spec(name: str) -> MetricSpec:
    """The catalog entry of ``convergenced_<name>``."""
    return BY_NAME["convergenced_" + name]


# -- state metrics -------------------------------------------------------------------


class StateSource(Protocol):
    """What the collector reads from the daemon at scrape time."""

    def streams(self) -> list[str]:
        """Streams declared on this node."""

    def stream_state(self, stream: str) -> dict[str, Any]:
        """The ``state`` result of the local API for ``stream``."""

    def node_id(self) -> str:
        """This node."""

    def peer_links(self) -> list[tuple[str, bool]]:
        """Every configured peer, and whether an established link to it is up."""

    def wal_bytes(self) -> int | None:
        """Size of the write-ahead log on disk (None: not open yet)."""

    def local_clients(self) -> int:
        """Connected local API clients."""

    def restore_point_age(self, stream: str) -> float | None:
        """Seconds since the restore point of ``stream`` last changed, if it did."""

    def versions(self) -> dict[str, Any]:
        """The ``versions`` result of the local API, for every job."""


class StateCollector(Collector):
    """State metrics, read from a `StateSource` when Prometheus scrapes."""

    def __init__(self, source: StateSource) -> None:
        self.source = source

    def describe(self) -> Iterable[Metric]:
        return []  # unchecked collector: the catalog documents the names

    def collect(self) -> Iterator[Metric]:
        src = self.source
        families: dict[str, GaugeMetricFamily] = {}

        def family(name: str) -> GaugeMetricFamily:
            fam = families.get(name)
            if fam is None:
                m = spec(name)
                fam = families[name] = GaugeMetricFamily(m.name, m.help, labels=list(m.labels))
            return fam

        def gauge(name: str, labels: list[str], value: float) -> None:
            family(name).add_metric(labels, value)

        for stream in src.streams():
            s = src.stream_state(stream)
            rp = s["restore_point"]
            if rp is not None:
                gauge("restore_point_epoch", [stream], rp)
            if s["proposal"] is not None:
                gauge("proposal_epoch", [stream], s["proposal"])
            ci = s["convergence"]
            if ci:
                gauge("convergence_low_epoch", [stream], ci[0][0])
                gauge("convergence_high_epoch", [stream], ci[-1][1])
            if s["skew"] is not None:
                gauge("epoch_skew", [stream], s["skew"])
            for domain, spread in s["domain_skew"].items():
                gauge("domain_divergence", [stream, domain], spread)
            gauge("knowledge_level", [stream], KNOWLEDGE.get(s["knowledge"], 0))
            for domain, size in s["stored_bytes"].items():
                gauge("stored_bytes", [stream, domain], size)
            for domain, count in s["stored_epochs"].items():
                gauge("stored_epochs", [stream, domain], count)
            age = src.restore_point_age(stream)
            if rp is not None and age is not None:
                gauge("restore_point_age_seconds", [stream], age)
            gauge("drain_safe", [stream], 1.0 if s["drain_safe"] else 0.0)
            requested = s["checkpoint_requested"] is not None
            gauge("checkpoint_requested", [stream], 1.0 if requested else 0.0)
            for domain, v in s.get("verification", {}).items():
                if v["age_s"] is not None:
                    gauge("restore_point_verified_age_seconds", [stream, domain], v["age_s"])
            overhead = s.get("overhead")
            if overhead is not None:
                gauge("checkpoint_overhead_ratio", [stream], overhead["ratio"])
            own = s["newest"].get(src.node_id(), {})
            if rp is not None and own:
                gauge("rpo_epochs", [stream], max(0, max(own.values()) - rp))
        v = src.versions()
        for component, c in v["components"].items():
            if c["running"] is not None:
                gauge("component_running", [component, c["running"]], 1.0)
        for stream, per_component in v["streams"].items():
            for component, h in per_component.items():
                if h["compatible"] is not None:
                    gauge("versions_compatible", [stream, component], float(h["compatible"]))
                if h["declared"]:
                    level = KNOWLEDGE.get(h["knowledge"], 0)
                    gauge("version_knowledge", [stream, component], level)
        family("peer_up")  # present even before any peer is configured
        for peer, up in src.peer_links():
            gauge("peer_up", [peer], 1.0 if up else 0.0)
        wal = src.wal_bytes()
        if wal is not None:
            gauge("wal_bytes", [], wal)
        gauge("local_clients", [], src.local_clients())
        yield from families.values()


# -- the documentation table ------------------------------------------------------------

TABLE_BEGIN = "<!-- metrics-table:begin -->"
TABLE_END = "<!-- metrics-table:end -->"


def markdown_table() -> str:
    """The metrics table of docs/operations.md, generated from `CATALOG`."""
    rows = ["| metric | type | meaning |", "|---|---|---|"]
    for m in CATALOG:
        labels = "{" + ",".join(m.labels) + "}" if m.labels else ""
        rows.append(f"| `{m.exported}{labels}` | {m.kind} | {m.help} |")
    return "\n".join(rows) + "\n"


def splice_table(text: str, table: str) -> str:
    """``text`` with the part between the table markers replaced by ``table``.

    Raises:
        ValueError: the markers are missing.
    """
    try:
        head, rest = text.split(TABLE_BEGIN + "\n", 1)
        _, tail = rest.split(TABLE_END, 1)
    except ValueError:
        raise ValueError(f"missing {TABLE_BEGIN} ... {TABLE_END}") from None
    return f"{head}{TABLE_BEGIN}\n\n{table}\n{TABLE_END}{tail}"


def main(argv: list[str] | None = None, out: Callable[[str], Any] = sys.stdout.write) -> int:
    """Print the metrics table, or ``--write FILE`` it between the markers of FILE."""
    p = argparse.ArgumentParser(prog="python -m convergenced.daemon.metrics")
    p.add_argument("--write", type=Path, metavar="FILE", help="update the table in FILE")
    args = p.parse_args(argv)
    table = markdown_table()
    if args.write is None:
        out(table)
        return 0
    args.write.write_text(splice_table(args.write.read_text(encoding="utf-8"), table), "utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
