"""How peer connections are secured: mutual TLS 1.3 by default, plaintext only when
the configuration says ``insecure = true``.

Accepting, the handshake must finish within the handshake deadline and the peer's
certificate names its node id; that id becomes the node the HELLO must carry, so a
node can only ever speak as itself. Dialling, the certificate must name the node
that was dialled. Every refusal raises `TransportError` with a short reason (the
label it is counted under).
"""

from __future__ import annotations

import ssl

import trio

from convergenced.daemon.config import Config, Peer
from convergenced.errors import ConvergencedError
from convergenced.security import tls


class TransportError(ConvergencedError):
    """A peer connection could not be secured; ``reason`` is the counter label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class PeerTransport:
    """Wraps peer TCP connections (see the module docstring)."""

    def __init__(self, config: Config) -> None:
        """Load certificates and keys now, so a bad file stops the start.

        Raises:
            TlsConfigError: naming the file at fault.
        """
        self.insecure = config.insecure
        self.handshake_timeout = config.limits.handshake_timeout_s
        self._server: ssl.SSLContext | None = None
        self._client: ssl.SSLContext | None = None
        if config.tls is not None and not config.insecure:
            t = config.tls
            self._server = tls.server_context(t.cert, t.key, t.ca)
            self._client = tls.client_context(t.cert, t.key, t.ca)

    async def accept(self, tcp: trio.SocketStream) -> tuple[trio.abc.Stream, str | None]:
        """Secure an accepted connection; return it and the peer's node id (None when
        insecure: the HELLO is then the only claim of identity).

        Raises:
            TransportError: handshake failed or timed out; the connection is closed.
        """
        if self._server is None:
            return tcp, None
        stream = trio.SSLStream(tcp, self._server, server_side=True)
        await self._handshake(stream)
        try:
            return stream, tls.peer_node_id(stream)
        except ConvergencedError as exc:
            await trio.aclose_forcefully(stream)
            raise TransportError("tls_no_node_id", str(exc)) from None

    async def dial(self, peer: Peer) -> trio.abc.Stream:
        """Connect to ``peer`` and secure the connection.

        Raises:
            OSError, trio.TooSlowError: the TCP connection failed.
            TransportError: the handshake failed or the certificate names another node.
        """
        with trio.fail_after(self.handshake_timeout):
            tcp = await trio.open_tcp_stream(peer.host, peer.port)
        if self._client is None:
            return tcp
        stream = trio.SSLStream(tcp, self._client, server_side=False)
        await self._handshake(stream)
        try:
            tls.check_peer(stream, peer.node_id)
        except ConvergencedError as exc:
            await trio.aclose_forcefully(stream)
            raise TransportError("tls_wrong_peer", str(exc)) from None
        return stream

    async def _handshake(self, stream: trio.SSLStream[trio.SocketStream]) -> None:
        try:
            with trio.fail_after(self.handshake_timeout):
                await stream.do_handshake()
        except trio.TooSlowError:
            await trio.aclose_forcefully(stream)
            raise TransportError(
                "tls_handshake_timeout",
                f"TLS handshake not done within {self.handshake_timeout:g} s",
            ) from None
        except (trio.BrokenResourceError, ssl.SSLError, OSError) as exc:
            await trio.aclose_forcefully(stream)
            cause = exc.__cause__ or exc
            raise TransportError("tls_handshake_failed", f"TLS handshake failed: {cause}") from None
