"""The local API server: who may connect, how many, and a graceful end.

Every accepted connection is checked against the peer's kernel credentials
(`peercred`): root, the daemon's own user, ``[local] allowed_uids`` and members of
``allowed_gids`` are served, one `ClientSession` each; anyone else gets one
``rejected``/``not_allowed`` error reply naming their uid, and is closed. Past
the client limit (``limits.max_clients``, or fewer when the descriptor limit leaves
less room: `descriptors`) a client gets ``unavailable``/``too_many_clients``. At
most `descriptors.REFUSING` refusals are under way at once (each waits up to a
second for its client to read the reply); past that a refused connection is
closed at once, without a reply, so a flood of connections cannot hold more
descriptors than the reserve kept for them.
Warnings about refused or misbehaving clients are rate-limited (a local process
must not be able to flood the log); every refusal is still counted.

Shutdown (`LocalApiServer.drain`): new requests get ``unavailable``; waits and
watches are ended with ``unavailable``; requests that change state run to their
acknowledgement; queued replies are flushed; then the connections close.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Awaitable, Callable, Iterable

import trio

from convergenced.core import local_api_codec as codec
from convergenced.core.gate import OutputGate
from convergenced.core.local_api_codec import ApiError, ErrorKind
from convergenced.daemon.config import Limits
from convergenced.daemon.localapi import peercred
from convergenced.daemon.localapi.batching import CommitBatcher
from convergenced.daemon.localapi.descriptors import REFUSING
from convergenced.daemon.localapi.operations import LocalOperations
from convergenced.daemon.localapi.session import ClientSession
from convergenced.daemon.telemetry import Telemetry


class LocalApiServer:
    """Accepts local clients and serves them with the `LocalOperations`."""

    def __init__(
        self,
        operations: LocalOperations,
        gate: OutputGate,
        durable: Callable[[int], Awaitable[None]],
        limits: Limits,
        telemetry: Telemetry,
        *,
        allowed_uids: Iterable[int] = (),
        allowed_gids: Iterable[int] = (),
    ) -> None:
        self.operations = operations
        self.gate = gate
        self.durable = durable
        self.limits = limits
        self.telemetry = telemetry
        self.own_uid = os.geteuid()
        self.allowed_uids = frozenset(allowed_uids)
        self.allowed_gids = frozenset(allowed_gids)
        self.sessions: set[ClientSession] = set()
        self.max_clients = limits.max_clients
        """The client limit in force (lowered at start when descriptors are short)."""
        self.shutting_down = False
        self._refusing = 0
        self.heavy_frames = trio.Lock()
        """Large frames are decoded one at a time across sessions (see `session`)."""
        self.batcher = CommitBatcher(operations)
        """Every session's commits of a scheduling round are applied together."""

    def check_peer(self, stream: trio.SocketStream) -> ApiError | None:
        """None when the connected process may use the daemon, else the error to send."""
        try:
            creds, ok = peercred.check(
                stream.socket, self.own_uid, self.allowed_uids, self.allowed_gids
            )
        except peercred.PeerCredentialsError as exc:
            self.telemetry.warn("no_credentials", "local client refused", error=str(exc))
            return ApiError(
                ErrorKind.REJECTED,
                "not_allowed",
                f"cannot tell who is connecting ({exc}); refusing",
            )
        if ok:
            return None
        self.telemetry.warn(
            "not_allowed",
            "local client refused",
            pid=creds.pid,
            uid=creds.uid,
            gid=creds.gid,
            groups=sorted(creds.groups),
        )
        return ApiError(ErrorKind.REJECTED, "not_allowed", peercred.refusal_message(creds))

    async def handle(self, stream: trio.SocketStream) -> None:
        """Serve one connection until it closes."""
        refusal = self.check_peer(stream)
        if refusal is not None:
            await self._refuse(stream, refusal)
            return
        if self.shutting_down:
            err = ApiError(ErrorKind.UNAVAILABLE, "shutting_down", "the daemon is shutting down")
            await self._refuse(stream, err)
            return
        if len(self.sessions) >= self.max_clients:
            err = ApiError(
                ErrorKind.UNAVAILABLE,
                "too_many_clients",
                f"the daemon already serves {self.max_clients} clients (limits.max_clients, "
                f"or fewer when its descriptor limit leaves less room)",
            )
            await self._refuse(stream, err)
            return
        session = ClientSession(stream, self.operations, self.gate, self.durable,
                                limits=self.limits, telemetry=self.telemetry,
                                heavy_frames=self.heavy_frames,
                                batcher=self.batcher)  # fmt: skip
        self.sessions.add(session)
        try:
            await session.run()
        finally:
            self.sessions.discard(session)

    async def _refuse(self, stream: trio.SocketStream, err: ApiError) -> None:
        """Count ``err``, send it as the only reply, and close; a second at most.

        What the client sent is read and dropped until it closes: closing a Unix
        socket that holds unread bytes makes the client's next read fail with
        ECONNRESET, and the client would report a reset instead of the reason.
        """
        self.telemetry.api_error(err.reason)
        if self._refusing >= REFUSING:  # a flood: its descriptors go back at once
            await trio.aclose_forcefully(stream)
            return
        self._refusing += 1
        try:
            with trio.move_on_after(1):
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await stream.send_all(codec.encode_frame(codec.error(None, err)))
                    await stream.send_eof()
                    while await stream.receive_some(65536):
                        pass
        finally:
            self._refusing -= 1
            await trio.aclose_forcefully(stream)

    async def drain(self, grace: float) -> None:
        """Stop serving (see the module docstring); give up after ``grace`` seconds."""
        self.shutting_down = True
        for session in list(self.sessions):
            session.begin_drain()
        with trio.move_on_after(grace):
            while self.sessions:
                await trio.sleep(0.01)
        for session in list(self.sessions):
            session.kill()
