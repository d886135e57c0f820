"""Saving at once when a drain of this node asks for a checkpoint.

Before a node goes down for maintenance, ``convergencectl gate NODE --checkpoint``
asks the jobs on it for a new checkpoint, and waits until every member has agreed
on it (see docs/maintenance.md). The request shows in the stream's state as
``checkpoint_requested`` (``{"after": E}``: a checkpoint newer than epoch E), so
on ``watch``. `SaveRequests` watches the stream in a background thread; the
training loop asks it at each step whether to save now::

    requests = SaveRequests(socket_path, "job")
    for step in range(start, steps):
        train_step()
        if step % save_every == 0 or requests.pending() is not None:
            checkpointer.save(step)
    requests.close()

Every rank of the job on the node sees the same request; ranks of the other
members see it only when their own node is drained too, so a save for a drain is
usually taken by the drained node's ranks first. That is enough for the gate,
which waits for the epoch to be recoverable on every member: the other members'
next scheduled save completes it, or the job saves on every rank when one rank
broadcasts the decision (as it would for any save decision taken on one rank).
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

from convergenced.client import Client
from convergenced.errors import ConvergencedError


class SaveRequests:
    """The pending drain checkpoint request of one stream, kept up to date by a
    watch in a daemon thread."""

    def __init__(self, socket: str | Path | None, stream: str) -> None:
        self._client = Client(socket)
        self._stream = stream
        self._after: int | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._watch, name=f"convergenced-save-requests-{stream}", daemon=True
        )
        self._thread.start()

    def pending(self) -> int | None:
        """The epoch a new checkpoint must exceed while a drain asks for one, else
        None."""
        with self._lock:
            return self._after

    def close(self) -> None:
        """Stop watching."""
        self._client.close()
        self._thread.join(timeout=10)

    def __enter__(self) -> SaveRequests:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _watch(self) -> None:
        # Ends when the client is closed (or the daemon is gone for good): a job
        # without its daemon saves on its own schedule, as before.
        with contextlib.suppress(ConvergencedError, OSError):
            for event in self._client.watch(self._stream):
                asked = event.get("checkpoint_requested")
                with self._lock:
                    self._after = None if asked is None else int(asked["after"])
