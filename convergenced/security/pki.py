"""A small certificate authority for one cluster's peer links (mutual TLS).

Why our own CA: peers must prove *which node* they are, not which host name they
resolve to; node ids are stable names from configuration while hosts and addresses
move (Kubernetes pods, DHCP). So every node certificate carries its node id in a URI
subjectAltName, ``convergenced://node/<node_id>``, which `node_id_from_cert` reads and
the daemon compares with the node it meant to reach (or, when accepting, looks up in
its peer list). The subject CN repeats the id for humans (truncated to X.509's 64
characters; the URI is authoritative). The node id is also a DNS name when it is a
valid one, and the configured ``hosts`` are added as IP or DNS names, so ordinary
tools (``openssl s_client -verify_hostname``, curl) work too.

Keys are ECDSA P-256: every OpenSSL that speaks TLS 1.3 supports it, unlike Ed25519
certificates, which older peers and some FIPS builds refuse. The CA is self-signed,
``pathlen:0`` (it signs node certificates only), and the only trust anchor the TLS
contexts load: no system roots, so a certificate from any public CA is worthless here.

Private keys are written as PKCS#8 PEM, mode 0600, atomically, and nothing is ever
overwritten by accident: re-initialising a CA would silently cut every node off.

File layout of a CA directory (node files may go elsewhere with ``out_dir``)::

    ca.crt  ca.key  node-1.crt  node-1.key  rack2%2Fgpu-7.crt ...

Node ids may contain ``/``, so file names percent-encode it (`node_file_stem`).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from convergenced.core.validate import NAME_RE
from convergenced.errors import ConvergencedError
from convergenced.fsutil import write_atomic
from convergenced.security.keys import check_private_mode

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
NODE_URI_PREFIX = "convergenced://node/"
DEFAULT_CA_DAYS = 3650
DEFAULT_NODE_DAYS = 825
"""The longest validity browsers accepted for server certificates; a sane rotation bound."""
DEFAULT_HOSTS = ("127.0.0.1", "localhost")
_CN_MAX = 64
_DNS_RE = re.compile(
    r"^(?=.{1,253}\Z)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\Z"
)


class PkiError(ConvergencedError):
    """A CA or node certificate operation failed; the message names the file at fault."""

    def __init__(self, message: str, path: Path | str | None = None) -> None:
        super().__init__(f"{path}: {message}" if path is not None else message)
        self.path = None if path is None else str(path)


class PkiExistsError(PkiError):
    """A file `init_ca` or `issue` would write exists already; nothing was written."""


@dataclass(frozen=True, slots=True)
class CaFiles:
    """Where `init_ca` wrote the CA."""

    cert: Path
    key: Path


@dataclass(frozen=True, slots=True)
class NodeFiles:
    """Where `issue` wrote one node's certificate and key."""

    node_id: str
    cert: Path
    key: Path


def node_file_stem(node_id: str) -> str:
    """The file name stem for ``node_id``: the id with ``/`` percent-encoded.

    Injective, because ``%`` cannot appear in a node id.
    """
    return urllib.parse.quote(node_id, safe="")


def node_files(directory: Path | str, node_id: str) -> NodeFiles:
    """The paths `issue` uses for ``node_id`` in ``directory`` (they may not exist)."""
    d = Path(directory)
    stem = node_file_stem(node_id)
    return NodeFiles(node_id, d / f"{stem}.crt", d / f"{stem}.key")


def is_dns_name(name: str) -> bool:
    """True for a syntactically valid DNS host name (letters, digits, hyphens, dots)."""
    return bool(_DNS_RE.match(name))


# -- creating ---------------------------------------------------------------------


def init_ca(
    directory: Path | str,
    name: str = "convergenced-ca",
    days: int = DEFAULT_CA_DAYS,
    *,
    valid_from: dt.datetime | None = None,
) -> CaFiles:
    """Create a self-signed CA (ECDSA P-256) in ``directory``: ``ca.crt`` and ``ca.key``.

    Args:
        directory: created (mode 0700) if missing.
        name: the CA's subject common name.
        days: validity from ``valid_from``.
        valid_from: start of validity (default: now minus five minutes, to tolerate
            small clock skew between the hosts).

    Returns:
        The paths written.

    Raises:
        PkiExistsError: a CA file already exists there (never overwritten).
        PkiError: bad arguments, or the files cannot be written.
    """
    d = Path(directory)
    files = CaFiles(d / CA_CERT, d / CA_KEY)
    if not name or len(name) > _CN_MAX:
        raise PkiError(f"CA name {name!r}: expected 1 to {_CN_MAX} characters")
    if days < 1:
        raise PkiError(f"days {days}: expected at least 1")
    for p in (files.cert, files.key):
        if p.exists():
            raise PkiExistsError(
                "already exists; refusing to replace the cluster CA (every node certificate "
                "depends on it). Use another directory or remove it deliberately",
                p,
            )
    _make_dir(d)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    start = _start(valid_from)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False
        )
        .sign(key, hashes.SHA256())
    )
    _write(files.key, _key_pem(key), 0o600, overwrite=False)
    _write(files.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644, overwrite=False)
    return files


