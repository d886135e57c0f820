"""The local API over a Unix socket: one `ClientSession` per connected process.

Each session has a reader and a writer. The reader applies facts (declare, commit,
retract, retire) inline, in the order they arrive, and acknowledges all the facts of
one read together after a single `Service.durable`; every other request gets a task
of its own, at most ``limits.client_queue`` in flight (which is also the
backpressure on a client that sends faster than it is served). The writer sends
replies from a bounded queue, everything queued in one write.
Handlers never wait for the writer: a reply that finds the queue full means the
client stopped reading, and that client alone is disconnected (``client_too_slow``),
so one stuck process can never stall the daemon or any other client.

Shutdown (`LocalApiServer.drain`): new requests get ``unavailable``; waits and
watches are ended with ``unavailable``; requests that change state run to their
acknowledgement; queued replies are flushed; then the connections close.

Access: the socket is created mode 0660 in a directory the daemon creates mode 0750
(`open_unix_listener`), and every accepted connection is checked against the peer's
kernel credentials (`convergenced.daemon.peercred`): root, the daemon's own user,
``[local] allowed_uids`` and members of ``allowed_gids`` are served; anyone else gets
one ``rejected``/``not_allowed`` error reply naming their uid, and is closed.
Warnings about refused or misbehaving clients are rate-limited (a local process must
not be able to flood the log); every refusal is still counted through ``on_reject``.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import structlog
import trio

from convergenced.core import api
from convergenced.core.api import ApiError, ErrorKind, Request
from convergenced.daemon import peercred
from convergenced.daemon.config import Limits
from convergenced.daemon.service import Service

log = structlog.get_logger("convergenced.api")

WAITING_OPS = frozenset({"wait", "restore_point", "watch"})
"""Operations that only wait: ended, not awaited, at shutdown."""
FACT_OPS = frozenset({"declare", "commit", "retract", "retire"})
"""Operations applied inline by the reader and acknowledged in batches."""
SOCKET_MODE = 0o660
RUNTIME_DIR_MODE = 0o750
"""Mode of the socket's directory when the daemon creates it."""
WARN_INTERVAL_S = 10.0
"""At most one warning per reason this often (every refusal is counted regardless)."""


