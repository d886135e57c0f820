"""Clients of the local daemon, for training code and tools.

`Client` is blocking and needs nothing but the standard library and msgpack: use it
from any training script, any thread. Calls from several threads share one
connection; a reader thread hands each reply to its caller, so a long `wait` in one
thread never holds up a `commit` in another.

`Client.commit_nowait` sends a commit and returns at once, with a `PendingCommit` to
collect the acknowledgement later: a training rank whose shard is already durable
need not wait for the daemon's own fsync (see its docstring for what that costs).

`AsyncClient` (`convergenced.async_client`) is the same for trio code::

    async with AsyncClient.connect() as client:
        await client.commit("job", rank=0, domain="nvme", epoch=120)

**Daemon restarts.** Both clients survive them: when the connection ends they
reconnect with backoff for up to ``reconnect`` seconds (default
``$CONVERGENCED_RECONNECT_S``, else 60; 0 turns it off), declare again what they
declared, and send again every request still unanswered, `commit_nowait`'s included;
a watch is subscribed again. A commit sent twice is counted once. Calls wait
meanwhile, never longer than the bound. After a reconnect to a daemon that restarted,
`Client` runs its reconnect hooks (`Client.add_reconnect_hook`): the checkpoint store
uses one to commit again the shards it holds. See `convergenced.client_protocol` for
the rules and why each operation may be sent twice.

Every failed request raises `ApiError` (``kind``, ``reason``, message) from
`convergenced.core.local_api_codec`; a daemon that cannot be reached (or not again
within the bound) raises `DaemonUnreachable`. The socket path defaults to
``$CONVERGENCED_SOCKET`` or ``/run/convergenced/convergenced.sock``.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from convergenced.async_client import AsyncClient
from convergenced.client_connection import Connection, Lost, ReconnectHook, Request
from convergenced.client_protocol import (
    DaemonUnreachable,
    Reconnected,
    declare_args,
    default_socket,
    reconnect_bound,
    result_of,
)
from convergenced.core.local_api_codec import ApiError, ErrorKind
from convergenced.core.spec import StreamSpec

__all__ = [
    "ApiError",
    "AsyncClient",
    "Client",
    "DaemonUnreachable",
    "ErrorKind",
    "PendingCommit",
    "Reconnected",
    "default_socket",
]


class Client:
    """Blocking, thread-safe client of the local daemon that survives its restarts."""

    def __init__(
        self,
        socket_path: Path | str | None = None,
        *,
        timeout: float = 10.0,
        reconnect: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] | None = None,
    ) -> None:
        """Connect to the daemon.

        Args:
            socket_path: the daemon's socket (default: `default_socket`).
            timeout: seconds to wait for each connection attempt itself (requests
                have their own).
            reconnect: seconds to keep trying to connect again once the connection
                ended (default ``$CONVERGENCED_RECONNECT_S``, else 60); 0: never, every
                call then raises `DaemonUnreachable` once the connection is lost. The
                first connection is tried once: a daemon missing at start is reported
                at once.
            clock, sleep: the clock of the reconnect bound and the pause between two
                attempts (tests pass their own; ``sleep`` returns early on `close`
                by default).

        Raises:
            DaemonUnreachable: nothing listens there, or access is denied.
            ValueError: ``reconnect`` (or ``$CONVERGENCED_RECONNECT_S``) is not a
                number of seconds >= 0.
        """
        self.socket_path = Path(socket_path) if socket_path else default_socket()
        self.reconnect = reconnect_bound(reconnect)
        """The reconnect bound, in seconds (0: off)."""
        self._connection = Connection(
            self.socket_path, timeout=timeout, reconnect=self.reconnect, clock=clock, sleep=sleep
        )

    def call(self, op: str, **args: Any) -> Any:
        """Send one request and return its result (raises `ApiError` on an error reply).

        Raises:
            ApiError: the daemon refused the request.
            DaemonUnreachable: no connection, and none again within the reconnect bound.
        """
        return self._connection.call(op, **args)

    def add_reconnect_hook(self, hook: ReconnectHook) -> None:
        """Call ``hook`` after each reconnect to a daemon of another incarnation than
        the last reconnect found (it restarted; the first reconnect always calls it:
        the client did not ask before), before the unanswered requests are sent again
        and before any other call goes through. It runs on the reconnecting thread: its
        own calls on this client go through, those of other threads wait, so it must
        not wait for another thread's call. An exception it raises is logged
        (`DaemonUnreachable`: the reconnect is tried again, hooks included)."""
        self._connection.add_hook(hook)

    def remove_reconnect_hook(self, hook: ReconnectHook) -> None:
        """Stop calling ``hook`` (nothing happens if it was not added)."""
        self._connection.remove_hook(hook)

    def close(self) -> None:
        """Close the connection (pending calls raise `DaemonUnreachable`)."""
        self._connection.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- operations ----------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Daemon identity, links, peers, clients, counters."""
        return dict(self.call("status"))

    def streams(self) -> list[str]:
        """Streams declared on this node."""
        return list(self.call("streams"))

    def declare(
        self, spec: StreamSpec | Mapping[str, Any], *, allow_unknown_members: bool = False
    ) -> dict[str, Any]:
        """Declare a stream (idempotent; a different spec under the same name is refused).

        A member that is neither a peer of the daemon nor in its trust list is refused
        (``unknown_member``) unless ``allow_unknown_members`` (a node not configured
        yet). The client declares it again after reconnecting to its daemon, so a
        daemon that lost its state knows the stream before anything else is sent again.
        """
        args = declare_args(spec, allow_unknown_members)
        result = dict(self.call("declare", **args))
        self._connection.declared(str(result.get("stream", args["spec"].get("name"))), args)
        return result

    def undeclare(self, stream: str) -> dict[str, Any]:
        """Remove ``stream`` from this node: it forgets the stream's facts and tells the
        other members it holds nothing of it (their restore point goes until they
        undeclare it too); returns once durable. The name may be declared again."""
        result = dict(self.call("undeclare", stream=stream))
        self._connection.undeclared(stream)
        return result

    def commit(
        self,
        stream: str,
        rank: int,
        domain: str,
        epoch: int,
        *,
        digest: str = "",
        size: int = 0,
        location: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Report ``epoch`` durable in ``domain`` for ``rank``; returns once logged durably.

        Sent again if the connection ends first: a commit the daemon already holds
        is acknowledged and counted once. ``location`` says where the bytes are, so
        the daemon can verify them later: ``{"kind": "shard", "url": ...}`` or
        ``{"kind": "files", "url": folder, "names": [...]}`` (docs/verification.md).
        """
        return dict(
            self.call(
                "commit",
                stream=stream,
                rank=rank,
                domain=domain,
                epoch=epoch,
                digest=digest,
                size=size,
                **({} if location is None else {"location": dict(location)}),
            )
        )

    def commit_nowait(
        self,
        stream: str,
        rank: int,
        domain: str,
        epoch: int,
        *,
        digest: str = "",
        size: int = 0,
        location: Mapping[str, Any] | None = None,
    ) -> PendingCommit:
        """Send a commit and return without waiting for its acknowledgement.

        For a training thread whose shard is already durable (its own fsync): the
        daemon logs the commit and answers while training goes on. Until the answer,
        the daemon may not count the epoch: a crash before its log is durable loses
        the commit (never the shard), and the epoch is then simply not restorable
        from this rank, which is safe; if the daemon comes back within the reconnect
        bound, the client sends the commit again and the answer still comes. Collect
        it with `PendingCommit.result` before relying on the epoch (before retiring
        older checkpoints, at the latest at the next checkpoint) to see any error.

        Raises:
            DaemonUnreachable: no connection, and none again within the bound.
        """
        args = {
            "stream": stream,
            "rank": rank,
            "domain": domain,
            "epoch": epoch,
            "digest": digest,
            "size": size,
        }
        if location is not None:
            args["location"] = dict(location)
        _, req = self._connection.send("commit", args)
        return PendingCommit(req)

    def retract(self, stream: str, rank: int, domain: str, epoch: int) -> dict[str, Any]:
        """Report ``epoch`` lost or corrupt in ``domain`` for ``rank``."""
        return dict(self.call("retract", stream=stream, rank=rank, domain=domain, epoch=epoch))

    def retire(self, stream: str, rank: int, domain: str, epoch: int) -> dict[str, Any]:
        """Report ``epoch`` deleted from ``domain`` (only epochs the daemon said are safe)."""
        return dict(self.call("retire", stream=stream, rank=rank, domain=domain, epoch=epoch))

    def state(self, stream: str) -> dict[str, Any]:
        """Recoverable set, convergence interval, restore point, GC horizon, skew..."""
        return dict(self.call("state", stream=stream))

    def wait(self, stream: str, epoch: int, timeout: float | None = None) -> dict[str, Any]:
        """Block until the restore point reaches ``epoch``; returns the state.

        Raises:
            ApiError: kind ``timeout`` after ``timeout`` seconds (a reconnect meanwhile
                does not extend it).
        """
        return dict(self.call("wait", stream=stream, epoch=epoch, timeout=timeout))

    def drain(
        self,
        node: str,
        *,
        streams: Sequence[str] = (),
        checkpoint: bool = False,
        timeout: float | None = None,
        versions: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """Wait until ``node`` (this daemon's own) may go down for maintenance: every
        stream it is a member of (or each of ``streams``) has a restore point at least
        as new as its newest epoch here, published by every member. ``checkpoint``
        asks the jobs for a new checkpoint first and waits for that one. ``versions``
        (component -> version): the node is to come back on those versions, so every
        member of each of its jobs must accept them and have acknowledged that.

        Returns ``{"node", "safe", "streams": {stream: {"safe", "target",
        "restore_point", "knowledge", "reason"}}, "versions": [{"stream",
        "component", "version", "safe", "reason"}]}``; ``safe`` is false when
        ``timeout`` ran out first.
        """
        args: dict[str, Any] = {"node": node, "streams": list(streams),
                                "checkpoint": checkpoint, "timeout": timeout}  # fmt: skip
        if versions:
            args["versions"] = dict(versions)
        return dict(self.call("drain", **args))

    def drill(
        self, stream: str, *, epoch: int | None = None, domain: str | None = None
    ) -> dict[str, Any]:
        """Test-restore ``epoch`` (default: the restore point) of ``stream`` for this
        node's ranks, in ``domain`` (default: every domain), and run the daemon's drill
        hook if it has one (docs/verification.md#drills).

        Returns ``{"stream", "epoch", "passed", "seconds", "at", "ranks": [{"rank",
        "domain", "outcome", "detail", "bytes", "seconds", "mb_s"}], "domains":
        {domain: {"bytes", "seconds", "ranks", "mb_s"}}, "hook": {"exit", "seconds",
        "output"} or None}``.
        """
        args: dict[str, Any] = {"stream": stream}
        if epoch is not None:
            args["epoch"] = epoch
        if domain is not None:
            args["domain"] = domain
        return dict(self.call("drill", **args))

    def report_version(
        self, component: str, running: str, accepts: Sequence[str] = ()
    ) -> dict[str, Any]:
        """Report that this node runs ``running`` of ``component`` and works beside
        peers that run any of ``accepts`` (``running`` is always among them); durable
        when it returns. Versions must be in the catalogue of the daemon's
        configuration."""
        acc = list(dict.fromkeys([*accepts, running])) if accepts else [running]
        return dict(self.call("report_version", component=component, running=running,
                              accepts=acc))  # fmt: skip

    def report_save(
        self, stream: str, rank: int, blocking_s: float, interval_s: float | None = None
    ) -> dict[str, Any]:
        """Report one save of ``rank``: ``blocking_s`` seconds the training loop waited
        for it, ``interval_s`` since the rank's previous save started (None: the first
        save). It feeds the checkpoint overhead figure of ``state`` and
        ``convergenced_checkpoint_overhead_ratio`` (docs/verification.md); nothing
        durable. Training code that must not wait uses `report_save_nowait`."""
        return dict(self.call("report_save", stream=stream, rank=rank, blocking_s=blocking_s,
                              interval_s=interval_s))  # fmt: skip

    def report_save_nowait(
        self, stream: str, rank: int, blocking_s: float, interval_s: float | None = None
    ) -> PendingCommit:
        """`report_save` without waiting: sent at once if connected, never waiting for
        a reconnect; the reply (or error) comes to the returned `PendingCommit`.

        Raises:
            DaemonUnreachable: not connected now (the report is dropped).
        """
        args: dict[str, Any] = {"stream": stream, "rank": rank, "blocking_s": blocking_s}
        if interval_s is not None:
            args["interval_s"] = interval_s
        _, req = self._connection.send("report_save", args, wait=False)
        return PendingCommit(req, "report_save")

    def note_rollout(self, text: str) -> dict[str, Any]:
        """Add ``text`` (a JSON object, at most 4096 chars) to this node's rollout audit
        trail, kept in its log (the newest 64); durable when it returns."""
        return dict(self.call("note_rollout", text=text))

    def versions(self, stream: str | None = None) -> dict[str, Any]:
        """The version constraint sets: the catalogues, this node's reports, what the
        fleet accepts and, per job (or ``stream``), each component's handshake."""
        return dict(self.call("versions", stream=stream))

    def restore_point(
        self, stream: str, generation: int, timeout: float | None = None
    ) -> dict[str, Any]:
        """The agreed restore point of recovery generation ``generation``."""
        return dict(
            self.call("restore_point", stream=stream, generation=generation, timeout=timeout)
        )

    def next_generation(self, stream: str, timeout: float | None = None) -> dict[str, Any]:
        """The recovery generation a new launch of ``stream`` uses: ``{stream, generation}``.

        No member has resolved or closed it, however often the job was launched
        before. One rank of the launch asks and hands the number to the others, which
        all ask `restore_point` for it; asking changes nothing (asking again before
        anyone froze it gives the same number).

        Raises:
            ApiError: kind ``timeout`` when a daemon that started without its state
                has not heard from its peers within ``timeout`` seconds.
        """
        return dict(self.call("next_generation", stream=stream, timeout=timeout))

    def watch(self, stream: str) -> Generator[dict[str, Any], None, None]:
        """The state now and after every change; stop iterating (or close) to end it.

        After a reconnect the watch is subscribed again; an event equal to the last
        one yielded is skipped, so every event still differs from the previous one.
        """
        rid, req = self._connection.send("watch", {"stream": stream})
        last: dict[str, Any] | None = None
        try:
            while True:
                event = dict(result_of(req.take()))
                if event != last:
                    last = event
                    yield event
        finally:
            self._connection.forget(rid, cancel=True)


class PendingCommit:
    """A commit sent by `Client.commit_nowait` (or a report by
    `Client.report_save_nowait`), its acknowledgement still to come."""

    def __init__(self, req: Request, what: str = "commit") -> None:
        self._req = req
        self._what = what
        self._reply: Any = None

    def done(self) -> bool:
        """Whether the answer (or the news that none will come) has arrived."""
        return self._reply is not None or not self._req.box.empty()

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait for the acknowledgement and return it, as `Client.commit` would.

        Raises:
            TimeoutError: no answer within ``timeout`` seconds (ask again later).
            ApiError: the daemon refused the commit.
            DaemonUnreachable: the connection was lost before the answer, and the
                daemon could not be reached again within the reconnect bound.
        """
        if self._reply is None:
            try:
                self._reply = self._req.box.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no answer to the {self._what} within {timeout} s") from None
        if isinstance(self._reply, Lost):
            raise DaemonUnreachable(self._reply.message)
        return dict(result_of(self._reply))
