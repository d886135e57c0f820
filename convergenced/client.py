"""Clients of the local daemon, for training code and tools.

`Client` is blocking and needs nothing but the standard library and msgpack: use it
from any training script, any thread. Calls from several threads share one
connection; a reader thread hands each reply to its caller, so a long `wait` in one
thread never holds up a `commit` in another.

`Client.commit_nowait` sends a commit and returns at once, with a `PendingCommit` to
collect the acknowledgement later: a training rank whose shard is already durable
need not wait for the daemon's own fsync (see its docstring for what that costs).

`AsyncClient` is the same for trio code::

    async with AsyncClient.connect() as client:
        await client.commit("job", rank=0, domain="nvme", epoch=120)

Every failed request raises `ApiError` (``kind``, ``reason``, message) from
`convergenced.core.local_api_codec`; a daemon that cannot be reached, or that went away,
raises `DaemonUnreachable`. The socket path defaults to ``$CONVERGENCED_SOCKET`` or
``/run/convergenced/convergenced.sock``.
"""

from __future__ import annotations

import itertools
import queue
import socket
import threading
from collections.abc import Generator, Mapping
from contextlib import suppress
from pathlib import Path
from types import TracebackType
from typing import Any

from convergenced.async_client import AsyncClient
from convergenced.client_protocol import (
    MAX_REPLY_BYTES,
    DaemonUnreachable,
    default_socket,
    result_of,
    spec_wire,
)
from convergenced.core import local_api_codec as codec
from convergenced.core.local_api_codec import ApiError, ErrorKind
from convergenced.core.spec import StreamSpec

__all__ = [
    "ApiError",
    "AsyncClient",
    "Client",
    "DaemonUnreachable",
    "ErrorKind",
    "PendingCommit",
    "default_socket",
]

_LOST = object()


