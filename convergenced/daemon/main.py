"""The daemon process: start-up, serving, graceful stop and reload.

Start-up order matters for the durability promise, and a start that fails must leave
the state directory as it was (no log created, no incarnation spent):

1. if a daemon used the state directory before, take its lock now (one daemon per
   directory), so a second daemon on it is refused before anything else;
2. load the certificates and keys and bind every listener (peers, the local socket,
   metrics), accepting nothing yet: a wrong key file or a busy port stops the start
   here, and nothing has been written;
3. take the lock (creating the state directory and its lock file on a first start),
   open the write-ahead log (creating it, truncating a torn tail, refusing damage) and
   rebuild the node from it (`wiring.assemble`);
4. log and fsync the new incarnation *before* any record of it can leave: only then
   are connections accepted (those that arrived meanwhile wait in the listeners'
   backlogs), metrics served and peers dialled.

Shutdown on SIGTERM or SIGINT (`Daemon.stop`): stop accepting, answer in-flight
requests (state changes run to their acknowledgement, waits and watches end with
``unavailable``), say BYE on every link, make the log durable, close. SIGHUP
re-reads the configuration and applies what can change safely (peers, trust,
mesh_limit, log_level, wal_compact_bytes), naming what it could not.
"""

from __future__ import annotations

import fcntl
import os
import signal
from contextlib import suppress
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import structlog
import trio
from cryptography import x509

from convergenced import __version__
from convergenced.core.events import StateLost
from convergenced.daemon import config as config_mod
from convergenced.daemon import logs
from convergenced.daemon.config import Config
from convergenced.daemon.durability.entries import Entry
from convergenced.daemon.durability.floor import IncarnationFloor
from convergenced.daemon.durability.log_file import FactLog, OpenReport
from convergenced.daemon.http import HttpEndpoint
from convergenced.daemon.localapi.descriptors import size_clients
from convergenced.daemon.localapi.unix_socket import open_unix_listener
from convergenced.daemon.notify import Notifier
from convergenced.daemon.peers.manager import link_config
from convergenced.daemon.peers.security import PeerSecurity, load_security
from convergenced.daemon.telemetry import Telemetry
from convergenced.daemon.wiring import Running, assemble, cluster_members, planned_links
from convergenced.errors import ConvergencedError, StartupError

__all__ = ["Daemon", "StartupError"]

log = structlog.get_logger("convergenced.daemon")

WAL_NAME = "facts.wal"
LOCK_NAME = "lock"
SHUTDOWN_GRACE_S = 5.0
RESTART_TO_CHANGE = (
    "node_id", "cluster", "listen_host", "listen_port", "socket_path", "state_dir",
    "tick_ms", "idle_ticks", "dead_ticks", "wal_group_commit", "limits", "insecure",
    "tls", "identity", "allowed_uids", "allowed_gids", "components", "labels",
)  # fmt: skip
"""Settings a reload cannot change (the daemon keeps running the old ones)."""


