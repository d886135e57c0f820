"""The blocking client's connection: one socket, its reader thread, and reconnecting.

`convergenced.client.Client` sends every request through one `Connection`. Replies
come back on a reader thread, which hands each to the box of the request it answers
(ids are unique, so replies may come in any order). When the connection ends, the
reader thread becomes the reconnecting one (`convergenced.client_protocol` has the
rules): it connects again with backoff until the reconnect bound passes, declares
again the specs the client declared, runs the reconnect hooks if the daemon's
incarnation changed, and sends again every request still unanswered, keeping its
id and its box, so a caller blocked on its reply (or a `PendingCommit`, or a watch)
simply gets the answer from the new connection. Only then may other threads send:
a hook's commits reach a daemon that lost its state before a retried
``restore_point`` can freeze a generation without them.

Time is the client's clock (``time.monotonic`` unless a test passes its own), used
only for the bound, the pauses and the time left of a retried wait's timeout.
"""

from __future__ import annotations

import itertools
import logging
import queue
import socket
import threading
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from convergenced.client_protocol import (
    MAX_REPLY_BYTES,
    RETRIED,
    TIMED,
    DaemonUnreachable,
    Outage,
    Reconnected,
    closes_for_good,
    going_away,
    redeclaration,
    result_of,
)
from convergenced.core import local_api_codec as codec
from convergenced.core.local_api_codec import ApiError, ErrorKind

__all__ = ["Connection", "Lost", "ReconnectHook", "Request"]

log = logging.getLogger("convergenced.client")

ReconnectHook = Callable[[Reconnected], None]


class _Link(Enum):
    """Where the connection stands."""

    UP = "up"
    """Connected: requests are sent at once."""
    RESTORING = "restoring"
    """Connected again; the reconnecting thread declares, runs the hooks and sends
    the unanswered requests again before anyone else may send."""
    RECONNECTING = "reconnecting"
    """No connection; a thread is trying to make one. Calls wait."""
    DOWN = "down"
    """No connection and nobody trying: the bound passed (the next call tries again),
    the client was closed, or reconnecting is off or cannot help."""


@dataclass(frozen=True, slots=True)
class Lost:
    """What a request's box receives when it will never be answered."""

    message: str


@dataclass(eq=False, slots=True)
class Request:
    """One request in flight, and the box its replies go to."""

    op: str
    args: dict[str, Any]
    internal: bool
    """Sent by the reconnecting thread on the connection it restores: never sent
    again (the restoration is tried again as a whole)."""
    deadline: float | None
    """When its ``timeout`` runs out, on the client's clock (wait, restore_point)."""
    box: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue)
    sock: socket.socket | None = None
    """The connection it was last sent on."""

    def take(self, timeout: float | None = None) -> Any:
        """The next reply (blocking; `queue.Empty` after ``timeout``).

        Raises:
            DaemonUnreachable: no reply will come.
        """
        reply = self.box.get(timeout=timeout)
        if isinstance(reply, Lost):
            raise DaemonUnreachable(reply.message)
        return reply


