"""The operations of the local API, independent of how requests arrive.

Each method takes validated arguments (see `convergenced.core.api`) and returns the
result map, or raises `ApiError`. Facts are applied to the core in memory, appended
to the journal and acknowledged only after `Journal.durable`; every answer that
reveals state is likewise sent only after it, so no client ever sees a state that a
crash could take back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import trio

from convergenced.core import api
from convergenced.core.api import ApiError, ErrorKind
from convergenced.core.errors import FactError, SpecConflictError, SpecError
from convergenced.core.facts import Commit, Declare, Fact, Retire, Retract
from convergenced.core.node import NodeCore
from convergenced.daemon.journal import Journal
from convergenced.daemon.peers import PeerHub


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


class Service:
    """Local API operations over one node."""

    def __init__(
        self,
        node: NodeCore,
        journal: Journal,
        hub: PeerHub,
        *,
        max_streams: int,
        max_members: int = 4096,
        status: Callable[[], dict[str, Any]],
        on_fact: Callable[[Fact], None] | None = None,
        on_refused: Callable[[Fact, str], None] | None = None,
        on_recovery: Callable[[str, float], None] | None = None,
    ) -> None:
        self.node = node
        self.journal = journal
        self.hub = hub
        self.max_streams = max_streams
        self.max_members = max_members
        self._status = status
        self._on_fact = on_fact
        self._on_refused = on_refused
        self._on_recovery = on_recovery

    # -- facts ------------------------------------------------------------------

    async def submit(self, fact: Fact) -> dict[str, Any]:
        """Apply, log and make ``fact`` durable; the reply acknowledges it."""
        result = self.apply(fact)
        await self.durable()
        return result

    def apply(self, fact: Fact) -> dict[str, Any]:
        """Apply and log ``fact`` now; return the reply to send once `durable` returned.

        Synchronous, so a connection can apply a whole batch of requests and
        acknowledge them all after one `durable` (see `local_api`).

        Raises:
            ApiError: ``rejected``; nothing changed.
        """
        try:
            self._admit(fact)
            try:
                self.node.apply(fact)
            except (FactError, SpecError, SpecConflictError) as exc:
                raise rejected(exc) from None
        except ApiError as err:
            if self._on_refused is not None:
                self._on_refused(fact, err.reason)
            raise
        self.journal.record(fact)
        if self._on_fact is not None:
            self._on_fact(fact)
        self.hub.view_changed()
        if isinstance(fact, Declare):
            return {"stream": fact.spec.name, "digest": fact.spec.digest.hex()}
        if isinstance(fact, Commit | Retract | Retire):
            return {"stream": fact.stream, "epoch": fact.epoch, "durable": True}
        return {"stream": fact.stream, "durable": True}

    async def durable(self) -> None:
        """Wait until everything applied so far is on disk.

        Raises:
            ApiError: ``unavailable``/``log_failed`` when the log failed.
        """
        try:
            await self.journal.durable()
        except OSError as exc:
            raise ApiError(
                ErrorKind.UNAVAILABLE,
                "log_failed",
                f"the write-ahead log failed ({exc}); nothing was acknowledged, the daemon "
                "is stopping",
            ) from None

    def _admit(self, fact: Fact) -> None:
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
            if name not in self.node.streams() and len(self.node.streams()) >= self.max_streams:
                raise ApiError(
                    ErrorKind.REJECTED,
                    "too_many_streams",
                    f"stream {name!r}: this node already holds {self.max_streams} streams "
                    "(limits.max_streams)",
                )
        elif isinstance(fact, Retire):
            # Retire records a deletion the daemon allowed. Deleting anything else
            # is a loss, which `retract` reports (and which may roll back).
            self._known(fact.stream)
            if fact.epoch not in self.node.safe_to_delete(fact.stream):
                raise ApiError(
                    ErrorKind.REJECTED,
                    "not_safe_to_delete",
                    f"stream {fact.stream!r}: epoch {fact.epoch} is not safe to delete yet "
                    "(see safe_to_delete in state); if its data is already gone, retract it",
                )

    def _known(self, stream: str) -> None:
        try:
            self.node.spec(stream)
        except FactError as exc:
            raise rejected(exc) from None

    # -- reads ------------------------------------------------------------------

    async def state(self, stream: str) -> dict[str, Any]:
        """The state of ``stream`` as this node sees it (durable before returned)."""
        self._known(stream)
        # Read first, then wait for the disk: whatever is applied while we wait may
        # not be durable yet, and must not show.
        current = api.status_to_wire(self.node.status(stream))
        await self.durable()
        return current

    async def streams(self) -> list[str]:
        """Streams declared on this node."""
        return self.node.streams()

    async def status(self) -> dict[str, Any]:
        """Daemon status: identity, links, clients."""
        return self._status()

    # -- waiting ------------------------------------------------------------------

    async def wait(self, stream: str, epoch: int, timeout: float | None) -> dict[str, Any]:
        """Return the state once the restore point reaches ``epoch``.

        Raises:
            ApiError: ``timeout`` when it did not within ``timeout`` seconds.
        """
        self._known(stream)
        with trio.move_on_after(math.inf if timeout is None else timeout):
            while True:
                rp = self.node.restore_point(stream)
                if rp is not None and rp >= epoch:
                    return await self.state(stream)
                await self.hub.wait_changed()
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
        it (durably, before it is published); the answer comes once every member's
        frozen set is known, and is the same on every member (S2).
        """
        try:
            fact = self.node.freeze_fact(stream, generation)
        except FactError as exc:
            raise rejected(exc) from None
        started = trio.current_time()
        if fact is not None:
            await self.submit(fact)
        with trio.move_on_after(math.inf if timeout is None else timeout):
            while True:
                try:
                    answer = self.node.generation(stream, generation)
                except FactError as exc:
                    raise rejected(exc) from None
                if answer.resolved:
                    self.hub.view_changed()
                    await self.durable()
                    if fact is not None and self._on_recovery is not None:
                        self._on_recovery(stream, trio.current_time() - started)
                    return api.generation_to_wire(stream, answer)
                await self.hub.wait_changed()
        answer = self.node.generation(stream, generation)
        raise ApiError(
            ErrorKind.TIMEOUT,
            "timeout",
            f"stream {stream!r}: generation {generation} still waits for the frozen sets "
            f"of {', '.join(answer.waiting_for)} after {timeout} s",
        )

    async def watch(self, stream: str, emit: Callable[[dict[str, Any]], None]) -> None:
        """Emit the state now and after every change, until cancelled."""
        self._known(stream)
        last: dict[str, Any] | None = None
        while True:
            current = api.status_to_wire(self.node.status(stream))
            if current != last:
                await self.durable()
                emit(current)
                last = current
            await self.hub.wait_changed()
