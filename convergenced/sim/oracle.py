"""Ground truth and the invariant checks (S1-S5 of DESIGN.md).

The truth is what really happened to the data, independent of any node's view:
where each copy of a (rank, domain, epoch) was written, which were lost (retracted,
or gone with a disk) and which were deleted (retired), in `storage` terms: a
node-local copy is readable only on the node that wrote it, a shared one from every
node. S1 asks whether every rank of a member map, on the node that hosts it there,
can read an epoch. The oracle never looks at a view to decide whether a node was
right.

Besides S1-S5 it checks the output gate against each node's virtual disk: a record
that leaves its origin reveals only facts that the origin had made durable by then
(`Truth.check_revealed`, the invariant named ``gate``).
"""

from __future__ import annotations

from collections import defaultdict

from convergenced.core.interval_set import IntervalSet
from convergenced.core.records import Record
from convergenced.core.spec import PolicyMode, StreamSpec
from convergenced.sim.storage import SHARED, Storage


class InvariantViolation(Exception):
    """An invariant failed; carries the invariant's name."""

    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"{invariant}: {detail}")
        self.invariant = invariant
        self.detail = detail

    def __reduce__(self) -> tuple[type[InvariantViolation], tuple[str, str]]:
        # Results cross process boundaries (--jobs); keep the two-argument form.
        return (type(self), (self.invariant, self.detail))


