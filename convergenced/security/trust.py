"""Verification of records against the cluster's trust list (node id -> public key).

Why: records travel through relays (the overlay past ``mesh_limit`` nodes), so the
link a record arrives on says nothing about who wrote it. Each origin signs its
records with its own Ed25519 key (`convergenced.security.keys`), and every node checks
that signature against the trust list (from configuration) before it merges a relayed
record.

Verification is the expensive part (tens of microseconds per record, see the
measurements in the security report), and a record version crosses a node many times
(once per link, again after every reconnect replay), so `TrustList` caches positive
results by ``(origin, incarnation, version, fingerprint)``. The cached value is the
signature that was checked: a copy of the same body carrying a *different* signature
misses the cache and is verified afresh. Without that, a forger could attach garbage
to a body we already trust and, because merge prefers the larger signature on equal
bodies (7.3 rule 3), replace the good copy in our view and poison what we relay.

Rejections are never cached (they would let garbage evict good entries) and are
counted by reason, the labels of the daemon's rejection metric.

Everything here is synchronous and free of trio, so the daemon, the CLI and offline
tools share it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from convergenced.core.records import SIGNATURE_LEN, Record
from convergenced.core.validate import NAME_RE
from convergenced.errors import ConfigError
from convergenced.security.keys import is_weak_public_key, public_key_from_hex

DEFAULT_CACHE_SIZE = 65536
MAX_PAST_KEYS = 4


class RejectReason(StrEnum):
    """Why `TrustList.check` refused a record (the rejection metric's label)."""

    UNKNOWN_ORIGIN = "unknown_origin"
    """The origin is not in the trust list: not a member of this cluster."""
    BAD_SIGNATURE = "bad_signature"
    """Signed, but not by the origin's key over this body: forged or tampered with."""
    UNSIGNED = "unsigned"
    """No signature, and it did not arrive from its origin over an authenticated link."""


@dataclass(slots=True)
class VerifyStats:
    """Counters of `TrustList`; every field only ever grows."""

    verified: int = 0
    """Ed25519 verifications that succeeded (each a cache miss)."""
    cache_hits: int = 0
    """Records accepted from the cache, no cryptography run."""
    link_trusted: int = 0
    """Records accepted because they came straight from their origin's mTLS link."""
    rejected: dict[RejectReason, int] = field(
        default_factory=lambda: dict.fromkeys(RejectReason, 0)
    )

    def as_dict(self) -> dict[str, int]:
        """Flat form for metrics and status: ``rejected_<reason>`` per reason."""
        out = {
            "verified": self.verified,
            "cache_hits": self.cache_hits,
            "link_trusted": self.link_trusted,
        }
        out.update({f"rejected_{r.value}": n for r, n in self.rejected.items()})
        return out


_CacheKey = tuple[str, int, int, bytes]


class TrustList:
    """The cluster's node id -> Ed25519 public key map, and the record verifier.

    Not thread-safe (the daemon runs it on its one trio thread).
    """

    __slots__ = ("_cache", "_cache_size", "_keys", "_past", "_raw", "stats")

    def __init__(
        self, keys: Mapping[str, bytes] | None = None, *, cache_size: int = DEFAULT_CACHE_SIZE
    ) -> None:
        """Build from raw 32-byte public keys.

        Args:
            keys: node id -> raw public key.
            cache_size: record versions remembered as verified (LRU); 0 disables it.

        Raises:
            ValueError: a bad node id, a weak or malformed key, or a negative size.
        """
        if cache_size < 0:
            raise ValueError(f"cache_size {cache_size} is negative")
        self._cache_size = cache_size
        self._cache: OrderedDict[_CacheKey, bytes] = OrderedDict()
        self._raw: dict[str, bytes] = {}
        self._keys: dict[str, Ed25519PublicKey] = {}
        self._past: dict[str, list[Ed25519PublicKey]] = {}
        """Keys a node signed with in earlier lives (`add_past_key`)."""
        self.stats = VerifyStats()
        for node_id, raw in (keys or {}).items():
            self._add(node_id, raw)

    def _add(self, node_id: str, raw: bytes) -> None:
        if not isinstance(node_id, str) or not NAME_RE.match(node_id):
            raise ValueError(f"node id {node_id!r} is not a valid name")
        if not isinstance(raw, bytes) or is_weak_public_key(raw):
            raise ValueError(f"{node_id}: not a valid 32-byte Ed25519 public key")
        self._raw[node_id] = raw
        self._keys[node_id] = Ed25519PublicKey.from_public_bytes(raw)

    def __len__(self) -> int:
        return len(self._raw)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._raw

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._raw))

    def public_key(self, node_id: str) -> bytes | None:
        """The raw public key trusted for ``node_id``, if any."""
        return self._raw.get(node_id)

    def items(self) -> list[tuple[str, bytes]]:
        """(node id, raw key) pairs, sorted by node id."""
        return sorted(self._raw.items())

    @property
    def cache_size(self) -> int:
        """Capacity of the verification cache."""
        return self._cache_size

    @property
    def cached(self) -> int:
        """Record versions currently in the verification cache."""
        return len(self._cache)

    def replace_keys(self, keys: Mapping[str, bytes]) -> None:
        """Swap in a new key set (configuration reload); keeps the counters.

        Cache entries of origins whose key changed or disappeared are dropped, so a
        revoked key stops vouching for records at once.

        Raises:
            ValueError: as the constructor; nothing changes then.
        """
        fresh = TrustList(keys, cache_size=0)
        changed = {n for n in self._raw if fresh._raw.get(n) != self._raw[n]}
        self._raw, self._keys = fresh._raw, fresh._keys
        if changed:
            for k in [k for k in self._cache if k[0] in changed]:
                del self._cache[k]

    def set_key(self, node_id: str, raw: bytes | None) -> None:
        """Trust ``raw`` for ``node_id`` (None: trust nothing for it); cached
        verifications of the node are dropped when its key changes.

        Raises:
            ValueError: a bad node id or a weak or malformed key; nothing changes then.
        """
        if raw is None:
            if self._raw.pop(node_id, None) is not None:
                del self._keys[node_id]
                self._drop_cached({node_id})
            return
        if self._raw.get(node_id) == raw:
            return
        self._add(node_id, raw)
        self._drop_cached({node_id})

    def add_past_key(self, node_id: str, raw: bytes) -> None:
        """Also accept ``raw`` for ``node_id``'s records: a key it signed with in an
        earlier life (a node that lost its identity key must still read its own
        records of before, PROTOCOL.md 13.9). At most `MAX_PAST_KEYS` are kept.

        Raises:
            ValueError: a weak or malformed key.
        """
        if is_weak_public_key(raw):
            raise ValueError(f"{node_id}: not a valid 32-byte Ed25519 public key")
        if raw == self._raw.get(node_id):
            return
        past = self._past.setdefault(node_id, [])
        key = Ed25519PublicKey.from_public_bytes(raw)
        if all(k.public_bytes_raw() != raw for k in past):
            past.append(key)
            del past[:-MAX_PAST_KEYS]

    def _drop_cached(self, nodes: set[str]) -> None:
        for k in [k for k in self._cache if k[0] in nodes]:
            del self._cache[k]

    def check(self, record: Record, *, link_peer: str | None = None) -> RejectReason | None:
        """Why ``record`` must not be merged, or None when it may be.

        Args:
            record: a decoded record (any stream).
            link_peer: the node id the arriving link authenticated by mutual TLS, if
                any. A record whose origin is that peer rests on the link's
                authentication and is accepted without running Ed25519 (even
                unsigned). Anything relayed must carry a valid signature, so once
                records are relayed (the overlay) origins must sign every record:
                an unsigned copy accepted here cannot be relayed, and since the
                signature is not in the fingerprint, digests and summaries never
                show that a peer holds a signed copy of it instead.

        Never raises for any record.
        """
        origin = record.origin
        key = self._keys.get(origin)
        if key is None:
            return self._reject(RejectReason.UNKNOWN_ORIGIN)
        if link_peer is not None and origin == link_peer:
            self.stats.link_trusted += 1
            return None
        signature = record.signature
        if not signature:
            return self._reject(RejectReason.UNSIGNED)
        if len(signature) != SIGNATURE_LEN:
            return self._reject(RejectReason.BAD_SIGNATURE)
        ck: _CacheKey = (origin, record.incarnation, record.version, record.fingerprint)
        cache = self._cache
        held = cache.get(ck)
        if held is not None and held == signature:
            cache.move_to_end(ck)
            self.stats.cache_hits += 1
            return None
        if not any(_verifies(k, signature, record) for k in (key, *self._past.get(origin, ()))):
            return self._reject(RejectReason.BAD_SIGNATURE)
        self.stats.verified += 1
        if self._cache_size:
            cache[ck] = signature
            cache.move_to_end(ck)
            if len(cache) > self._cache_size:
                cache.popitem(last=False)
        return None

    def verify(self, record: Record, *, link_peer: str | None = None) -> bool:
        """True when ``record`` may be merged (see `check`); never raises."""
        return self.check(record, link_peer=link_peer) is None

    def _reject(self, reason: RejectReason) -> RejectReason:
        self.stats.rejected[reason] += 1
        return reason