class Client:
    """Blocking, thread-safe client of the local daemon."""

    def __init__(self, socket_path: Path | str | None = None, *, timeout: float = 10.0) -> None:
        """Connect to the daemon.

        Args:
            socket_path: the daemon's socket (default: `default_socket`).
            timeout: seconds to wait for the connection itself (requests have their own).

        Raises:
            DaemonUnreachable: nothing listens there, or access is denied.
        """
        self.socket_path = Path(socket_path) if socket_path else default_socket()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(str(self.socket_path))
        except OSError as exc:
            self._sock.close()
            raise DaemonUnreachable(
                f"cannot reach the daemon at {self.socket_path}: {exc}"
            ) from None
        self._sock.settimeout(None)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: dict[int, queue.SimpleQueue[Any]] = {}
        self._one_shot: set[int] = set()
        """Requests nobody may be waiting for (`commit_nowait`): the reader forgets
        them after their one reply, so an uncollected `PendingCommit` leaks nothing."""
        self._lost: str | None = None
        self._reader = threading.Thread(
            target=self._read_loop, name="convergenced-client", daemon=True
        )
        self._reader.start()

    # -- plumbing -----------------------------------------------------------------

    def _read_loop(self) -> None:
        reader = codec.FrameReader(MAX_REPLY_BYTES)
        why = "the daemon closed the connection"
        told = False  # the daemon said why it closed: keep that over what follows
        try:
            while True:
                data = self._sock.recv(65536)
                if not data:
                    break
                for reply in reader.feed(data):
                    if not isinstance(reply, Mapping):
                        raise ApiError(ErrorKind.INTERNAL, "bad_reply", f"not a map: {reply!r}")
                    rid = reply.get("id")
                    with self._lock:
                        box = self._pending.get(rid) if isinstance(rid, int) else None
                        if box is not None and rid in self._one_shot:
                            self._one_shot.discard(rid)
                            del self._pending[rid]
                    if box is not None:
                        box.put(reply)
                    elif rid is None and "error" in reply:
                        # An error for no request (not allowed, too many clients,
                        # shutting down).
                        why = str(codec.error_from_wire(reply["error"]))
                        told = True
        except (OSError, ApiError) as exc:
            if not told:
                why = f"connection lost: {exc}"
        with self._lock:
            self._lost = why
            boxes = list(self._pending.values())
        for box in boxes:
            box.put(_LOST)

    def _send(
        self, op: str, args: dict[str, Any], *, one_shot: bool = False
    ) -> tuple[int, queue.SimpleQueue[Any]]:
        box: queue.SimpleQueue[Any] = queue.SimpleQueue()
        with self._lock:
            if self._lost is not None:
                raise DaemonUnreachable(self._lost)
            rid = next(self._ids)
            self._pending[rid] = box
            if one_shot:
                self._one_shot.add(rid)
            try:
                self._sock.sendall(codec.encode_frame(codec.request(rid, op, **args)))
            except OSError as exc:
                del self._pending[rid]
                self._one_shot.discard(rid)
                raise DaemonUnreachable(f"cannot send to the daemon: {exc}") from None
        return rid, box

    def _take(self, rid: int, box: queue.SimpleQueue[Any]) -> Any:
        reply = box.get()
        if reply is _LOST:
            with self._lock:
                self._pending.pop(rid, None)
                raise DaemonUnreachable(self._lost or "connection lost")
        return reply

    def call(self, op: str, **args: Any) -> Any:
        """Send one request and return its result (raises `ApiError` on an error reply)."""
        rid, box = self._send(op, args)
        try:
            return result_of(self._take(rid, box))
        finally:
            with self._lock:
                self._pending.pop(rid, None)

    def close(self) -> None:
        """Close the connection (pending calls raise `DaemonUnreachable`)."""
        with suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

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

    def declare(self, spec: StreamSpec | Mapping[str, Any]) -> dict[str, Any]:
        """Declare a stream (idempotent; a different spec under the same name is refused)."""
        return dict(self.call("declare", spec=spec_wire(spec)))

    def commit(
        self, stream: str, rank: int, domain: str, epoch: int, *, digest: str = "", size: int = 0
    ) -> dict[str, Any]:
        """Report ``epoch`` durable in ``domain`` for ``rank``; returns once logged durably."""
        return dict(
            self.call(
                "commit",
                stream=stream,
                rank=rank,
                domain=domain,
                epoch=epoch,
                digest=digest,
                size=size,
            )
        )

    def commit_nowait(
        self, stream: str, rank: int, domain: str, epoch: int, *, digest: str = "", size: int = 0
    ) -> PendingCommit:
        """Send a commit and return without waiting for its acknowledgement.

        For a training thread whose shard is already durable (its own fsync): the
        daemon logs the commit and answers while training goes on. Until the answer,
        the daemon may not count the epoch: a crash before its log is durable loses
        the commit (never the shard), and the epoch is then simply not restorable
        from this rank, which is safe. Collect the answer with
        `PendingCommit.result` before relying on the epoch (before retiring older
        checkpoints, at the latest at the next checkpoint) to see any error.

        Raises:
            DaemonUnreachable: the request could not be sent.
        """
        args = {
            "stream": stream,
            "rank": rank,
            "domain": domain,
            "epoch": epoch,
            "digest": digest,
            "size": size,
        }
        rid, box = self._send("commit", args, one_shot=True)
        return PendingCommit(self, rid, box)

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
            ApiError: kind ``timeout`` after ``timeout`` seconds.
        """
        return dict(self.call("wait", stream=stream, epoch=epoch, timeout=timeout))

    def restore_point(
        self, stream: str, generation: int, timeout: float | None = None
    ) -> dict[str, Any]:
        """The agreed restore point of recovery generation ``generation``."""
        return dict(
            self.call("restore_point", stream=stream, generation=generation, timeout=timeout)
        )

    def watch(self, stream: str) -> Generator[dict[str, Any], None, None]:
        """The state now and after every change; stop iterating (or close) to end it."""
        rid, box = self._send("watch", {"stream": stream})
        try:
            while True:
                yield dict(result_of(self._take(rid, box)))
        finally:
            with self._lock:
                self._pending.pop(rid, None)
            if self._lost is None:
                self._forget(rid)

    def _forget(self, rid: int) -> None:
        # Cancel without waiting for the reply (which then has no taker).
        with self._lock:
            try:
                frame = codec.request(next(self._ids), "cancel", target=rid)
                self._sock.sendall(codec.encode_frame(frame))
            except OSError:
                pass


class PendingCommit:
    """A commit sent by `Client.commit_nowait`, its acknowledgement still to come."""

    def __init__(self, client: Client, rid: int, box: queue.SimpleQueue[Any]) -> None:
        self._client = client
        self._rid = rid
        self._box = box
        self._reply: Any = None

    def done(self) -> bool:
        """Whether the answer (or the news of a lost connection) has arrived."""
        return self._reply is not None or not self._box.empty()

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait for the acknowledgement and return it, as `Client.commit` would.

        Raises:
            TimeoutError: no answer within ``timeout`` seconds (ask again later).
            ApiError: the daemon refused the commit.
            DaemonUnreachable: the connection was lost before the answer.
        """
        if self._reply is None:
            try:
                self._reply = self._box.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no answer to the commit within {timeout} s") from None
        if self._reply is _LOST:
            with self._client._lock:
                self._client._pending.pop(self._rid, None)
                self._client._one_shot.discard(self._rid)
                raise DaemonUnreachable(self._client._lost or "connection lost")
        return dict(result_of(self._reply))