class Connection:
    """The connection of one `convergenced.client.Client` (see the module docstring)."""

    def __init__(
        self,
        socket_path: Path,
        *,
        timeout: float,
        reconnect: float,
        clock: Callable[[], float],
        sleep: Callable[[float], object] | None,
    ) -> None:
        """Connect once.

        Raises:
            DaemonUnreachable: nothing listens there, or access is denied.
        """
        self.socket_path = socket_path
        self.reconnect = reconnect
        self._timeout = timeout
        self._clock = clock
        self._closing = threading.Event()
        self._sleep: Callable[[float], object] = sleep or self._closing.wait
        self._cond = threading.Condition()
        """Guards everything below, and sending (frames never interleave)."""
        self._ids = itertools.count(1)
        self.requests: dict[int, Request] = {}
        """Requests sent and not answered yet, by id (ids are never reused, so a
        request sent again keeps its id)."""
        self._declared: dict[str, Any] = {}
        """The declarations made through this client (their arguments), made again
        after a reconnect."""
        self._hooks: list[ReconnectHook] = []
        self._incarnation: int | None = None
        """The daemon's incarnation, as last learned at a reconnect (None: not yet)."""
        self._link = _Link.UP
        self._lost = ""
        """Why the connection is down."""
        self._final = False
        """Down for good: closed, reconnecting off, or refused for good."""
        self._outages = 0
        """Outages so far: a call that waited through one that gave up raises."""
        self._restorer: int | None = None
        """The thread restoring the connection: it alone may send meanwhile."""
        self.waiting = 0
        """Calls waiting for the connection to come back."""
        self._sock: socket.socket | None = self._connect()
        self._start_reader(self._sock)

    # -- the socket -----------------------------------------------------------------

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self._timeout)
        try:
            sock.connect(str(self.socket_path))
        except OSError as exc:
            sock.close()
            raise DaemonUnreachable(
                f"cannot reach the daemon at {self.socket_path}: {exc}"
            ) from None
        sock.settimeout(None)
        return sock

    def _start_reader(self, sock: socket.socket) -> None:
        threading.Thread(
            target=self._read_loop, args=(sock,), name="convergenced-client", daemon=True
        ).start()

    def _read_loop(self, sock: socket.socket) -> None:
        reader = codec.FrameReader(MAX_REPLY_BYTES)
        why = "the daemon closed the connection"
        told: ApiError | None = None  # the daemon said why it closed: keep that
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    break
                for reply in reader.feed(data):
                    if not isinstance(reply, Mapping):
                        raise ApiError(ErrorKind.INTERNAL, "bad_reply", f"not a map: {reply!r}")
                    rid = reply.get("id")
                    if rid is None and "error" in reply:
                        # An error for no request (not allowed, too many clients,
                        # shutting down): the daemon closes the connection next.
                        told = codec.error_from_wire(reply["error"])
                        why = str(told)
                    elif isinstance(rid, int):
                        self._deliver(rid, reply)
        except (OSError, ApiError) as exc:
            if told is None:
                why = f"connection lost: {exc}"
        self._connection_lost(sock, why, told)

    def _retried(self, req: Request) -> bool:
        return self.reconnect > 0 and not req.internal and req.op in RETRIED

    def _deliver(self, rid: int, reply: Mapping[str, Any]) -> None:
        with self._cond:
            req = self.requests.get(rid)
            if req is None:
                return
            if "event" not in reply:  # a final reply
                if going_away(reply) and self._retried(req):
                    log.info("the daemon is stopping; %s is sent again once it is back", req.op)
                    return
                del self.requests[rid]
        req.box.put(reply)

    # -- losing and restoring the connection ------------------------------------------

    def _connection_lost(self, sock: socket.socket, why: str, told: ApiError | None) -> None:
        with self._cond:
            with suppress(OSError):
                sock.close()
            fatal = self.reconnect <= 0 or (told is not None and closes_for_good(told))
            for rid, req in list(self.requests.items()):
                if req.sock is sock and (fatal or not self._retried(req)):
                    del self.requests[rid]
                    req.box.put(Lost(why))
            if self._sock is not sock:
                return  # closed, or a connection the reconnecting thread gave up
            self._sock = None
            if self._link is _Link.RESTORING:
                self._final = self._final or fatal
                return  # the reconnecting thread sees its own request fail
            if fatal:
                self._down(why, final=True)
                return
            self._link = _Link.RECONNECTING
            self._outages += 1
        self._reconnect(why)  # this thread becomes the reconnecting one

    def _down(self, why: str, *, final: bool) -> None:
        """Give up (the caller holds the lock): fail every request, wake every call."""
        self._link = _Link.DOWN
        self._lost = why
        self._final = self._final or final
        requests, self.requests = self.requests, {}
        for req in requests.values():
            req.box.put(Lost(why))
        self._cond.notify_all()

    def _reconnect(self, why: str) -> None:
        """Try to connect and restore until connected, closed, or the bound passes."""
        outage = Outage(self.reconnect, self._clock(), why)
        log.warning(
            "lost the connection to the daemon at %s (%s); reconnecting for up to %g s",
            self.socket_path,
            why,
            self.reconnect,
        )
        while not self._closing.is_set():
            try:
                self._restore(outage)
                return
            except Exception as exc:  # DaemonUnreachable, ApiError: try again
                if not isinstance(exc, DaemonUnreachable | ApiError):
                    log.exception("reconnecting failed")
                pause = outage.failed(str(exc), self._clock())
            with self._cond:
                final = self._final
            if pause is None or final:
                message = outage.give_up(self.socket_path, self._clock())
                log.error("%s", message)
                with self._cond:
                    self._down(message, final=final)
                return
            self._sleep(pause)

    def _restore(self, outage: Outage) -> None:
        """Connect; declare again, run the hooks if the daemon restarted, send the
        unanswered requests again; only then may other threads send."""
        sock = self._connect()
        me = threading.get_ident()
        with self._cond:
            if self._closing.is_set():
                sock.close()
                raise DaemonUnreachable("the client is closed")
            self._sock, self._link, self._restorer = sock, _Link.RESTORING, me
        self._start_reader(sock)
        try:
            incarnation = self.call("status").get("incarnation")
            for name, args in list(self._declared.items()):
                try:
                    self.call("declare", **args)
                except ApiError as exc:
                    log.warning("stream %r cannot be declared again: %s", name, exc)
                    with self._cond:
                        self._declared.pop(name, None)
            if incarnation != self._incarnation:
                info = Reconnected(self._incarnation, incarnation, self._clock() - outage.started)
                for hook in list(self._hooks):
                    try:
                        hook(info)
                    except DaemonUnreachable:
                        raise
                    except Exception:
                        log.exception("a reconnect hook failed")
                self._incarnation = incarnation  # only once every hook ran on it
            with self._cond:
                if self._sock is not sock:
                    raise DaemonUnreachable("the connection ended while it was restored")
                self._link, self._restorer = _Link.UP, None
                for rid, req in self.requests.items():
                    if req.sock is not sock:  # a hook's own commit_nowait went already
                        self._transmit(rid, req, sock)
                self._cond.notify_all()
        except BaseException:
            with self._cond:
                if self._restorer == me:
                    self._restorer = None
                    if self._link is _Link.RESTORING:
                        self._link = _Link.RECONNECTING
                if self._sock is sock:
                    self._sock = None
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            raise
        log.warning(
            "reconnected to the daemon at %s after %.1f s (incarnation %s)",
            self.socket_path,
            self._clock() - outage.started,
            incarnation,
        )

    # -- requests -----------------------------------------------------------------------

    def _transmit(self, rid: int, req: Request, sock: socket.socket) -> None:
        """Send ``req`` on ``sock`` (the caller holds the lock). A failed send is left
        to the reader, which sees the connection end."""
        args = req.args
        if req.deadline is not None and req.sock is not None:  # sent before: time left
            args = {**args, "timeout": max(0.0, req.deadline - self._clock())}
        req.sock = sock
        try:
            sock.sendall(codec.encode_frame(codec.request(rid, req.op, **args)))
        except OSError:
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def send(self, op: str, args: dict[str, Any], *, wait: bool = True) -> tuple[int, Request]:
        """Send a request, once connected (waiting at most for the reconnect bound;
        without ``wait``, not at all).

        Raises:
            DaemonUnreachable: no connection, and none again within the bound (without
                ``wait``: none now).
        """
        me = threading.get_ident()
        with self._cond:
            waited_through: int | None = None
            while True:
                if self._restorer == me:
                    internal = True
                    break
                if self._link is _Link.UP:
                    internal = False
                    break
                if not wait:
                    raise DaemonUnreachable(f"not connected to the daemon ({self._link.value})")
                if self._link is _Link.DOWN:
                    if self._final or waited_through == self._outages:
                        raise DaemonUnreachable(self._lost)
                    self._link = _Link.RECONNECTING
                    self._outages += 1
                    threading.Thread(
                        target=self._reconnect,
                        args=(self._lost,),
                        name="convergenced-client-reconnect",
                        daemon=True,
                    ).start()
                waited_through = self._outages
                self.waiting += 1
                try:
                    self._cond.wait()
                finally:
                    self.waiting -= 1
            timeout = args.get("timeout") if op in TIMED else None
            deadline: float | None = None  # the daemon checks the timeout itself
            if isinstance(timeout, int | float) and not isinstance(timeout, bool):
                deadline = self._clock() + timeout
            req = Request(op, args, internal, deadline)
            rid = next(self._ids)
            self.requests[rid] = req
            assert self._sock is not None  # UP or RESTORING: connected
            self._transmit(rid, req, self._sock)
        return rid, req

    def forget(self, rid: int, *, cancel: bool = False) -> None:
        """Drop a request nobody waits for any more; with ``cancel``, cancel it on the
        daemon too (fire and forget: the reply to the cancel has no taker)."""
        with self._cond:
            req = self.requests.pop(rid, None)
            if not cancel or req is None or self._sock is None or req.sock is not self._sock:
                return
            with suppress(OSError):
                frame = codec.request(next(self._ids), "cancel", target=rid)
                self._sock.sendall(codec.encode_frame(frame))

    def call(self, op: str, **args: Any) -> Any:
        """Send one request and return its result.

        Raises:
            ApiError: the daemon refused the request.
            DaemonUnreachable: no connection, and none again within the bound.
        """
        rid, req = self.send(op, args)
        try:
            return result_of(req.take())
        finally:
            self.forget(rid)

    def declared(self, name: str, args: dict[str, Any]) -> None:
        """Remember a declaration the daemon accepted (the request's arguments), to
        declare it again after a reconnect."""
        with self._cond:
            self._declared[name] = redeclaration(self._declared.get(name), args)

    def undeclared(self, name: str) -> None:
        """Forget a spec: the stream was undeclared, a reconnect must not declare it."""
        with self._cond:
            self._declared.pop(name, None)

    def add_hook(self, hook: ReconnectHook) -> None:
        """See `convergenced.client.Client.add_reconnect_hook`."""
        with self._cond:
            self._hooks.append(hook)

    def remove_hook(self, hook: ReconnectHook) -> None:
        """See `convergenced.client.Client.remove_reconnect_hook`."""
        with self._cond, suppress(ValueError):
            self._hooks.remove(hook)

    def close(self) -> None:
        """Close the socket; every request in flight and every later call raises
        `DaemonUnreachable`."""
        with self._cond:
            self._closing.set()
            sock, self._sock = self._sock, None
            self._down("the client was closed", final=True)
        if sock is not None:
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