def _verifies(key: Ed25519PublicKey, signature: bytes, record: Record) -> bool:
    try:
        key.verify(signature, record.body_bytes())
    except InvalidSignature:
        return False
    except Exception:  # any other failure of the backend still means "not verified"
        return False
    return True


def parse_trust_list(
    table: Any, source: str = "<config>", *, cache_size: int = DEFAULT_CACHE_SIZE
) -> TrustList:
    """Validate a TOML ``[trust]`` table: node id = 64 hex digits of its public key.

    Example::

        [trust]
        node-1 = "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c"
        "rack2/gpu-7" = "..."

    Args:
        table: the parsed value of the ``trust`` key.
        source: the configuration file, for error messages.
        cache_size: passed to `TrustList`.

    Raises:
        ConfigError: naming ``source`` and the key (``trust.node-1``): not a table, a
            bad node id, a malformed or weak key, or one key listed for two nodes
            (which would let either node speak for the other).
    """
    if not isinstance(table, Mapping):
        raise ConfigError(source, "trust", 'expected a table: [trust] node-1 = "<hex key>"')
    keys: dict[str, bytes] = {}
    owner: dict[bytes, str] = {}
    for node_id, value in table.items():
        where = f"trust.{node_id}"
        if not isinstance(node_id, str) or not NAME_RE.match(node_id):
            raise ConfigError(
                source,
                where,
                "not a node id; expected 1-128 of A-Z a-z 0-9 . _ / -, "
                "starting with a letter or digit",
            )
        if not isinstance(value, str):
            raise ConfigError(
                source, where, f"{value!r}; expected the node's public key as 64 hex digits"
            )
        try:
            raw = public_key_from_hex(value.strip())
        except ValueError as exc:
            raise ConfigError(source, where, f"{value!r}: {exc}") from None
        if raw in owner:
            raise ConfigError(
                source, where, f"same public key as {owner[raw]!r}; every node needs its own key"
            )
        owner[raw] = node_id
        keys[node_id] = raw
    return TrustList(keys, cache_size=cache_size)
