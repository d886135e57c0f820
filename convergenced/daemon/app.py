"""The daemon process: assembles the core, the log, the peer links and the local API.

Start-up order matters for the durability promise:

1. lock the state directory (one daemon per directory);
2. open the write-ahead log, truncating a torn tail, and replay it into a fresh
   `NodeCore`;
3. log and fsync the new incarnation *before* any record of it can leave;
4. bind the peer listener and the local socket, then dial peers.

Shutdown on SIGTERM or SIGINT (`Daemon.stop`): stop accepting, answer in-flight
requests (state changes run to their acknowledgement, waits and watches end with
``unavailable``), say BYE on every link, make the log durable, close. SIGHUP
re-reads the configuration and applies what can change safely (peers, mesh_limit,
log_level, wal_compact_bytes), naming what it could not.
"""

from __future__ import annotations

import fcntl
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import structlog
import trio

from convergenced import __version__
from convergenced.core.errors import ProtocolError
from convergenced.core.facts import Commit, Declare, Fact, Retract
from convergenced.core.link import LinkConfig, Role
from convergenced.core.node import (
    GenerationResolved,
    NodeCore,
    RestorePointChanged,
    SpecConflictDetected,
)
from convergenced.core.overlay import dial_targets
from convergenced.core.records import Record
from convergenced.core.wire import WireLimits
from convergenced.daemon import config as config_mod
from convergenced.daemon import logs
from convergenced.daemon.config import Config, Peer
from convergenced.daemon.dialer import dial_forever
from convergenced.daemon.http import HttpEndpoint
from convergenced.daemon.journal import Journal
from convergenced.daemon.local_api import LocalApiServer, open_unix_listener
from convergenced.daemon.metrics import Metrics
from convergenced.daemon.metrics import register as register_collector
from convergenced.daemon.notify import Notifier
from convergenced.daemon.peers import PeerHub, PeerSession
from convergenced.daemon.service import Service
from convergenced.daemon.transport import PeerTransport, TransportError
from convergenced.daemon.wal import Incarnation, WriteAheadLog
from convergenced.errors import ConvergencedError
from convergenced.security.keys import NodeIdentity
from convergenced.security.trust import TrustList

log = structlog.get_logger("convergenced.daemon")

WAL_NAME = "facts.wal"
LOCK_NAME = "lock"
SHUTDOWN_GRACE_S = 5.0
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
WARN_INTERVAL_S = 10.0
"""At most one warning per reason this often (rejections are counted regardless)."""


class StartupError(Exception):
    """The daemon cannot start (state directory in use, port taken...)."""


@contextmanager
def _state_lock(state_dir: Path) -> Iterator[None]:
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
    fd = os.open(state_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o640)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StartupError(
                f"{state_dir}: another convergenced already uses this state directory"
            ) from None
        yield
    finally:
        os.close(fd)


