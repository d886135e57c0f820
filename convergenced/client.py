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
import os
import queue
import socket
import threading
from collections.abc import AsyncIterator, Generator, Mapping
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from convergenced.core import local_api_codec as codec
from convergenced.core.local_api_codec import ApiError, ErrorKind
from convergenced.core.spec import StreamSpec
from convergenced.errors import ConvergencedError

if TYPE_CHECKING:  # trio is only needed by AsyncClient users
    import trio

__all__ = [
    "ApiError",
    "AsyncClient",
    "Client",
    "DaemonUnreachable",
    "ErrorKind",
    "PendingCommit",
    "default_socket",
]

MAX_REPLY_BYTES = 64 << 20
"""Replies are bounded too: a state with thousands of members stays well below this."""


class DaemonUnreachable(ConvergencedError):
    """The daemon's socket cannot be reached, or the connection was lost."""


def default_socket() -> Path:
    """``$CONVERGENCED_SOCKET``, else the daemon's default socket path."""
    env = os.environ.get("CONVERGENCED_SOCKET")
    return Path(env) if env else Path("/run/convergenced/convergenced.sock")


def _spec_wire(spec: StreamSpec | Mapping[str, Any]) -> Any:
    return spec.to_wire() if isinstance(spec, StreamSpec) else dict(spec)


def _result(reply: Mapping[str, Any]) -> Any:
    if "error" in reply:
        raise codec.error_from_wire(reply["error"])
    return reply.get("ok", reply.get("event"))


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
            return _result(self._take(rid, box))
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
        return dict(self.call("declare", spec=_spec_wire(spec)))

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
                yield dict(_result(self._take(rid, box)))
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
        return dict(_result(self._reply))


