"""How this daemon's peer links are secured, from its configuration.

Three modes: mutual TLS with signed records (the default), no peers at all (a node
that works alone admits nobody, so it needs no certificates), and ``insecure =
true`` (plaintext links and unsigned records, for a throwaway local cluster, loudly
announced). In the default mode the node's Ed25519 identity signs every record it
publishes and every received record is verified against the trust list before the
core merges it; a rejected record is counted and dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from convergenced.core.records import Record
from convergenced.daemon.config import Config
from convergenced.daemon.peers.transport import PeerTransport
from convergenced.daemon.telemetry import Telemetry
from convergenced.errors import ConvergencedError, StartupError
from convergenced.security import pki
from convergenced.security.keys import NodeIdentity
from convergenced.security.tls import TlsConfigError
from convergenced.security.trust import TrustList

log = structlog.get_logger("convergenced.daemon")

INSECURE_WARNING = "INSECURE: plaintext peer links and unsigned records (insecure = true)"


Sign = Callable[[Record], Record]
Verify = Callable[[Record, str | None], str | None]


@dataclass
class PeerSecurity:
    """The transport, and the record signer and verifier the core uses (None: off)."""

    transport: PeerTransport
    sign: Sign | None = None
    verify: Verify | None = None
    trust: TrustList | None = None
    own_public_key: bytes = b""
    identity: NodeIdentity | None = None
    credential_keys: dict[str, bytes] = field(default_factory=dict)
    """Keys the cluster CA vouches for (CA-bound trust): they take precedence over the
    trust list's, which they replace as a fleet migrates."""
    list_keys: dict[str, bytes] = field(default_factory=dict)
    revoked_nodes: frozenset[str] = frozenset()
    """Node ids on the deny list: no key of theirs counts, the trust list's included."""

    def reload_trust(self, cfg: Config) -> None:
        """Take the trust list of a reloaded configuration (our own key and the
        credentials' keys stay)."""
        if self.trust is not None:
            self.list_keys = {node: bytes.fromhex(key) for node, key in cfg.trust}
            keys = {**self.list_keys, **self.credential_keys}
            for node in self.revoked_nodes:
                keys.pop(node, None)
            keys[cfg.node_id] = self.own_public_key
            self.trust.replace_keys(keys)

    def revoke_nodes(self, nodes: frozenset[str]) -> None:
        """Trust no key of ``nodes`` (deny-listed), nor again of those no longer listed."""
        if self.trust is None or nodes == self.revoked_nodes:
            return
        restored, self.revoked_nodes = self.revoked_nodes - nodes, nodes
        for node in nodes:
            self.trust.set_key(node, None)
        for node in restored:
            key = self.credential_keys.get(node) or self.list_keys.get(node)
            self.trust.set_key(node, key)

    def set_credential_key(self, node: str, raw: bytes | None) -> None:
        """Trust ``raw`` for ``node`` because its credential says so (None: its
        credential is gone; the trust list's key, if any, counts again)."""
        if self.trust is None:
            return
        if raw is None:
            self.credential_keys.pop(node, None)
        else:
            self.credential_keys[node] = raw
        if node not in self.revoked_nodes:
            self.trust.set_key(node, raw or self.list_keys.get(node))


@dataclass(frozen=True, slots=True)
class KeyFiles:
    """What the configuration's key files hold, read and checked against each other."""

    transport: PeerTransport
    identity: NodeIdentity | None
    """This node's signing key (None: insecure, or no peers, so nothing is signed)."""


