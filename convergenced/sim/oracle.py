"""Ground truth and the invariant checks (S1-S5 of DESIGN.md).

The truth is what really happened to the data, independent of any node's view:
which (rank, domain, epoch) were acknowledged as durable, which were lost
(retracted) and which were deleted (retired). The oracle never looks at a view to
decide whether a node was right.

Besides S1-S5 it checks the output gate against each node's virtual disk: a record
that leaves its origin reveals only facts that the origin had made durable by then
(`Truth.check_revealed`, the invariant named ``gate``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from convergenced.core.interval_set import IntervalSet
from convergenced.core.records import Record
from convergenced.core.spec import PolicyMode, StreamSpec


class InvariantViolation(Exception):
    """An invariant failed; carries the invariant's name."""

    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"{invariant}: {detail}")
        self.invariant = invariant
        self.detail = detail

    def __reduce__(self) -> tuple[type[InvariantViolation], tuple[str, str]]:
        # Results cross process boundaries (--jobs); keep the two-argument form.
        return (type(self), (self.invariant, self.detail))


@dataclass
class Truth:
    """What really happened to one stream's data."""

    spec: StreamSpec
    ever: dict[tuple[int, str], set[int]] = field(default_factory=lambda: defaultdict(set))
    """Acknowledged commits, per (rank, domain), ever."""
    available: dict[tuple[int, str], set[int]] = field(default_factory=lambda: defaultdict(set))
    """Acknowledged and neither lost nor deleted, per (rank, domain)."""
    retired: dict[tuple[int, str], set[int]] = field(default_factory=lambda: defaultdict(set))
    retractions: int = 0
    generation_answers: dict[int, int | None] = field(default_factory=dict)
    last_rp: dict[str, int | None] = field(default_factory=dict)
    _valid_cache: dict[int, bool] = field(default_factory=dict)

    def touch(self) -> None:
        """Call after changing ``ever`` or ``retired``: cached answers are stale."""
        self._valid_cache.clear()

    def valid(self, epoch: int) -> bool:
        """S1: every rank of every member committed ``epoch`` in domains satisfying the
        policy, and none of those copies was retired. Losses (retractions) do not
        count against validity: they surface as rollbacks (S3)."""
        cached = self._valid_cache.get(epoch)
        if cached is None:
            cached = self._valid_cache[epoch] = self._valid(epoch)
        return cached

    def _valid(self, epoch: int) -> bool:
        for _, ranks in self.spec.members:
            for r in ranks:
                hits = [
                    epoch in self.ever[(r, d)] and epoch not in self.retired[(r, d)]
                    for d in self.spec.policy.domains
                ]
                ok = all(hits) if self.spec.policy.mode is PolicyMode.ALL else any(hits)
                if not ok:
                    return False
        return True

    def recoverable(self, node: str) -> IntervalSet:
        """The true E(n): epochs every rank of ``node`` can restore now."""
        acc: IntervalSet | None = None
        for r in self.spec.ranks_of(node):
            per = [IntervalSet.of(*self.available[(r, d)]) for d in self.spec.policy.domains]
            rs = (
                IntervalSet.intersect_all(per)
                if self.spec.policy.mode is PolicyMode.ALL
                else IntervalSet.union_all(per)
            )
            acc = rs if acc is None else acc & rs
        return acc if acc is not None else IntervalSet()

    def convergence(self) -> IntervalSet:
        """The true convergence interval."""
        return IntervalSet.intersect_all([self.recoverable(m) for m in self.spec.member_ids])

    # -- checks -----------------------------------------------------------

    def check_restore_point(self, node: str, rp: int | None, rollback: bool) -> None:
        """S1 on a reported restore point and S3 on its movement."""
        if rp is not None and not self.valid(rp):
            raise InvariantViolation(
                "S1", f"{node} reports restore point {rp}, not committed everywhere or retired"
            )
        old = self.last_rp.get(node)
        if old is not None and (rp is None or rp < old):
            if not rollback:
                raise InvariantViolation(
                    "S3", f"{node} moved its restore point {old} -> {rp} silently"
                )
            if self.retractions == 0:
                raise InvariantViolation(
                    "S3", f"{node} rolled back {old} -> {rp} with no retraction"
                )
        self.last_rp[node] = rp

    def crashed(self, node: str, durable_high_water: int | None, *, state_lost: bool) -> None:
        """``node`` died: S3 from now on compares with what it could have revealed.

        A restore point above its durable high-water mark never left the node (the
        output gate held it), so a new life need not reach it again. A node whose
        state directory is lost starts over: the loss is reported as a state loss
        when its peers held its last life, and nothing more can be known of it.
        """
        old = self.last_rp.get(node)
        if state_lost or old is None or durable_high_water is None:
            self.last_rp.pop(node, None)
        else:
            self.last_rp[node] = min(old, durable_high_water)

    def check_generation(self, node: str, generation: int, rp: int | None) -> None:
        """S2: every member returns the same restore point for a generation (and S1)."""
        if generation in self.generation_answers:
            first = self.generation_answers[generation]
            if first != rp:
                raise InvariantViolation(
                    "S2", f"generation {generation}: {node} answers {rp}, another answered {first}"
                )
        else:
            self.generation_answers[generation] = rp
        if rp is not None and not self.valid(rp):
            raise InvariantViolation(
                "S1", f"generation {generation}: {node} answers invalid epoch {rp}"
            )

    def check_opened(self, node: str, generation: int, resolved_anywhere: int) -> None:
        """S2 across launches: ``node`` handed out ``generation`` for a relaunch, so no
        node may have resolved it (or a newer one), in any life: the launch would get
        the final answer of an older launch's frozen sets."""
        if generation <= resolved_anywhere:
            raise InvariantViolation(
                "S2", f"{node} opened generation {generation} for a relaunch, but generation "
                f"{resolved_anywhere} is resolved already",
            )  # fmt: skip

    def check_revealed(
        self,
        node: str,
        record: Record,
        high_water: int | None,
        frozen: dict[int, IntervalSet],
    ) -> None:
        """The gate: ``record``, leaving ``node`` now, reveals only durable facts.

        ``high_water`` and ``frozen`` are what ``node``'s disk holds (its highest
        durable high-water mark, its durable frozen sets); commits count once
        acknowledged, which is when they are durable. Checked: the high-water mark
        and restore point, every frozen set, the newest recoverable epoch and the
        newest epoch per domain the record claims.
        """
        for what, epoch in (("high-water mark", record.high_water),
                            ("restore point", record.restore_point)):  # fmt: skip
            if epoch is not None and (high_water is None or epoch > high_water):
                raise InvariantViolation(
                    "gate",
                    f"{node} sent its {what} {epoch} before it was durable "
                    f"(durable high-water mark: {high_water})",
                )
        for generation, epochs in record.generations:
            if frozen.get(generation) != epochs:
                raise InvariantViolation(
                    "gate", f"{node} sent its frozen set of generation {generation} before "
                    "it was durable",
                )  # fmt: skip
        ranks = self.spec.ranks_of(node)
        top = record.recoverable.max()
        if top is not None and not all(self._holds_durably(r, top) for r in ranks):
            raise InvariantViolation(
                "gate", f"{node} sent epoch {top} as recoverable before every rank's "
                "commits of it were durable",
            )  # fmt: skip
        for domain, epoch in record.newest:
            if not all(epoch in self.ever[(r, domain)] for r in ranks):
                raise InvariantViolation(
                    "gate", f"{node} sent {domain}@{epoch} as newest before it was durable"
                )

    def _holds_durably(self, rank: int, epoch: int) -> bool:
        hits = [epoch in self.ever[(rank, d)] for d in self.spec.policy.domains]
        return all(hits) if self.spec.policy.mode is PolicyMode.ALL else any(hits)

    def check_retire(
        self,
        node: str,
        epoch: int,
        high_water: dict[str, int | None],
        frozen: dict[str, list[IntervalSet]],
    ) -> None:
        """S4: nothing deleted that a member could still return, or that lies in an
        open frozen set of the deleting node (``frozen``: its own). A generation's
        answer lies in every member's frozen set, so an epoch outside the deleting
        node's own sets can never be the answer of one it froze, nor of one it has
        yet to freeze (what it deleted is no longer in its recoverable set)."""
        limit = None
        for m in self.spec.member_ids:
            hw = high_water.get(m)
            if hw is None:
                raise InvariantViolation(
                    "S4", f"{node} deletes {epoch} before {m} published any point"
                )
            bound = hw - self.spec.retention
            limit = bound if limit is None else min(limit, bound)
        if limit is not None and epoch >= limit:
            raise InvariantViolation(
                "S4", f"{node} deletes {epoch}, a member could still return it"
            )
        for m, sets in frozen.items():
            for s in sets:
                if epoch in s:
                    raise InvariantViolation(
                        "S4", f"{node} deletes {epoch}, in an open frozen set of {m}"
                    )
