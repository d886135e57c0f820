"""Background verification: the daemon reads its ranks' retained checkpoints again and
retracts what no longer matches its commit (docs/verification.md).

Where it runs, and why one per node suffices: a commit may carry the *location* of its
bytes (`convergenced.core.locations`), kept by the node beside the digest and size, so
the daemon that holds the commit knows where to look and what to expect, whatever the
integration or the store layout. Each node verifies the commits of its own ranks, in
every domain (a shared file system or an object store included), and no node reads
another's: the verifiers of a cluster cover every rank exactly once.

What a pass checks: every epoch this node's ranks hold with a location that the
protocol still keeps (not in ``safe_to_delete``: a checkpoint being garbage collected
may vanish at any time), the restore point first, then the newest first. Reads go
through one `Throttle`, the ``[verification]`` bandwidth cap, in a worker thread.

What it does with the outcome:

* ``ok``: the bytes hash to the committed digest and size;
* ``mismatch``, ``missing``, ``corrupt``: evidence against the bytes. The epoch is
  retracted for that rank and domain at once, through the local API's own path
  (`LocalOperations.submit`: logged, fsynced, gossiped), exactly as if the job had
  reported the loss; with an all-of policy the restore point then rolls back on every
  member, with an any-of policy another domain's copy may keep it. Logged as a
  warning and counted;
* ``unreadable`` (no reader for the URL's scheme, a permission or network error) and
  ``unchecked`` (a digest of an algorithm the verifier does not compute): no evidence,
  nothing retracted; counted, so an operator sees a verifier that cannot do its job.

A commit that changed while it was read (committed again, retired, retracted, the
stream undeclared) is left alone: the outcome is about bytes the node no longer
vouches for.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Final, TypeVar

import structlog
import trio
from prometheus_client import CollectorRegistry, Counter

from convergenced.core.errors import UnknownStreamError
from convergenced.core.facts import Commit, Retract
from convergenced.core.local_api_codec import ApiError
from convergenced.core.locations import Location
from convergenced.core.node import NodeCore
from convergenced.daemon.metrics import spec
from convergenced.daemon.verification.config import VerificationConfig
from convergenced.daemon.verification.digests import (
    Corrupt,
    Missing,
    Throttle,
    Unreadable,
    measure,
)

__all__ = ["EVIDENCE", "OUTCOMES", "Check", "Outcome", "Verifier"]

log = structlog.get_logger("convergenced.verification")

OUTCOMES: Final = ("ok", "mismatch", "missing", "corrupt", "unreadable", "unchecked")
EVIDENCE: Final = frozenset(("mismatch", "missing", "corrupt"))
"""Outcomes that retract the epoch."""
_T = TypeVar("_T")
BlockingRunner = Callable[[Callable[[], _T]], Awaitable[_T]]


@dataclass(frozen=True, slots=True)
class Check:
    """One held epoch of one of this node's ranks, and what its commit said."""

    stream: str
    rank: int
    domain: str
    epoch: int
    location: Location
    digest: str
    size: int
    text: str
    """The location as the node keeps it (to see whether the commit changed)."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one check found."""

    check: Check
    result: str
    """One of `OUTCOMES`."""
    detail: str
    bytes_read: int
    seconds: float
    retracted: bool = False


@dataclass(slots=True)
class _RestorePointWatch:
    """Per (stream, domain): the restore point the verifier last saw, since when, and
    when it last passed verification in the domain."""

    epoch: int
    since: float
    verified_at: float | None = None


async def _in_thread(fn: Callable[[], _T]) -> _T:
    return await trio.to_thread.run_sync(fn, abandon_on_cancel=True)


