"""The marker: commits an unmodified framework's finished steps, and points its
"latest" file only at the restore point the daemons agreed on.

One `Marker` runs beside a job on each node (``convergenced marker``), for the ranks
that node hosts in the stream's spec. Each `Marker.poll`:

1. checks the steps it committed: a file of one that changed or vanished means the
   step is no longer what was committed (a step saved again in place, a disk
   cleaned by hand), so it is retracted for this node's ranks, or retired when the
   daemon lists it in ``safe_to_delete`` (another node's marker collected it);
2. looks at every other step directory and commits it, for each rank this node
   hosts, once complete in the framework's own format (`convergenced.markers.layouts`)
   and settled (`convergenced.markers.verify`), with the sha256 of the files the rank
   reads to restore it;
3. points the framework's "latest" file (and an optional plain step file) at the
   *target*, written atomically (temporary file, fsync, rename, directory fsync), or
   removes it when there is none; a "latest" the framework wrote itself after its
   save (DeepSpeed's and Megatron's rank 0 do) is put back on the next poll;
4. with ``gc``, deletes the steps the daemon lists in ``safe_to_delete`` below the
   target, retiring this node's ranks first.

**The target.** Without a generation: the stream's restore point as this node's
daemon publishes it (an epoch every rank of every member committed, and every member
proposed); when it rolls back (a retraction), the file rolls back with it. With a
generation (a relaunch: ``convergencectl next-generation`` asked once and handed to
every node's marker): the restore point of that recovery generation, the same on
every member (S2), *held* while the relaunched job starts and reads the file, until
the stream's restore point passes a step the marker had not seen when the generation
resolved (a step the new run saved: it has read the file by then), then it follows
the stream's restore point again. A held restore point that is lost (retracted) is
dropped at once for the stream's own, rolled back. Before the generation resolves,
the file follows the stream's restore point; start the job only once it resolved
(``convergenced marker --once --generation G``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from convergenced import fsutil
from convergenced.core.local_api_codec import ApiError, ErrorKind
from convergenced.integrations.store_api import in_intervals
from convergenced.markers.layouts import Layout
from convergenced.markers.verify import (
    DigestCache,
    Settler,
    Signature,
    signature,
    zip_complete,
)

__all__ = ["Committed", "Marker", "MarkerClient", "MarkerError", "PassReport"]

log = logging.getLogger("convergenced.marker")


class MarkerError(Exception):
    """Input the marker cannot work with (a directory it cannot read, a spec that
    does not name this node...): the message says which and why."""


class MarkerClient(Protocol):
    """What the marker needs of a client (`convergenced.client.Client` has it)."""

    def commit(
        self, stream: str, rank: int, domain: str, epoch: int, *, digest: str = "", size: int = 0
    ) -> dict[str, Any]: ...

    def retract(self, stream: str, rank: int, domain: str, epoch: int) -> dict[str, Any]: ...

    def retire(self, stream: str, rank: int, domain: str, epoch: int) -> dict[str, Any]: ...

    def state(self, stream: str) -> dict[str, Any]: ...

    def restore_point(
        self, stream: str, generation: int, timeout: float | None = None
    ) -> dict[str, Any]: ...


@dataclass
class Committed:
    """A step this marker committed: the files it checked and what it committed."""

    step: int
    signatures: dict[Path, Signature]
    digests: dict[int, tuple[str, int]]
    """Per rank of this node: (digest, size) as committed."""


@dataclass
class PassReport:
    """What one `Marker.poll` did."""

    committed: list[int] = field(default_factory=list)
    retracted: list[int] = field(default_factory=list)
    retired: list[int] = field(default_factory=list)
    deleted: list[int] = field(default_factory=list)
    waiting: dict[int, str] = field(default_factory=dict)
    """Steps not committed yet, with the first reason why."""
    target: int | None = None
    """The step the "latest" file points at after the pass (None: no file)."""
    unsettled: bool = False
    """Some step waits only for a file to hold still for the settle period."""
    reconciled: bool = False
    """The marker has checked what the daemon held for its ranks when it started
    (one settle period after its first pass; see `Marker.poll`)."""


class Marker:
    """Commits a framework's complete steps for this node's ranks and keeps its
    "latest" file on the agreed restore point (see the module docstring)."""

    def __init__(
        self,
        client: MarkerClient,
        layout: Layout,
        root: Path,
        *,
        stream: str,
        ranks: Sequence[int],
        domain: str,
        check_ranks: Sequence[int] | None = None,
        shared_dir: bool = True,
        settle: float = 2.0,
        generation: int | None = None,
        gc: bool = False,
        step_file: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """A marker for ``ranks`` (this node's) of ``stream``, watching ``root``.

        Args:
            client: a client of this node's daemon; the stream is declared already.
            layout: the framework's layout (`convergenced.markers.layouts.make_layout`).
            root: the framework's checkpoint directory (``--save``, ``save_dir``).
            ranks: the ranks this node hosts in the stream's spec: commits are theirs.
            domain: the persistence domain ``root`` is in (one the policy names).
            check_ranks: the ranks whose files must be complete before any commit:
                the whole saving world for a directory every node shares (the
                default), this node's ranks for node-local storage.
            shared_dir: ``root`` is one directory every node's marker watches (a
                parallel file system): gc deletes a whole step; False (node-local
                storage): only this node's ranks' files.
            settle: seconds a file must keep its size and mtime before it counts.
            generation: the recovery generation of this launch, or None (see the
                module docstring, "The target").
            gc: delete steps the daemon lists in ``safe_to_delete`` (retired first).
            step_file: a plain file also given the target step (NVRx's
                ``--ft-checkpoint-iteration-file``), or None.
            clock: a monotonic clock (the settle period); tests pass their own.
        """
        self.client = client
        self.layout = layout
        self.root = root
        self.stream = stream
        self.ranks = sorted(ranks)
        self.domain = domain
        self.check_ranks = sorted(check_ranks) if check_ranks is not None else self.ranks
        self.shared_dir = shared_dir
        self.generation = generation
        self.gc = gc
        self.step_file = step_file
        self.settler = Settler(settle, clock)
        self.digests = DigestCache()
        self.committed: dict[int, Committed] = {}
        self.refused: dict[int, str] = {}
        """Steps the daemon refused to take (retired before): never committed again."""
        self.resolved = generation is None
        """Whether the generation has resolved (True without one)."""
        self.held: int | None = None
        """The generation's restore point while it is held (see the module docstring)."""
        self._holding = False
        self._seen_at_resolve: set[int] = set()
        self._recommit = False
        self.target: int | None = None
        self._clock = clock
        self._settle = settle
        self._started: float | None = None
        self._unverified: set[int] | None = None

    # -- the daemon restarted -----------------------------------------------------------

    def reconnected(self, info: object = None) -> None:
        """Commit every committed step again at the next poll (a client reconnect
        hook: a daemon that lost its state learns again what this node holds)."""
        self._recommit = True

    # -- one pass -----------------------------------------------------------------------

    def poll(self) -> PassReport:
        """Check, commit, point "latest", collect: one pass (see the module docstring).

        Raises:
            MarkerError: the checkpoint directory cannot be listed.
            ApiError, DaemonUnreachable: the daemon refused or is gone.
        """
        report = PassReport()
        try:
            steps = self.layout.steps(self.root)
        except OSError as exc:
            raise MarkerError(f"{self.root}: cannot list the checkpoint directory: {exc}") from exc
        if self._recommit:
            self._recommit = False
            for c in list(self.committed.values()):
                self._commit_ranks(c.step, c.digests)
        before = self.client.state(self.stream)
        if self._started is None:
            self._started = self._clock()
            self._unverified = self._held_here(before)
        self._check_committed(steps, before.get("safe_to_delete") or [], report)
        for step, step_dir in sorted(steps.items()):
            if step in self.committed or step in self.refused:
                continue
            why = self._try_commit(step, step_dir)
            if why is None:
                report.committed.append(step)
            else:
                report.waiting[step] = why
                report.unsettled |= why.endswith("settling")
        report.reconciled = self._reconcile(report)
        state = self.client.state(self.stream)
        report.target = self._point(self._target(state, steps))
        if self.gc:
            self._collect(steps, state.get("safe_to_delete") or [], report)
        return report

    def _held_here(self, state: Mapping[str, Any]) -> set[int]:
        # What the daemon already counts as restorable on this node: commits of an
        # earlier marker process, perhaps of steps deleted or damaged since. Only
        # epochs a rollback may still reach matter (none below the rollback floor
        # can become a restore point again), which bounds the set.
        floor = state.get("rollback_floor")
        held: set[int] = set()
        for lo, hi in state.get("recoverable") or []:
            start = max(int(lo), int(floor)) if floor is not None else int(lo)
            held.update(range(start, int(hi) + 1))
        return held

    def _reconcile(self, report: PassReport) -> bool:
        """Retract what the daemon held for this node when the marker started and the
        disk does not hold whole: once every step had one settle period to count."""
        if self._unverified is None:
            return True
        assert self._started is not None
        if self._clock() - self._started < self._settle:
            return False
        for step in sorted(self._unverified):
            if step in self.committed or step in self.refused:
                continue
            why = report.waiting.get(step)
            if why is not None and why.endswith("settling"):
                return False  # decided at a later pass
        for step in sorted(self._unverified - set(self.committed) - set(self.refused)):
            for rank in self.ranks:
                self._call_allowing(("unknown_rank",), self.client.retract,
                                    self.stream, rank, self.domain, step)  # fmt: skip
            report.retracted.append(step)
            why = report.waiting.get(step, "not on disk")
            log.warning("step %d was held for ranks %s but is not whole on disk (%s): retracted",
                        step, _ranges(self.ranks), why)  # fmt: skip
        self._unverified = None
        return True

    def _check_committed(
        self, steps: Mapping[int, Path], safe: Sequence[Sequence[int]], report: PassReport
    ) -> None:
        for step, c in list(self.committed.items()):
            now = {p: signature(p) for p in c.signatures}
            if all(now[p] == sig for p, sig in c.signatures.items()):
                continue
            del self.committed[step]
            self.settler.forget(c.signatures)
            self.digests.forget(c.signatures)
            gone = all(sig is None for sig in now.values())
            if gone and in_intervals(step, safe) and self._retire(step):
                report.retired.append(step)
                log.info("step %d deleted (safe to delete): retired for ranks %s",
                         step, _ranges(self.ranks))  # fmt: skip
                continue
            for rank in self.ranks:
                self._call_allowing(("unknown_rank",), self.client.retract,
                                    self.stream, rank, self.domain, step)  # fmt: skip
            report.retracted.append(step)
            what = "deleted" if gone else "changed on disk"
            log.warning("step %d %s since it was committed: retracted for ranks %s",
                        step, what, _ranges(self.ranks))  # fmt: skip

    def _try_commit(self, step: int, step_dir: Path) -> str | None:
        files = self.layout.files(step_dir, self.check_ranks)
        if files.problems:
            return files.problems[0]
        names = files.all_files()
        if not names:
            return "no files expected"
        looks = {n: self.settler.look(step_dir / n) for n in names}
        for name in names:  # every file looked at first, so every settle clock runs
            sig = looks[name][0]
            if sig is None:
                return f"{name}: missing"
            if sig.size == 0:
                return f"{name}: empty"
        for name in names:
            if not looks[name][1]:
                return f"{name}: settling"
        for name in sorted(files.zip_files):
            why = zip_complete(step_dir / name)
            if why is not None:
                return f"{name}: {why}"
        own = self.layout.files(step_dir, self.ranks).by_rank
        sigs = {step_dir / n: looks[n][0] for n in names}
        try:
            for path in sigs:
                fsutil.fsync_file(path)
            for d in sorted({p.parent for p in sigs}):
                fsutil.fsync_dir(d)
            digests: dict[int, tuple[str, int]] = {}
            for rank in self.ranks:
                manifest = hashlib.sha256()
                size = 0
                for name in sorted(own[rank]):
                    path = step_dir / name
                    sig = sigs.get(path) or looks.get(name, (None, False))[0]
                    hexd = self.digests.sha256(path, sig) if sig is not None else None
                    if sig is None or hexd is None:
                        return f"{name}: changed while read"
                    manifest.update(f"{name}\0{sig.size}\0{hexd}\n".encode())
                    size += sig.size
                digests[rank] = (f"sha256:{manifest.hexdigest()}", size)
        except FileNotFoundError as exc:
            return f"{Path(exc.filename or '?').name}: vanished"
        if any(signature(p) != sig for p, sig in sigs.items()):
            return "a file changed while being verified: settling"
        if not self._commit_ranks(step, digests):
            return self.refused[step]
        self.committed[step] = Committed(step, dict(sigs), digests)  # type: ignore[arg-type]
        total = sum(s for _, s in digests.values())
        log.info("step %d complete: committed for ranks %s in %s (%d bytes)",
                 step, _ranges(self.ranks), self.domain, total)  # fmt: skip
        return None

    def _commit_ranks(self, step: int, digests: Mapping[int, tuple[str, int]]) -> bool:
        for rank, (digest, size) in sorted(digests.items()):
            try:
                self.client.commit(self.stream, rank, self.domain, step, digest=digest, size=size)
            except ApiError as exc:
                if exc.reason == "digest_conflict":
                    # The daemon holds other bytes of this step (saved again while no
                    # marker watched): those are gone; what is on disk now counts.
                    self.client.retract(self.stream, rank, self.domain, step)
                    self.client.commit(self.stream, rank, self.domain, step,
                                       digest=digest, size=size)  # fmt: skip
                    continue
                if exc.reason != "retired":
                    raise
                self.refused[step] = f"retired on this node: {exc}"
                self.committed.pop(step, None)
                log.warning("step %d not committed: %s", step, exc)
                return False
        return True

    def _retire(self, step: int) -> bool:
        for rank in self.ranks:
            try:
                self.client.retire(self.stream, rank, self.domain, step)
            except ApiError as exc:
                if exc.reason == "not_safe_to_delete":
                    return False
                raise
        return True

    def _call_allowing(self, reasons: tuple[str, ...], fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except ApiError as exc:
            if exc.reason not in reasons:
                raise

    # -- the target and the latest file ---------------------------------------------------

    def resolve(self, timeout: float | None) -> bool:
        """Ask the generation's restore point, waiting at most ``timeout`` seconds.

        Returns whether it resolved (always True without a generation). Freezes this
        node's recoverable set for the generation at the first ask: call it once the
        steps on disk are committed (a first poll after the settle period).
        """
        if self.resolved or self.generation is None:
            return True
        try:
            answer = self.client.restore_point(self.stream, self.generation, timeout)
        except ApiError as exc:
            if exc.kind is ErrorKind.TIMEOUT:
                return False
            raise
        if not answer.get("resolved", False):
            return False
        self.resolved = True
        rp = answer.get("restore_point")
        self.held = None if rp is None else int(rp)
        self._holding = not answer.get("lost", False)
        try:
            self._seen_at_resolve = set(self.layout.steps(self.root))
        except OSError:
            self._seen_at_resolve = set()
        log.info("generation %d resolved: restore point %s, held until the job saves a new step",
                 self.generation, self.held)  # fmt: skip
        return True

    def _target(self, state: Mapping[str, Any], steps: Mapping[int, Path]) -> int | None:
        live = state.get("restore_point")
        live = None if live is None else int(live)
        if not self._holding:
            return live
        assert self.generation is not None
        answer = self.client.restore_point(self.stream, self.generation, 0)
        if answer.get("lost"):
            self._holding = False
            log.warning("generation %d's restore point %s was lost: following the stream's, %s",
                        self.generation, self.held, live)  # fmt: skip
            return live
        newer = live is not None and (self.held is None or live > self.held)
        if newer and live not in self._seen_at_resolve:
            self._holding = False
            log.info("the job saved step %d since its launch: following the stream's "
                     "restore point", live)  # fmt: skip
            return live
        return self.held

    def _point(self, target: int | None) -> int | None:
        if target != self.target:
            old = self.target
            if old is not None and target is not None and target < old:
                log.warning("restore point rolled back: latest %d -> %d", old, target)
            elif target is None and old is not None:
                log.warning("no restore point any more: latest file removed (was %d)", old)
            else:
                log.info("latest -> %s", target)
        self.target = target
        latest = self.root / self.layout.latest_name
        want = None if target is None else self.layout.latest_text(target)
        self._put(latest, want, self.layout.read_latest)
        if self.step_file is not None:
            text = None if target is None else f"{target}\n".encode()
            self._put(self.step_file, text, _read_step)
        return target

    def _put(self, path: Path, want: bytes | None, names: Callable[[bytes], int | None]) -> None:
        try:
            have: bytes | None = path.read_bytes()
        except FileNotFoundError:
            have = None
        if have == want:
            return
        if want is not None:
            fsutil.write_atomic(path, want)
        elif have is not None and names(have) is not None:
            # It names a step the daemons did not agree on (the framework wrote it).
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            fsutil.fsync_dir(path.parent)

    # -- garbage collection ---------------------------------------------------------------

    def _collect(
        self, steps: Mapping[int, Path], safe: Sequence[Sequence[int]], report: PassReport
    ) -> None:
        floor = min((s for s in (self.target, self.held) if s is not None), default=None)
        if floor is None:
            return
        for step, step_dir in sorted(steps.items()):
            if step >= floor or not in_intervals(step, safe):
                continue
            c = self.committed.pop(step, None)
            if c is not None and not self._retire(step):
                self.committed[step] = c
                continue
            self._delete(step_dir)
            if c is not None:
                self.settler.forget(c.signatures)
                self.digests.forget(c.signatures)
            report.deleted.append(step)
            log.info("step %d deleted: the daemon lists it safe to delete", step)

    def _delete(self, step_dir: Path) -> None:
        if self.shared_dir:
            shutil.rmtree(step_dir, ignore_errors=True)
        else:
            for name in self.layout.files(step_dir, self.ranks).all_files():
                with contextlib.suppress(FileNotFoundError):
                    (step_dir / name).unlink()
            for d in [*sorted(step_dir.rglob("*"), reverse=True), step_dir]:
                with contextlib.suppress(OSError):
                    d.rmdir()
        with contextlib.suppress(OSError):
            fsutil.fsync_dir(self.root)


def _read_step(data: bytes) -> int | None:
    text = data.decode(errors="replace").strip()
    return int(text) if text.isascii() and text.isdigit() else None


def _ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5``."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