def issue(
    directory: Path | str,
    node_id: str,
    days: int = DEFAULT_NODE_DAYS,
    hosts: Iterable[str] = DEFAULT_HOSTS,
    *,
    out_dir: Path | str | None = None,
    valid_from: dt.datetime | None = None,
    overwrite: bool = False,
) -> NodeFiles:
    """Issue a key and certificate for ``node_id``, signed by the CA in ``directory``.

    The certificate has subject CN = node id, subjectAltName = the URI
    ``convergenced://node/<node_id>``, the node id as a DNS name when it is one, and
    every entry of ``hosts`` (IP addresses as IP, others as DNS); extended key usage
    serverAuth and clientAuth, since every node both dials and accepts.

    Args:
        directory: the CA directory (`init_ca`).
        node_id: the node's id, as in its configuration.
        days: validity from ``valid_from``.
        hosts: extra names and addresses the node is reached at.
        out_dir: where to write ``<node>.crt`` and ``<node>.key`` (default ``directory``).
        valid_from: start of validity (default: now minus five minutes). Tests set it
            in the past to make an already expired certificate.
        overwrite: replace existing node files (re-issue, e.g. before expiry).

    Returns:
        The paths written.

    Raises:
        PkiExistsError: node files exist (and ``overwrite`` is false).
        PkiError: naming the file: CA missing, unreadable or inconsistent, bad node id
            or host.
    """
    if not isinstance(node_id, str) or not NAME_RE.match(node_id):
        raise PkiError(
            f"node id {node_id!r}: expected 1-128 of A-Z a-z 0-9 . _ / -, "
            "starting with a letter or digit"
        )
    if days < 1:
        raise PkiError(f"days {days}: expected at least 1")
    ca_cert, ca_key = load_ca(directory)
    target = Path(out_dir) if out_dir is not None else Path(directory)
    files = node_files(target, node_id)
    if not overwrite:
        for p in (files.cert, files.key):
            if p.exists():
                raise PkiExistsError("already exists; pass overwrite to re-issue", p)
    san = _subject_alt_names(node_id, hosts)
    key = ec.generate_private_key(ec.SECP256R1())
    start = _start(valid_from)
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id[:_CN_MAX])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    _make_dir(target)
    _write(files.key, _key_pem(key), 0o600, overwrite=overwrite)
    _write(files.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644, overwrite=overwrite)
    return files