class _StateLock:
    """The lock that keeps a state directory to one daemon, taken in two steps.

    `take_if_used` locks a directory some daemon used before (its lock file exists)
    without writing anything, so a second daemon is refused first; `take` creates
    the directory and the lock file on a first start, once nothing else can fail.
    """

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self._fd: int | None = None

    def take_if_used(self) -> None:
        """Lock the state directory if its lock file exists (writing nothing).

        Raises:
            StartupError: another daemon holds it.
        """
        try:
            fd = os.open(self.state_dir / LOCK_NAME, os.O_RDWR)
        except FileNotFoundError:
            return
        self._lock(fd)

    def take(self) -> None:
        """Lock the state directory, creating it and its lock file if missing.

        Raises:
            StartupError: another daemon holds it.
        """
        if self._fd is not None:
            return
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
        self._lock(os.open(self.state_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o640))

    def _lock(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StartupError(
                f"{self.state_dir}: another convergenced already uses this state directory"
            ) from None
        self._fd = fd

    def release(self) -> None:
        """Unlock (closing the file releases the lock)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass
class _Listeners:
    """Every listener of a daemon, bound before anything is written (see the module
    docstring) and served once the incarnation is durable."""

    peers: list[trio.SocketListener]
    local: trio.SocketListener
    local_path: Path
    metrics: list[trio.SocketListener]

    async def aclose(self) -> None:
        """Close them all and remove the local socket (ours: it was bound here)."""
        with trio.CancelScope(shield=True):
            for listener in [*self.peers, self.local, *self.metrics]:
                await listener.aclose()
            with suppress(OSError):
                self.local_path.unlink()


async def _bind(cfg: Config) -> _Listeners:
    """Bind the peer port, the metrics port, then the local socket (the one that
    leaves a file behind, so it comes last); on failure close what was bound.

    Raises:
        StartupError: naming the address that cannot be bound and why.
    """
    bound: list[trio.SocketListener] = []
    try:
        try:
            peers = await trio.open_tcp_listeners(cfg.listen_port, host=cfg.listen_host)
        except OSError as exc:
            raise StartupError(
                f"cannot listen for peers on {cfg.listen_host}:{cfg.listen_port}: {_why(exc)}"
            ) from None
        bound += peers
        metrics: list[trio.SocketListener] = []
        if cfg.metrics_listen is not None:
            host, port = cfg.metrics_listen
            try:
                metrics = await trio.open_tcp_listeners(port, host=host)
            except OSError as exc:
                raise StartupError(f"cannot serve metrics on {host}:{port}: {_why(exc)}") from None
            bound += metrics
        try:
            local = await open_unix_listener(cfg.socket_path)
        except OSError as exc:
            raise StartupError(f"cannot listen on {cfg.socket_path}: {exc}") from None
    except BaseException:
        with trio.CancelScope(shield=True):
            for listener in bound:
                await listener.aclose()
        raise
    return _Listeners(peers, local, cfg.socket_path, metrics)


def _why(exc: OSError) -> str:
    """``Address already in use``, not ``[Errno 98] Address already in use``."""
    return exc.strerror or str(exc)


class Daemon:
    """One convergenced daemon. `run` serves until `stop` (or a signal)."""

    def __init__(
        self, config: Config, *, config_path: Path | None = None, log_json: bool | None = None
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.log_json = log_json
        """The log format chosen at start (None: by terminal); kept across reloads."""
        self.running: Running | None = None
        self.notifier = Notifier()
        self.ready = False
        self.fatal: BaseException | None = None
        """Why the daemon stopped on its own (the log failed), if it did."""
        self._floor: IncarnationFloor | None = None
        self._floor_warned = False
        self._stop = trio.Event()
        self._stop_reason = ""
        self._nursery: trio.Nursery | None = None

    # -- life cycle ----------------------------------------------------------------

    def stop(self, reason: str = "stop requested") -> None:
        """Begin a graceful shutdown."""
        self._stop_reason = self._stop_reason or reason
        self._stop.set()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until stopped. ``task_status.started`` fires once listeners are bound.

        A start that fails writes nothing (see the module docstring).

        Raises:
            StartupError: the state directory is in use, a listener cannot bind, a
                key file is wrong.
            WalCorruptError: the log is damaged where acknowledged facts live.
        """
        cfg = self.config
        lock = _StateLock(cfg.state_dir)
        try:
            lock.take_if_used()
            telemetry = Telemetry()
            security = load_security(cfg, telemetry)
            listeners = await _bind(cfg)
            try:
                lock.take()
                wal, entries, report = FactLog.open(cfg.state_dir / WAL_NAME)
                try:
                    await self._serve(wal, entries, report, telemetry=telemetry,
                                      security=security, listeners=listeners,
                                      task_status=task_status)  # fmt: skip
                finally:
                    if self.running is not None:
                        self.running.commits.close()
                    wal.close()
            finally:
                await listeners.aclose()
        finally:
            lock.release()

    async def _serve(
        self,
        wal: FactLog,
        entries: list[Entry],
        report: OpenReport,
        *,
        telemetry: Telemetry,
        security: PeerSecurity,
        listeners: _Listeners,
        task_status: Any,
    ) -> None:
        cfg = self.config
        if report.torn_tail_bytes:
            log.warning("write-ahead log had a torn tail; truncated it",
                        bytes=report.torn_tail_bytes, detail=report.detail)  # fmt: skip
        if report.upgraded_from is not None:
            log.info("write-ahead log rewritten in the current format",
                     from_version=report.upgraded_from)  # fmt: skip
        # The floor lives beside the identity key; a node without one (insecure, or
        # alone) has nowhere outside its state directory to keep it.
        if security.sign is not None:
            self._floor = IncarnationFloor(cfg.incarnation_floor_path)
            if cfg.identity is None and cfg.identity_path == cfg.legacy_identity:
                log.warning("the identity key is inside the state directory, and would be "
                            "lost with it: move it to the default path, or set identity",
                            path=str(cfg.identity_path),
                            default=str(config_mod.DEFAULT_IDENTITY))  # fmt: skip
        r = self.running = assemble(cfg, wal, entries, telemetry, security,
                                    on_log_failure=self._log_failed,
                                    floor=self._floor.read() if self._floor else 0)  # fmt: skip
        # Before any listener: clients get only the descriptors the log, the peers and
        # the metrics endpoint can spare (a log write that meets EMFILE stops the daemon).
        r.api.max_clients = size_clients(cfg).max_clients
        telemetry.watch(r)
        self._keep_floor(r.node.incarnation)
        try:
            r.fleet.publish_own(r.node.incarnation)
        except (ConvergencedError, ValueError) as exc:
            raise StartupError(
                f"{cfg.source}: tls: cannot sign this node's credential: {exc}"
            ) from None
        await r.commits.log_now(r.node.incarnation_fact())
        log.info("starting", version=__version__, incarnation=r.node.incarnation,
                 facts=len(entries), streams=len(r.node.streams()),
                 wal_bytes=wal.synced_bytes)  # fmt: skip
        if r.commits.compaction_due:
            await r.commits.compact(r.snapshot)
        r.peer_port = int(listeners.peers[0].socket.getsockname()[1])
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            accept_scope = trio.CancelScope()
            nursery.start_soon(self._accept, accept_scope, listeners.peers, listeners.local)
            nursery.start_soon(self._watch_signals)
            nursery.start_soon(self._report_node_events)
            nursery.start_soon(r.commits.compact_when_due, r.snapshot)
            nursery.start_soon(r.hub.run_timer)
            nursery.start_soon(r.verifier.run)
            nursery.start_soon(r.drills.run)
            self._prime_metrics()
            self._serve_http(nursery, listeners.metrics)
            r.fleet.on_members = self.apply_members
            r.fleet.on_recheck = self._close_untrusted_links
            r.fleet.linked = lambda: frozenset(r.node.neighbours)
            r.fleet.dialled_by = r.hub.dialled_by
            r.fleet.on_credentials = self._admit_credentialed
            nursery.start_soon(r.fleet.run, nursery)
            self.apply_members(r.fleet.effective())
            log.info("ready", peer_port=r.peer_port, socket=str(cfg.socket_path),
                     dials=sorted(r.peers.dialers))  # fmt: skip
            self.ready = True
            self.notifier.ready(r.summary())
            nursery.start_soon(self._notify_loop)
            task_status.started(self)
            await self._stop.wait()
            self.ready = False
            self.notifier.stopping()
            log.info("stopping", reason=self._stop_reason)
            accept_scope.cancel()
            await self._graceful_stop()
            nursery.cancel_scope.cancel()
        log.info("stopped")

    async def _accept(
        self,
        scope: trio.CancelScope,
        peer_listeners: list[trio.SocketListener],
        unix_listener: trio.SocketListener,
    ) -> None:
        r = self.running
        assert r is not None and self._nursery is not None
        # Connections are handled in the daemon's nursery, not under ``scope``:
        # cancelling ``scope`` stops accepting, while live sessions drain gracefully.
        handlers = self._nursery
        with scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(trio.serve_listeners, r.peers.accept,
                                           peer_listeners, handler_nursery=handlers))  # fmt: skip
                nursery.start_soon(partial(trio.serve_listeners, r.api.handle,
                                           [unix_listener], handler_nursery=handlers))  # fmt: skip

    async def _graceful_stop(self) -> None:
        r = self.running
        assert r is not None
        r.peers.stop_dialers()
        await r.api.drain(SHUTDOWN_GRACE_S)
        with trio.move_on_after(1.0):
            async with trio.open_nursery() as nursery:
                for session in list(r.hub.sessions):
                    nursery.start_soon(session.close, "shutting down")
        if r.commits.failure is None:
            await r.commits.durable()

    def _keep_floor(self, incarnation: int) -> None:
        """Write ``incarnation`` beside the identity key (`durability.floor`)."""
        if self._floor is None:
            return
        if not self._floor.write(incarnation) and not self._floor_warned:
            self._floor_warned = True
            log.info(
                "cannot keep the incarnation floor beside the identity key; if the state "
                "directory is lost, this node relies on its peers to rise above its "
                "earlier lives", path=str(self._floor.path),
            )  # fmt: skip

    def _log_failed(self, exc: BaseException) -> None:
        # Nothing more can be acknowledged (see `group_commit`): stop, and let the
        # restart replay what is really on disk.
        log.critical("write-ahead log failed; stopping", error=str(exc))
        self.fatal = exc
        self.stop("write-ahead log failed")

    async def _report_node_events(self) -> None:
        r = self.running
        assert r is not None
        while True:
            await r.hub.wait_changed()
            while (ev := r.node.next_event()) is not None:
                r.telemetry.node_event(ev)
                if isinstance(ev, StateLost):
                    self._keep_floor(ev.incarnation)

    def _prime_metrics(self) -> None:
        r = self.running
        assert r is not None
        streams = [(s, r.node.spec(s).policy.domains) for s in r.node.streams()]
        r.telemetry.prime(streams, [p.node_id for p in self.config.peers])

    # -- signals and reload ------------------------------------------------------------

    async def _watch_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async for signum in signals:
                if signum == signal.SIGHUP:
                    self.reload()
                else:
                    self.stop(signal.Signals(signum).name)

    def reload(self) -> list[str]:
        """Re-read the configuration file; apply peers, trust, mesh_limit, log_level
        and wal_compact_bytes.

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
        fixed = [key for key in RESTART_TO_CHANGE if getattr(old, key) != getattr(new, key)]
        kept = replace(old, peers=new.peers, mesh_limit=new.mesh_limit,
                       log_level=new.log_level, wal_compact_bytes=new.wal_compact_bytes,
                       trust=new.trust, source=new.source)  # fmt: skip
        self.config = kept
        r = self.running
        assert r is not None and self._nursery is not None
        r.config = kept
        if new.trust != old.trust:
            r.security.reload_trust(kept)
        if new.log_level != old.log_level:
            logs.configure(new.log_level, old.node_id, json=self.log_json)
        r.commits.compact_bytes = kept.wal_compact_bytes
        r.fleet.recheck(force=True)
        if r.fleet.discovery is not None:
            r.fleet.discovery.reload()
        self.apply_members(r.fleet.effective(kept))
        self._prime_metrics()
        log.info("configuration reloaded", peers=[p.node_id for p in kept.peers],
                 log_level=kept.log_level)  # fmt: skip
        if fixed:
            log.warning(
                "these settings need a restart to change; still running the old ones", keys=fixed
            )
        return fixed

    def apply_members(self, effective: Config) -> None:
        """Dial, admit and wait for the members ``effective`` names: the configured
        peers and those the fleet learned (`peers.fleet`)."""
        r = self.running
        assert r is not None and self._nursery is not None
        r.operations.admission.cluster = cluster_members(effective, r.fleet)
        r.hub.link_config = link_config(effective, r.fleet.book)
        # A node unsure of its past waits to hear from the peers it links to: a peer
        # removed (a dead host) is waited for no more.
        r.node.plan_links(planned_links(effective, r.fleet))
        r.hub.view_changed()  # what waited for that peer looks again
        r.telemetry.fleet_members.set(len(effective.peers))
        r.peers.start_dialers(self._nursery, effective, r.fleet.extra_dials())

    def _admit_credentialed(self) -> None:
        r = self.running
        assert r is not None
        r.operations.admission.cluster = cluster_members(r.fleet.effective(), r.fleet)

    def _close_untrusted_links(self) -> None:
        """Close every link whose peer certificate no longer holds (revoked, or its CA
        taken out of the CA file), whether or not its node sent a credential."""
        r = self.running
        judge = r.fleet.judge if r is not None else None
        if r is None or judge is None:
            return
        for session in list(r.hub.sessions):
            getpeercert = getattr(session.stream, "getpeercert", None)
            try:
                der = getpeercert(True) if getpeercert is not None else None
            except (ValueError, OSError):  # the connection is already gone
                continue
            if session.peer is None or not der:
                continue
            why = judge.revoked_or_untrusted(session.peer, x509.load_der_x509_certificate(der))
            if why is not None:
                log.warning("closing the link of a peer no longer trusted", peer=session.peer,
                            reason=why)  # fmt: skip
                session.link.close(f"certificate no longer trusted: {why}")
                session.wake()

    # -- metrics endpoint, probes, systemd ---------------------------------------------

    def _serve_http(self, nursery: trio.Nursery, listeners: list[trio.SocketListener]) -> None:
        r = self.running
        if not listeners or r is None:
            return
        endpoint = HttpEndpoint(r.telemetry.registry, healthy=self.healthy, ready=self.readiness)
        nursery.start_soon(partial(trio.serve_listeners, endpoint.handle, listeners))
        r.metrics_port = int(listeners[0].socket.getsockname()[1])

    def healthy(self) -> tuple[bool, str]:
        """For /healthz and `convergenced healthcheck`: the process serves and its log
        works."""
        r = self.running
        if r is not None and r.commits.failure is not None:
            return False, f"write-ahead log failed: {r.commits.failure}"
        return True, "ok"

    def readiness(self) -> tuple[bool, str]:
        """For /readyz: listeners bound, not stopping."""
        ok, why = self.healthy()
        if not ok:
            return ok, why
        return (True, "ready") if self.ready else (False, "starting or stopping")

    async def _notify_loop(self) -> None:
        r = self.running
        assert r is not None
        interval = self.notifier.watchdog_interval
        last_status = 0.0
        while True:
            await trio.sleep(interval if interval is not None else 5.0)
            if interval is not None:
                self.notifier.watchdog()
            if trio.current_time() - last_status >= 5.0:
                self.notifier.status(r.summary())
                last_status = trio.current_time()
