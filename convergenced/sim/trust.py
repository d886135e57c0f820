"""CA-bound trust in the simulator: credentials gossiped by the real core, and records
checked against them as the daemon checks its peers' signatures.

With ``SimConfig.credentials`` every node's links speak wire version 3 and share the
node's `CredentialBook` (the core's, as the daemon's links do), so the core's rules
run under every fault: each link sends every credential once, and holds a record back
until its origin's credential went out (`CredentialExchange.owed`). What the simulator
stands in for is only the cryptography:

- a *credential* here is ``node|key|serial``: the node, which of its identity keys it
  vouches for (a counter, bumped when the key is lost), and the serial it was signed
  at (its incarnation at start-up, as the daemon's). Every second lost key comes with
  a new certificate too (a host re-imaged and its certificate issued again), so the
  rank is ``(key // 2, serial)``: half the time the new credential ranks below the
  old one and the node must sign its own again above it, half the time it ranks above
  at once and only the replaced credential that peers send back tells it its old key;
- a record's *signature* is the number of the key that signed it, padded to the wire's
  64 bytes, set by the core's ``sign`` hook as the daemon's Ed25519 signature is;
- `SimTrust.verify` is the daemon's `TrustList.check` with CA-bound keys: a record
  whose origin is the link's own peer rests on the link; any other needs the held
  credential's key (or, for this node's own records, a key of an earlier life it has
  seen a credential of).

A record that arrives over a link while the node holds **no** credential of its
origin means the link sent it too early: the check raises an `InvariantViolation`
("protocol"). Records the ``replay`` fault injects (from no link) are refused as the
daemon would, and counted. A record refused for its key is expected for a while after a
node lost its identity key (its peers hold its old credential until it signs its own
again above it, `core.credentials.serial_to_outrank`), and is counted; the cluster must
still converge (S5).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from convergenced.core.credentials import Credential, CredentialBook, Rank, serial_to_outrank
from convergenced.core.records import SIGNATURE_LEN, Record
from convergenced.sim.oracle import InvariantViolation


def credential(node: str, key: int, serial: int) -> bytes:
    """The simulated credential of ``node`` vouching for its key ``key``."""
    return f"{node}|{key}|{serial}".encode()


def parse(blob: bytes) -> tuple[str, int, int] | None:
    """(node, key, serial) of a simulated credential, or None."""
    try:
        node, key, serial = blob.decode().split("|")
        return node, int(key), int(serial)
    except ValueError:
        return None


def rank_of(key: int, serial: int) -> Rank:
    """The rank of a credential: its certificate (one per two keys), then its serial."""
    return key // 2, serial


def signature(key: int) -> bytes:
    """The simulated signature of any record signed with ``key``."""
    return key.to_bytes(8, "big") * (SIGNATURE_LEN // 8)


def signed_with(rec: Record) -> int | None:
    """Which key signed ``rec`` (None: unsigned or not a simulated signature)."""
    sig = rec.signature
    if len(sig) != SIGNATURE_LEN or sig != sig[:8] * (SIGNATURE_LEN // 8):
        return None
    return int.from_bytes(sig[:8], "big")


class SimTrust:
    """One life of one node: its credential book, its key, its checks."""

    def __init__(
        self, node: str, key: int, incarnation: int, on_refused: Callable[[], None]
    ) -> None:
        self.node = node
        self.key = key
        self.past_keys: set[int] = set()
        """Keys of this node's earlier lives, learned from its old credentials that
        peers sent back (the daemon's `TrustList.add_past_key`)."""
        self.keys: dict[str, int] = {}
        """node -> the key its held credential vouches for."""
        self._on_refused = on_refused
        self.book = CredentialBook(self._admit, self._changed, own=node, on_own=self._own_seen)
        self.book.put(node, rank_of(key, incarnation), credential(node, key, incarnation))

    def _admit(self, blob: bytes, via: str | None) -> tuple[str, Rank] | None:
        parsed = parse(blob)
        return None if parsed is None else (parsed[0], rank_of(parsed[1], parsed[2]))

    def _changed(self, node: str, cred: Credential | None) -> None:
        parsed = parse(cred.blob) if cred is not None else None
        if parsed is None:
            self.keys.pop(node, None)
        else:
            self.keys[node] = parsed[1]

    def _own_seen(self, blob: bytes, rank: Rank) -> None:
        # As the daemon's `Fleet._own_seen`: a credential of ours (sent back, or
        # relayed) names a key of an earlier life, unless it is of a newer certificate.
        parsed = parse(blob)
        own = self.book.get(self.node)
        if parsed is None or own is None or rank[0] > own.rank[0]:
            return
        if parsed[1] != self.key:
            self.past_keys.add(parsed[1])
        serial = serial_to_outrank(own.rank, rank)
        if serial is not None:
            self.book.put(
                self.node, rank_of(self.key, serial), credential(self.node, self.key, serial)
            )

    def sign(self, rec: Record) -> Record:
        """The core's ``sign`` hook."""
        # As the daemon's signing: `_packed` caches the wire bytes, signature included.
        return dataclasses.replace(rec, signature=signature(self.key), _packed=b"")

    def verify(self, rec: Record, via: str | None) -> str | None:
        """The core's ``verify`` hook (see the module docstring)."""
        origin = rec.origin
        key = self.keys.get(origin)
        if key is None:
            if via is None:  # the replay fault's old records, from no link
                self._on_refused()
                return "unknown_origin"
            raise InvariantViolation(
                "protocol",
                f"{self.node} got a record of {origin} via {via} before {origin}'s "
                "credential: a link sent it too early",
            )
        if via is not None and origin == via:
            return None
        used = signed_with(rec)
        if used == key or (origin == self.node and used in self.past_keys):
            return None
        self._on_refused()
        return "bad_signature"
