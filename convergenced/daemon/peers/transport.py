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
from collections.abc import Callable

import trio
from cryptography import x509

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
        self.revoked: Callable[[str, x509.Certificate], str | None] | None = None
        """Why a peer's certificate is no longer trusted (CA-bound trust sets it)."""
        self.reload(config)

    def reload(self, config: Config) -> None:
        """Load the certificate files again (rotated on disk): new connections use
        them, open ones keep what they negotiated.

        Raises:
            TlsConfigError: naming the file at fault; the old contexts stay.
        """
        if config.tls is not None and not config.insecure:
            t = config.tls
            server = tls.server_context(t.cert, t.key, t.ca)
            self._client = tls.client_context(t.cert, t.key, t.ca)
            self._server = server

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
            node = tls.peer_node_id(stream)
        except ConvergencedError as exc:
            await trio.aclose_forcefully(stream)
            raise TransportError("tls_no_node_id", str(exc)) from None
        await self._check_revoked(stream, node)
        return stream, node

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
        await self._check_revoked(stream, peer.node_id)
        return stream

    async def probe(self, host: str, port: int) -> str:
        """The node id of whoever answers at ``host:port`` (a discovered address with
        no node id yet): a TLS handshake, then the connection is closed.

        Raises:
            OSError, trio.TooSlowError: the TCP connection failed.
            TransportError: insecure mode (no certificate to read), a failed
                handshake, or a certificate with no node id or revoked.
        """
        if self._client is None:
            raise TransportError(
                "probe_insecure", "an address alone names no node in insecure mode"
            )
        with trio.fail_after(self.handshake_timeout):
            tcp = await trio.open_tcp_stream(host, port)
        stream = trio.SSLStream(tcp, self._client, server_side=False)
        await self._handshake(stream)
        try:
            node = tls.peer_node_id(stream)
            await self._check_revoked(stream, node)
        except ConvergencedError as exc:
            raise TransportError(getattr(exc, "reason", "tls_no_node_id"), str(exc)) from None
        finally:
            await trio.aclose_forcefully(stream)
        return node

    async def _check_revoked(self, stream: trio.SSLStream[trio.SocketStream], node: str) -> None:
        if self.revoked is None:
            return
        der = stream.getpeercert(True)
        why = self.revoked(node, x509.load_der_x509_certificate(der)) if der else "no certificate"
        if why is not None:
            await trio.aclose_forcefully(stream)
            raise TransportError("tls_revoked", f"{node}: {why}")

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
