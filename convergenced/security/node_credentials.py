"""Node credentials: the cluster CA vouches for each node's record-signing key.

With trust lists every node must hold every other node's public key, so replacing a
host means rewriting every configuration. With CA-bound trust a node instead
publishes a *credential* (PROTOCOL.md 7.6): its certificate from the cluster CA, and,
signed with that certificate's private key, the Ed25519 key that signs its records and
the address peers may dial. Whoever trusts the CA can check it without any list: the
certificate chains to the CA and names the node; the signature proves the holder of
the certificate's key chose this record key. A replaced host needs a new certificate
and nothing else.

`make_credential` builds one; `CredentialJudge` checks those that arrive (the ``admit``
function of `core.credentials.CredentialBook`), remembers what each held one says,
and re-checks them when certificates expire or the revocation list changes.

Synchronous and free of trio, like the rest of `security`. The wall clock appears
here, and only here: certificate validity is defined by it. It never feeds the
agreement; it only decides whose records are believed, as TLS itself does.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.hazmat.primitives.serialization import Encoding

from convergenced.core.credentials import MAX_CREDENTIAL_BYTES, Rank
from convergenced.core.packing import UnpackError, UnpackLimits, pack, unpack_strict
from convergenced.core.validate import NAME_RE
from convergenced.security import pki
from convergenced.security.keys import is_weak_public_key

FORMAT = "convergenced-credential"
"""First field of every credential body: the certificate's key signs nothing else
that starts so (a domain separator)."""
FORMAT_VERSION = 1
MAX_ADDRESS_CHARS = 262
"""A DNS name (253) plus ``:65535`` and brackets."""
CLOCK_SKEW = dt.timedelta(minutes=5)
"""A certificate issued a little in the future of this host's clock still counts."""

_LIMITS = UnpackLimits(
    max_str=MAX_ADDRESS_CHARS, max_bin=MAX_CREDENTIAL_BYTES, max_array=8, max_map=0
)


class Refusal(StrEnum):
    """Why a credential was not admitted (the refusal metric's label)."""

    MALFORMED = "malformed"
    WRONG_CLUSTER = "wrong_cluster"
    UNTRUSTED = "untrusted_certificate"
    """Not issued by the cluster CA, or not a usable node certificate."""
    WRONG_NODE = "wrong_node"
    """The certificate names another node than the credential."""
    EXPIRED = "expired"
    REVOKED = "revoked"
    BAD_SIGNATURE = "bad_signature"


@dataclass(frozen=True, slots=True)
class CredentialInfo:
    """What a credential says, once checked."""

    node: str
    cluster: str
    record_key: bytes
    """The node's Ed25519 public key, raw 32 bytes: its records' signatures check
    against it."""
    address: str
    """``host:port`` peers may dial, or empty."""
    serial: int
    certificate: x509.Certificate

    @property
    def rank(self) -> Rank:
        """A newer certificate wins; for one certificate, the later signing."""
        return int(self.certificate.not_valid_before_utc.timestamp()), self.serial

    @property
    def not_after(self) -> dt.datetime:
        """When the certificate, and so the credential, expires."""
        return self.certificate.not_valid_after_utc


def make_credential(
    *,
    cluster: str,
    node: str,
    record_key: bytes,
    address: str,
    serial: int,
    certificate: x509.Certificate,
    tls_key: Any,
) -> bytes:
    """The credential of this node, signed with its certificate's private key.

    Args:
        tls_key: the private key of ``certificate`` (EC, Ed25519 or RSA).

    Raises:
        ValueError: a field out of range, or a key that does not match the certificate.
    """
    if pki.public_key_der(tls_key) != pki.public_key_der(certificate):
        raise ValueError("the TLS key does not match the certificate")
    if len(address) > MAX_ADDRESS_CHARS:
        raise ValueError(f"address longer than {MAX_ADDRESS_CHARS} characters")
    der = certificate.public_bytes(Encoding.DER)
    body = pack([FORMAT, FORMAT_VERSION, cluster, node, record_key, address, serial, der])
    blob = pack([body, _sign(tls_key, body)])
    if len(blob) > MAX_CREDENTIAL_BYTES:
        raise ValueError(
            f"credential of {len(blob)} bytes exceeds {MAX_CREDENTIAL_BYTES} "
            "(certificate too large)"
        )
    return blob


def _sign(key: Any, data: bytes) -> bytes:
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return bytes(key.sign(data, ec.ECDSA(hashes.SHA256())))
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return bytes(key.sign(data))
    if isinstance(key, rsa.RSAPrivateKey):
        return bytes(key.sign(data, padding.PKCS1v15(), hashes.SHA256()))
    raise ValueError(f"cannot sign with a {type(key).__name__}")