class LocalApiServer:
    """Accepts local clients and serves them with a `Service`.

    ``on_reject`` is called with the reason of every error reply (metrics);
    ``allowed_uids`` are served besides root and the daemon's effective uid, and so
    are members (primary or supplementary group) of ``allowed_gids``.
    """

    def __init__(
        self,
        service: Service,
        limits: Limits,
        *,
        on_reject: Callable[[str], None] | None = None,
        allowed_uids: Iterable[int] = (),
        allowed_gids: Iterable[int] = (),
    ) -> None:
        self.service = service
        self.limits = limits
        self.on_reject = on_reject
        """Called with the reason of every error reply (metrics)."""
        self.own_uid = os.geteuid()
        self.allowed_uids = frozenset(allowed_uids)
        self.allowed_gids = frozenset(allowed_gids)
        self.sessions: set[ClientSession] = set()
        self.shutting_down = False
        self.disconnected_slow = 0
        self._last_warned: dict[str, float] = {}

    def rejected(self, reason: str) -> None:
        """Count one error reply."""
        if self.on_reject is not None:
            self.on_reject(reason)

    def may_warn(self, key: str) -> bool:
        """True at most once per ``key`` every `WARN_INTERVAL_S` (the caller then logs)."""
        now = time.monotonic()
        if now - self._last_warned.get(key, -1e9) < WARN_INTERVAL_S:
            return False
        self._last_warned[key] = now
        return True

    def warn(self, key: str, event: str, **fields: Any) -> None:
        """Log a warning, rate-limited per ``key`` (see `may_warn`)."""
        if self.may_warn(key):
            log.warning(event, **fields)

    def check_peer(self, stream: trio.SocketStream) -> ApiError | None:
        """None when the connected process may use the daemon, else the error to send."""
        try:
            creds, ok = peercred.check(
                stream.socket, self.own_uid, self.allowed_uids, self.allowed_gids
            )
        except peercred.PeerCredentialsError as exc:
            self.warn("no_credentials", "local client refused", error=str(exc))
            return ApiError(
                ErrorKind.REJECTED,
                "not_allowed",
                f"cannot tell who is connecting ({exc}); refusing",
            )
        if ok:
            return None
        self.warn(
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
        if self.shutting_down or len(self.sessions) >= self.limits.max_clients:
            if self.shutting_down:
                err = ApiError(
                    ErrorKind.UNAVAILABLE, "shutting_down", "the daemon is shutting down"
                )
            else:
                err = ApiError(
                    ErrorKind.UNAVAILABLE,
                    "too_many_clients",
                    f"the daemon already serves {self.limits.max_clients} clients "
                    "(limits.max_clients)",
                )
            await self._refuse(stream, err)
            return
        session = ClientSession(self, stream)
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
        self.rejected(err.reason)
        with trio.move_on_after(1):
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await stream.send_all(api.encode_frame(api.error(None, err)))
                await stream.send_eof()
                while await stream.receive_some(65536):
                    pass
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


class ClientSession:
    """One connected client process."""

    def __init__(self, server: LocalApiServer, stream: trio.SocketStream) -> None:
        self.server = server
        self.stream = stream
        limits = server.limits
        self._send, self._queue = trio.open_memory_channel[bytes](limits.client_queue)
        self._slots = trio.Semaphore(limits.client_queue)
        self._inflight: dict[int, tuple[str, trio.CancelScope]] = {}
        """Requests being handled, by id; acknowledgement batches use negative keys."""
        self._acks: list[tuple[int, Any]] = []
        """Facts applied from the current read, awaiting one shared `durable`."""
        self._batches = 0
        self._nursery: trio.Nursery | None = None
        self._read_scope = trio.CancelScope()
        self._idle = trio.Event()
        self._draining = False

    async def run(self) -> None:
        """Read, dispatch and write until the client leaves or is disconnected."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._writer)
                with self._read_scope:
                    await self._reader()
                # Let in-flight requests finish, then close the queue so the writer
                # flushes what is left and ends the session.
                while self._inflight:
                    await self._idle.wait()
                self._send.close()
        finally:
            with trio.CancelScope(shield=True):
                await self.stream.aclose()

    def begin_drain(self) -> None:
        """Shutdown: stop reading, end waits and watches, let the rest finish."""
        self._draining = True
        self._read_scope.cancel()
        for op, scope in list(self._inflight.values()):
            if op in WAITING_OPS:
                scope.cancel()

    def kill(self) -> None:
        """Disconnect now."""
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    # -- reading ---------------------------------------------------------------

    async def _reader(self) -> None:
        reader = api.FrameReader(self.server.limits.max_frame_bytes)
        while True:
            try:
                data = await self.stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not data:
                return
            try:
                objs = reader.feed(data)
            except ApiError as err:
                # The byte stream cannot be resynchronized: answer, then hang up.
                self._fail(None, err)
                return
            for obj in objs:
                await self._dispatch(obj)
            self._flush_acks()
            if reader.failed is not None:
                # Requests before the bad frame were served; the stream ends here.
                self._fail(None, reader.failed)
                return

    def _flush_acks(self) -> None:
        # One task and one fsync wait for every fact of the read (group commit within
        # a connection; across connections the journal groups the fsyncs).
        if not self._acks:
            return
        batch, self._acks = self._acks, []
        self._batches += 1
        key = -self._batches
        scope = trio.CancelScope()
        self._inflight[key] = ("ack", scope)
        self._idle = trio.Event()
        assert self._nursery is not None
        self._nursery.start_soon(self._acknowledge, key, batch)

    async def _acknowledge(self, key: int, batch: list[tuple[int, Any]]) -> None:
        try:
            await self.server.service.durable()
        except ApiError as err:
            for rid, _ in batch:
                self._fail(rid, err)
        else:
            for rid, result in batch:
                self._reply(api.ok(rid, result))
        finally:
            self._done(key)

    def _done(self, key: int) -> None:
        self._inflight.pop(key, None)
        if not self._inflight:
            self._idle.set()

    async def _dispatch(self, obj: Any) -> None:
        try:
            req = api.parse_request(obj)
        except ApiError as err:
            self._fail(err.request_id, err)
            return
        if req.id in self._inflight:
            self._fail(
                req.id, api.bad_request(f"request id {req.id} is already in flight", "duplicate_id")
            )
            return
        if req.op == "cancel":
            target = self._inflight.get(req.args["target"])
            if target is not None:
                target[1].cancel()
            self._reply(api.ok(req.id, {"cancelled": target is not None}))
            return
        if self.server.shutting_down:
            self._fail(
                req.id, ApiError(ErrorKind.UNAVAILABLE, "shutting_down", "daemon is shutting down")
            )
            return
        if req.op in FACT_OPS:
            try:
                self._acks.append((req.id, self.server.service.apply(req.args["fact"])))
            except ApiError as err:
                self._fail(req.id, err)
            return
        await self._slots.acquire()
        scope = trio.CancelScope()
        self._inflight[req.id] = (req.op, scope)
        self._idle = trio.Event()
        assert self._nursery is not None
        self._nursery.start_soon(self._handle, req, scope)

    # -- handling ----------------------------------------------------------------

    async def _handle(self, req: Request, scope: trio.CancelScope) -> None:
        try:
            with scope:
                try:
                    result = await self._call(req)
                    self._reply(api.ok(req.id, result))
                except ApiError as err:
                    self._fail(req.id, err)
                except Exception as exc:  # a bug: answer it, log it, keep serving
                    if self.server.may_warn("internal"):
                        log.exception("request failed", op=req.op, request=req.id)
                    text = f"{type(exc).__name__}: {exc}"
                    self._fail(req.id, ApiError(ErrorKind.INTERNAL, "internal", text))
            if scope.cancelled_caught:
                if self._draining:
                    end = ApiError(
                        ErrorKind.UNAVAILABLE,
                        "shutting_down",
                        "the daemon is shutting down; ask again after it restarts",
                    )
                else:
                    end = ApiError(
                        ErrorKind.UNAVAILABLE, "cancelled", f"request {req.id} was cancelled"
                    )
                self._fail(req.id, end)
        finally:
            self._slots.release()
            self._done(req.id)

    async def _call(self, req: Request) -> Any:
        svc, a = self.server.service, req.args
        match req.op:
            case "status":
                return await svc.status()
            case "streams":
                return await svc.streams()
            case "state":
                return await svc.state(a["stream"])
            case "wait":
                return await svc.wait(a["stream"], a["epoch"], a["timeout"])
            case "restore_point":
                return await svc.restore_point(a["stream"], a["generation"], a["timeout"])
            case "watch":
                await svc.watch(a["stream"], lambda ev: self._reply(api.event(req.id, ev)))
        raise AssertionError(f"unhandled op {req.op}")  # pragma: no cover

    # -- writing -------------------------------------------------------------------

    def _fail(self, rid: int | None, err: ApiError) -> None:
        self._reply(api.error(rid, err), err.reason)

    def _reply(self, msg: dict[str, Any], reject_reason: str | None = None) -> None:
        if reject_reason is not None:
            self.server.rejected(reject_reason)
        try:
            self._send.send_nowait(api.encode_frame(msg))
        except trio.WouldBlock:
            # The client stopped reading: it alone pays for it.
            self.server.disconnected_slow += 1
            self.server.rejected("client_too_slow")
            self.server.warn(
                "client_too_slow",
                "client too slow; disconnecting",
                queued=self.server.limits.client_queue,
            )
            self.kill()
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    async def _writer(self) -> None:
        async with self._queue:
            async for frame in self._queue:
                frames = [frame]
                while True:  # everything queued goes out in one write
                    try:
                        frames.append(self._queue.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                try:
                    await self.stream.send_all(b"".join(frames))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    self.kill()
                    return
        # Queue closed and flushed: the session is over.
        self.kill()


def prepare_socket_dir(directory: Path) -> None:
    """Make sure the socket's directory exists and is safe to put the socket in.

    A missing directory is created mode 0750 exactly, whatever the umask (its own
    missing parents get the default mode). An existing one is left as it is: it may
    be ``/tmp``, a systemd ``RuntimeDirectory`` or a volume someone else manages,
    and its mode is theirs to choose. But one that anyone may write to without the
    sticky bit is refused: there anyone could replace the daemon's socket with their
    own and read (and answer) every training process's requests.

    Raises:
        OSError: the path is not a directory, cannot be created, or is unsafe.
    """
    if not directory.exists():
        directory.parent.mkdir(parents=True, exist_ok=True)
        try:
            directory.mkdir(mode=RUNTIME_DIR_MODE)
        except FileExistsError:
            pass  # created meanwhile by someone else: judged below like any existing one
        else:
            os.chmod(directory, RUNTIME_DIR_MODE)
            return
    st = os.stat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{directory}: not a directory (the socket's directory)")
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        raise PermissionError(
            f"{directory}: anyone may write to this directory (mode {mode:04o}, no sticky "
            "bit), so anyone could replace the daemon's socket; put the socket in a "
            "directory only the daemon's user can write (a missing one is created mode "
            "0750), or set the sticky bit (chmod +t)"
        )


async def open_unix_listener(path: Path, *, backlog: int = 128) -> trio.SocketListener:
    """Bind the local socket at ``path`` (mode 0660), replacing a stale one.

    The directory is prepared by `prepare_socket_dir`. Something at ``path`` that is
    not a socket (a file, a symlink) is never removed; a socket nobody answers on is
    the leftover of a dead daemon and is replaced.

    Raises:
        OSError: another daemon is listening there already, or the path is unusable.
    """
    prepare_socket_dir(path.parent)
    try:
        st: os.stat_result | None = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise FileExistsError(f"{path}: exists and is not a socket; refusing to replace it")
        probe = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        try:
            await probe.connect(str(path))
        except OSError:
            path.unlink()  # nobody answers: a leftover of a dead daemon
        else:
            raise OSError(f"{path}: another daemon is already listening on this socket")
        finally:
            probe.close()
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    try:
        old = os.umask(0o777 & ~SOCKET_MODE)
        try:
            await sock.bind(str(path))
        finally:
            os.umask(old)
        os.chmod(path, SOCKET_MODE)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return trio.SocketListener(sock)
