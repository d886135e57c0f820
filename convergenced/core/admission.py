"""Admission: which facts a node accepts from its ranks, and their one path in.

A fact a rank submits (a declaration, commit, retraction, retirement, or the frozen
set of its first request for a recovery generation) is checked here against the
daemon's own limits and rules, then applied to the `NodeCore` and given its place
in the log through the `OutputGate`. The reply it returns may leave only once the
gate says the fact is durable, like every other byte.

Sans-IO, and shared: the daemon's local API and the simulator's ranks submit
through the same `Admission`, so the simulator checks the daemon's rules, not a
copy of them. The rules on top of the core's own checks:

* a declaration may name at most ``max_members`` members, and a node holds at most
  ``max_streams`` streams (both from the configuration's limits);
* a new declaration names only members of the cluster (this node, its configured
  peers, the trust list), unless the request allows unknown members explicitly
  (``unknown_member``);
* a commit, retraction or retirement names a domain of the stream's policy
  (``unknown_domain`` otherwise: a typo such as ``nvm`` would add a column to
  ``state``, a label to the metrics and an entry to the record, which peers refuse
  past `limits.MAX_DOMAINS`; see `limits`);
* a commit's digest, if it states one, is ``ALGO:hex`` of that algorithm's length
  (``bad_digest``), and a commit of an epoch held with another digest or size is a
  conflict (``digest_conflict``) unless a later launch of the job saved it again
  (`commits`);
* a retirement records a deletion the daemon allowed: an epoch that is not in
  ``safe_to_delete`` is refused (deleting anything else is a loss, which a
  retraction reports, and which may roll the restore point back);
* a stream name under ``convergenced.versions/`` is the daemon's own
  (``reserved_stream``): a job may not declare it or commit to it;
* a component report names a component of the configuration's catalogues and
  versions that its catalogue lists (``unknown_component``, ``unknown_version``);
* a fact the node already holds, sent again (a declaration of the spec declared, a
  commit of an epoch held with nothing else to say, see `commits`), is a *repeat*:
  acknowledged, and neither applied nor logged again. Its reply, like every reply,
  goes through the output gate, so it waits for the fsync of the fact it repeats.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from convergenced.core.commits import Verdict, check_digest
from convergenced.core.errors import (
    FactError,
    SpecConflictError,
    SpecError,
    UnknownStreamError,
)
from convergenced.core.facts import (
    Commit,
    ComponentReport,
    Declare,
    Fact,
    Incarnation,
    Retire,
    Retract,
    RolloutNote,
)
from convergenced.core.gate import OutputGate
from convergenced.core.limits import MAX_MEMBERS
from convergenced.core.local_api_codec import ApiError, ErrorKind
from convergenced.core.node import NodeCore
from convergenced.core.versions import check_note, check_report, is_reserved

DEFAULT_MAX_STREAMS = 1024
DEFAULT_MAX_MEMBERS = MAX_MEMBERS


def rejected(exc: Exception) -> ApiError:
    """The `ApiError` for a fact or spec the core refused (nothing changed)."""
    if isinstance(exc, SpecConflictError):
        reason = "spec_conflict"
    elif isinstance(exc, SpecError):
        reason = "bad_spec"
    elif isinstance(exc, FactError):
        reason = exc.reason
    else:
        reason = "rejected"
    return ApiError(ErrorKind.REJECTED, reason, str(exc))


@dataclass(frozen=True, slots=True)
class Admitted:
    """A fact the node accepted, and the reply for when it is durable."""

    reply: dict[str, Any]
    repeat: bool = False
    """The node held the fact already: nothing was applied or logged."""


class Admission:
    """Admits facts for one node (see the module docstring)."""

    def __init__(
        self,
        node: NodeCore,
        gate: OutputGate,
        *,
        max_streams: int = DEFAULT_MAX_STREAMS,
        max_members: int = DEFAULT_MAX_MEMBERS,
        cluster: Iterable[str] | None = None,
    ) -> None:
        self.node = node
        self.gate = gate
        self.max_streams = max_streams
        self.max_members = max_members
        self.cluster = None if cluster is None else frozenset(cluster)
        """The nodes of the cluster, this one included (None: any member goes)."""

    def submit(self, fact: Fact, *, allow_unknown_members: bool = False) -> Admitted:
        """Admit, apply and log ``fact``; return the reply for when it is durable.

        ``allow_unknown_members``: a declaration may name members outside the cluster
        (nodes not configured yet).

        Raises:
            ApiError: ``rejected`` with the reason; nothing changed.
        """
        self._admit(fact)
        if isinstance(fact, Declare) and not allow_unknown_members:
            self._members_known(fact)
        try:
            if self._repeats(fact):
                return Admitted(self._reply(fact), repeat=True)
            self.gate.apply(fact)
        except SpecConflictError as exc:
            if isinstance(fact, Declare):
                self.node.refused(fact.spec)  # the members that declared first see it
            raise rejected(exc) from None
        except (FactError, SpecError) as exc:
            raise rejected(exc) from None
        return Admitted(self._reply(fact))

    def submit_commits(self, commits: Sequence[Commit]) -> list[Admitted | ApiError]:
        """`submit` each of ``commits`` in turn, with the same outcomes, but apply the
        admitted ones together (`NodeCore.apply_many`): a read of 64 commits costs one
        refresh of their stream instead of 64.

        Each commit is admitted against the state the ones before it left: judging a
        commit reads only what is held for its own rank, domain and epoch (and the
        frozen generations, which commits do not change), so the commits of a run
        are applied when one comes for an epoch the run already holds, just before
        it is judged. The outcome of each commit is its `Admitted`, or the `ApiError`
        that `submit` would have raised; nothing is applied for a refused one.
        """
        out: list[Admitted | ApiError] = []
        run: list[Commit] = []
        held: set[tuple[str, int, str, int]] = set()
        for fact in commits:
            key = (fact.stream, fact.rank, fact.domain, fact.epoch)
            if key in held:
                self.node.apply_many(run, checked=True)
                run, held = [], set()
            try:
                self._admit(fact)
                repeat = self._repeats(fact)
            except ApiError as err:
                out.append(err)
                continue
            except (FactError, SpecError) as exc:
                out.append(rejected(exc))
                continue
            if not repeat:
                run.append(fact)
                held.add(key)
            out.append(Admitted(self._reply(fact), repeat=repeat))
        # Each was checked (`_repeats`) against the state apply_many applies it to:
        # none is refused, and none is checked again.
        self.node.apply_many(run, checked=True)
        return out

    def _repeats(self, fact: Fact) -> bool:
        """Whether ``fact`` is one the node holds already (checked first: a refusal
        is never mistaken for a repeat)."""
        if isinstance(fact, Declare):
            self.node.check(fact)  # a member's different spec is still a conflict
            name = fact.spec.name
            # Checked: a declared stream with another spec is a new membership of it.
            return name in self.node.streams() and self.node.spec(name) == fact.spec
        if isinstance(fact, Commit):
            self.node.check(fact)
            verdict = self.node.judge(fact)
            if verdict is Verdict.CONFLICT:
                held = self.node.content(fact)
                assert held is not None  # a conflict is with a held content
                raise ApiError(
                    ErrorKind.REJECTED,
                    "digest_conflict",
                    f"stream {fact.stream!r}: rank {fact.rank} holds epoch {fact.epoch} in "
                    f"{fact.domain} with digest {held.digest!r} and size {held.size}; this "
                    f"commit says {fact.digest!r} and {fact.size} (a different checkpoint "
                    "under the same epoch: retract the epoch first if it was rewritten)",
                )
            return verdict is Verdict.REPEAT
        if isinstance(fact, ComponentReport):
            return self.node.reports().get(fact.component) == fact
        return False

    @staticmethod
    def _reply(fact: Fact) -> dict[str, Any]:
        if isinstance(fact, Declare):
            return {"stream": fact.spec.name, "digest": fact.spec.digest.hex()}
        if isinstance(fact, ComponentReport):
            return {"component": fact.component, "durable": True}
        if isinstance(fact, RolloutNote):
            return {"noted": True, "durable": True}
        if isinstance(fact, Commit | Retract | Retire):
            return {"stream": fact.stream, "epoch": fact.epoch, "durable": True}
        assert not isinstance(fact, Incarnation)  # the core refuses it: never a client's
        return {"stream": fact.stream, "durable": True}

    def known(self, stream: str) -> None:
        """Raise ``rejected``/``unknown_stream`` unless ``stream`` is a job's stream
        declared here (a version companion is the daemon's own: `versions`)."""
        if is_reserved(stream):
            raise rejected(UnknownStreamError(stream))
        try:
            self.node.spec(stream)
        except FactError as exc:
            raise rejected(exc) from None

    def _members_known(self, fact: Declare) -> None:
        """Refuse a new declaration naming a member outside the cluster: no peer of
        ours would ever link it (or accept its records), so the stream could never
        converge. The members of a stream declared here already are left alone (sent
        again by a reconnecting client, or a conflict found later): a new membership of
        it is checked for the members it adds."""
        if self.cluster is None:
            return
        known = self.cluster
        if fact.spec.name in self.node.streams():
            known = known | set(self.node.spec(fact.spec.name).member_ids)
        unknown = sorted(set(fact.spec.member_ids) - known)
        if unknown:
            raise ApiError(
                ErrorKind.REJECTED,
                "unknown_member",
                f"stream {fact.spec.name!r}: {', '.join(unknown[:8])}"
                f"{' and others' if len(unknown) > 8 else ''} not in this cluster (neither "
                "a configured peer, nor in the trust list, nor holding a certificate of "
                "the cluster CA this node heard of); declare with allow_unknown_members "
                "to name a node not known yet",
            )

    def _named_domain(self, fact: Commit | Retract | Retire) -> None:
        """Refuse a fact about a domain the stream's policy does not name: it could
        never count, and each one would add a column to ``state`` and a label to the
        metrics, and past `limits.MAX_DOMAINS` an entry in the record peers refuse."""
        self.known(fact.stream)
        domains = self.node.spec(fact.stream).policy.domains
        if fact.domain not in domains:
            raise ApiError(
                ErrorKind.REJECTED,
                "unknown_domain",
                f"stream {fact.stream!r}: the policy names no domain {fact.domain!r} "
                f"(it names {', '.join(domains)})",
            )

    def _admit(self, fact: Fact) -> None:
        if isinstance(fact, RolloutNote):
            try:
                check_note(fact)
            except FactError as exc:
                raise rejected(exc) from None
            return
        if isinstance(fact, ComponentReport):
            try:
                check_report(fact, self.node.catalogues.get(fact.component))
            except FactError as exc:
                raise rejected(exc) from None
            return
        stream = fact.spec.name if isinstance(fact, Declare) else getattr(fact, "stream", "")
        if is_reserved(stream):
            raise ApiError(
                ErrorKind.REJECTED,
                "reserved_stream",
                f"stream {stream!r}: names under 'convergenced.versions/' belong to the "
                "daemon (the version handshake of each job); choose another name",
            )
        if isinstance(fact, Declare):
            name = fact.spec.name
            members = len(fact.spec.members)
            if members > self.max_members:
                raise ApiError(
                    ErrorKind.REJECTED,
                    "too_many_members",
                    f"stream {name!r}: {members} members above this node's limit of "
                    f"{self.max_members} (limits.max_members)",
                )
            streams = self.node.streams()
            if name not in streams and len(streams) >= self.max_streams:
                raise ApiError(
                    ErrorKind.REJECTED,
                    "too_many_streams",
                    f"stream {name!r}: this node already holds {self.max_streams} streams "
                    "(limits.max_streams)",
                )
        elif isinstance(fact, Commit | Retract | Retire):
            self._named_domain(fact)
        if isinstance(fact, Commit) and (problem := check_digest(fact.digest)) is not None:
            raise ApiError(ErrorKind.REJECTED, "bad_digest", f"stream {fact.stream!r}: {problem}")
        if isinstance(fact, Retire) and fact.epoch not in self.node.safe_to_delete(fact.stream):
            raise ApiError(
                ErrorKind.REJECTED,
                "not_safe_to_delete",
                f"stream {fact.stream!r}: epoch {fact.epoch} is not safe to delete yet "
                "(see safe_to_delete in state); if its data is already gone, retract it",
            )
