"""The trio client of the local daemon (imported as `convergenced.client.AsyncClient`).

The same operations as the blocking `convergenced.client.Client`, as coroutines::

    async with AsyncClient.connect() as client:
        await client.commit("job", rank=0, domain="nvme", epoch=120)
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:  # trio is only needed by AsyncClient users
    import trio

__all__ = ["AsyncClient"]


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
            return result_of(reply)
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
        return dict(await self.call("declare", spec=spec_wire(spec)))

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
        return dict(result_of(await self._client._next(self._recv)))
