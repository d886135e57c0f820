"""The trio client of the local daemon (imported as `convergenced.client.AsyncClient`).

The same operations as the blocking `convergenced.client.Client`, as coroutines::

    async with AsyncClient.connect() as client:
        await client.commit("job", rank=0, domain="nvme", epoch=120)

It survives daemon restarts as `Client` does (`convergenced.client_protocol` has the
rules): when the connection ends, a task of the client's nursery connects again with
backoff until the reconnect bound passes, declares again what the client declared,
awaits the reconnect hooks if the daemon's incarnation changed, and sends again every
request still unanswered; calls made meanwhile wait. Time is trio's
(``trio.current_time``), so tests drive it with ``trio.testing.MockClock``.

Requests are queued on the connection and sent by one writer task, many at once
(`convergenced.async_connection`); a call's reply is handed to it without a memory
channel. A call made in a cancelled scope sends nothing; one cancelled after it was
queued is sent whole, then cancelled on the daemon.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from convergenced.client_protocol import (
    MAX_REPLY_BYTES,
    RETRIED,
    TIMED,
    DaemonUnreachable,
    Outage,
    Reconnected,
    closes_for_good,
    declare_args,
    default_socket,
    going_away,
    reconnect_bound,
    redeclaration,
    result_of,
)
from convergenced.core import local_api_codec as codec
from convergenced.core.local_api_codec import ApiError, ErrorKind
from convergenced.core.spec import StreamSpec

if TYPE_CHECKING:  # trio is only needed by AsyncClient users
    import trio

    from convergenced.async_connection import Connection, ReplyBox

__all__ = ["AsyncClient", "AsyncReconnectHook"]

log = logging.getLogger("convergenced.client")

AsyncReconnectHook = Callable[[Reconnected], Awaitable[None]]


@dataclass(eq=False, slots=True)
class _Request:
    op: str
    args: dict[str, Any]
    internal: bool
    """Sent while the connection is restored, by the restoring task: never sent again."""
    deadline: float | None
    box: ReplyBox | None
    """Where the reply of a call goes (None: a watch, whose events go to ``send``)."""
    send: Any = None  # trio.MemorySendChannel[Any], for a watch
    stream: Connection | None = None
    """The connection it was last sent on."""
    lost: str = field(default="")


class AsyncClient:
    """The trio client: same operations as `Client`, as coroutines."""

    def __init__(self, socket_path: Path, nursery: trio.Nursery, reconnect: float) -> None:
        """Use `AsyncClient.connect`."""
        import trio

        from convergenced import async_connection

        self._trio = trio
        self._io = async_connection
        self.socket_path = socket_path
        self.reconnect = reconnect
        """The reconnect bound, in seconds (0: off)."""
        self._nursery = nursery
        self._ids = itertools.count(1)
        self._requests: dict[int, _Request] = {}
        self._stream: Connection | None = None
        self._encoder = codec.FrameEncoder()
        self._restoring = False
        self._restorer: Any = None
        """The task restoring the connection: it alone may send meanwhile."""
        self._changed = trio.Event()
        """Set (and replaced) whenever the connection comes, goes or is given up."""
        self._lost: str | None = None
        """Why there is no connection, once given up (None: connected or trying)."""
        self._final = False
        self._outages = 0
        self._declared: dict[str, Any] = {}
        self._hooks: list[AsyncReconnectHook] = []
        self._incarnation: int | None = None

    @staticmethod
    @asynccontextmanager
    async def connect(
        socket_path: Path | str | None = None, *, reconnect: float | None = None
    ) -> AsyncIterator[AsyncClient]:
        """Connect; the client lives inside the ``async with`` block.

        Args:
            socket_path: the daemon's socket (default: `default_socket`).
            reconnect: seconds to keep trying to connect again once the connection
                ended (default ``$CONVERGENCED_RECONNECT_S``, else 60; 0: never). The
                first connection is tried once.

        Raises:
            DaemonUnreachable: nothing listens there, or access is denied.
            ValueError: ``reconnect`` is not a number of seconds >= 0.
        """
        import trio

        path = Path(socket_path) if socket_path else default_socket()
        bound = reconnect_bound(reconnect)
        stream = await AsyncClient._open_stream(path)
        raised: BaseException | None = None
        async with trio.open_nursery() as nursery:
            client = AsyncClient(path, nursery, bound)
            client._attach(stream)
            try:
                yield client
            except BaseException as exc:
                raised = exc  # raised again as it is, not in the nursery's group
            finally:
                client._final = True
                # Shielded: a Cancelled from the cancelled nursery would replace (and
                # so swallow) an exception raised in the block.
                with trio.CancelScope(shield=True):
                    if client._stream is not None:
                        await client._stream.stream.aclose()
                nursery.cancel_scope.cancel()
        if raised is not None:
            raise raised

    @staticmethod
    async def _open_stream(path: Path) -> trio.SocketStream:
        import trio

        try:
            return await trio.open_unix_socket(str(path))
        except OSError as exc:
            raise DaemonUnreachable(f"cannot reach the daemon at {path}: {exc}") from None

    def _attach(self, stream: trio.SocketStream) -> Connection:
        conn = self._stream = self._io.Connection(stream)
        self._nursery.start_soon(self._read_loop, conn)
        self._nursery.start_soon(conn.write_loop)
        return conn

    def _notify(self) -> None:
        self._changed.set()
        self._changed = self._trio.Event()

    # -- the connection -------------------------------------------------------------------

    async def _read_loop(self, conn: Connection) -> None:
        trio = self._trio
        stream = conn.stream
        reader = codec.FrameReader(MAX_REPLY_BYTES)
        why = "the daemon closed the connection"
        told: ApiError | None = None
        try:
            while True:
                data = await stream.receive_some(65536)
                if not data:
                    break
                for reply in reader.feed(data):
                    if type(reply) is not dict and not isinstance(reply, Mapping):
                        raise ApiError(ErrorKind.INTERNAL, "bad_reply", f"not a map: {reply!r}")
                    rid = reply.get("id")
                    if rid is None and "error" in reply:
                        told = codec.error_from_wire(reply["error"])
                        why = str(told)
                    elif isinstance(rid, int) and (watch := self._deliver(rid, reply)):
                        # Watches may outpace their reader; the daemon bounds it too. A
                        # closed channel: nobody waits for the events any more.
                        with suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                            await watch.send(reply)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ApiError) as exc:
            if told is None:
                why = f"connection lost: {exc}"
        finally:
            conn.close()
            with trio.CancelScope(shield=True):
                await stream.aclose()
        self._connection_lost(conn, why, told)

    def _retried(self, req: _Request) -> bool:
        return self.reconnect > 0 and not req.internal and req.op in RETRIED

    def _deliver(self, rid: int, reply: Mapping[str, Any]) -> Any:
        """Hand ``reply`` to its call; for a watch, return the channel to send it on
        (None otherwise). A call's reply costs the read loop no checkpoint."""
        req = self._requests.get(rid)
        if req is None:
            return None
        if "event" not in reply:
            if going_away(reply) and self._retried(req):
                return None  # answered by the daemon's next life
            del self._requests[rid]
        if req.box is not None:
            req.box.put(reply)
            return None
        return req.send

    def _fail(self, rid: int, req: _Request, why: str) -> None:
        self._requests.pop(rid, None)
        req.lost = why
        if req.box is not None:
            req.box.close()
        else:
            req.send.close()

    def _connection_lost(self, stream: Connection, why: str, told: ApiError | None) -> None:
        fatal = self.reconnect <= 0 or (told is not None and closes_for_good(told))
        for rid, req in list(self._requests.items()):
            if req.stream is stream and (fatal or not self._retried(req)):
                self._fail(rid, req, why)
        if self._stream is not stream:
            return
        self._stream = None
        self._final = self._final or fatal
        if self._restoring:
            return  # the restoring task sees its own request fail
        if self._final:
            self._give_up(why)
            return
        self._outages += 1
        self._nursery.start_soon(self._reconnect, why)
        self._notify()

    def _give_up(self, why: str) -> None:
        self._lost = why
        for rid, req in list(self._requests.items()):
            self._fail(rid, req, why)
        self._notify()

    async def _reconnect(self, why: str) -> None:
        trio = self._trio
        outage = Outage(self.reconnect, trio.current_time(), why)
        log.warning(
            "lost the connection to the daemon at %s (%s); reconnecting for up to %g s",
            self.socket_path,
            why,
            self.reconnect,
        )
        while True:
            try:
                await self._restore(outage)
                return
            except (DaemonUnreachable, ApiError) as exc:
                pause = outage.failed(str(exc), trio.current_time())
            if pause is None or self._final:
                message = outage.give_up(self.socket_path, trio.current_time())
                log.error("%s", message)
                self._give_up(message)
                return
            await trio.sleep(pause)

    async def _restore(self, outage: Outage) -> None:
        stream = self._attach(await self._open_stream(self.socket_path))
        self._restoring, self._restorer = True, self._trio.lowlevel.current_task()
        try:
            incarnation = (await self.call("status")).get("incarnation")
            for name, args in list(self._declared.items()):
                try:
                    await self.call("declare", **args)
                except ApiError as exc:
                    log.warning("stream %r cannot be declared again: %s", name, exc)
                    self._declared.pop(name, None)
            if incarnation != self._incarnation:
                after = self._trio.current_time() - outage.started
                info = Reconnected(self._incarnation, incarnation, after)
                for hook in list(self._hooks):
                    try:
                        await hook(info)
                    except DaemonUnreachable:
                        raise
                    except Exception:
                        log.exception("a reconnect hook failed")
                self._incarnation = incarnation
            if self._stream is not stream:
                raise DaemonUnreachable("the connection ended while it was restored")
        except BaseException:
            self._restoring, self._restorer = False, None
            if self._stream is stream:
                self._stream = None
            stream.close()
            with self._trio.CancelScope(shield=True):
                await stream.stream.aclose()
            raise
        self._restoring, self._restorer = False, None
        for rid, req in list(self._requests.items()):
            if req.stream is not stream:
                self._transmit(rid, req, stream)
        self._notify()
        log.warning(
            "reconnected to the daemon at %s after %.1f s (incarnation %s)",
            self.socket_path,
            self._trio.current_time() - outage.started,
            incarnation,
        )

    def _transmit(self, rid: int, req: _Request, stream: Connection) -> None:
        """Queue ``req`` on ``stream``; a failed send is left to the read loop, which
        sees the connection end."""
        args = req.args
        if req.deadline is not None and req.stream is not None:  # sent before: time left
            args = {**args, "timeout": max(0.0, req.deadline - self._trio.current_time())}
        req.stream = stream
        stream.send(self._encoder.encode(codec.request(rid, req.op, **args)))

    async def _ready(self) -> bool:
        """Wait for a connection; whether this is the restoring task's own request."""
        waited_through: int | None = None
        while True:
            if self._stream is not None:
                if not self._restoring:
                    return False
                if self._restorer is self._trio.lowlevel.current_task():
                    return True  # the restoring task's own request
            elif self._lost is not None:
                if self._final or waited_through == self._outages:
                    raise DaemonUnreachable(self._lost)
                self._lost = None
                self._outages += 1
                self._nursery.start_soon(self._reconnect, "the last reconnect gave up")
            waited_through = self._outages
            await self._changed.wait()

    async def _open(
        self, op: str, args: dict[str, Any], *, watch: bool = False
    ) -> tuple[int, _Request, Any]:
        """Send a request; its reply comes in ``req.box`` (a watch: on the channel
        returned, else None)."""
        trio = self._trio
        await trio.lowlevel.checkpoint_if_cancelled()  # a cancelled call sends nothing
        internal = await self._ready()
        deadline = None
        timeout = args.get("timeout") if op in TIMED else None
        if isinstance(timeout, int | float) and not isinstance(timeout, bool):
            deadline = trio.current_time() + timeout
        rid = next(self._ids)
        recv = None
        if watch:
            send, recv = trio.open_memory_channel[Any](64)
            req = _Request(op, args, internal, deadline, None, send)
        else:
            req = _Request(op, args, internal, deadline, self._io.ReplyBox())
        self._requests[rid] = req
        assert self._stream is not None  # _ready: connected
        self._transmit(rid, req, self._stream)
        return rid, req, recv

    async def _next(self, req: _Request, recv: Any) -> Any:
        if req.box is not None:
            reply = await req.box.get()
            if reply is None:
                raise DaemonUnreachable(req.lost or self._lost or "connection lost")
            return reply
        try:
            return await recv.receive()
        except self._trio.EndOfChannel:
            raise DaemonUnreachable(req.lost or self._lost or "connection lost") from None

    async def call(self, op: str, **args: Any) -> Any:
        """Send one request and return its result (raises `ApiError` on an error reply).

        Cancelling the calling task cancels the request on the daemon too, so an
        abandoned `wait` does not keep holding one of the connection's request slots.

        Raises:
            ApiError: the daemon refused the request.
            DaemonUnreachable: no connection, and none again within the reconnect bound.
        """
        rid, req, recv = await self._open(op, args)
        answered = False
        try:
            reply = await self._next(req, recv)
            answered = True
            return result_of(reply)
        finally:
            self._requests.pop(rid, None)
            if not answered:
                self._send_cancel(rid, req)

    def _send_cancel(self, rid: int, req: _Request) -> None:
        # Fire and forget: the reply to the cancel has no taker. Queued after the
        # request itself, so the daemon always sees the request first.
        stream = self._stream
        if stream is None or req.stream is not stream:
            return
        stream.send(self._encoder.encode(codec.request(next(self._ids), "cancel", target=rid)))

    def add_reconnect_hook(self, hook: AsyncReconnectHook) -> None:
        """Await ``hook`` after each reconnect to a daemon of another incarnation than
        the last reconnect found (the first reconnect always awaits it), before the
        unanswered requests are sent again and before any other call goes through
        (see `Client.add_reconnect_hook`)."""
        self._hooks.append(hook)

    async def status(self) -> dict[str, Any]:
        """See `Client.status`."""
        return dict(await self.call("status"))

    async def streams(self) -> list[str]:
        """See `Client.streams`."""
        return list(await self.call("streams"))

    async def declare(
        self, spec: StreamSpec | Mapping[str, Any], *, allow_unknown_members: bool = False
    ) -> dict[str, Any]:
        """See `Client.declare` (declared again after a reconnect)."""
        args = declare_args(spec, allow_unknown_members)
        result = dict(await self.call("declare", **args))
        name = str(result.get("stream", args["spec"].get("name")))
        self._declared[name] = redeclaration(self._declared.get(name), args)
        return result

    async def undeclare(self, stream: str) -> dict[str, Any]:
        """See `Client.undeclare` (not declared again after a reconnect)."""
        result = dict(await self.call("undeclare", stream=stream))
        self._declared.pop(stream, None)
        return result

    async def commit(
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
                **({} if location is None else {"location": dict(location)}),
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

    async def next_generation(self, stream: str, timeout: float | None = None) -> dict[str, Any]:
        """See `Client.next_generation`."""
        return dict(await self.call("next_generation", stream=stream, timeout=timeout))

    async def drain(
        self,
        node: str,
        *,
        streams: Sequence[str] = (),
        checkpoint: bool = False,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """See `Client.drain`."""
        return dict(await self.call("drain", node=node, streams=list(streams),
                                    checkpoint=checkpoint, timeout=timeout))  # fmt: skip

    async def drill(
        self, stream: str, *, epoch: int | None = None, domain: str | None = None
    ) -> dict[str, Any]:
        """See `Client.drill`."""
        args: dict[str, Any] = {"stream": stream}
        if epoch is not None:
            args["epoch"] = epoch
        if domain is not None:
            args["domain"] = domain
        return dict(await self.call("drill", **args))

    async def report_save(
        self, stream: str, rank: int, blocking_s: float, interval_s: float | None = None
    ) -> dict[str, Any]:
        """See `Client.report_save`."""
        return dict(await self.call("report_save", stream=stream, rank=rank,
                                    blocking_s=blocking_s, interval_s=interval_s))  # fmt: skip

    @asynccontextmanager
    async def watch(self, stream: str) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """See `Client.watch`. A context manager, so the watch ends when the block does::

        async with client.watch("job") as events:
            async for state in events:
                ...

        After a reconnect the watch is subscribed again; an event equal to the last one
        is skipped.
        """
        rid, req, recv = await self._open("watch", {"stream": stream}, watch=True)
        try:
            yield _Events(self, req, recv)
        finally:
            self._requests.pop(rid, None)
            self._send_cancel(rid, req)


class _Events:
    """The events of one `AsyncClient.watch` (an async iterator, not a generator, so
    nothing is left to finalize when a loop stops early)."""

    def __init__(self, client: AsyncClient, req: _Request, recv: Any) -> None:
        self._client = client
        self._req = req
        self._recv = recv
        self._last: dict[str, Any] | None = None

    def __aiter__(self) -> _Events:
        return self

    async def __anext__(self) -> dict[str, Any]:
        while True:
            event = dict(result_of(await self._client._next(self._req, self._recv)))
            if event != self._last:
                self._last = event
                return event
