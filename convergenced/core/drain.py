"""The drain gate: may a node go down for maintenance without losing work?

A node may be drained when every stream it is a member of has a restore point at
least as new as the drain's *target*, and every member has published a restore
point at least that new (`Knowledge.PUBLISHED`): every member can restore it, and
each knows that the others can, so whatever happens to this node while it is down
(a firmware flash that fails, a disk that is wiped) the job restarts from that epoch
at the latest.

The target of a stream is fixed when the drain is asked:

* the newest epoch recoverable on this node at that moment: nothing this node had
  made durable before the request is lost;
* with a checkpoint request (the jobs are asked to save now, `checkpoint=True`), the
  first epoch after it: the checkpoint taken for the drain.

A drain for a driver or firmware upgrade may also name the versions the node is to
run after it (`judge_moves`): then every job of the node must accept each of them,
and every member must have acknowledged that (`versions`), so the node never comes
back on a version some member of one of its jobs cannot work with.

A stream with nothing recoverable on this node yet has target 0: the drain waits
for the job's first restore point rather than pass on a job that would lose all its
work (the gate fails closed). Nothing here reads a clock: the caller decides how
long to wait, and a timeout only ever says "not safe".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from convergenced.core.agreement import Knowledge
from convergenced.core.status import StreamStatus
from convergenced.core.versions import ComponentView, judge_move


def drain_target(status: StreamStatus, *, checkpoint: bool) -> int:
    """The epoch a drain asked now needs agreed for this stream (see the module
    docstring)."""
    newest = status.recoverable.max()
    if newest is None:
        return 0
    return newest + 1 if checkpoint else newest


@dataclass(frozen=True, slots=True)
class DrainVerdict:
    """Whether one stream lets the node drain, and why not."""

    stream: str
    target: int
    restore_point: int | None
    knowledge: Knowledge
    safe: bool
    reason: str
    """Why it is not safe yet, in a sentence ("" when it is)."""


def judge_stream(status: StreamStatus, target: int) -> DrainVerdict:
    """The verdict of one stream on a drain that needs ``target`` agreed."""
    rp, knowledge = status.restore_point, status.knowledge
    if rp is None:
        why = status.why_no_restore_point or "no restore point yet"
        reason = f"no restore point: {why}"
    elif rp < target:
        reason = f"the restore point {rp} is older than the drain's target {target}"
    elif knowledge < Knowledge.PUBLISHED:
        reason = (f"restore point {rp} is not yet published by every member "
                  f"(knowledge {knowledge.name.lower()})")  # fmt: skip
    else:
        reason = ""
    return DrainVerdict(status.stream, target, rp, knowledge, not reason, reason)


@dataclass(frozen=True, slots=True)
class MoveVerdict:
    """Whether one job lets the node move to ``version`` of ``component``
    (`versions.judge_move`), and why not."""

    stream: str
    component: str
    version: str
    reason: str
    """Why not yet, in a sentence ("" when every member accepts the version and has
    acknowledged that)."""


def judge_moves(
    views: Mapping[str, Iterable[ComponentView]], moves: Mapping[str, str]
) -> tuple[MoveVerdict, ...]:
    """The verdicts of the jobs on a move to ``moves`` (component -> version): for
    each job of ``views`` (its component views) and each component moved."""
    out = []
    for stream, per_component in sorted(views.items()):
        by_component = {v.component: v for v in per_component}
        for component, version in sorted(moves.items()):
            view = by_component.get(component)
            reason = (judge_move(view, version) if view is not None
                      else f"{stream}: {component} has no catalogue on this node")  # fmt: skip
            out.append(MoveVerdict(stream, component, version, reason))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class DrainAnswer:
    """The gate's answer for a node: safe only when every stream is, and every job
    accepts the versions the node is to move to."""

    node: str
    streams: tuple[DrainVerdict, ...]
    moves: tuple[MoveVerdict, ...] = ()

    @property
    def safe(self) -> bool:
        return all(v.safe for v in self.streams) and not any(m.reason for m in self.moves)


def judge(
    node: str,
    statuses: Iterable[StreamStatus],
    targets: Mapping[str, int],
    moves: tuple[MoveVerdict, ...] = (),
) -> DrainAnswer:
    """The answer over ``statuses`` (the streams ``node`` is a member of), each
    judged against its target in ``targets``, and the verdicts on a version move."""
    verdicts = tuple(judge_stream(s, targets[s.stream]) for s in statuses)
    return DrainAnswer(node, tuple(sorted(verdicts, key=lambda v: v.stream)), moves)


def member_streams(node: str, statuses: Iterable[StreamStatus]) -> list[StreamStatus]:
    """The statuses of the streams whose spec names ``node`` as a member."""
    return [s for s in statuses if node in s.spec.member_ids]


class CheckpointRequests:
    """The checkpoints that drains in progress asked the jobs for, per stream.

    A drain with ``checkpoint=True`` asks for an epoch newer than ``after`` (the
    newest recoverable here when it was asked); several drains of one stream ask
    for the newest of theirs. The request shows in the stream's state (and so on
    ``watch``) until this node holds such an epoch or the drains end.
    """

    def __init__(self) -> None:
        self._asked: dict[str, list[int]] = {}

    def ask(self, stream: str, after: int) -> None:
        """A drain asks for a checkpoint of ``stream`` newer than ``after``."""
        self._asked.setdefault(stream, []).append(after)

    def withdraw(self, stream: str, after: int) -> None:
        """The drain that asked ``ask(stream, after)`` ended."""
        asked = self._asked.get(stream)
        if asked is not None and after in asked:
            asked.remove(after)
            if not asked:
                del self._asked[stream]

    def pending(self, status: StreamStatus) -> int | None:
        """The epoch a new checkpoint of this stream must exceed, or None when no
        drain waits for one (or this node already holds a newer epoch)."""
        asked = self._asked.get(status.stream)
        if not asked:
            return None
        after = max(asked)
        newest = status.recoverable.max()
        return after if newest is None or newest <= after else None
