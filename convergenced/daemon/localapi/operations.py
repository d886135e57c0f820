"""The operations of the local API: one table, one handler each.

`OPERATIONS` maps every operation the local-API codec knows (`core.api.OPS`) to its
kind and its handler; a test holds the two lists to each other. The kind says how
a session runs it:

* ``FACT`` (declare, commit, retract, retire): applied inline by the session's
  reader, in arrival order, through `Admission` (commits together, the reads of
  one scheduling round at once: `submit_commits`, `batching`); its reply is queued
  at once and the output gate holds it until the fact is durable, so one fsync
  acknowledges a whole read's worth of facts;
* ``READ`` (status, streams, state): a task of its own; the reply shows the state
  at that instant and, like every reply, waits for the fsync of anything it may
  reveal;
* ``WAIT`` (wait, restore_point, next_generation, watch, drain): a task that may
  wait for the cluster; ended with ``unavailable`` at shutdown;
* ``NOTE`` (report_save): a figure the integrations report, kept in memory only
  (nothing logged or gossiped), answered at once;
* ``SESSION`` (cancel): addresses the session's own requests; the session answers
  it itself.

Handlers take the validated arguments (`core.api.parse_request`) and return the
result map, or raise `ApiError`.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import trio

from convergenced.core import local_api_results as results
from convergenced.core.admission import Admission, rejected
from convergenced.core.drain import (
    CheckpointRequests,
    drain_target,
    judge,
    judge_moves,
    member_streams,
)
from convergenced.core.errors import FactError
from convergenced.core.facts import Commit, Declare, Fact, Retract
from convergenced.core.local_api_codec import ApiError, ErrorKind
from convergenced.core.node import NodeCore
from convergenced.daemon.localapi.watches import Snapshot, StreamFeed
from convergenced.daemon.overhead import SaveOverheads
from convergenced.daemon.peers.session import PeerHub
from convergenced.daemon.telemetry import Telemetry

Emit = Callable[[Snapshot], None]
"""Sends one event of a watch."""


class OpKind(Enum):
    """How a session runs an operation (see the module docstring)."""

    FACT = "fact"
    READ = "read"
    WAIT = "wait"
    NOTE = "note"
    SESSION = "session"


class LocalOperations:
    """The operations over one node."""

    def __init__(
        self,
        node: NodeCore,
        admission: Admission,
        hub: PeerHub,
        telemetry: Telemetry,
        *,
        durable: Callable[[], Awaitable[None]],
        status: Callable[[], dict[str, Any]],
    ) -> None:
        self.node = node
        self.admission = admission
        self.hub = hub
        self.telemetry = telemetry
        self._durable = durable
        self._status = status
        self.feeds: dict[str, StreamFeed] = {}
        """The watched streams' feeds, while a watch of them is open."""
        self.checkpoints = CheckpointRequests()
        """The checkpoints drains in progress ask the jobs for."""
        self.verification: Callable[[str], dict[str, Any]] = lambda stream: {}
        """The ``verification`` part of a stream's state (the daemon's verifier)."""
        self.last_drill: Callable[[str], dict[str, Any] | None] = lambda stream: None
        """The ``drill`` part of a stream's state (the daemon's drills)."""
        self.drill: Callable[[str, int | None, str | None], Awaitable[dict[str, Any]]] = _no_drills
        """Runs a drill (`verification.drills.Drills.drill`)."""
        self.overheads = SaveOverheads(trio.current_time)
        """The recent saves the integrations reported (`report_save`)."""

    # -- facts ------------------------------------------------------------------

    def submit(self, fact: Fact, *, allow_unknown_members: bool = False) -> dict[str, Any]:
        """Admit, apply and log ``fact``; the reply acknowledges it once durable.

        A fact the node holds already (sent again) is acknowledged the same way, and
        neither applied, logged nor counted again (`core.admission`), which also says
        what ``allow_unknown_members`` allows.

        Raises:
            ApiError: ``rejected``; nothing changed.
        """
        try:
            admitted = self.admission.submit(fact, allow_unknown_members=allow_unknown_members)
        except ApiError:
            self._refused(fact)
            if isinstance(fact, Declare):
                self.hub.view_changed()  # a refused one may leave a notice (NodeCore.refused)
            raise
        if admitted.repeat:
            self.telemetry.fact_repeated(fact)
        else:
            self.telemetry.fact_applied(fact)
            self.hub.view_changed()
            if isinstance(fact, Retract):
                self._note_failed_restore(fact)
        return admitted.reply

    def _note_failed_restore(self, fact: Retract) -> None:
        """Count an incomplete recovery: ``fact`` retracts the restore point of the
        generation the job is restoring from, so it needs another generation."""
        recovering = self.node.recovering_from(fact.stream)
        if recovering is not None and recovering[1] == fact.epoch:
            self.telemetry.incomplete_recovery(fact.stream, *recovering)

    def submit_commits(self, commits: Sequence[Commit]) -> list[dict[str, Any] | ApiError]:
        """`submit` each of ``commits`` in turn, applied together
        (`Admission.submit_commits`): the reply of each, or its ``rejected`` error.

        The stream is refreshed once for the lot, and the peers woken once.
        """
        results: list[dict[str, Any] | ApiError] = []
        applied = False
        for fact, outcome in zip(commits, self.admission.submit_commits(commits), strict=True):
            if isinstance(outcome, ApiError):
                self._refused(fact)
                results.append(outcome)
                continue
            if outcome.repeat:
                self.telemetry.fact_repeated(fact)
            else:
                self.telemetry.fact_applied(fact)
                applied = True
            results.append(outcome.reply)
        if applied:
            self.hub.view_changed()
        return results

    def _refused(self, fact: Fact) -> None:
        stream = getattr(fact, "stream", None)
        declared = stream in self.node.streams()
        domains = self.node.spec(stream).policy.domains if declared and stream else ()
        self.telemetry.fact_refused(fact, domains)

    async def durable(self) -> None:
        """Wait until everything applied so far is on disk.

        Raises:
            ApiError: ``unavailable``/``log_failed`` when the log failed.
        """
        try:
            await self._durable()
        except OSError as exc:
            raise log_failed(exc) from None

    # -- reads ------------------------------------------------------------------

    def state(self, stream: str) -> dict[str, Any]:
        """The state of ``stream`` as this node sees it."""
        self.admission.known(stream)
        status = self.node.status(stream)
        out = results.status_to_wire(status, self.checkpoints.pending(status))
        out["verification"] = self.verification(stream)
        out["drill"] = self.last_drill(stream)
        out["overhead"] = self.overheads.describe(stream)
        return out

    def streams(self) -> list[str]:
        """Streams declared on this node."""
        return self.node.streams()

    def versions(self, stream: str | None) -> dict[str, Any]:
        """The version constraint sets: the catalogues, this node's reports, the
        fleet's, and each job's handshake (of ``stream`` only, when given)."""
        if stream is not None:
            self.admission.known(stream)
        return results.versions_to_wire(self.node, [stream] if stream else self.node.streams())

    def status(self) -> dict[str, Any]:
        """Daemon status: identity, links, clients, counters."""
        return self._status()

    def report_save(
        self, stream: str, rank: int, blocking_s: float, interval_s: float | None
    ) -> dict[str, Any]:
        """Keep one save of ``rank`` for the checkpoint overhead figure
        (`convergenced.daemon.overhead`); nothing durable.

        Raises:
            ApiError: ``unknown_stream``, ``unknown_rank`` (not a rank this node hosts
                in the stream); nothing kept.
        """
        self.admission.known(stream)
        if rank not in self.node.spec(stream).ranks_of(self.node.node_id):
            raise ApiError(ErrorKind.REJECTED, "unknown_rank",
                           f"stream {stream!r}: rank {rank} is not hosted by "
                           f"{self.node.node_id}")  # fmt: skip
        if not self.overheads.tracks(stream):
            # A stream new to the figure: drop those undeclared since, so what is
            # kept never outgrows the declared streams.
            self.overheads.prune(self.node.streams())
        self.overheads.add(stream, rank, blocking_s, interval_s)
        return {"stream": stream, "rank": rank}

    # -- waiting ------------------------------------------------------------------

    async def wait(self, stream: str, epoch: int, timeout: float | None) -> dict[str, Any]:
        """The state once the restore point reaches ``epoch``.

        Raises:
            ApiError: ``timeout`` when it did not within ``timeout`` seconds.
        """
        with trio.move_on_after(math.inf if timeout is None else timeout):
            while True:
                self.admission.known(stream)  # again after every change: it may be undeclared
                rp = self.node.restore_point(stream)
                if rp is not None and rp >= epoch:
                    return self.state(stream)
                await self.hub.wait_changed()
        self.admission.known(stream)
        rp = self.node.restore_point(stream)
        raise ApiError(
            ErrorKind.TIMEOUT,
            "timeout",
            f"stream {stream!r}: restore point is {rp}, not yet {epoch}, after {timeout} s",
        )

    async def restore_point(
        self, stream: str, generation: int, timeout: float | None
    ) -> dict[str, Any]:
        """The restore point of recovery generation ``generation``.

        The first request for a generation freezes this node's recoverable set for
        it (once the node has heard from its peers, when it started without a log:
        `core.lives`); the answer comes once every member's frozen set is known, and
        is the same on every member (S2).
        """
        self.admission.known(stream)
        started = trio.current_time()
        froze = False
        with trio.move_on_after(math.inf if timeout is None else timeout):
            while True:
                try:
                    if not self.node.waiting_to_freeze(stream):
                        fact = self.node.freeze_fact(stream, generation)
                        if fact is not None:
                            self.submit(fact)
                            froze = True
                    answer = self.node.generation(stream, generation)
                except FactError as exc:
                    raise rejected(exc) from None
                if answer.resolved:
                    await self.durable()
                    if froze:
                        self.telemetry.recovered(stream, trio.current_time() - started)
                    return results.generation_to_wire(stream, answer)
                await self.hub.wait_changed()
        self.admission.known(stream)
        answer = self.node.generation(stream, generation)
        if answer.resolved:
            # Resolved in time, but the timeout ran out while its last facts were
            # being made durable (a poll with timeout 0): the answer stands.
            await self.durable()
            if froze:
                self.telemetry.recovered(stream, trio.current_time() - started)
            return results.generation_to_wire(stream, answer)
        unheard = self.node.waiting_to_freeze(stream)
        why = (f"this node has not heard from {', '.join(unheard)} since it started"
               if unheard else f"it still waits for the frozen sets of "
               f"{', '.join(answer.waiting_for)}")  # fmt: skip
        raise ApiError(
            ErrorKind.TIMEOUT,
            "timeout",
            f"stream {stream!r}: generation {generation} unresolved after {timeout} s: {why}",
        )

    async def next_generation(self, stream: str, timeout: float | None) -> dict[str, Any]:
        """The recovery generation a new launch of ``stream`` uses: one that no member
        has resolved or closed (`core.generations`, rule 6). One rank of the launch
        asks and hands the number to the others; asking changes nothing.

        Waits, like a freeze, until a node that started without a log has heard from
        its peers (`core.lives`). Works on a stream not declared here too (a spare
        about to take over ranks asks before it can declare the new member map).
        """
        with trio.move_on_after(math.inf if timeout is None else timeout):
            while True:
                try:
                    generation = self.node.next_generation(stream)
                except FactError as exc:
                    raise rejected(exc) from None
                if generation is not None:
                    await self.durable()
                    return {"stream": stream, "generation": generation}
                await self.hub.wait_changed()
        try:
            generation = self.node.next_generation(stream)
        except FactError as exc:
            raise rejected(exc) from None
        if generation is not None:  # found in time; the timeout ran out in the fsync
            await self.durable()
            return {"stream": stream, "generation": generation}
        unheard = ", ".join(self.node.waiting_to_freeze(stream))
        raise ApiError(
            ErrorKind.TIMEOUT,
            "timeout",
            f"stream {stream!r}: no new generation after {timeout} s: this node has not "
            f"heard from {unheard} since it started",
        )

    async def drain(
        self,
        node: str,
        streams: Sequence[str],
        checkpoint: bool,
        timeout: float | None,
        versions: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """Wait until ``node`` (this one) may go down for maintenance (`core.drain`):
        every stream it is a member of (or those of ``streams``) has a restore point
        at least its target that every member published. With ``checkpoint``, the
        jobs are asked for a new checkpoint (``checkpoint_requested`` in their state)
        and the target is that checkpoint. With ``versions`` (component -> version),
        the node is to move to those versions: every job of the node must accept
        them and every member have acknowledged that (`core.drain.judge_moves`).
        Returns the answer, ``safe`` false when ``timeout`` ran out first (the gate
        fails closed).

        Raises:
            ApiError: ``wrong_node`` (the gate answers for its own node only),
                ``unknown_stream``.
        """
        me = self.node.node_id
        if node != me:
            raise ApiError(ErrorKind.REJECTED, "wrong_node",
                           f"this daemon is {me}: ask the daemon of {node} whether it "
                           "may drain (only it knows every stream it is a member of)")  # fmt: skip
        for stream in streams:
            self.admission.known(stream)

        def statuses() -> list[Any]:
            declared = [s for s in self.node.streams() if not streams or s in streams]
            return member_streams(me, [self.node.status(s) for s in declared])

        targets = {s.stream: drain_target(s, checkpoint=checkpoint) for s in statuses()}
        asked = {name: t - 1 for name, t in targets.items() if checkpoint}
        for name, after in asked.items():
            self.checkpoints.ask(name, after)
        if asked:
            self.hub.view_changed()  # the watchers of those streams see the request
        try:

            def judged() -> Any:  # streams undeclared meanwhile drop out
                now = [s for s in statuses() if s.stream in targets]
                if not versions:  # a plain drain: no version handshake to read
                    return judge(me, now, targets)
                views = {s.stream: self.node.versions(s.stream) for s in now}
                return judge(me, now, targets, judge_moves(views, versions))

            with trio.move_on_after(math.inf if timeout is None else timeout):
                while not judged().safe:
                    await self.hub.wait_changed()
                await self.durable()
            answer = judged()
            self.telemetry.drain_answered(answer.safe)
            return results.drain_to_wire(answer)
        finally:
            for name, after in asked.items():
                self.checkpoints.withdraw(name, after)
            if asked:
                self.hub.view_changed()

    async def watch(self, stream: str, emit: Emit) -> None:
        """Emit the state now and after every change, until cancelled.

        Each event waits for the fsync of what it shows before the next state is
        taken, so a watcher sees at most one event per group commit. The watchers
        of one stream share its `StreamFeed`: one computation per change for all.
        """
        self.admission.known(stream)
        feed = self.feeds.get(stream)
        if feed is None:
            feed = self.feeds[stream] = StreamFeed(
                lambda: self.state(stream), self.hub.wait_changed, self.durable
            )
        feed.watchers += 1
        try:
            shown: Snapshot | None = None
            while True:
                shown = await feed.after(shown)
                emit(shown)
        finally:
            feed.watchers -= 1
            if not feed.watchers:
                del self.feeds[stream]


async def _no_drills(stream: str, epoch: int | None, domain: str | None) -> dict[str, Any]:
    raise ApiError(ErrorKind.UNAVAILABLE, "unavailable", "this daemon runs no drills")


def log_failed(exc: BaseException) -> ApiError:
    """The error every request gets once the log failed."""
    return ApiError(
        ErrorKind.UNAVAILABLE,
        "log_failed",
        f"the write-ahead log failed ({exc}); nothing was acknowledged, the daemon is stopping",
    )


# -- the table ----------------------------------------------------------------------

Args = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Operation:
    """One operation of the local API."""

    kind: OpKind
    run: Callable[[LocalOperations, Args, Emit], Any]
    """Returns the result (FACT and READ), or an awaitable of it (WAIT)."""


async def _wait(ops: LocalOperations, a: Args, emit: Emit) -> Any:
    return await ops.wait(a["stream"], a["epoch"], a["timeout"])


async def _restore_point(ops: LocalOperations, a: Args, emit: Emit) -> Any:
    return await ops.restore_point(a["stream"], a["generation"], a["timeout"])


async def _next_generation(ops: LocalOperations, a: Args, emit: Emit) -> Any:
    return await ops.next_generation(a["stream"], a["timeout"])


async def _drain(ops: LocalOperations, a: Args, emit: Emit) -> Any:
    return await ops.drain(a["node"], a["streams"], a["checkpoint"], a["timeout"], a["versions"])


async def _drill(ops: LocalOperations, a: Args, emit: Emit) -> Any:
    ops.admission.known(a["stream"])
    return await ops.drill(a["stream"], a["epoch"], a["domain"])


async def _watch(ops: LocalOperations, a: Args, emit: Emit) -> Any:
    await ops.watch(a["stream"], emit)


def _fact(ops: LocalOperations, a: Args, emit: Emit) -> Any:
    return ops.submit(a["fact"])


def _declare(ops: LocalOperations, a: Args, emit: Emit) -> Any:
    return ops.submit(a["fact"], allow_unknown_members=a["allow_unknown_members"])


def _report_save(ops: LocalOperations, a: Args, emit: Emit) -> Any:
    return ops.report_save(a["stream"], a["rank"], a["blocking_s"], a["interval_s"])


def _session(ops: LocalOperations, a: Args, emit: Emit) -> Any:
    raise AssertionError("answered by the session itself")  # pragma: no cover


OPERATIONS: dict[str, Operation] = {
    "declare": Operation(OpKind.FACT, _declare),
    "undeclare": Operation(OpKind.FACT, _fact),
    "commit": Operation(OpKind.FACT, _fact),
    "retract": Operation(OpKind.FACT, _fact),
    "retire": Operation(OpKind.FACT, _fact),
    "report_version": Operation(OpKind.FACT, _fact),
    "note_rollout": Operation(OpKind.FACT, _fact),
    "status": Operation(OpKind.READ, lambda ops, a, emit: ops.status()),
    "streams": Operation(OpKind.READ, lambda ops, a, emit: ops.streams()),
    "versions": Operation(OpKind.READ, lambda ops, a, emit: ops.versions(a["stream"])),
    "state": Operation(OpKind.READ, lambda ops, a, emit: ops.state(a["stream"])),
    "wait": Operation(OpKind.WAIT, _wait),
    "restore_point": Operation(OpKind.WAIT, _restore_point),
    "next_generation": Operation(OpKind.WAIT, _next_generation),
    "watch": Operation(OpKind.WAIT, _watch),
    "drain": Operation(OpKind.WAIT, _drain),
    "drill": Operation(OpKind.WAIT, _drill),
    "report_save": Operation(OpKind.NOTE, _report_save),
    "cancel": Operation(OpKind.SESSION, _session),
}
"""Every operation of the local API, by name."""
