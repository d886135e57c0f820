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
from dataclasses import dataclass

import structlog

from convergenced.core.records import Record
from convergenced.daemon.config import Config
from convergenced.daemon.peers.transport import PeerTransport
from convergenced.daemon.telemetry import Telemetry
from convergenced.errors import ConvergencedError, StartupError
from convergenced.security.keys import NodeIdentity
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

    def reload_trust(self, cfg: Config) -> None:
        """Take the trust list of a reloaded configuration (our own key stays)."""
        if self.trust is not None:
            keys = {node: bytes.fromhex(key) for node, key in cfg.trust}
            keys[cfg.node_id] = self.own_public_key
            self.trust.replace_keys(keys)


def load_security(cfg: Config, telemetry: Telemetry) -> PeerSecurity:
    """Load certificates, the identity key and the trust list.

    Raises:
        StartupError: a file is missing or wrong, or the identity's key is not the
            one the trust list names for this node.
    """
    try:
        security = PeerSecurity(PeerTransport(cfg))
    except ConvergencedError as exc:
        raise StartupError(str(exc)) from None
    if cfg.insecure:
        log.warning(
            "INSECURE: peer links are plaintext and records unsigned; anyone who can "
            "reach the peer port can change what this node believes (insecure = true)"
        )
        return security
    if cfg.tls is None:
        log.info("no peers configured: this node works alone and admits no peer")
        return security
    try:
        identity = NodeIdentity.load(cfg.identity_path, node_id=cfg.node_id)
    except ConvergencedError as exc:
        raise StartupError(f"{exc} (create it with: convergenced keygen)") from None
    keys = {node: bytes.fromhex(key) for node, key in cfg.trust}
    listed = keys.get(cfg.node_id)
    own = identity.public_key_bytes()
    if listed is not None and listed != own:
        raise StartupError(
            f"{cfg.identity_path}: its public key is not the one trust.{cfg.node_id} "
            f"lists in {cfg.source}"
        )
    keys[cfg.node_id] = own
    trust = TrustList(keys)

    def verify(record: Record, via: str | None) -> str | None:
        reason = trust.check(record, link_peer=via)
        if reason is None:
            return None
        telemetry.record_rejected(reason.value, record, via)
        return str(reason)

    security.sign, security.verify = identity.sign_record, verify
    security.trust, security.own_public_key = trust, own
    return security
