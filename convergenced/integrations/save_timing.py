"""Timing the saves a training loop waits for, for the checkpoint overhead figure.

An integration that drives the saves (`convergenced.integrations.dcp.DcpCheckpointer`,
torchtitan's manager) wraps the part of each save the training loop waits for in
`SaveTimer.timing`; the timer reports it, with the time since the rank's previous
save started, to the local daemon (``report_save``), which turns the recent saves
into ``convergenced_checkpoint_overhead_ratio`` (docs/verification.md).

Reporting never gets in the way of training: the report is sent without waiting for
the reply, only while the client is connected (never waiting for a reconnect), and
any failure is logged at debug level and dropped. A save that raises is not
reported (its error goes to the loop as before).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

logger = logging.getLogger(__name__)


class SaveTimer:
    """Times one rank's saves of one stream and reports them, best effort."""

    def __init__(
        self,
        client: Any,
        stream: str,
        rank: int,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """A timer reporting through ``client`` (a `convergenced.client.Client`; a
        client without ``report_save_nowait`` gets no reports)."""
        self.client = client
        self.stream = stream
        self.rank = rank
        self._clock = clock
        self._previous: float | None = None
        """When the previous save started (None: none yet)."""
        self._pending: Any = None
        """The reply of the last report, read (never waited for) at the next one."""
        self.extra_s = 0.0
        """Blocking seconds outside the timed part (a staging wait after the save
        returned), added to the next save reported."""
        self.reported = 0
        """Saves reported (sent) so far."""

    @contextmanager
    def timing(self) -> Iterator[None]:
        """Time the block as one save and report it when the block returns."""
        started = self._clock()
        yield
        self.saved(started, self._clock() - started)

    def saved(self, started: float, blocking_s: float) -> None:
        """Report a save that started at ``started`` (the timer's clock) and held the
        training loop for ``blocking_s`` seconds. Never raises."""
        interval = None if self._previous is None else max(0.0, started - self._previous)
        self._previous = started
        blocking, self.extra_s = blocking_s + self.extra_s, 0.0
        try:
            self._collect()
            send = getattr(self.client, "report_save_nowait", None)
            if send is None:
                return
            self._pending = send(self.stream, self.rank, max(0.0, blocking), interval)
            self.reported += 1
        except Exception as exc:  # a figure, never a reason to stop training
            logger.debug("stream %r rank %d: save not reported: %s", self.stream, self.rank, exc)

    def _collect(self) -> None:
        """Log the outcome of the last report if it came (without waiting for it)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if not pending.done():
            return  # no answer yet: dropped, the figure does not need it
        try:
            pending.result(0)
        except Exception as exc:
            logger.debug("stream %r rank %d: a save report was refused: %s",
                         self.stream, self.rank, exc)  # fmt: skip
