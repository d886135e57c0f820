"""Stream specs: who takes part in a stream and what makes an epoch count.

A job declares its stream with a spec: the stream name, the members (node ids) with
the ranks each hosts, a domain policy ("all of [nvme]", "any of [nvme, s3]"), a
retention in epochs, the domains whose *scope* is shared, and the *membership*: the
first recovery generation the member map applies to. Every member must declare the
same spec; specs are compared by a canonical digest (SHA-256 over a canonical msgpack
encoding), and records carry that digest so a conflict anywhere in the cluster is
noticed, never merged.

**Scopes.** A shared domain (an object store, a parallel file system) is readable from
any host; every other domain is node-local (gpu, ram, nvme: readable only on the
host that wrote it). A rank that moves to another node keeps its shared-domain
epochs and loses its node-local ones: the policy says which domains count, the scope
what survives a move.

**Memberships.** A relaunch may come with another member map (a spare replaces a
dead host, the job shrinks or grows). It declares a spec that differs from the one
before only in its members and a higher ``membership``: the same stream
(`same_stream`), under a new membership (PROTOCOL.md section 8.1).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from convergenced.core.errors import SpecError
from convergenced.core.limits import MAX_MEMBERS, MAX_POLICY_DOMAINS, MAX_RANKS_PER_MEMBER
from convergenced.core.packing import pack
from convergenced.core.validate import INT64_MAX, NAME_RE


class PolicyMode(Enum):
    """How the policy's domains combine for one rank."""

    ALL = "all"
    """The epoch must be durable in every listed domain."""
    ANY = "any"
    """The epoch must be durable in at least one listed domain."""


