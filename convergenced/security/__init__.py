"""Who may change what a node believes: identities, signatures, certificates, TLS.

Why a package of its own: the daemon, the command line (``keygen``, ``ca init``,
``ca issue``, ``cluster``) and offline tools all need the same pieces, so they are
synchronous and free of trio, and the sans-IO core does not depend on them.

- `keys`: each node's Ed25519 identity (its key file) and record signing over the
  canonical body (PROTOCOL.md 7.2), and the check that refuses weak public keys.
- `trust`: the trust list (node id -> public key) that verifies relayed records
  (cached, with rejection counters).
- `pki`: a small cluster CA (ECDSA P-256) that issues node certificates naming the
  node id in a ``convergenced://node/<id>`` URI.
- `tls`: TLS 1.3 mutual-authentication contexts for peer links and the peer's node
  id from its certificate.
"""

from __future__ import annotations

from convergenced.security.keys import IdentityError, NodeIdentity
from convergenced.security.pki import PkiError, init_ca, issue, node_id_from_cert
from convergenced.security.tls import (
    PeerIdentityError,
    TlsConfigError,
    check_peer,
    client_context,
    peer_node_id,
    server_context,
)
from convergenced.security.trust import RejectReason, TrustList, VerifyStats, parse_trust_list

__all__ = [
    "IdentityError",
    "NodeIdentity",
    "PeerIdentityError",
    "PkiError",
    "RejectReason",
    "TlsConfigError",
    "TrustList",
    "VerifyStats",
    "check_peer",
    "client_context",
    "init_ca",
    "issue",
    "node_id_from_cert",
    "parse_trust_list",
    "peer_node_id",
    "server_context",
]