def _verify(cert: x509.Certificate, signature: bytes, data: bytes) -> bool:
    key = cert.public_key()
    try:
        if isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        elif isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, data)
        elif isinstance(key, rsa.RSAPublicKey):
            key.verify(signature, data, padding.PKCS1v15(), hashes.SHA256())
        else:
            return False
    except InvalidSignature:
        return False
    except Exception:  # a malformed signature the backend cannot even parse
        return False
    return True


@dataclass(frozen=True, slots=True)
class Revocations:
    """Certificates and nodes no longer trusted: a deny list and the CA's CRLs.

    Entries of the deny list are node ids, certificate serial numbers (hex, with or
    without ``0x`` and colons) or SHA-256 fingerprints of certificates (64 hex digits).
    """

    node_ids: frozenset[str] = frozenset()
    serials: frozenset[int] = frozenset()
    fingerprints: frozenset[str] = frozenset()
    crl_serials: frozenset[int] = frozenset()

    @classmethod
    def from_entries(cls, entries: Iterable[str], crl_serials: Iterable[int] = ()) -> Revocations:
        """Sort deny-list entries into their kinds.

        Raises:
            ValueError: an entry that is none of the three kinds.
        """
        nodes: set[str] = set()
        serials: set[int] = set()
        prints: set[str] = set()
        for raw in entries:
            entry = raw.strip()
            hexed = entry.lower().removeprefix("0x").replace(":", "")
            if len(hexed) == 64 and _is_hex(hexed):
                prints.add(hexed)
            elif entry.lower().startswith("0x") or (":" in entry and _is_hex(hexed)):
                if not hexed or not _is_hex(hexed):
                    raise ValueError(f"{raw!r} is not a hex serial number")
                serials.add(int(hexed, 16))
            elif NAME_RE.match(entry):
                nodes.add(entry)
            else:
                raise ValueError(
                    f"{raw!r}: expected a node id, a serial number (0x...) or a "
                    "SHA-256 fingerprint (64 hex digits)"
                )
        return cls(frozenset(nodes), frozenset(serials), frozenset(prints), frozenset(crl_serials))

    def __len__(self) -> int:
        return (
            len(self.node_ids) + len(self.serials) + len(self.fingerprints) + len(self.crl_serials)
        )

    def why(self, node: str, cert: x509.Certificate) -> str | None:
        """Why ``node`` with ``cert`` is revoked, or None."""
        if node in self.node_ids:
            return f"node {node!r} is on the deny list"
        serial = cert.serial_number
        if serial in self.serials:
            return f"certificate serial {serial:#x} is on the deny list"
        if serial in self.crl_serials:
            return f"certificate serial {serial:#x} is revoked by the CA's CRL"
        if fingerprint(cert) in self.fingerprints:
            return "certificate fingerprint is on the deny list"
        return None


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def fingerprint(cert: x509.Certificate) -> str:
    """SHA-256 of the certificate's DER, 64 lower-case hex digits."""
    return hashlib.sha256(cert.public_bytes(Encoding.DER)).hexdigest()


@dataclass(slots=True)
class JudgeStats:
    """Counters of `CredentialJudge`; every field only grows."""

    admitted: int = 0
    refused: dict[Refusal, int] = field(default_factory=lambda: dict.fromkeys(Refusal, 0))