class Daemon:
    """One convergenced daemon. `run` serves until `stop` (or a signal)."""

    def __init__(
        self, config: Config, *, config_path: Path | None = None, log_json: bool | None = None
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.log_json = log_json
        """The log format chosen at start (None: by terminal); kept across reloads."""
        self.started_monotonic = time.monotonic()
        self.node: NodeCore | None = None
        self.hub: PeerHub | None = None
        self.api: LocalApiServer | None = None
        self.journal: Journal | None = None
        self.peer_port: int | None = None
        """The TCP port actually bound (useful with ``listen = "127.0.0.1:0"``)."""
        self.counters: dict[str, int] = {}
        self.metrics = Metrics()
        register_collector(self.metrics, self)
        self.notifier = Notifier()
        self.restore_point_since: dict[str, float] = {}
        """Per stream, when the restore point last changed (monotonic; metrics only)."""
        self.metrics_port: int | None = None
        self.ready = False
        self.fatal: BaseException | None = None
        """Why the daemon stopped on its own (the log failed), if it did."""
        self._compact_wanted = trio.Event()
        self._compacted_size = 0
        self.transport: PeerTransport | None = None
        self.trust: TrustList | None = None
        self._own_public_key = b""
        self._last_warned: dict[str, float] = {}
        self._handshaking = 0
        """Accepted peer connections still in their TLS handshake."""
        self._stop = trio.Event()
        self._stop_reason = ""
        self._dialers: dict[str, trio.CancelScope] = {}
        self._nursery: trio.Nursery | None = None

    # -- life cycle ----------------------------------------------------------------

    def stop(self, reason: str = "stop requested") -> None:
        """Begin a graceful shutdown."""
        self._stop_reason = self._stop_reason or reason
        self._stop.set()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until stopped. ``task_status.started`` fires once listeners are bound.

        Raises:
            StartupError: the state directory is in use or a listener cannot bind.
            WalCorruptError: the log is damaged before its end (acknowledged facts at risk).
        """
        cfg = self.config
        with _state_lock(cfg.state_dir):
            wal, entries, report = WriteAheadLog.open(cfg.state_dir / WAL_NAME)
            try:
                await self._serve(wal, entries, report.torn_tail_bytes, report.detail, task_status)
            finally:
                if self.journal is not None:
                    self.journal.close()
                wal.close()

    async def _serve(
        self,
        wal: WriteAheadLog,
        entries: list[Any],
        torn: int,
        torn_detail: str,
        task_status: Any,
    ) -> None:
        cfg = self.config
        if torn:
            log.warning(
                "write-ahead log had a torn tail; truncated it", bytes=torn, detail=torn_detail
            )
        incarnation = 1 + max((e.number for e in entries if isinstance(e, Incarnation)), default=0)
        sign, verify = self._security(cfg)
        node = NodeCore(cfg.node_id, incarnation, sign=sign, verify=verify)
        node.replay(e for e in entries if not isinstance(e, Incarnation))
        while node.next_event() is not None:
            pass  # replay's own events: old news
        self.node = node
        self.journal = Journal(
            wal,
            node,
            on_fsync=self._after_fsync,
            on_failure=self._log_failed,
            group_commit=self.config.wal_group_commit,
        )
        self.journal.record(Incarnation(incarnation))
        await self.journal.durable()
        log.info(
            "starting",
            version=__version__,
            incarnation=incarnation,
            facts=len(entries),
            streams=len(node.streams()),
            wal_bytes=wal.synced_bytes,
        )
        if wal.synced_bytes >= self._compact_threshold:
            await self._compact()

        self.hub = PeerHub(
            node,
            self._link_config(cfg),
            tick_seconds=cfg.tick_ms / 1000,
            make_durable=self.journal.durable,
            on_reject=self._peer_violation,
            metrics=self.metrics,
        )
        service = Service(
            node,
            self.journal,
            self.hub,
            max_streams=cfg.limits.max_streams,
            max_members=cfg.limits.max_members,
            status=self.status,
            on_fact=self._count_fact,
            on_refused=self._count_refused,
            on_recovery=lambda stream, s: self.metrics.recovery.labels(stream=stream).set(s),
        )
        self.api = LocalApiServer(
            service,
            cfg.limits,
            on_reject=self._count_reject,
            allowed_uids=cfg.allowed_uids,
            allowed_gids=cfg.allowed_gids,
        )

        try:
            peer_listeners = await trio.open_tcp_listeners(cfg.listen_port, host=cfg.listen_host)
        except OSError as exc:
            raise StartupError(
                f"cannot listen for peers on {cfg.listen_host}:{cfg.listen_port}: {exc}"
            ) from None
        self.peer_port = int(peer_listeners[0].socket.getsockname()[1])
        try:
            unix_listener = await open_unix_listener(cfg.socket_path)
        except OSError as exc:
            for listener in peer_listeners:
                await listener.aclose()
            raise StartupError(f"cannot listen on {cfg.socket_path}: {exc}") from None

        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                accept_scope = trio.CancelScope()
                nursery.start_soon(self._accept, accept_scope, peer_listeners, unix_listener)
                nursery.start_soon(self._watch_signals)
                nursery.start_soon(self._drain_events)
                nursery.start_soon(self._compactor)
                self._prime_metrics()
                await self._start_http(nursery)
                self._start_dialers(cfg)
                log.info(
                    "ready",
                    peer_port=self.peer_port,
                    socket=str(cfg.socket_path),
                    dials=sorted(self._dialers),
                )
                self.ready = True
                self.notifier.ready(self.summary())
                nursery.start_soon(self._notify_loop)
                task_status.started(self)
                await self._stop.wait()
                self.ready = False
                self.notifier.stopping()
                log.info("stopping", reason=self._stop_reason)
                accept_scope.cancel()
                await self._graceful_stop()
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True), suppress(OSError):
                cfg.socket_path.unlink()
        log.info("stopped")

    async def _accept(
        self,
        scope: trio.CancelScope,
        peer_listeners: list[trio.SocketListener],
        unix_listener: trio.SocketListener,
    ) -> None:
        assert self.api is not None and self._nursery is not None
        # Connections are handled in the daemon's nursery, not under ``scope``:
        # cancelling ``scope`` stops accepting, while live sessions drain gracefully.
        handlers = self._nursery
        with scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    partial(
                        trio.serve_listeners,
                        self._accept_peer,
                        peer_listeners,
                        handler_nursery=handlers,
                    )
                )
                nursery.start_soon(
                    partial(
                        trio.serve_listeners,
                        self.api.handle,
                        [unix_listener],
                        handler_nursery=handlers,
                    )
                )

    async def _accept_peer(self, tcp: trio.SocketStream) -> None:
        assert self.hub is not None and self.transport is not None
        # Connections still in their TLS handshake count too: they are exactly what
        # an unauthenticated flood would hold open.
        if len(self.hub.sessions) + self._handshaking >= self.config.limits.max_connections:
            self._count("peer_connections_refused")
            self.metrics.frames_rejected.labels(reason="too_many_connections").inc()
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
            self._count(f"peer_refused_{exc.reason}")
            self.metrics.frames_rejected.labels(reason=exc.reason).inc()
            self._rate_limited_warning(
                exc.reason, "peer connection refused", address=address, error=str(exc)
            )
            return
        finally:
            self._handshaking -= 1
        session = PeerSession(
            self.hub,
            stream,
            Role.ACCEPTOR,
            address=address,
            expected_peer=authenticated,
            handshake_timeout=self.config.limits.handshake_timeout_s,
        )
        reason = await session.run()
        log.info("link closed", peer=session.peer, address=address, reason=reason)

    async def _graceful_stop(self) -> None:
        assert self.api is not None and self.hub is not None and self.journal is not None
        for scope in self._dialers.values():
            scope.cancel()
        await self.api.drain(SHUTDOWN_GRACE_S)
        with trio.move_on_after(1.0):
            async with trio.open_nursery() as nursery:
                for session in list(self.hub.sessions):
                    nursery.start_soon(session.close, "shutting down")
        if self.journal.failure is None:
            await self.journal.durable()

    # -- security ----------------------------------------------------------------------

    def _security(self, cfg: Config) -> tuple[Any, Any]:
        """The record signer and verifier for the core, and the peer transport.

        Raises:
            StartupError: the identity or TLS files are missing or wrong.
        """
        try:
            self.transport = PeerTransport(cfg)
        except ConvergencedError as exc:
            raise StartupError(str(exc)) from None
        if cfg.insecure:
            log.warning(
                "INSECURE: peer links are plaintext and records unsigned; anyone who can "
                "reach the peer port can change what this node believes (insecure = true)"
            )
            return None, None
        if cfg.tls is None:
            log.info("no peers configured: this node works alone and admits no peer")
            return None, None
        try:
            identity = NodeIdentity.load(cfg.identity_path, node_id=cfg.node_id)
        except ConvergencedError as exc:
            raise StartupError(f"{exc} (create it with: convergenced keygen)") from None
        keys = {node: bytes.fromhex(key) for node, key in cfg.trust}
        listed = keys.get(cfg.node_id)
        if listed is not None and listed != identity.public_key_bytes():
            raise StartupError(
                f"{cfg.identity_path}: its public key is not the one trust.{cfg.node_id} "
                f"lists in {cfg.source}"
            )
        keys[cfg.node_id] = self._own_public_key = identity.public_key_bytes()
        self.trust = TrustList(keys)
        trust = self.trust

        def verify(record: Record, via: str | None) -> str | None:
            reason = trust.check(record, link_peer=via)
            if reason is None:
                return None
            self._count(f"records_rejected_{reason.value}")
            self.metrics.records_rejected.labels(reason=reason.value).inc()
            self._rate_limited_warning(
                str(reason),
                "record rejected",
                origin=record.origin,
                stream=record.stream,
                via=via,
                reason=str(reason),
            )
            return str(reason)

        return identity.sign_record, verify

    def _peer_violation(self, err: ProtocolError, session: PeerSession) -> None:
        self._count(f"peer_rejected_{err.reason}")
        self.metrics.frames_rejected.labels(reason=err.reason).inc()
        self._rate_limited_warning(
            f"peer:{err.reason}",
            "peer broke the protocol; link closed",
            peer=session.peer,
            address=session.address,
            error=str(err),
        )

    def _rate_limited_warning(self, key: str, event: str, **fields: Any) -> None:
        # At most one line per reason per interval: a hostile peer must not be able
        # to flood the log (the counters still count every occurrence).
        now = time.monotonic()
        if now - self._last_warned.get(key, -1e9) >= WARN_INTERVAL_S:
            self._last_warned[key] = now
            log.warning(event, **fields)

    # -- the log ----------------------------------------------------------------------

    def _after_fsync(self, seconds: float, entries: int) -> None:
        self.metrics.fsync.observe(seconds)
        self._count("wal_fsyncs")
        self._count("wal_entries", entries)
        assert self.journal is not None
        if self.journal.wal.synced_bytes >= self._compact_threshold:
            self._compact_wanted.set()

    def _log_failed(self, exc: BaseException) -> None:
        # Nothing more can be acknowledged (see `journal`): stop, and let the restart
        # replay what is really on disk.
        log.critical("write-ahead log failed; stopping", error=str(exc))
        self.fatal = exc
        self.stop("write-ahead log failed")

    @property
    def _compact_threshold(self) -> int:
        # Twice the last compacted size too: a log whose live state is large must not
        # be rewritten after every few appends.
        return max(self.config.wal_compact_bytes, 2 * self._compacted_size)

    async def _compactor(self) -> None:
        while True:
            await self._compact_wanted.wait()
            self._compact_wanted = trio.Event()
            await self._compact()

    async def _compact(self) -> None:
        assert self.journal is not None and self.node is not None
        node, journal = self.node, self.journal
        before = journal.wal.synced_bytes
        started = time.monotonic()
        size = await journal.compact(
            lambda: [Incarnation(node.incarnation), *node.compacted_facts()]
        )
        self._compacted_size = size
        self._count("wal_compactions")
        log.info(
            "write-ahead log compacted",
            bytes_before=before,
            bytes_after=size,
            seconds=round(time.monotonic() - started, 3),
        )

    # -- peers -----------------------------------------------------------------------

    def _link_config(self, cfg: Config) -> LinkConfig:
        allowed = frozenset([cfg.node_id, *(p.node_id for p in cfg.peers)])
        return LinkConfig(
            cluster=cfg.cluster,
            idle_ticks=cfg.idle_ticks,
            dead_ticks=cfg.dead_ticks,
            allowed_peers=allowed,
            limits=WireLimits(
                max_frame_bytes=cfg.limits.max_frame_bytes,
                max_records=cfg.limits.max_records_per_message,
            ),
        )

    def dial_plan(self, cfg: Config) -> list[Peer]:
        """The configured peers this node dials (the overlay decides; see `overlay`)."""
        ids = [cfg.node_id, *(p.node_id for p in cfg.peers)]
        targets = set(dial_targets(ids, cfg.node_id, cfg.mesh_limit))
        return [p for p in cfg.peers if p.node_id in targets]

    def _start_dialers(self, cfg: Config) -> None:
        assert self._nursery is not None and self.hub is not None
        wanted = {p.node_id: p for p in self.dial_plan(cfg)}
        for node_id in list(self._dialers):
            if node_id not in wanted:
                self._dialers.pop(node_id).cancel()
                for session in self.hub.sessions:
                    if session.peer == node_id:
                        session.link.close("peer removed from configuration")
                        session.wake()
        for node_id, peer in wanted.items():
            if node_id not in self._dialers:
                scope = trio.CancelScope()
                self._dialers[node_id] = scope
                self._nursery.start_soon(self._dial, scope, peer)

    async def _dial(self, scope: trio.CancelScope, peer: Peer) -> None:
        assert self.hub is not None
        with scope:
            assert self.transport is not None
            await dial_forever(
                self.hub,
                peer,
                connect=self.transport.dial,
                connect_timeout=self.config.limits.handshake_timeout_s,
                on_reconnect=self._count_reconnect,
                on_refused=self._count_dial_refused,
            )

    # -- signals and reload ------------------------------------------------------------

    async def _watch_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async for signum in signals:
                if signum == signal.SIGHUP:
                    self.reload()
                else:
                    self.stop(signal.Signals(signum).name)

    def reload(self) -> list[str]:
        """Re-read the configuration file; apply peers, mesh_limit, log_level and
        wal_compact_bytes.

        Returns the keys that changed but need a restart (also logged).
        """
        if self.config_path is None:
            log.warning("reload ignored: the daemon was not started from a file")
            return []
        try:
            new = config_mod.load(self.config_path)
        except config_mod.ConfigError as exc:
            log.error("reload failed; keeping the running configuration", error=str(exc))
            return []
        old = self.config
        fixed = [
            key
            for key in (
                "node_id",
                "cluster",
                "listen_host",
                "listen_port",
                "socket_path",
                "state_dir",
                "tick_ms",
                "idle_ticks",
                "dead_ticks",
                "wal_group_commit",
                "limits",
                "insecure",
                "tls",
                "identity",
                "allowed_uids",
                "allowed_gids",
            )
            if getattr(old, key) != getattr(new, key)
        ]
        kept = replace(
            old,
            peers=new.peers,
            mesh_limit=new.mesh_limit,
            log_level=new.log_level,
            wal_compact_bytes=new.wal_compact_bytes,
            trust=new.trust,
            source=new.source,
        )
        self.config = kept
        if self.trust is not None and new.trust != old.trust:
            keys = {node: bytes.fromhex(key) for node, key in new.trust}
            keys[old.node_id] = self._own_public_key
            self.trust.replace_keys(keys)
        if new.log_level != old.log_level:
            logs.configure(new.log_level, old.node_id, json=self.log_json)
        assert self.hub is not None
        self.hub.link_config = self._link_config(kept)
        self._prime_metrics()
        self._start_dialers(kept)
        log.info(
            "configuration reloaded",
            peers=[p.node_id for p in kept.peers],
            log_level=kept.log_level,
        )
        if fixed:
            log.warning(
                "these settings need a restart to change; still running the old ones", keys=fixed
            )
        return fixed

    # -- events and status ---------------------------------------------------------------

    async def _drain_events(self) -> None:
        assert self.node is not None and self.hub is not None
        while True:
            await self.hub.wait_changed()
            for ev in iter(self.node.next_event, None):
                if isinstance(ev, RestorePointChanged):
                    self.restore_point_since[ev.stream] = time.monotonic()
                    if ev.rollback:
                        self._count("rollbacks")
                        self.metrics.rollbacks.labels(stream=ev.stream).inc()
                        log.warning(
                            "restore point rolled back", stream=ev.stream, old=ev.old, new=ev.new
                        )
                    else:
                        log.debug("restore point", stream=ev.stream, old=ev.old, new=ev.new)
                elif isinstance(ev, SpecConflictDetected):
                    self._count("spec_conflicts")
                    log.error(
                        "member declared a different spec",
                        stream=ev.stream,
                        member=ev.member,
                        digest=ev.digest.hex()[:16],
                    )
                elif isinstance(ev, GenerationResolved):
                    log.info(
                        "recovery generation resolved",
                        stream=ev.stream,
                        generation=ev.generation,
                        restore_point=ev.restore_point,
                    )

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def _prime_metrics(self) -> None:
        # Labelled series exist only from their first increment, and Prometheus'
        # rate()/increase() cannot see that first event: a stream's first rollback
        # would never fire an alert. So every bounded label set starts at zero.
        m = self.metrics
        if self.node is not None:
            for stream in self.node.streams():
                self._prime_stream(stream)
        for peer in self.config.peers:
            m.reconnects.labels(peer=peer.node_id)
        for reason in ("unknown_origin", "unsigned", "bad_signature"):
            m.records_rejected.labels(reason=reason)
        for reason in PRIMED_FRAME_REASONS:
            m.frames_rejected.labels(reason=reason)

    def _prime_stream(self, stream: str) -> None:
        assert self.node is not None
        m = self.metrics
        m.rollbacks.labels(stream=stream)
        m.retractions.labels(stream=stream)
        for domain in self.node.spec(stream).policy.domains:
            for outcome in ("accepted", "rejected"):
                m.commits.labels(domain=domain, outcome=outcome)

    def _count_fact(self, fact: Fact) -> None:
        self._count(f"facts_{type(fact).__name__.lower()}")
        if isinstance(fact, Declare):
            self._prime_stream(fact.spec.name)
        if isinstance(fact, Commit):
            self.metrics.commits.labels(domain=fact.domain, outcome="accepted").inc()
        elif isinstance(fact, Retract):
            self.metrics.retractions.labels(stream=fact.stream).inc()

    def _count_refused(self, fact: Fact, reason: str) -> None:
        # Only domains of declared streams label the metric: a client cannot grow
        # the label set by inventing domain names.
        if isinstance(fact, Commit) and self.node is not None:
            declared = fact.stream in self.node.streams()
            domains = self.node.spec(fact.stream).policy.domains if declared else ()
            domain = fact.domain if fact.domain in domains else "other"
            self.metrics.commits.labels(domain=domain, outcome="rejected").inc()

    def _count_reject(self, reason: str) -> None:
        self._count(f"api_errors_{reason}")
        self.metrics.api_errors.labels(reason=reason).inc()

    def _count_reconnect(self, peer: str) -> None:
        self._count("peer_reconnects")
        self.metrics.reconnects.labels(peer=peer).inc()

    def _count_dial_refused(self, reason: str) -> None:
        self._count(f"peer_refused_{reason}")
        self.metrics.frames_rejected.labels(reason=reason).inc()

    # -- metrics endpoint, probes, systemd ---------------------------------------------

    async def _start_http(self, nursery: trio.Nursery) -> None:
        where = self.config.metrics_listen
        if where is None:
            return
        endpoint = HttpEndpoint(self.metrics.registry, healthy=self.healthy, ready=self.readiness)
        try:
            listeners = await endpoint.listen(where[0], where[1], nursery)
        except OSError as exc:
            raise StartupError(f"cannot serve metrics on {where[0]}:{where[1]}: {exc}") from None
        self.metrics_port = int(listeners[0].socket.getsockname()[1])

    def healthy(self) -> tuple[bool, str]:
        """For /healthz and `convergenced healthcheck`: the process serves and its log
        works."""
        if self.journal is not None and self.journal.failure is not None:
            return False, f"write-ahead log failed: {self.journal.failure}"
        return True, "ok"

    def readiness(self) -> tuple[bool, str]:
        """For /readyz: listeners bound, not stopping."""
        ok, why = self.healthy()
        if not ok:
            return ok, why
        return (True, "ready") if self.ready else (False, "starting or stopping")

    def summary(self) -> str:
        """One line for systemd's STATUS= and logs."""
        if self.node is None:
            return "starting"
        linked = len(self.node.neighbours)
        streams = self.node.streams()
        points = ", ".join(f"{s}@{self.node.restore_point(s)}" for s in streams[:3])
        more = f" (+{len(streams) - 3})" if len(streams) > 3 else ""
        return (
            f"{linked}/{len(self.config.peers)} peers linked, {len(streams)} streams"
            f"{': ' + points if points else ''}{more}"
        )

    async def _notify_loop(self) -> None:
        interval = self.notifier.watchdog_interval
        last_status = 0.0
        while True:
            await trio.sleep(interval if interval is not None else 5.0)
            if interval is not None:
                self.notifier.watchdog()
            if trio.current_time() - last_status >= 5.0:
                self.notifier.status(self.summary())
                last_status = trio.current_time()

    def status(self) -> dict[str, Any]:
        """The ``status`` result of the local API."""
        assert self.node is not None and self.hub is not None and self.api is not None
        cfg = self.config
        links = []
        for s in sorted(self.hub.sessions, key=lambda s: (s.peer or "", s.address)):
            links.append(
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
            )
        connected = {entry["peer"] for entry in links}
        warnings = []
        if cfg.insecure:
            warnings.append("INSECURE: plaintext peer links and unsigned records (insecure = true)")
        return {
            "node": cfg.node_id,
            "cluster": cfg.cluster,
            "insecure": cfg.insecure,
            "warnings": warnings,
            "version": __version__,
            "incarnation": self.node.incarnation,
            "uptime_s": round(time.monotonic() - self.started_monotonic, 3),
            "peer_port": self.peer_port,
            "metrics_port": self.metrics_port,
            "summary": self.summary(),
            "socket": str(cfg.socket_path),
            "peers": [
                {
                    "id": p.node_id,
                    "address": f"{p.host}:{p.port}",
                    "connected": p.node_id in connected,
                    "dialled": p.node_id in self._dialers,
                }
                for p in cfg.peers
            ],
            "links": links,
            "clients": len(self.api.sessions),
            "streams": self.node.streams(),
            "counters": dict(sorted(self.counters.items())),
        }
