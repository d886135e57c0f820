"""TLS 1.3 contexts with mutual authentication for peer links (stdlib `ssl`).

Why these settings:

- **TLS 1.3 only.** Peers are all convergenced daemons of one release line; there is
  no legacy client to accommodate, and 1.3 removes renegotiation, compression,
  static-RSA and CBC suites in one stroke (a 1.2-only client fails the handshake).
- **Mutual, cluster CA only.** Both sides present a certificate from the cluster CA
  (`convergenced.security.pki`) and require one from the other side. The contexts load
  that CA and nothing else (no system roots), so no public certificate gets in.
- **Identity is the node id, not the host name.** The client does not check host
  names (``check_hostname = False``): peers move between addresses, and a name check
  would tie trust to DNS. Instead, after the handshake, the caller reads the peer's
  node id from its certificate with `peer_node_id` and compares it with the node it
  dialled (or, when accepting, with its peer list) using `check_peer`.
- **No session tickets.** The server issues none, so every connection runs a full
  handshake and presents a certificate that is checked against the current CA.
- **Strict X.509.** ``VERIFY_X509_STRICT`` rejects malformed certificates that
  OpenSSL would otherwise tolerate; `pki` issues certificates that pass it.

Configuration errors are found before OpenSSL sees the files, so `TlsConfigError`
can say which file is wrong and how (missing, unreadable, not PEM, key not matching the
certificate, certificate not issued by the CA), where OpenSSL would only say
``[SSL] PEM lib``.

A TLS 1.3 detail the daemon must expect: the client finishes its handshake before the
server has judged the client's certificate, so a client the server refuses sees the
failure on its first receive (``tlsv13 alert certificate required`` or ``unknown ca``),
not in ``do_handshake``.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any, Protocol

from cryptography import x509

from convergenced.errors import ConvergencedError
from convergenced.security import pki


class TlsConfigError(ConvergencedError):
    """A certificate, key or CA file cannot be used; the message names the file."""

    def __init__(self, path: Path | str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = str(path)


class PeerIdentityError(ConvergencedError):
    """The peer's certificate names no node id, or not the one expected."""


class PeerCertSource(Protocol):
    """Anything with ``getpeercert`` (``ssl.SSLObject``, ``ssl.SSLSocket``,
    ``trio.SSLStream``)."""

    def getpeercert(self, binary_form: bool = False) -> Any:
        """The peer certificate, as a dict or as DER bytes."""


def _check_files(cert: Path, key: Path, ca: Path, *, check_mode: bool) -> None:
    """Load all three with cryptography first, to name the file at fault."""
    try:
        ca_certs = x509.load_pem_x509_certificates(pki.read_file(ca))
    except pki.PkiError as exc:
        raise TlsConfigError(ca, _problem(exc)) from None
    except ValueError:
        raise TlsConfigError(ca, "no PEM certificate in the CA file") from None
    try:
        leaf = pki.load_certificate(cert)
    except pki.PkiError as exc:
        raise TlsConfigError(cert, _problem(exc)) from None
    try:
        private = pki.load_private_key(key, check_mode=check_mode)
    except pki.PkiError as exc:
        raise TlsConfigError(key, _problem(exc)) from None
    if pki.public_key_der(private) != pki.public_key_der(leaf):
        raise TlsConfigError(key, f"does not match the certificate {cert}")
    for anchor in ca_certs:
        try:
            leaf.verify_directly_issued_by(anchor)
        except Exception:  # wrong issuer name, bad signature, or unsupported key type
            continue
        break
    else:
        raise TlsConfigError(cert, f"is not issued by the CA in {ca}")
    try:
        pki.node_id_from_cert(leaf)
    except pki.PkiError as exc:
        raise TlsConfigError(cert, str(exc)) from None


def _problem(exc: pki.PkiError) -> str:
    """The PkiError's message without its leading path (TlsConfigError adds its own)."""
    text = str(exc)
    prefix = f"{exc.path}: " if exc.path else ""
    return text[len(prefix) :] if prefix and text.startswith(prefix) else text