def _subject_alt_names(node_id: str, hosts: Iterable[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(NODE_URI_PREFIX + node_id)]
    seen: set[str] = set()
    candidates = [node_id] if is_dns_name(node_id) and not _is_ip(node_id) else []
    if isinstance(hosts, str):  # a lone string would iterate as characters
        hosts = [hosts]
    candidates.extend(hosts)
    for host in candidates:
        if not isinstance(host, str):
            raise PkiError(f"host {host!r}: expected an IP address or a DNS name as a string")
        if host in seen:
            continue
        seen.add(host)
        if _is_ip(host):
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        elif is_dns_name(host):
            names.append(x509.DNSName(host))
        else:
            raise PkiError(f"host {host!r}: expected an IP address or a DNS name")
    return names


def _is_ip(value: Any) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def _start(valid_from: dt.datetime | None) -> dt.datetime:
    if valid_from is None:
        return dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    if valid_from.tzinfo is None:
        raise PkiError("valid_from must be timezone-aware (e.g. datetime.now(UTC))")
    return valid_from


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _make_dir(d: Path) -> None:
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise PkiError(f"cannot create directory: {exc.strerror or exc}", d) from None


def _write(path: Path, data: bytes, mode: int, *, overwrite: bool) -> None:
    try:
        write_atomic(path, data, chmod=mode, overwrite=overwrite)
    except FileExistsError:
        raise PkiExistsError("already exists", path) from None
    except OSError as exc:
        raise PkiError(f"cannot write: {exc.strerror or exc}", path) from None


# -- reading ----------------------------------------------------------------------


def load_ca_certificates(path: Path | str) -> list[x509.Certificate]:
    """Every PEM certificate in a CA file (several during a change of CA).

    Raises:
        PkiError: naming the file: missing, unreadable, or no PEM certificate in it.
    """
    data = read_file(path)
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError:
        raise PkiError("no PEM certificate in the CA file", path) from None


def load_certificate(path: Path | str) -> x509.Certificate:
    """The first PEM certificate in ``path``.

    Raises:
        PkiError: naming the file: missing, unreadable, or not a PEM certificate.
    """
    data = read_file(path)
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError:
        raise PkiError("not a PEM certificate", path) from None


def load_private_key(path: Path | str, *, check_mode: bool = True) -> Any:
    """The PEM private key in ``path`` (unencrypted PKCS#8 or traditional).

    Raises:
        PkiError: naming the file: missing, unreadable, too open (group or other
            bits set, when ``check_mode``), or not a PEM private key.
    """
    data = read_file(path)
    if check_mode:
        problem = check_private_mode(path, os.stat(path))
        if problem:
            raise PkiError(problem, path)
    try:
        return serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise PkiError("not an unencrypted PEM private key", path) from None
    except Exception as exc:  # cryptography's own error types for odd encodings
        raise PkiError(f"not a PEM private key ({type(exc).__name__})", path) from None


def read_file(path: Path | str) -> bytes:
    """The bytes of ``path`` (up to 1 MiB).

    Raises:
        PkiError: naming the file: missing or unreadable.
    """
    try:
        with open(path, "rb") as f:
            return f.read(1 << 20)
    except FileNotFoundError:
        raise PkiError("not found", path) from None
    except OSError as exc:
        raise PkiError(f"cannot read: {exc.strerror or exc}", path) from None


def public_key_der(key_or_cert: Any) -> bytes:
    """DER SubjectPublicKeyInfo of a certificate, private key or public key."""
    pub = key_or_cert.public_key() if hasattr(key_or_cert, "public_key") else key_or_cert
    return bytes(
        pub.public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


def load_ca(directory: Path | str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA certificate and key of ``directory``, checked to belong together.

    Raises:
        PkiError: naming the file: missing, unreadable, not a CA, or a key that does
            not match the certificate.
    """
    d = Path(directory)
    cert = load_certificate(d / CA_CERT)
    key = load_private_key(d / CA_KEY)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PkiError(f"holds a {type(key).__name__}, expected an EC key", d / CA_KEY)
    if public_key_der(key) != public_key_der(cert):
        raise PkiError(f"does not match the certificate {d / CA_CERT}", d / CA_KEY)
    try:
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        bc = None
    if bc is None or not bc.ca:
        raise PkiError("is not a CA certificate", d / CA_CERT)
    return cert, key


def _as_cert(cert: x509.Certificate | bytes) -> x509.Certificate:
    if isinstance(cert, x509.Certificate):
        return cert
    try:
        if cert.lstrip().startswith(b"-----BEGIN"):
            return x509.load_pem_x509_certificate(cert)
        return x509.load_der_x509_certificate(cert)
    except ValueError:
        raise PkiError("not a DER or PEM certificate") from None


def node_id_from_cert(cert: x509.Certificate | bytes) -> str:
    """The node id a certificate speaks for, from its ``convergenced://node/`` URI.

    Args:
        cert: a certificate, or its DER or PEM bytes.

    Raises:
        PkiError: no such URI, more than one, or an invalid node id in it.
    """
    c = _as_cert(cert)
    try:
        san = c.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise PkiError("certificate has no subjectAltName, so no node id") from None
    except ValueError as exc:  # a malformed extension
        raise PkiError(f"certificate has a malformed subjectAltName ({exc})") from None
    uris = [
        u[len(NODE_URI_PREFIX) :]
        for u in san.get_values_for_type(x509.UniformResourceIdentifier)
        if u.startswith(NODE_URI_PREFIX)
    ]
    return node_id_from_uris(uris)


def node_id_from_uris(ids: list[str]) -> str:
    """Check the node ids found after ``convergenced://node/`` (exactly one, valid).

    Raises:
        PkiError: none, several, or not a valid node id.
    """
    if not ids:
        raise PkiError(f"certificate has no {NODE_URI_PREFIX}<node_id> URI in subjectAltName")
    if len(ids) > 1:
        raise PkiError(f"certificate names {len(ids)} node ids {ids!r}; expected exactly one")
    if not NAME_RE.match(ids[0]):
        raise PkiError(f"certificate names an invalid node id {ids[0]!r}")
    return ids[0]


def verify_node_cert(
    cert: x509.Certificate | bytes,
    ca_cert: x509.Certificate,
    *,
    now: dt.datetime | None = None,
) -> str:
    """Check a node certificate offline, as a peer's TLS stack would; return its node id.

    Checks: signed by ``ca_cert`` (directly), within its validity period at ``now``,
    extended key usage serverAuth and clientAuth, exactly one node id URI.

    Raises:
        PkiError: saying which check failed.
    """
    c = _as_cert(cert)
    try:
        c.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError) as exc:
        raise PkiError(f"not issued by CA {ca_cert.subject.rfc4514_string()!r} ({exc})") from None
    except Exception:  # InvalidSignature
        raise PkiError(
            f"signature does not verify under CA {ca_cert.subject.rfc4514_string()!r}"
        ) from None
    at = now or dt.datetime.now(dt.UTC)
    if at < c.not_valid_before_utc:
        raise PkiError(f"not valid before {c.not_valid_before_utc.isoformat()}")
    if at > c.not_valid_after_utc:
        raise PkiError(f"expired at {c.not_valid_after_utc.isoformat()}")
    try:
        eku = c.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        raise PkiError("no extended key usage; expected serverAuth and clientAuth") from None
    wanted = {
        ExtendedKeyUsageOID.SERVER_AUTH: "serverAuth",
        ExtendedKeyUsageOID.CLIENT_AUTH: "clientAuth",
    }
    missing = sorted(label for oid, label in wanted.items() if oid not in set(eku))
    if missing:
        raise PkiError(f"extended key usage lacks {', '.join(missing)}")
    return node_id_from_cert(c)