class CredentialJudge:
    """Checks credentials against the cluster CA and the revocations; see the module
    docstring. Not thread-safe (the daemon's one trio thread)."""

    def __init__(
        self,
        cluster: str,
        ca_certs: Iterable[x509.Certificate],
        revocations: Revocations | None = None,
        *,
        clock: Callable[[], dt.datetime] | None = None,
        on_refused: Callable[[Refusal, str, str | None], None] | None = None,
    ) -> None:
        """Args:
        ca_certs: the trust anchors (the CA file may hold several during a CA change).
        clock: the time certificates are judged at (tests pass their own).
        on_refused: told (reason, detail, via) of each refusal: the daemon logs and
            counts it.
        """
        self.cluster = cluster
        self.ca_certs = tuple(ca_certs)
        self.revocations = revocations or Revocations()
        self._clock = clock or (lambda: dt.datetime.now(dt.UTC))
        self._on_refused = on_refused
        self._admitted: dict[bytes, CredentialInfo] = {}
        self.stats = JudgeStats()

    def info(self, blob: bytes) -> CredentialInfo | None:
        """What an admitted credential says (None: never admitted, or forgotten)."""
        return self._admitted.get(blob)

    @property
    def remembered(self) -> int:
        """Credentials whose checked contents are kept."""
        return len(self._admitted)

    def keep_only(self, blobs: set[bytes]) -> None:
        """Forget every credential but ``blobs`` (those held): superseded and untaken
        ones would otherwise pile up."""
        self._admitted = {b: i for b, i in self._admitted.items() if b in blobs}

    def revoked_or_untrusted(self, node: str, cert: x509.Certificate) -> str | None:
        """Why a live link's certificate no longer holds (revoked, or no CA of the
        current CA file issued it), or None."""
        if not self._issued_by_ca(cert):
            return "its certificate is not issued by the cluster CA any more"
        return self.revocations.why(node, cert)

    def forget(self, blob: bytes) -> None:
        """Drop what was remembered of ``blob`` (its node's book entry changed)."""
        self._admitted.pop(blob, None)

    def admit(self, blob: bytes, via: str | None) -> tuple[str, Rank] | None:
        """The ``admit`` of `core.credentials.CredentialBook`: the node and rank of a
        valid credential, or None (counted, and told to ``on_refused``)."""
        verdict = self.check(blob)
        if isinstance(verdict, tuple):
            reason, detail = verdict
            self.stats.refused[reason] += 1
            if self._on_refused is not None:
                self._on_refused(reason, detail, via)
            return None
        self.stats.admitted += 1
        self._admitted[blob] = verdict
        return verdict.node, verdict.rank

    def check(self, blob: bytes) -> CredentialInfo | tuple[Refusal, str]:
        """Every check of a credential; never raises."""
        parsed = _parse(blob)
        if isinstance(parsed, str):
            return Refusal.MALFORMED, parsed
        info, body, signature = parsed
        if info.cluster != self.cluster:
            return Refusal.WRONG_CLUSTER, f"cluster {info.cluster!r}, expected {self.cluster!r}"
        cert = info.certificate
        if not self._issued_by_ca(cert):
            return Refusal.UNTRUSTED, f"{info.node}: certificate not issued by the cluster CA"
        try:
            named = pki.node_id_from_cert(cert)
        except pki.PkiError as exc:
            return Refusal.UNTRUSTED, f"{info.node}: {exc}"
        if named != info.node:
            return (
                Refusal.WRONG_NODE,
                f"credential of {info.node!r} holds the certificate of {named!r}",
            )
        problem = self.still_valid(info)
        if problem is not None:
            return problem
        if not _verify(cert, signature, body):
            return Refusal.BAD_SIGNATURE, f"{info.node}: not signed by its certificate's key"
        return info

    def still_valid(self, info: CredentialInfo) -> tuple[Refusal, str] | None:
        """What no longer holds of an admitted credential at this time and with these
        revocations (expired, revoked), or None."""
        now = self._clock()
        cert = info.certificate
        if now + CLOCK_SKEW < cert.not_valid_before_utc:
            return (
                Refusal.EXPIRED,
                f"{info.node}: certificate not valid before "
                f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M}",
            )
        if now > cert.not_valid_after_utc:
            return (
                Refusal.EXPIRED,
                f"{info.node}: certificate expired at {cert.not_valid_after_utc:%Y-%m-%d %H:%M}",
            )
        why = self.revocations.why(info.node, cert)
        if why is not None:
            return Refusal.REVOKED, why
        return None

    def _issued_by_ca(self, cert: x509.Certificate) -> bool:
        for anchor in self.ca_certs:
            try:
                cert.verify_directly_issued_by(anchor)
            except Exception:  # wrong issuer, bad signature, unsupported key type
                continue
            return True
        return False


def _parse(blob: bytes) -> tuple[CredentialInfo, bytes, bytes] | str:
    """The fields of a credential, structurally checked, or what is wrong."""
    if len(blob) > MAX_CREDENTIAL_BYTES:
        return f"{len(blob)} bytes, above {MAX_CREDENTIAL_BYTES}"
    try:
        outer = unpack_strict(blob, _LIMITS)
        if not (isinstance(outer, list) and len(outer) == 2):
            return "expected [body, signature]"
        body, signature = outer
        if not (isinstance(body, bytes) and isinstance(signature, bytes)):
            return "body and signature must be bytes"
        fields = unpack_strict(body, _LIMITS)
    except UnpackError as exc:
        return f"not msgpack ({exc})"
    if not (isinstance(fields, list) and len(fields) == 8):
        return "body: expected 8 fields"
    fmt, version, cluster, node, key, address, serial, der = fields
    if fmt != FORMAT or version != FORMAT_VERSION:
        return f"body: format {fmt!r} {version!r}, expected {FORMAT!r} {FORMAT_VERSION}"
    if not (isinstance(cluster, str) and NAME_RE.match(cluster)):
        return "body: bad cluster name"
    if not (isinstance(node, str) and NAME_RE.match(node)):
        return "body: bad node id"
    if not isinstance(key, bytes) or is_weak_public_key(key):
        return f"{node}: record key is not a valid Ed25519 public key"
    if not isinstance(address, str):
        return f"{node}: address must be a string"
    if type(serial) is not int or not 0 <= serial < 1 << 63:
        return f"{node}: bad serial"
    if not isinstance(der, bytes):
        return f"{node}: certificate must be bytes"
    try:
        cert = x509.load_der_x509_certificate(der)
        cert.not_valid_before_utc  # noqa: B018  (malformed dates raise here, not later)
    except ValueError as exc:
        return f"{node}: certificate does not parse ({exc})"
    info = CredentialInfo(node, cluster, key, address, serial, cert)
    return info, body, signature
