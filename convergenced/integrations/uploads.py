"""The background uploader of a `convergenced.integrations.files.CheckpointStore`.

An `Uploader` runs one function, the store's upload of one epoch (copy to the remote
tier, verify, commit the remote domain), for each epoch queued, in order, on a thread
of its own, after a delay that models an object store's lag. It counts what is
pending, so that `flush` can wait for it, and keeps the failures until `flush`
reports them. What an upload does, and how it keeps out of the way of garbage
collection, is the store's: this module only runs it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from convergenced.integrations.errors import UploadError

__all__ = ["Uploader"]


class Uploader:
    """A thread that runs ``upload(epoch)`` for every epoch `put`, one at a time."""

    def __init__(
        self, upload: Callable[[int], None], delay: float | Callable[[int], float], name: str
    ) -> None:
        """``delay``: seconds to wait before each upload (a number, or a function of
        the epoch); ``name``: the thread's (started at the first `put`)."""
        self._upload = upload
        self._delay = delay
        self._name = name
        self._cond = threading.Condition()
        self._queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._pending = 0
        self._failures: list[tuple[int, BaseException]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def stopped(self) -> bool:
        """Whether `stop` was called: an upload that has not started yet must not."""
        return self._stop.is_set()

    @property
    def pending(self) -> int:
        """Uploads queued and not finished yet."""
        with self._cond:
            return self._pending

    def put(self, epoch: int) -> None:
        """Queue the upload of ``epoch``."""
        with self._cond:
            self._pending += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()
        self._queue.put(epoch)

    def _loop(self) -> None:
        while True:
            epoch = self._queue.get()
            if epoch is None:
                return
            try:
                if not self._stop.is_set():
                    delay = self._delay(epoch) if callable(self._delay) else self._delay
                    if delay <= 0 or not self._stop.wait(delay):
                        self._upload(epoch)
            except Exception as exc:
                with self._cond:
                    self._failures.append((epoch, exc))
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every upload queued so far has finished.

        Raises:
            TimeoutError: uploads are still pending after ``timeout`` seconds.
            UploadError: uploads failed since the last `flush` (each failure is
                reported once).
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._pending == 0, timeout):
                raise TimeoutError(f"{self._pending} upload(s) still pending after {timeout} s")
            failures, self._failures = self._failures, []
        if failures:
            raise UploadError(failures)

    def stop(self) -> None:
        """Drop the uploads not started yet, wait for the one running, end the thread."""
        self._stop.set()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
