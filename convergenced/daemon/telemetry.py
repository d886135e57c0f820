"""Telemetry: every event the daemon counts or reports, in one object.

Each adapter (the group commit, the peer sessions and dialers, the local API, the
daemon itself) gets the daemon's one `Telemetry` and tells it what happened. Each
event is counted once, in its Prometheus counter (from the `metrics` catalog), and
logged when an operator should hear of it; warnings a peer or a local process can
provoke are rate-limited per reason, so nobody can flood the log (the counters
still count every occurrence). The ``counters`` map of ``status --json`` is read
back from the same counters (`counters`), not kept beside them.

Label sets start at zero where Prometheus needs to see the first event (`prime`):
``rate()`` and ``increase()`` cannot see a series' first increment, so a stream's
first rollback would never fire an alert otherwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import structlog
import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from convergenced import __version__
from convergenced.core.errors import ProtocolError
from convergenced.core.facts import Commit, Declare, Fact, Retract, Undeclare
from convergenced.core.interval_set import IntervalSet
from convergenced.core.node import (
    GenerationResolved,
    MembershipChanged,
    NodeEvent,
    RestorePointChanged,
    SpecConflictDetected,
    StateLost,
)
from convergenced.core.records import Record
from convergenced.core.versions import is_reserved
from convergenced.daemon.metrics import StateCollector, StateSource, spec

log = structlog.get_logger("convergenced.daemon")

RTT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
FSYNC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)
WARN_INTERVAL_S = 10.0
"""At most one warning per reason this often."""
TRANSPORT_REASONS = frozenset(
    {"tls_handshake_failed", "tls_handshake_timeout", "tls_no_node_id", "tls_wrong_peer"}
)
"""Reasons a connection is refused before any protocol message (the TLS layer)."""
TOO_MANY_CONNECTIONS = "too_many_connections"
PRIMED_FRAME_REASONS = (
    "tls_handshake_failed",
    "tls_handshake_timeout",
    "tls_wrong_peer",
    "out_of_order",
    "invalid_field",
    "malformed_body",
    "unknown_node",
    "wrong_cluster",
    "unexpected_peer",
)
"""Rejection reasons whose counters start at zero (any other appears on first use)."""
RECORD_REASONS = ("unknown_origin", "unsigned", "bad_signature")


def _counter(name: str, registry: CollectorRegistry) -> Counter:
    m = spec(name)
    return Counter(m.name, m.help, list(m.labels), registry=registry)


class Telemetry:
    """The daemon's counters, histograms and operator-facing log lines."""

    def __init__(self, clock: Callable[[], float] = trio.current_time) -> None:
        self.clock = clock
        self.registry = r = CollectorRegistry(auto_describe=True)
        info = spec("build_info")
        Gauge(info.name, info.help, list(info.labels), registry=r).labels(__version__).set(1)
        self.commits = _counter("commits", r)
        self.facts = _counter("facts", r)
        self.repeated = _counter("repeated_facts", r)
        self.retractions = _counter("retractions", r)
        self.rollbacks = _counter("rollbacks", r)
        self.spec_conflicts = _counter("spec_conflicts", r)
        self.state_losses = _counter("state_losses", r)
        self.membership_changes = _counter("membership_changes", r)
        self.incomplete_recoveries = _counter("incomplete_recoveries", r)
        self._incomplete_seen: set[tuple[str, int]] = set()
        self.api_errors = _counter("api_errors", r)
        self.frames_rejected = _counter("frames_rejected", r)
        self.records_rejected = _counter("records_rejected", r)
        self.credentials_refused = _counter("credentials_refused", r)
        fm = spec("fleet_members")
        self.fleet_members = Gauge(fm.name, fm.help, list(fm.labels), registry=r)
        self.reconnects = _counter("peer_reconnects", r)
        self.frames = _counter("peer_frames", r)
        self.bytes = _counter("peer_bytes", r)
        self.wal_entries = _counter("wal_entries", r)
        self.wal_compactions = _counter("wal_compactions", r)
        self.wal_compactions_deferred = _counter("wal_compactions_deferred", r)
        self.drains = _counter("drain_requests", r)
        for outcome in ("safe", "timeout"):
            self.drains.labels(outcome=outcome)
        rtt, fsync, rec = spec("peer_exchange_rtt_seconds"), spec("wal_fsync_duration_seconds"), \
            spec("recovery_seconds")  # fmt: skip
        self.exchange_rtt = Histogram(rtt.name, rtt.help, list(rtt.labels),
                                      buckets=RTT_BUCKETS, registry=r)  # fmt: skip
        self.fsync = Histogram(fsync.name, fsync.help, buckets=FSYNC_BUCKETS, registry=r)
        self.recovery = Gauge(rec.name, rec.help, list(rec.labels), registry=r)
        self._restore_point_since: dict[str, float] = {}
        self._last_warned: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}
        """Rate-limited events counted since their last log line, by key."""
        self._applied: dict[type, Any] = {}
        """`facts` children by fact type, and `commits` (accepted) children by domain:
        looked up once, as `.labels` costs more than the increment on the commit path.
        Neither family ever has a child removed, so a cached child is never stale."""
        self._accepted: dict[str, Any] = {}

    def watch(self, source: StateSource) -> None:
        """Export the state metrics of ``source`` at every scrape."""
        self.registry.register(StateCollector(source))

    def prime(self, streams: Iterable[tuple[str, Iterable[str]]], peers: Iterable[str]) -> None:
        """Start the bounded label sets at zero: (stream, its policy's domains), peers."""
        for stream, domains in streams:
            self.rollbacks.labels(stream=stream)
            self.retractions.labels(stream=stream)
            self.membership_changes.labels(stream=stream)
            self.incomplete_recoveries.labels(stream=stream)
            for domain in domains:
                for outcome in ("accepted", "rejected"):
                    self.commits.labels(domain=domain, outcome=outcome)
        for peer in peers:
            self.reconnects.labels(peer=peer)
        for reason in RECORD_REASONS:
            self.records_rejected.labels(reason=reason)
        for reason in PRIMED_FRAME_REASONS:
            self.frames_rejected.labels(reason=reason)

    def may_warn(self, key: str) -> bool:
        """True at most once per ``key`` every `WARN_INTERVAL_S` (the caller then logs)."""
        now = self.clock()
        if now - self._last_warned.get(key, -1e18) < WARN_INTERVAL_S:
            return False
        self._last_warned[key] = now
        return True

    def warn(self, key: str, event: str, **fields: Any) -> None:
        """Log a warning, at most once per ``key`` every `WARN_INTERVAL_S`."""
        if self.may_warn(key):
            log.warning(event, **fields)

    # -- facts and the local API ---------------------------------------------------

    def fact_applied(self, fact: Fact) -> None:
        """A client's fact was applied (acknowledged once durable)."""
        kind = type(fact)
        child = self._applied.get(kind)
        if child is None:
            child = self._applied[kind] = self.facts.labels(type=kind.__name__.lower())
        child.inc()
        if isinstance(fact, Commit):
            accepted = self._accepted.get(fact.domain)
            if accepted is None:
                accepted = self._accepted[fact.domain] = self.commits.labels(
                    domain=fact.domain, outcome="accepted"
                )
            accepted.inc()
        elif isinstance(fact, Declare):
            self.prime([(fact.spec.name, fact.spec.policy.domains)], ())
        elif isinstance(fact, Retract):
            self.retractions.labels(stream=fact.stream).inc()
        elif isinstance(fact, Undeclare):
            log.info("stream undeclared", stream=fact.stream)
            for family in (self.rollbacks, self.retractions, self.spec_conflicts, self.recovery,
                           self.membership_changes, self.incomplete_recoveries):  # fmt: skip
                with contextlib.suppress(KeyError):  # labels stay bounded by declared streams
                    family.remove(fact.stream)
            self._restore_point_since.pop(fact.stream, None)

    def fact_repeated(self, fact: Fact) -> None:
        """A client sent again a fact the node held already (acknowledged, not applied):
        counted apart, so commits and facts count each fact once."""
        self.repeated.labels(type=type(fact).__name__.lower()).inc()

    def fact_refused(self, fact: Fact, declared_domains: Iterable[str]) -> None:
        """A client's fact was refused; ``declared_domains``: of its stream, if declared.

        Only domains of declared streams label the metric: a client cannot grow the
        label set by inventing domain names.
        """
        if isinstance(fact, Commit):
            domain = fact.domain if fact.domain in set(declared_domains) else "other"
            self.commits.labels(domain=domain, outcome="rejected").inc()

    def api_error(self, reason: str) -> None:
        """One local API error reply."""
        self.api_errors.labels(reason=reason).inc()

    def recovered(self, stream: str, seconds: float) -> None:
        """A recovery generation this node asked for was answered after ``seconds``."""
        self.recovery.labels(stream=stream).set(seconds)

    def incomplete_recovery(self, stream: str, generation: int, epoch: int) -> None:
        """A rank could not restore ``epoch``, the restore point of ``generation`` (its
        checkpoint was retracted): the job needs another generation. Counted once per
        generation."""
        if (stream, generation) in self._incomplete_seen:
            return
        self._incomplete_seen.add((stream, generation))
        self.incomplete_recoveries.labels(stream=stream).inc()
        log.warning("incomplete recovery: the restore point was lost during the restore",
                    stream=stream, generation=generation, epoch=epoch)  # fmt: skip

    def drain_answered(self, safe: bool) -> None:
        """A drain request was answered: safe, or not before its timeout."""
        self.drains.labels(outcome="safe" if safe else "timeout").inc()

    # -- the node's events -----------------------------------------------------------

    def node_event(self, ev: NodeEvent) -> None:
        """Count and log what the core reported."""
        stream = getattr(ev, "stream", "")
        if is_reserved(stream):
            # A job's version handshake (`core.versions`): its own metrics are read
            # from the state; per-stream counters keep to the jobs' streams.
            log.info("version handshake", what=type(ev).__name__, stream=stream)
            return
        if isinstance(ev, RestorePointChanged):
            self._restore_point_since[ev.stream] = self.clock()
            if ev.rollback:
                self.rollbacks.labels(stream=ev.stream).inc()
                log.warning("restore point rolled back", stream=ev.stream, old=ev.old, new=ev.new)
            else:
                log.debug("restore point", stream=ev.stream, old=ev.old, new=ev.new)
        elif isinstance(ev, SpecConflictDetected):
            self.spec_conflicts.labels(stream=ev.stream).inc()
            log.error("member declared a different spec", stream=ev.stream, member=ev.member,
                      digest=ev.digest.hex()[:16])  # fmt: skip
        elif isinstance(ev, StateLost):
            self.state_losses.inc()
            log.warning("this node's state was lost: it found an earlier life of its own it "
                        "does not remember, rose above it and adopted what that life "
                        "published", seen_incarnation=ev.seen,
                        incarnation=ev.incarnation)  # fmt: skip
        elif isinstance(ev, MembershipChanged):
            self.membership_changes.labels(stream=ev.stream).inc()
            # Members are unbounded: they go in the log line, never in labels.
            log.info("membership changed", stream=ev.stream, membership=ev.membership,
                        left=list(ev.left), joined=list(ev.joined),
                        replaced=[f"{old} -> {new}" for old, new in ev.replaced],
                        moved_ranks=_ranges(ev.moved_ranks))  # fmt: skip
        elif isinstance(ev, GenerationResolved):
            log.info("recovery generation resolved", stream=ev.stream,
                     generation=ev.generation, restore_point=ev.restore_point)  # fmt: skip

    def restore_point_age(self, stream: str) -> float | None:
        """Seconds since the restore point of ``stream`` last changed here, if it did."""
        since = self._restore_point_since.get(stream)
        return None if since is None else self.clock() - since

    # -- peers -----------------------------------------------------------------------

    def peer_violation(self, err: ProtocolError, peer: str | None, address: str) -> None:
        """A peer broke the protocol; its link was closed."""
        self.frames_rejected.labels(reason=err.reason).inc()
        self.warn(f"peer:{err.reason}", "peer broke the protocol; link closed",
                  peer=peer, address=address, error=str(err))  # fmt: skip

    def connection_refused(self, reason: str, address: str = "", error: str = "") -> None:
        """A peer connection was refused before its HELLO (TLS, or too many)."""
        self.frames_rejected.labels(reason=reason).inc()
        if address:
            self.warn(reason, "peer connection refused", address=address, error=error)

    def credential_refused(self, reason: str, detail: str, via: str | None) -> None:
        """A peer's credential was not admitted (``reason`` is a bounded label)."""
        self.credentials_refused.labels(reason=reason).inc()
        self.warn(f"credential:{reason}", "credential refused", reason=reason, detail=detail,
                  via=via)  # fmt: skip

    def record_rejected(self, reason: str, record: Record, via: str | None) -> None:
        """A record failed verification and was dropped before merging."""
        self.records_rejected.labels(reason=reason).inc()
        self.warn(reason, "record rejected", origin=record.origin, stream=record.stream,
                  via=via, reason=reason)  # fmt: skip

    def reconnected(self, peer: str) -> None:
        """A link to ``peer`` came back after a loss."""
        self.reconnects.labels(peer=peer).inc()

    def link_up(self, peer: str, address: str, role: str, incarnation: int) -> None:
        """HELLOs exchanged with ``peer``: the link is up."""
        log.info("link up", peer=peer, address=address, role=role, incarnation=incarnation)

    def link_down(self, peer: str, address: str, reason: str) -> None:
        """The link to ``peer`` that was up is gone, for ``reason``."""
        log.info("link down", peer=peer, address=address, reason=reason)

    def reconnecting(self, peer: str, address: str, reason: str, retry_in: float) -> None:
        """The dialer will dial ``peer`` again in ``retry_in`` seconds."""
        log.info("reconnecting", peer=peer, address=address, reason=reason,
                 retry_in=round(retry_in, 3))  # fmt: skip

    def dial_failed(
        self, peer: str, address: str, reason: str, error: str, retry_in: float
    ) -> None:
        """A dial of ``peer`` failed for ``reason`` (a TLS refusal is counted as one).

        Logged at most once per peer and reason every `WARN_INTERVAL_S`, with the
        failures since the last line: a peer that is down is redialled every few
        seconds for as long as it is down. A TLS refusal is a warning (a certificate
        or a configuration to fix); a peer that is not up yet is information.
        """
        if reason in TRANSPORT_REASONS:
            self.connection_refused(reason)
        key = f"dial:{peer}:{reason}"
        self._unlogged[key] = failures = self._unlogged.get(key, 0) + 1
        if not self.may_warn(key):
            return
        del self._unlogged[key]
        (log.warning if reason in TRANSPORT_REASONS else log.info)(
            "dial failed", peer=peer, address=address, reason=reason, error=error,
            failures=failures, retry_in=round(retry_in, 3),
        )  # fmt: skip

    def exchanged(self, peer: str, seconds: float) -> None:
        """An exchange this node started with ``peer`` completed."""
        self.exchange_rtt.labels(peer=peer).observe(seconds)

    def traffic(self, peer: str, frames: Iterable[tuple[tuple[str, str], int]],
                sent: int, received: int) -> None:  # fmt: skip
        """Frames ((direction, type), count) and bytes exchanged with ``peer``."""
        for (direction, kind), n in frames:
            self.frames.labels(peer=peer, type=kind, direction=direction).inc(n)
        if sent:
            self.bytes.labels(peer=peer, direction="sent").inc(sent)
        if received:
            self.bytes.labels(peer=peer, direction="received").inc(received)

    # -- the log -----------------------------------------------------------------------

    def log_synced(self, seconds: float, entries: int) -> None:
        """One group write and fsync of ``entries`` took ``seconds``."""
        self.fsync.observe(seconds)
        self.wal_entries.inc(entries)

    def log_compacted(self, before: int, after: int, seconds: float) -> None:
        """The log was rewritten from the live state."""
        self.wal_compactions.inc()
        log.info("write-ahead log compacted", bytes_before=before, bytes_after=after,
                 seconds=round(seconds, 3))  # fmt: skip

    def log_compaction_deferred(self, exc: OSError) -> None:
        """A compaction failed before replacing anything; the old log goes on."""
        self.wal_compactions_deferred.inc()
        self.warn("compaction", "write-ahead log not compacted; it goes on as it is and "
                  "is compacted once it has doubled", reason=str(exc))  # fmt: skip

    # -- the status view ------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        """The ``counters`` of ``status``, read from the Prometheus counters.

        Names: ``facts_<type>``, ``repeated_<type>``, ``api_errors_<reason>``,
        ``peer_refused_<reason>`` (TLS refusals), ``peer_connections_refused``,
        ``peer_rejected_<reason>``
        (protocol violations), ``records_rejected_<reason>``, ``peer_reconnects``,
        ``rollbacks``, ``spec_conflicts``, ``membership_changes``, ``wal_fsyncs``, ``wal_entries``,
        ``wal_compactions``, ``drain_requests_<outcome>``. Counters still at zero are
        left out.
        """
        out: dict[str, int] = {}

        def add(name: str, value: float) -> None:
            if value:
                out[name] = out.get(name, 0) + int(value)

        for labels, v in _samples(self.facts):
            add(f"facts_{labels['type']}", v)
        for labels, v in _samples(self.repeated):
            add(f"repeated_{labels['type']}", v)
        for labels, v in _samples(self.api_errors):
            add(f"api_errors_{labels['reason']}", v)
        for labels, v in _samples(self.records_rejected):
            add(f"records_rejected_{labels['reason']}", v)
        for labels, v in _samples(self.credentials_refused):
            add(f"credentials_refused_{labels['reason']}", v)
        for labels, v in _samples(self.drains):
            add(f"drain_requests_{labels['outcome']}", v)
        for labels, v in _samples(self.frames_rejected):
            reason = labels["reason"]
            if reason == TOO_MANY_CONNECTIONS:
                add("peer_connections_refused", v)
            elif reason in TRANSPORT_REASONS:
                add(f"peer_refused_{reason}", v)
            else:
                add(f"peer_rejected_{reason}", v)
        for name, counter in (("peer_reconnects", self.reconnects), ("rollbacks", self.rollbacks),
                              ("spec_conflicts", self.spec_conflicts),
                              ("membership_changes", self.membership_changes),
                              ("state_losses", self.state_losses),
                              ("wal_entries", self.wal_entries),
                              ("wal_compactions", self.wal_compactions),
                              ("wal_compactions_deferred",
                               self.wal_compactions_deferred)):  # fmt: skip
            for _, v in _samples(counter):
                add(name, v)
        for fam in self.fsync.collect():
            for s in fam.samples:
                if s.name.endswith("_count"):
                    add("wal_fsyncs", s.value)
        return dict(sorted(out.items()))


def _ranges(ranks: Iterable[int]) -> str:
    """``0-3, 7``: ranks in a short form (a large job moves thousands)."""
    spans = IntervalSet.of(*ranks).ranges
    return ", ".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in spans)


def _samples(counter: Counter) -> Iterable[tuple[dict[str, str], float]]:
    for fam in counter.collect():
        for s in fam.samples:
            if s.name.endswith("_total"):
                yield s.labels, s.value
