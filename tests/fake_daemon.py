"""A fake daemon on a real Unix socket, for the clients' reconnect logic.

It speaks the local API's framing and answers what each test tells it to; it can
die (close the socket and every connection, as ``kill -9`` does) and come back with
a new incarnation. `FakeClock` is the clock and the sleep a `Client` is given: a
sleep moves the time on at once and runs what the test scheduled for that time
(bringing the daemon back, say), so backoff and bounds are checked without waiting.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

from convergenced.core import local_api_codec as codec

Answer = Callable[["FakeDaemon", str, dict[str, Any]], Any]
"""What the daemon does with a request: return a result, or `DIE`, `SILENT`, or an
`codec.ApiError` to send as an error reply."""

DIE = object()
"""Answer nothing and die (the socket, every connection)."""
SILENT = object()
"""Answer nothing (yet)."""


def answer_everything(daemon: FakeDaemon, op: str, args: dict[str, Any]) -> Any:
    """A daemon that acknowledges every fact and answers reads with little."""
    if op in ("commit", "retract", "retire"):
        return {"stream": args["stream"], "epoch": args["epoch"], "durable": True}
    if op == "wait":
        return {"stream": args["stream"], "restore_point": args["epoch"]}
    return {}


class FakeDaemon:
    """One fake daemon at ``path``; `start` it, `die`, `start` again."""

    def __init__(self, path: Path, answer: Answer = answer_everything) -> None:
        self.path = path
        self.answer = answer
        self.incarnation = 0
        self.connections: list[list[tuple[str, dict[str, Any]]]] = []
        """Per connection, the requests it received, in order."""
        self.held: list[tuple[socket.socket, int, str, dict[str, Any]]] = []
        """Requests answered `SILENT`: (connection, id, op, args)."""
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._socks: list[socket.socket] = []

    # -- life -----------------------------------------------------------------------

    def start(self) -> None:
        """Listen (as a new incarnation)."""
        self.incarnation += 1
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.path))
        listener.listen(16)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def die(self) -> None:
        """Close the socket and every connection, unanswered."""
        with self._lock:
            listener, self._listener = self._listener, None
            socks, self._socks = self._socks, []
        if listener is not None:
            with suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with suppress(FileNotFoundError):
            self.path.unlink()
        for s in socks:
            with suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def ops(self, connection: int = -1) -> list[str]:
        """The operations one connection received."""
        with self._lock:
            return [op for op, _ in self.connections[connection]]

    def reply(self, sock: socket.socket, rid: int, result: Any, *, event: bool = False) -> None:
        """Send a result (or an `codec.ApiError`) for request ``rid``."""
        if isinstance(result, codec.ApiError):
            frame = codec.error(rid, result)
        else:
            frame = codec.event(rid, result) if event else codec.ok(rid, result)
        with suppress(OSError):
            sock.sendall(codec.encode_frame(frame))

    # -- serving --------------------------------------------------------------------

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                if self._listener is not listener:
                    sock.close()
                    return
                self._socks.append(sock)
                seen: list[tuple[str, dict[str, Any]]] = []
                self.connections.append(seen)
            threading.Thread(target=self._serve, args=(sock, seen), daemon=True).start()

    def _serve(self, sock: socket.socket, seen: list[tuple[str, dict[str, Any]]]) -> None:
        reader = codec.FrameReader()
        while True:
            try:
                data = sock.recv(65536)
            except OSError:
                return
            if not data:
                return
            for frame in reader.feed(data):
                rid, op, args = frame["id"], frame["op"], dict(frame.get("args", {}))
                with self._lock:
                    seen.append((op, args))
                if op == "status":
                    result: Any = {"node": "node-1", "incarnation": self.incarnation}
                elif op == "declare":
                    result = {"stream": args["spec"]["name"], "digest": "00"}
                elif op == "cancel":
                    result = {"cancelled": True}
                else:
                    result = self.answer(self, op, args)
                if result is DIE:
                    self.die()
                    return
                if result is SILENT:
                    with self._lock:
                        self.held.append((sock, rid, op, args))
                    continue
                self.reply(sock, rid, result, event=op == "watch")


class FakeClock:
    """Virtual time for a `Client`: ``clock=fake.now, sleep=fake.sleep``."""

    def __init__(self) -> None:
        self.time = 1000.0
        self.sleeps: list[float] = []
        self._at: list[tuple[float, Callable[[], None]]] = []

    def now(self) -> float:
        """The virtual time."""
        return self.time

    def at(self, when: float, action: Callable[[], None]) -> None:
        """Run ``action`` once a sleep reaches ``when`` (virtual seconds from now)."""
        self._at.append((self.time + when, action))

    def sleep(self, seconds: float) -> None:
        """Move the time on by ``seconds`` and run what was due by then."""
        self.sleeps.append(seconds)
        self.time += seconds
        due = [a for a in self._at if a[0] <= self.time]
        self._at = [a for a in self._at if a[0] > self.time]
        for _, action in due:
            action()