def _base(
    protocol: int, cert: Path | str, key: Path | str, ca: Path | str, check_mode: bool
) -> ssl.SSLContext:
    cert, key, ca = Path(cert), Path(key), Path(ca)
    _check_files(cert, key, ca, check_mode=check_mode)
    ctx = ssl.SSLContext(protocol)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION | ssl.OP_NO_TICKET
    if protocol == ssl.PROTOCOL_TLS_CLIENT:
        ctx.check_hostname = False  # before verify_mode: identity is the node id
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    try:
        ctx.load_verify_locations(cafile=str(ca))
    except (ssl.SSLError, OSError) as exc:
        raise TlsConfigError(ca, f"OpenSSL refused the CA file ({exc})") from None
    try:
        ctx.load_cert_chain(certfile=str(cert), keyfile=str(key))
    except (ssl.SSLError, OSError) as exc:
        raise TlsConfigError(
            cert, f"OpenSSL refused the certificate or key {key} ({exc})"
        ) from None
    return ctx


def server_context(
    cert: Path | str, key: Path | str, ca: Path | str, *, check_mode: bool = True
) -> ssl.SSLContext:
    """The context for accepting peer links: TLS 1.3, client certificate required.

    Args:
        cert: this node's certificate (PEM).
        key: its private key (PEM, mode 0600).
        ca: the cluster CA certificate, the only trust anchor.
        check_mode: refuse a key file group or others may read.

    Raises:
        TlsConfigError: naming the file that is missing, unreadable or inconsistent.
    """
    ctx = _base(ssl.PROTOCOL_TLS_SERVER, cert, key, ca, check_mode)
    ctx.num_tickets = 0
    return ctx


def client_context(
    cert: Path | str, key: Path | str, ca: Path | str, *, check_mode: bool = True
) -> ssl.SSLContext:
    """The context for dialling peers: TLS 1.3, server certificate required.

    Host names are not checked; call `check_peer` with the node id you dialled once
    the handshake is done.

    Raises:
        TlsConfigError: as `server_context`.
    """
    return _base(ssl.PROTOCOL_TLS_CLIENT, cert, key, ca, check_mode)


def node_contexts(
    directory: Path | str, node_id: str, *, ca: Path | str | None = None, check_mode: bool = True
) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts from the files `pki.issue` wrote for ``node_id``.

    Args:
        directory: where ``<node>.crt`` and ``<node>.key`` are.
        node_id: this node.
        ca: the CA certificate (default ``directory/ca.crt``).
        check_mode: as `server_context`.

    Raises:
        TlsConfigError: naming the file at fault.
    """
    files = pki.node_files(directory, node_id)
    ca_path = Path(ca) if ca is not None else Path(directory) / pki.CA_CERT
    server = server_context(files.cert, files.key, ca_path, check_mode=check_mode)
    ours = pki.node_id_from_cert(pki.load_certificate(files.cert))  # checked above
    if ours != node_id:
        raise TlsConfigError(files.cert, f"is the certificate of {ours!r}, not of {node_id!r}")
    return server, client_context(files.cert, files.key, ca_path, check_mode=check_mode)


def peer_node_id(ssl_obj: PeerCertSource) -> str:
    """The node id in the peer's certificate, after a completed handshake.

    Reads the binary certificate (parsed with cryptography) and falls back to the
    parsed dict form, both from ``getpeercert``.

    Raises:
        PeerIdentityError: no peer certificate (handshake not done) or no valid node
            id in it.
    """
    der = ssl_obj.getpeercert(True)
    if isinstance(der, bytes | bytearray) and der:
        try:
            return pki.node_id_from_cert(bytes(der))
        except pki.PkiError as exc:
            raise PeerIdentityError(f"peer certificate: {exc}") from None
    info = ssl_obj.getpeercert()
    if not info:
        raise PeerIdentityError("no peer certificate (handshake not complete?)")
    return node_id_from_peercert_dict(info)


def node_id_from_peercert_dict(info: Any) -> str:
    """The node id from the dict form of ``getpeercert()``.

    Raises:
        PeerIdentityError: no or several node id URIs, or an invalid id.
    """
    san = info.get("subjectAltName", ()) if isinstance(info, dict) else ()
    ids = [
        value[len(pki.NODE_URI_PREFIX) :]
        for kind, value in san
        if kind == "URI" and isinstance(value, str) and value.startswith(pki.NODE_URI_PREFIX)
    ]
    try:
        return pki.node_id_from_uris(ids)
    except pki.PkiError as exc:
        raise PeerIdentityError(f"peer certificate: {exc}") from None


def check_peer(ssl_obj: PeerCertSource, expected: str) -> str:
    """`peer_node_id`, required to equal ``expected`` (the node that was dialled).

    Raises:
        PeerIdentityError: the peer is another node or has no node id.
    """
    found = peer_node_id(ssl_obj)
    if found != expected:
        raise PeerIdentityError(f"peer presented a certificate of {found!r}, expected {expected!r}")
    return found
