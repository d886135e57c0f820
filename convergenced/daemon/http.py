"""A tiny HTTP/1.1 server for ``/metrics``, ``/healthz`` and ``/readyz``.

Deliberately minimal: GET (and HEAD) of three fixed paths, one request per
connection, ``Connection: close``. Limits are explicit: the request head may be at
most 8 KiB and must arrive within 5 s, at most 64 scrapes run at once. Anything else
gets a plain 4xx. It listens on loopback by default (``metrics_listen``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import structlog
import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = structlog.get_logger("convergenced.http")

MAX_HEAD = 8192
HEAD_TIMEOUT_S = 5.0
MAX_CONCURRENT = 64


class HttpEndpoint:
    """Serves the registry and the two probes."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        healthy: Callable[[], tuple[bool, str]],
        ready: Callable[[], tuple[bool, str]],
    ) -> None:
        self.registry = registry
        self.healthy = healthy
        self.ready = ready
        self._slots = trio.Semaphore(MAX_CONCURRENT)

    async def handle(self, stream: trio.SocketStream) -> None:
        """Answer one request."""
        async with stream:
            if self._slots.value == 0:
                await self._send(stream, 503, "text/plain", b"busy\n")
                return
            async with self._slots:
                with trio.move_on_after(HEAD_TIMEOUT_S):
                    head = await self._read_head(stream)
                    if head is None:
                        await self._send(stream, 400, "text/plain", b"bad request\n")
                        return
                    await self._answer(stream, head)

    async def _read_head(self, stream: trio.SocketStream) -> bytes | None:
        buf = b""
        while b"\r\n\r\n" not in buf:
            try:
                data = await stream.receive_some(4096)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return None
            if not data:
                return None
            buf += data
            if len(buf) > MAX_HEAD:
                return None
        return buf.split(b"\r\n\r\n", 1)[0]

    async def _answer(self, stream: trio.SocketStream, head: bytes) -> None:
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            await self._send(stream, 400, "text/plain", b"bad request\n")
            return
        method, target, _ = parts
        if method not in ("GET", "HEAD"):
            await self._send(stream, 405, "text/plain", b"method not allowed\n")
            return
        path = target.split("?", 1)[0]
        if path == "/metrics":
            body = generate_latest(self.registry)
            await self._send(stream, 200, CONTENT_TYPE_LATEST, body, method == "HEAD")
        elif path in ("/healthz", "/readyz"):
            ok, why = (self.healthy if path == "/healthz" else self.ready)()
            body = (why + "\n").encode()
            await self._send(stream, 200 if ok else 503, "text/plain", body, method == "HEAD")
        else:
            await self._send(stream, 404, "text/plain", b"not found\n")

    async def _send(
        self, stream: trio.SocketStream, code: int, ctype: str, body: bytes, head: bool = False
    ) -> None:
        reason = {
            200: "OK",
            400: "Bad Request",
            404: "Not Found",
            405: "Method Not Allowed",
            503: "Service Unavailable",
        }[code]
        header = (
            f"HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.send_all(header if head else header + body)