class Verifier:
    """The background verifier of one daemon (see the module docstring)."""

    def __init__(
        self,
        node: NodeCore,
        submit: Callable[[Retract], object],
        durable: Callable[[], Awaitable[None]],
        registry: CollectorRegistry,
        config: VerificationConfig,
        *,
        clock: Callable[[], float] = trio.current_time,
        run_blocking: Callable[[Callable[[], Any]], Awaitable[Any]] = _in_thread,
    ) -> None:
        """Args:
        submit: applies a retraction as the local API does (`LocalOperations.submit`).
        durable: waits until what was applied is on disk.
        run_blocking: how a read runs; default a worker thread (tests run it inline).
        """
        self.node = node
        self.config = config
        self._submit = submit
        self._durable = durable
        self._clock = clock
        self._run_blocking = run_blocking
        self.throttle = Throttle(config.bytes_per_s)
        v, b = spec("verifications"), spec("verified_bytes")
        self.outcomes = Counter(v.name, v.help, list(v.labels), registry=registry)
        self.bytes = Counter(b.name, b.help, list(b.labels), registry=registry)
        self._watches: dict[tuple[str, str], _RestorePointWatch] = {}
        self.passes = 0
        """Passes completed."""
        self.last: dict[tuple[str, str], Outcome] = {}
        """Per (stream, domain), the last outcome."""

    # -- what to check ---------------------------------------------------------------

    def plan(self) -> list[Check]:
        """Every check of one pass, in order (see the module docstring)."""
        checks: list[Check] = []
        for stream in self.node.streams():
            try:
                safe = self.node.safe_to_delete(stream)
                rp = self.node.restore_point(stream)
                held = self.node.located(stream)
            except UnknownStreamError:
                continue
            here = []
            for rank, domain, epoch, content in held:
                if epoch in safe:
                    continue
                try:
                    loc = Location.from_text(content.location)
                except ValueError:
                    continue  # not one of ours (the core keeps it opaque)
                here.append(Check(stream, rank, domain, epoch, loc, content.digest,
                                  content.size, content.location))  # fmt: skip
            here.sort(key=lambda c: (c.epoch != rp, -c.epoch, c.rank, c.domain))
            checks.extend(here)
        return checks

    # -- running ---------------------------------------------------------------------

    async def run(self) -> None:
        """Verify every ``period_s`` until cancelled (returns at once when disabled)."""
        if not self.config.enabled:
            return
        while True:
            started = self._clock()
            await self.verify_pass()
            await trio.sleep_until(started + self.config.period_s)

    async def verify_pass(self) -> list[Outcome]:
        """One pass: every check of `plan`, then the restore points' verification times."""
        outcomes = [await self.verify(check) for check in self.plan()]
        self._note_restore_points(outcomes)
        self.passes += 1
        return outcomes

    async def verify(self, check: Check) -> Outcome:
        """Read ``check``'s bytes, judge them, count, and retract on evidence."""
        start = self._clock()
        result, detail, size = await self.read(check, self.throttle)
        self.outcomes.labels(domain=check.domain, outcome=result).inc()
        self.bytes.labels(domain=check.domain).inc(size)
        retracted = result in EVIDENCE and await self.retract(check, result, detail)
        out = Outcome(check, result, detail, size, self._clock() - start, retracted)
        self.last[(check.stream, check.domain)] = out
        return out

    async def read(
        self, check: Check, throttle: Throttle, into: Path | None = None
    ) -> tuple[str, str, int]:
        """``(outcome, detail, bytes read)`` of reading ``check``'s bytes through
        ``throttle`` (restoring them into ``into``, a folder, when given): one of
        `OUTCOMES`, never an exception."""
        try:
            digest, size = await self._run_blocking(
                partial(measure, check.location, throttle, into)
            )
        except Missing as exc:
            return "missing", str(exc), 0
        except Corrupt as exc:
            return "corrupt", str(exc), 0
        except Unreadable as exc:
            return "unreadable", str(exc), 0
        except Exception as exc:  # a reader's own bug (fsspec, a filesystem): never fatal
            log.error("verification: the reader failed", url=check.location.url, error=repr(exc))
            return "unreadable", f"{check.location.url}: {exc!r}", 0
        return (*self.judge(check, digest, size), size)

    @staticmethod
    def judge(check: Check, digest: str, size: int) -> tuple[str, str]:
        """The outcome, and why, of reading ``digest`` and ``size`` for ``check``."""
        if check.digest and not check.digest.startswith("sha256:"):
            return "unchecked", f"digest {check.digest.split(':')[0]} not computed"
        if check.digest and digest != check.digest:
            return "mismatch", f"digest {digest}, committed {check.digest}"
        if check.size and size != check.size:
            return "mismatch", f"{size} bytes, committed {check.size}"
        return "ok", ""

    def _still_held(self, check: Check) -> bool:
        try:
            c = self.node.content(Commit(check.stream, check.rank, check.domain, check.epoch))
        except UnknownStreamError:
            return False
        return c is not None and c.location == check.text and c.digest == check.digest

    async def retract(self, check: Check, result: str, detail: str) -> bool:
        """Retract ``check``'s epoch for its rank and domain on evidence ``result``,
        unless its commit changed since it was read; whether it was retracted."""
        if not self._still_held(check):
            return False  # changed while it was read: not the bytes we judged
        fact = Retract(check.stream, check.rank, check.domain, check.epoch)
        try:
            self._submit(fact)
        except ApiError as exc:
            log.info("verification: retraction refused", stream=check.stream,
                     epoch=check.epoch, reason=exc.reason)  # fmt: skip
            return False
        await self._durable()
        log.warning("checkpoint failed verification: retracted", stream=check.stream,
                    rank=check.rank, domain=check.domain, epoch=check.epoch,
                    outcome=result, detail=detail, url=check.location.url)  # fmt: skip
        return True

    # -- figures ---------------------------------------------------------------------

    def _note_restore_points(self, outcomes: list[Outcome]) -> None:
        """Per (stream, domain) holding the restore point with a location: passed
        when every check of it this pass was ``ok``."""
        now = self._clock()
        verdict: dict[tuple[str, str, int], bool] = {}
        for o in outcomes:
            key = (o.check.stream, o.check.domain, o.check.epoch)
            verdict[key] = verdict.get(key, True) and o.result == "ok"
        for (stream, domain, epoch), passed in verdict.items():
            w = self._watch(stream, domain, epoch, now)
            if w is not None and passed:
                w.verified_at = now

    def _watch(self, stream: str, domain: str, epoch: int, now: float) -> _RestorePointWatch | None:
        try:
            rp = self.node.restore_point(stream)
        except UnknownStreamError:
            return None
        if rp != epoch:
            return None
        w = self._watches.get((stream, domain))
        if w is None or w.epoch != rp:
            w = self._watches[(stream, domain)] = _RestorePointWatch(rp, now)
        return w

    def describe(self, stream: str) -> dict[str, Any]:
        """The ``verification`` part of the state map: per domain where this node's
        ranks hold epochs with a location, ``restore_point`` (the one watched),
        ``verified`` (whether it passed at least once), ``age_s`` (seconds since it
        last passed, or since the verifier first saw it as the restore point if it
        has not yet) and the last outcome and its epoch."""
        now = self._clock()
        try:
            rp = self.node.restore_point(stream)
            domains = sorted({d for _, d, _, _ in self.node.located(stream)})
        except UnknownStreamError:
            return {}
        out: dict[str, Any] = {}
        for domain in domains:
            w = self._watches.get((stream, domain))
            if rp is not None and (w is None or w.epoch != rp):
                w = self._watches[(stream, domain)] = _RestorePointWatch(rp, now)
            last = self.last.get((stream, domain))
            out[domain] = {
                "restore_point": rp,
                "verified": w is not None and w.verified_at is not None,
                "age_s": None if w is None or rp is None else now - (w.verified_at or w.since),
                "last_outcome": None if last is None else last.result,
                "last_epoch": None if last is None else last.check.epoch,
            }
        return out