@dataclass(frozen=True, slots=True)
class Policy:
    """Which domains must hold an epoch for one rank to count it as recoverable."""

    mode: PolicyMode
    domains: tuple[str, ...]

    @classmethod
    def all_of(cls, *domains: str) -> Policy:
        """Policy requiring every domain."""
        return cls(PolicyMode.ALL, tuple(sorted(set(domains))))

    @classmethod
    def any_of(cls, *domains: str) -> Policy:
        """Policy requiring at least one domain."""
        return cls(PolicyMode.ANY, tuple(sorted(set(domains))))

    def __str__(self) -> str:
        return f"{self.mode.value} of [{', '.join(self.domains)}]"


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """One job's stream. Build with `StreamSpec.create`, which validates and normalizes."""

    name: str
    members: tuple[tuple[str, tuple[int, ...]], ...]
    """(node id, sorted ranks) pairs, sorted by node id."""
    policy: Policy
    retention: int
    """Epochs kept below the lowest published restore point (in epoch units)."""
    shared: tuple[str, ...] = ()
    """Domains whose scope is shared (readable from any host), sorted; every other
    domain is node-local."""
    membership: int = 0
    """The first recovery generation this member map applies to."""
    _digest: bytes = field(default=b"", compare=False, repr=False)
    _member_ids: tuple[str, ...] = field(default=(), compare=False, repr=False)
    _hosted: dict[str, tuple[int, ...]] = field(
        init=False, default_factory=dict, compare=False, repr=False
    )

    @classmethod
    def create(
        cls,
        name: str,
        members: Mapping[str, Iterable[int]],
        policy: Policy,
        retention: int = 0,
        *,
        shared: Iterable[str] = (),
        membership: int = 0,
    ) -> StreamSpec:
        """Validate and normalize a spec.

        Raises:
            SpecError: naming the field that is wrong.
        """
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise SpecError(f"spec.name: {name!r} is not a valid stream name")
        if not members:
            raise SpecError("spec.members: a stream needs at least one member")
        if len(members) > MAX_MEMBERS:
            raise SpecError(f"spec.members: {len(members)} members above the limit {MAX_MEMBERS}")
        norm: list[tuple[str, tuple[int, ...]]] = []
        seen_ranks: dict[int, str] = {}
        # Check every node id and rank before sorting: sorting mixed or unhashable
        # values would raise a TypeError that names no field.
        for node in members:
            if not isinstance(node, str) or not NAME_RE.match(node):
                raise SpecError(f"spec.members: {node!r} is not a valid node id")
        for node in sorted(members):
            try:
                raw = list(members[node])
            except TypeError:
                raise SpecError(f"spec.members.{node}: expected a list of ranks") from None
            for r in raw:
                if type(r) is not int or not 0 <= r <= INT64_MAX:
                    raise SpecError(f"spec.members.{node}: rank {r!r} is not a non-negative int")
            ranks = sorted(set(raw))
            if not ranks:
                raise SpecError(f"spec.members.{node}: a member hosts at least one rank")
            if len(ranks) > MAX_RANKS_PER_MEMBER:
                raise SpecError(f"spec.members.{node}: {len(ranks)} ranks above the limit")
            for r in ranks:
                if r in seen_ranks:
                    raise SpecError(
                        f"spec.members.{node}: rank {r} is also hosted by {seen_ranks[r]}"
                    )
                seen_ranks[r] = node
            norm.append((node, tuple(ranks)))
        if not isinstance(policy, Policy) or not policy.domains:
            raise SpecError("spec.policy: name at least one domain")
        if len(policy.domains) > MAX_POLICY_DOMAINS:
            raise SpecError(f"spec.policy: more than {MAX_POLICY_DOMAINS} domains")
        for d in policy.domains:
            if not isinstance(d, str) or not NAME_RE.match(d):
                raise SpecError(f"spec.policy.domains: {d!r} is not a valid domain name")
        if type(retention) is not int or not 0 <= retention <= INT64_MAX:
            raise SpecError(f"spec.retention: {retention!r} is not a non-negative integer")
        policy = Policy(policy.mode, tuple(sorted(set(policy.domains))))
        if isinstance(shared, str | bytes):
            raise SpecError("spec.shared: expected a list of domain names")
        try:
            shared_list = list(shared)
        except TypeError:
            raise SpecError("spec.shared: expected a list of domain names") from None
        if len(shared_list) > MAX_POLICY_DOMAINS:
            raise SpecError(f"spec.shared: more than {MAX_POLICY_DOMAINS} domains")
        for d in shared_list:
            if not isinstance(d, str) or not NAME_RE.match(d):
                raise SpecError(f"spec.shared: {d!r} is not a valid domain name")
            if d not in policy.domains:
                raise SpecError(f"spec.shared: {d!r} is not a domain of the policy")
        if type(membership) is not int or not 0 <= membership <= INT64_MAX:
            raise SpecError(f"spec.membership: {membership!r} is not a non-negative integer")
        return cls(name, tuple(norm), policy, retention, tuple(sorted(set(shared_list))),
                   membership)  # fmt: skip

    # -- queries ------------------------------------------------------------

    @property
    def member_ids(self) -> tuple[str, ...]:
        """Member node ids, sorted (cached: large clusters ask often)."""
        if not self._member_ids:
            object.__setattr__(self, "_member_ids", tuple(node for node, _ in self.members))
        return self._member_ids

    def is_shared(self, domain: str) -> bool:
        """Whether ``domain`` is readable from any host (else node-local)."""
        return domain in self.shared

    def same_stream(self, other: StreamSpec) -> bool:
        """Whether ``other`` is this stream, under this or another membership: the
        same name, policy, retention and scopes (members and membership may differ)."""
        return (self.name, self.policy, self.retention, self.shared) == (
            other.name, other.policy, other.retention, other.shared,
        )  # fmt: skip

    def ranks_of(self, node: str) -> tuple[int, ...]:
        """The ranks ``node`` hosts (empty when it is not a member; cached)."""
        hosted = self._hosted
        if not hosted and self.members:
            hosted.update(self.members)
        return hosted.get(node, ())

    # -- canonical form -----------------------------------------------------

    def to_wire(self) -> dict[str, Any]:
        """The canonical, language-neutral form (also what the local API takes).

        ``shared`` and ``membership`` appear only when they are not the defaults."""
        out: dict[str, Any] = {
            "name": self.name,
            "members": {node: list(ranks) for node, ranks in self.members},
            "policy": {"mode": self.policy.mode.value, "domains": list(self.policy.domains)},
            "retention": self.retention,
        }
        if self.shared:
            out["shared"] = list(self.shared)
        if self.membership:
            out["membership"] = self.membership
        return out

    @classmethod
    def from_wire(cls, obj: Any) -> StreamSpec:
        """Parse the form `to_wire` produces.

        Raises:
            SpecError: naming the field that is wrong.
        """
        if not isinstance(obj, Mapping):
            raise SpecError("spec: expected a map")
        unknown = set(obj) - {"name", "members", "policy", "retention", "shared", "membership"}
        if unknown:
            raise SpecError(f"spec: unknown field {sorted(map(str, unknown))[0]!r}")
        for key in ("name", "members", "policy"):
            if key not in obj:
                raise SpecError(f"spec.{key}: missing")
        members = obj["members"]
        if not isinstance(members, Mapping):
            raise SpecError("spec.members: expected a map of node id to a list of ranks")
        for node, ranks in members.items():
            if not isinstance(ranks, list | tuple):
                raise SpecError(f"spec.members.{node}: expected a list of ranks")
        policy = obj["policy"]
        if not isinstance(policy, Mapping) or set(policy) != {"mode", "domains"}:
            raise SpecError("spec.policy: expected {mode: 'all'|'any', domains: [...]}")
        try:
            mode = PolicyMode(policy["mode"])
        except ValueError:
            raise SpecError(f"spec.policy.mode: {policy['mode']!r} is not 'all' or 'any'") from None
        domains = policy["domains"]
        if not isinstance(domains, list | tuple):
            raise SpecError("spec.policy.domains: expected a list")
        shared = obj.get("shared", [])
        if not isinstance(shared, list | tuple):
            raise SpecError("spec.shared: expected a list of domain names")
        return cls.create(
            obj["name"],
            members,
            Policy(mode, tuple(domains)),
            obj.get("retention", 0),
            shared=shared,
            membership=obj.get("membership", 0),
        )

    def canonical_bytes(self) -> bytes:
        """Canonical msgpack encoding: sorted maps, so equal specs give equal bytes.

        A spec with no shared domain and membership 0 encodes as the 5-element array
        of earlier versions, so its digest is unchanged; otherwise 7 elements."""
        wire = self.to_wire()
        body: list[Any] = [
            wire["name"],
            [[node, ranks] for node, ranks in sorted(wire["members"].items())],
            wire["policy"]["mode"],
            wire["policy"]["domains"],
            wire["retention"],
        ]
        if self.shared or self.membership:
            body += [list(self.shared), self.membership]
        return pack(body)

    @property
    def digest(self) -> bytes:
        """SHA-256 of `canonical_bytes`: equal specs have equal digests (cached)."""
        if not self._digest:
            object.__setattr__(self, "_digest", hashlib.sha256(self.canonical_bytes()).digest())
        return self._digest

    def differences(self, other: StreamSpec) -> list[str]:
        """Human-readable differences, for conflict errors."""
        out = []
        if self.members != other.members:
            out.append("members differ")
        if self.policy != other.policy:
            out.append(f"policy {self.policy} vs {other.policy}")
        if self.retention != other.retention:
            out.append(f"retention {self.retention} vs {other.retention}")
        if self.shared != other.shared:
            out.append(f"shared domains [{', '.join(self.shared)}] vs [{', '.join(other.shared)}]")
        if self.membership != other.membership:
            out.append(f"membership {self.membership} vs {other.membership}")
        return out