class Truth:
    """What really happened to one stream's data (see the module docstring)."""

    def __init__(self, spec: StreamSpec, storage: Storage) -> None:
        self.spec = spec
        """The spec of the job now: its member map is where its ranks run (S5 and the
        baselines judge by it; S1 judges each node's answers by the spec it holds)."""
        self.storage = storage
        self.acked: defaultdict[tuple[str, int, str], set[int]] = defaultdict(set)
        """Per (node, rank, domain): commits that node's disk acknowledged (the gate)."""
        self.specs: dict[bytes, StreamSpec] = {spec.digest: spec}
        """Every spec the job declared, by digest (to read a record's ranks)."""
        self.retractions = 0
        """Losses so far, and membership changes: what may move a restore point back."""
        self.generation_answers: dict[tuple[int, bytes], int | None] = {}
        self.last_rp: dict[str, int | None] = {}
        self._valid_cache: dict[tuple[bytes, int], bool] = {}
        self.version = 0
        """Bumped whenever a check that passed might fail now: the storage lost a
        copy's validity (`touch`) or the job declared a spec. Callers may skip a check
        that passed on the same inputs at the same version (`world`)."""

    def declared(self, spec: StreamSpec) -> None:
        """The job declares ``spec`` (a new membership of the stream): the spec of the
        job from now on."""
        self.spec = spec
        self.specs[spec.digest] = spec
        self.version += 1

    def touch(self) -> None:
        """Call after changing what the storage holds: cached answers are stale."""
        self._valid_cache.clear()
        self.version += 1

    def valid(self, epoch: int, spec: StreamSpec | None = None) -> bool:
        """S1 under the scope rules: every rank of every member of ``spec`` (default:
        the job's), on the node that hosts it there, reads ``epoch`` in domains
        satisfying the policy: a node-local copy written on that node, or a shared
        copy written by any node, and not retired. Losses do not count against
        validity: they surface as rollbacks (S3)."""
        spec = spec or self.spec
        key = (spec.digest, epoch)
        cached = self._valid_cache.get(key)
        if cached is None:
            cached = self._valid_cache[key] = self._valid(epoch, spec)
        return cached

    def _valid(self, epoch: int, spec: StreamSpec) -> bool:
        readable = self.storage.readable
        domains = spec.policy.domains
        every = spec.policy.mode is PolicyMode.ALL
        for node, ranks in spec.members:
            for r in ranks:
                hits = (readable(node, r, d, epoch) for d in domains)
                if not (all(hits) if every else any(hits)):
                    return False
        return True

    def recoverable(self, node: str, spec: StreamSpec | None = None) -> IntervalSet:
        """The true E(n): epochs every rank of ``node`` can restore there now."""
        spec = spec or self.spec
        acc: IntervalSet | None = None
        for r in spec.ranks_of(node):
            per = [IntervalSet.of(*self.storage.committed(node, r, d))
                   for d in spec.policy.domains]  # fmt: skip
            rs = (
                IntervalSet.intersect_all(per)
                if spec.policy.mode is PolicyMode.ALL
                else IntervalSet.union_all(per)
            )
            acc = rs if acc is None else acc & rs
        return acc if acc is not None else IntervalSet()

    def convergence(self, spec: StreamSpec | None = None) -> IntervalSet:
        """The true convergence interval of ``spec``'s members (default: the job's)."""
        spec = spec or self.spec
        return IntervalSet.intersect_all([self.recoverable(m, spec) for m in spec.member_ids])

    def shared_newest(self, spec: StreamSpec) -> int | None:
        """The newest epoch that every rank of ``spec`` reads from the shared tier
        alone, wherever it runs (None: none, or the policy cannot be met from shared
        domains alone): what a new member map could adopt and restore after every rank
        moved. Every copy written counts, acknowledged or not (the ranks commit what
        they find), and losses do not count against it."""
        policy = spec.policy
        shared = [d for d in policy.domains if d in self.storage.shared]
        every = policy.mode is PolicyMode.ALL
        if not shared or (every and len(shared) < len(policy.domains)):
            return None
        st = self.storage
        acc: IntervalSet | None = None
        for _, ranks in spec.members:
            for r in ranks:
                keys = [(SHARED, r, d) for d in shared]
                per = [IntervalSet.of(*(st.written[k] - st.retired[k])) for k in keys]
                rs = IntervalSet.intersect_all(per) if every else IntervalSet.union_all(per)
                acc = rs if acc is None else acc & rs
        return None if acc is None else acc.max()

    # -- checks -----------------------------------------------------------

    def superseded(self, spec: StreamSpec, node: str) -> bool:
        """Whether ``node``, holding ``spec``, is a node the job left since: it keeps
        an older member map, whose ranks run elsewhere now, where a newer world may
        delete what its restore point needs. S1 judges the restore points of the maps
        in force (PROTOCOL.md section 8.1); a member of every newer map never sees such
        a deletion before it declared the map that makes it."""
        return any(s.membership > spec.membership and node not in s.member_ids
                   for s in self.specs.values())  # fmt: skip

    def check_held(self, node: str, rp: int | None, spec: StreamSpec) -> None:
        """S1 on the restore point ``node`` holds now under ``spec`` (re-checked after
        every event: a deletion must never invalidate it)."""
        if rp is not None and not self.superseded(spec, node) and not self.valid(rp, spec):
            raise InvariantViolation(
                "S1", f"{node} holds restore point {rp}, no longer valid in the truth"
            )

    def check_restore_point(
        self,
        node: str,
        rp: int | None,
        rollback: bool,
        spec: StreamSpec,
        *,
        same_stream: bool = True,
    ) -> None:
        """S1 on a restore point ``node`` reports under ``spec`` (not for a node the
        job left, see `superseded`), and S3 on its movement (a membership change
        counts as a loss: the new world may not read the old point), unless the
        stream was undeclared since (not ``same_stream``)."""
        if rp is not None and not self.superseded(spec, node) and not self.valid(rp, spec):
            raise InvariantViolation(
                "S1", f"{node} reports restore point {rp}, not committed everywhere or retired"
            )
        if not same_stream:
            return
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

    def check_generation(
        self, node: str, generation: int, rp: int | None, spec: StreamSpec
    ) -> None:
        """S2: every member of ``spec`` returns the same restore point for a generation
        (S2 holds per generation and membership), and S1 under ``spec``: every rank,
        on its node of ``spec``, reads the answer."""
        key = (generation, spec.digest)
        if key in self.generation_answers:
            first = self.generation_answers[key]
            if first != rp:
                raise InvariantViolation(
                    "S2", f"generation {generation}: {node} answers {rp}, another answered {first}"
                )
        else:
            self.generation_answers[key] = rp
        if rp is not None and not self.valid(rp, spec):
            raise InvariantViolation(
                "S1", f"generation {generation}: {node} answers invalid epoch {rp}"
            )

    def check_opened(self, node: str, generation: int, resolved: int) -> None:
        """S2 across launches: ``node`` handed out ``generation`` for a relaunch, so no
        node may have resolved it (or a newer one) under the spec the launch declares
        (``resolved``: the newest so resolved, -1: none), in any life: the launch
        would get the final answer of an older launch's frozen sets. A launch that
        declares a new membership starts from frozen sets of that spec only."""
        if generation <= resolved:
            raise InvariantViolation(
                "S2", f"{node} opened generation {generation} for a relaunch, but generation "
                f"{resolved} is resolved already",
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
        spec = self.specs.get(record.spec_digest)
        if spec is None:
            return  # a tombstone or a notice: no ranks, nothing recoverable
        ranks = spec.ranks_of(node)
        top = record.recoverable.max()
        if top is not None and not all(self._holds_durably(node, r, top, spec) for r in ranks):
            raise InvariantViolation(
                "gate", f"{node} sent epoch {top} as recoverable before every rank's "
                "commits of it were durable",
            )  # fmt: skip
        for domain, epoch in record.newest:
            if not all(epoch in self.acked[(node, r, domain)] for r in ranks):
                raise InvariantViolation(
                    "gate", f"{node} sent {domain}@{epoch} as newest before it was durable"
                )

    def _holds_durably(self, node: str, rank: int, epoch: int, spec: StreamSpec) -> bool:
        hits = [epoch in self.acked[(node, rank, d)] for d in spec.policy.domains]
        return all(hits) if spec.policy.mode is PolicyMode.ALL else any(hits)

    def check_retire(
        self,
        node: str,
        epoch: int,
        spec: StreamSpec,
        high_water: dict[str, int | None],
        frozen: dict[str, list[IntervalSet]],
        *,
        shared_newest: int | None = None,
    ) -> None:
        """S4: nothing deleted that a member of ``spec`` (the deleting node's) could
        still return, or that lies in an open frozen set of the deleting node
        (``frozen``: its own). A generation's answer lies in every member's frozen
        set, so an epoch outside the deleting node's own sets can never be the answer
        of one it froze, nor of one it has yet to freeze (what it deleted is no longer
        in its recoverable set). And, for a copy in the shared tier, nothing at or
        above ``shared_newest`` (`shared_newest`, taken before the deletion) minus
        the retention: a new member map could need it."""
        limit = None
        for m in spec.member_ids:
            hw = high_water.get(m)
            if hw is None:
                raise InvariantViolation(
                    "S4", f"{node} deletes {epoch} before {m} published any point"
                )
            bound = hw - spec.retention
            limit = bound if limit is None else min(limit, bound)
        if limit is not None and epoch >= limit:
            raise InvariantViolation(
                "S4", f"{node} deletes {epoch}, a member could still return it"
            )
        if shared_newest is not None and epoch >= shared_newest - spec.retention:
            raise InvariantViolation(
                "S4", f"{node} deletes {epoch} from the shared tier, which holds {shared_newest} "
                "for every rank: a new member map could still return it",
            )  # fmt: skip
        for m, sets in frozen.items():
            for s in sets:
                if epoch in s:
                    raise InvariantViolation(
                        "S4", f"{node} deletes {epoch}, in an open frozen set of {m}"
                    )
