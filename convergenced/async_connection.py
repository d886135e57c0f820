"""The trio client's connection: frames queued for one writer, and reply boxes.

`AsyncClient` (`convergenced.async_client`) sends every request through a
`Connection` and waits for its reply in a `ReplyBox`. Both exist for what they
save at tens of thousands of calls a second on one connection, measured with 64
tasks committing (benchmarks/bench_daemon.py): one ``send_all`` per scheduling
round instead of one per request, and a reply handed over without a memory channel
or a checkpoint of the read loop per reply. Imported by the client on first use:
trio is only needed by AsyncClient users.
"""

from __future__ import annotations

from typing import Any

import trio


class Connection:
    """One connection: its stream, and the frames waiting to be sent on it.

    Callers queue their frames and one writer task (`write_loop`) sends everything
    queued in one ``send_all``: 64 tasks committing on one connection make one
    system call per round instead of 64, and a cancelled caller can never cut a
    frame in half (it never sends anything itself).
    """

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._frames: list[bytes] = []
        self._ready = trio.Event()
        self._closed = False

    def send(self, frame: bytes) -> None:
        """Queue ``frame``; it leaves after every frame queued before it."""
        if not self._closed:
            self._frames.append(frame)
            self._ready.set()

    def close(self) -> None:
        """Send nothing more: the writer ends, what is queued is dropped."""
        self._closed = True
        self._frames = []
        self._ready.set()

    async def write_loop(self) -> None:
        """The writer task: send what is queued until the connection ends."""
        while True:
            await self._ready.wait()
            self._ready = trio.Event()
            if self._closed:
                return
            frames, self._frames = self._frames, []
            try:
                await self.stream.send_all(b"".join(frames))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.close()  # the read loop sees the connection end
                return


class ReplyBox:
    """Where the one reply of a call goes: the calling task parks until it is put.

    Lighter than a memory channel (one object, no lock, no checkpoint for the read
    loop to hand a reply over). Single-use.
    """

    __slots__ = ("_closed", "_task", "_value")

    def __init__(self) -> None:
        self._value: Any = None
        self._closed = False
        self._task: Any = None

    def put(self, reply: Any) -> None:
        """Hand over the reply (the read loop does); wakes the caller."""
        if self._value is None and not self._closed:
            self._value = reply
            self._wake()

    def close(self) -> None:
        """No reply will come (`get` returns None)."""
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            trio.lowlevel.reschedule(task)

    async def get(self) -> Any:
        """The reply; None once closed without one. A checkpoint, cancellable."""
        if self._value is None and not self._closed:
            self._task = trio.lowlevel.current_task()

            def abort(_: Any) -> trio.lowlevel.Abort:
                self._task = None
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
        else:
            await trio.lowlevel.checkpoint()
        return self._value