def read_key_files(cfg: Config, *, create_identity: bool = False) -> KeyFiles:
    """Read every certificate and key ``cfg`` names and check that they agree.

    The TLS key must match its certificate, which the cluster CA must have issued to
    this node; the identity key must be this node's and the one the trust list names
    for it. Nothing is logged or written (except a new identity key when
    ``create_identity`` and there is none), so `convergenced check` runs this too.

    Raises:
        StartupError: naming the configuration file, its key, and the file at fault.
    """
    try:
        transport = PeerTransport(cfg)
    except TlsConfigError as exc:
        raise StartupError(f"{cfg.source}: {_tls_key(cfg, exc.path)}: {exc}") from None
    except ConvergencedError as exc:
        raise StartupError(f"{cfg.source}: tls: {exc}") from None
    if cfg.insecure or cfg.tls is None:
        return KeyFiles(transport, None)
    # The contexts loaded, so the certificate is readable and names a node; a daemon
    # holding another node's certificate would start and then be refused by every peer.
    try:
        ours = pki.node_id_from_cert(pki.load_certificate(cfg.tls.cert))
    except pki.PkiError as exc:  # replaced since the contexts read it
        raise StartupError(f"{cfg.source}: tls.cert: {exc}") from None
    if ours != cfg.node_id:
        raise StartupError(
            f"{cfg.source}: tls.cert: {cfg.tls.cert}: is the certificate of {ours!r}, "
            f"not of this node {cfg.node_id!r} (issue one with: convergenced ca issue)"
        )
    key = "identity" if cfg.identity is not None else f"identity (default {cfg.identity_path})"
    if create_identity and not cfg.identity_path.exists():
        # CA-bound trust: nobody lists this key, the credential vouches for it, so a
        # node may make its own at its first start.
        try:
            cfg.identity_path.parent.mkdir(parents=True, exist_ok=True)
            NodeIdentity.generate(cfg.node_id).save(cfg.identity_path)
        except (OSError, ConvergencedError) as exc:
            raise StartupError(f"{cfg.source}: {key}: cannot create it: {exc}") from None
        log.info("created this node's identity key", path=str(cfg.identity_path))
    try:
        identity = NodeIdentity.load(cfg.identity_path, node_id=cfg.node_id)
    except ConvergencedError as exc:
        raise StartupError(
            f"{cfg.source}: {key}: {exc} (create it with: convergenced keygen)"
        ) from None
    listed = dict(cfg.trust).get(cfg.node_id)
    if listed is not None and bytes.fromhex(listed) != identity.public_key_bytes():
        raise StartupError(
            f"{cfg.source}: trust.{cfg.node_id}: is not the public key of "
            f"{cfg.identity_path} (its 'convergenced keygen' printed the right line)"
        )
    return KeyFiles(transport, identity)


def _tls_key(cfg: Config, path: str) -> str:
    """The configuration key that names ``path`` (``tls.cert``, ``tls.key``, ``tls.ca``)."""
    t = cfg.tls
    for name in ("cert", "key", "ca"):
        if t is not None and str(getattr(t, name)) == path:
            return f"tls.{name}"
    return "tls"


def load_security(cfg: Config, telemetry: Telemetry) -> PeerSecurity:
    """Load certificates, the identity key and the trust list (`read_key_files`).

    Raises:
        StartupError: a file is missing or wrong, or the identity's key is not the
            one the trust list names for this node.
    """
    files = read_key_files(cfg, create_identity=cfg.fleet.ca_trust)
    security = PeerSecurity(files.transport)
    if cfg.insecure:
        log.warning(
            "INSECURE: peer links are plaintext and records unsigned; anyone who can "
            "reach the peer port can change what this node believes (insecure = true)"
        )
        return security
    if files.identity is None:
        log.info("no peers configured: this node works alone and admits no peer")
        return security
    identity = files.identity
    security.list_keys = {node: bytes.fromhex(key) for node, key in cfg.trust}
    own = identity.public_key_bytes()
    trust = TrustList({**security.list_keys, cfg.node_id: own})

    def verify(record: Record, via: str | None) -> str | None:
        reason = trust.check(record, link_peer=via)
        if reason is None:
            return None
        telemetry.record_rejected(reason.value, record, via)
        return str(reason)

    security.sign, security.verify = identity.sign_record, verify
    security.trust, security.own_public_key = trust, own
    security.identity = identity
    return security