class AsyncClient:
    """The trio client: same operations as `Client`, as coroutines."""

    def __init__(self, stream: trio.SocketStream, nursery: trio.Nursery) -> None:
        import trio

        self._trio = trio
        self._stream = stream
        self._nursery = nursery
        self._ids = itertools.count(1)
        self._pending: dict[int, trio.MemorySendChannel[Any]] = {}
        self._send_lock = trio.Lock()
        self._lost: str | None = None

    @staticmethod
    @asynccontextmanager
    async def connect(socket_path: Path | str | None = None) -> AsyncIterator[AsyncClient]:
        """Connect; the client lives inside the ``async with`` block.

        Raises:
            DaemonUnreachable: nothing listens there, or access is denied.
        """
        import trio

        path = Path(socket_path) if socket_path else default_socket()
        try:
            stream = await trio.open_unix_socket(str(path))
        except OSError as exc:
            raise DaemonUnreachable(f"cannot reach the daemon at {path}: {exc}") from None
        async with trio.open_nursery() as nursery:
            client = AsyncClient(stream, nursery)
            nursery.start_soon(client._read_loop)
            try:
                yield client
            finally:
                nursery.cancel_scope.cancel()
                await stream.aclose()

    async def _read_loop(self) -> None:
        trio = self._trio
        reader = codec.FrameReader(MAX_REPLY_BYTES)
        why = "the daemon closed the connection"
        try:
            while True:
                data = await self._stream.receive_some(65536)
                if not data:
                    break
                for reply in reader.feed(data):
                    if not isinstance(reply, Mapping):
                        raise ApiError(ErrorKind.INTERNAL, "bad_reply", f"not a map: {reply!r}")
                    rid = reply.get("id")
                    ch = self._pending.get(rid) if isinstance(rid, int) else None
                    if ch is not None:
                        # Watches may outpace their reader; the daemon bounds it too.
                        await ch.send(reply)
                    elif rid is None and "error" in reply:
                        why = str(codec.error_from_wire(reply["error"]))
        except (trio.BrokenResourceError, trio.ClosedResourceError, ApiError) as exc:
            why = f"connection lost: {exc}"
        self._lost = why
        for ch in list(self._pending.values()):
            ch.close()

    async def _open(self, op: str, args: dict[str, Any]) -> tuple[int, Any]:
        trio = self._trio
        if self._lost is not None:
            raise DaemonUnreachable(self._lost)
        rid = next(self._ids)
        send, recv = trio.open_memory_channel[Any](64)
        self._pending[rid] = send
        try:
            async with self._send_lock:
                await self._stream.send_all(codec.encode_frame(codec.request(rid, op, **args)))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            del self._pending[rid]
            raise DaemonUnreachable(f"cannot send to the daemon: {exc}") from None
        return rid, recv

    async def _next(self, recv: Any) -> Any:
        try:
            return await recv.receive()
        except self._trio.EndOfChannel:
            raise DaemonUnreachable(self._lost or "connection lost") from None

    async def call(self, op: str, **args: Any) -> Any:
        """Send one request and return its result (raises `ApiError` on an error reply).

        Cancelling the calling task cancels the request on the daemon too, so an
        abandoned `wait` does not keep holding one of the connection's request slots.
        """
        rid, recv = await self._open(op, args)
        answered = False
        try:
            reply = await self._next(recv)
            answered = True
            return _result(reply)
        finally:
            self._pending.pop(rid, None)
            if not answered:
                await self._send_cancel(rid)

    async def _send_cancel(self, rid: int) -> None:
        # Fire and forget: the reply to the cancel has no taker.
        if self._lost is not None:
            return
        frame = codec.encode_frame(codec.request(next(self._ids), "cancel", target=rid))
        with self._trio.CancelScope(shield=True):
            try:
                async with self._send_lock:
                    await self._stream.send_all(frame)
            except (self._trio.BrokenResourceError, self._trio.ClosedResourceError):
                pass

    async def status(self) -> dict[str, Any]:
        """See `Client.status`."""
        return dict(await self.call("status"))

    async def streams(self) -> list[str]:
        """See `Client.streams`."""
        return list(await self.call("streams"))

    async def declare(self, spec: StreamSpec | Mapping[str, Any]) -> dict[str, Any]:
        """See `Client.declare`."""
        return dict(await self.call("declare", spec=_spec_wire(spec)))

    async def commit(
        self, stream: str, rank: int, domain: str, epoch: int, *, digest: str = "", size: int = 0
    ) -> dict[str, Any]:
        """See `Client.commit`."""
        return dict(
            await self.call(
                "commit",
                stream=stream,
                rank=rank,
                domain=domain,
                epoch=epoch,
                digest=digest,
                size=size,
            )
        )

    async def retract(self, stream: str, rank: int, domain: str, epoch: int) -> dict[str, Any]:
        """See `Client.retract`."""
        return dict(
            await self.call("retract", stream=stream, rank=rank, domain=domain, epoch=epoch)
        )

    async def retire(self, stream: str, rank: int, domain: str, epoch: int) -> dict[str, Any]:
        """See `Client.retire`."""
        return dict(await self.call("retire", stream=stream, rank=rank, domain=domain, epoch=epoch))

    async def state(self, stream: str) -> dict[str, Any]:
        """See `Client.state`."""
        return dict(await self.call("state", stream=stream))

    async def wait(self, stream: str, epoch: int, timeout: float | None = None) -> dict[str, Any]:
        """See `Client.wait`."""
        return dict(await self.call("wait", stream=stream, epoch=epoch, timeout=timeout))

    async def restore_point(
        self, stream: str, generation: int, timeout: float | None = None
    ) -> dict[str, Any]:
        """See `Client.restore_point`."""
        return dict(
            await self.call("restore_point", stream=stream, generation=generation, timeout=timeout)
        )

    @asynccontextmanager
    async def watch(self, stream: str) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """See `Client.watch`. A context manager, so the watch ends when the block does::

        async with client.watch("job") as events:
            async for state in events:
                ...
        """
        rid, recv = await self._open("watch", {"stream": stream})
        try:
            yield _Events(self, recv)
        finally:
            self._pending.pop(rid, None)
            await self._send_cancel(rid)


class _Events:
    """The events of one `AsyncClient.watch` (an async iterator, not a generator, so
    nothing is left to finalize when a loop stops early)."""

    def __init__(self, client: AsyncClient, recv: Any) -> None:
        self._client = client
        self._recv = recv

    def __aiter__(self) -> _Events:
        return self

    async def __anext__(self) -> dict[str, Any]:
        return dict(_result(await self._client._next(self._recv)))
