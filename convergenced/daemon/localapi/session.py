"""One connected client process: a reader, a writer, and every reply through the gate.

The reader runs facts and reads inline, in the order they arrive (see
`operations`); consecutive commits are applied together, with those other sessions
read in the same scheduling round (`batching`), before anything after them is
served. Waits get a task each, at most ``limits.client_queue`` at a time.
Every reply, error replies included, is queued on the session's gated output the
moment it is made, so it leaves only once every fact it may reveal is durable: a
refusal that only makes sense given an earlier declaration of the same read waits
for that declaration's fsync like the acknowledgement would. The writer sends what
the gate releases, everything releasable in one write, and waits for the group
commit when nothing is.

Decoding is bounded and shared fairly: the codec refuses a frame that would cost
more to decode than any request can (see `local_api_codec.DecodeBudget`); a frame
larger than `HEAVY_FRAME_BYTES` is decoded and parsed under a lock every session
of the daemon shares, held afterwards for as long again as the work took, so
however many clients send large frames, they get at most half of the event loop,
one frame at a time; and the reader lets the others run after each `SLICE_BYTES`
of small frames. A well-behaved commit then waits for about one frame of someone
else's work, not for all of it.

Backpressure and stuck clients: the reader stops reading while the replies it
queued reach ``limits.client_queue``. A client whose replies pile up that high
while its socket takes no bytes for `SEND_STALL_S` has stopped reading: that client
alone is disconnected (``client_too_slow``), so one stuck process can never stall
the daemon or any other client. A busy client that pipelines hundreds of commits
and reads its acknowledgements is never cut: the writer sends in pieces of
`SEND_PIECE_BYTES`, and any piece taken counts as reading. Replies waiting for an
fsync never make a client look stuck: only a send that does not move does.

A connection that ends (end of stream or an error on read, a client killed with
a watch open) ends its waits and watches at once, unanswered: nothing would read
their replies, and a watch of a quiet stream would otherwise hold the session and
its descriptor forever (a thousand killed watchers used to fill
``limits.max_clients``). Facts already read still get their acknowledgement
flushed (a client that only half-closed reads it), then the session closes. The
same holds when the daemon hangs up on a frame it cannot resynchronize after.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
import trio

from convergenced.core import local_api_codec as codec
from convergenced.core.gate import OutputGate
from convergenced.core.local_api_codec import ApiError, ErrorKind, Request
from convergenced.daemon.config import Limits
from convergenced.daemon.localapi.batching import CommitBatcher
from convergenced.daemon.localapi.operations import (
    OPERATIONS,
    LocalOperations,
    OpKind,
    log_failed,
)
from convergenced.daemon.localapi.watches import Snapshot
from convergenced.daemon.telemetry import Telemetry

log = structlog.get_logger("convergenced.api")

HEAVY_FRAME_BYTES = 8192
"""Frames larger than this are decoded one at a time across the daemon's sessions
(a smaller one costs at most a couple of milliseconds, even full of empty maps)."""
SLICE_BYTES = 8192
"""Bytes of small frames decoded between two turns of the other tasks."""
SEND_PIECE_BYTES = 16384
"""The writer sends at most this much per call, so progress is seen per piece."""
SEND_STALL_S = 5.0
"""A client over its reply limit whose socket takes no piece for this long is cut."""


class ClientSession:
    """One connected client process."""

    def __init__(
        self,
        stream: trio.abc.Stream,
        operations: LocalOperations,
        gate: OutputGate,
        durable: Callable[[int], Awaitable[None]],
        *,
        limits: Limits,
        telemetry: Telemetry,
        heavy_frames: trio.Lock | None = None,
        batcher: CommitBatcher | None = None,
    ) -> None:
        """``heavy_frames``: the lock large frames are decoded under, shared by every
        session of the daemon (see the module docstring); ``batcher``: where commits
        are applied, shared too (`batching`)."""
        self.stream = stream
        self.operations = operations
        self.limits = limits
        self.telemetry = telemetry
        self.limit = limits.client_queue
        self._durable = durable
        self._out = gate.output()
        self._counts: deque[int] = deque()
        """Replies in each chunk held in ``_out`` (a run of commits' replies go as
        one chunk), so the limit counts replies, not chunks."""
        self._queued = 0
        """Replies held in ``_out``."""
        self._encoder = codec.FrameEncoder()
        self._ready = trio.Event()
        self._drained = trio.Event()
        self._sending = False
        self._pieces_sent = 0
        """Pieces the client's socket has taken: the writer's progress."""
        self._stall_watch = False
        """A `_stall_watchdog` is running."""
        self._slots = trio.Semaphore(self.limit)
        self._inflight: dict[int, tuple[str, trio.CancelScope]] = {}
        self._idle = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._read_scope = trio.CancelScope()
        self._reading_done = False
        self._draining = False
        self._heavy = heavy_frames if heavy_frames is not None else trio.Lock()
        self._batcher = batcher if batcher is not None else CommitBatcher(operations)
        self._hung_up = False
        """The connection ended, or the daemon hung up on it: waits end unanswered."""

    async def run(self) -> None:
        """Read, dispatch and write until the client leaves or is disconnected."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._writer)
                with self._read_scope:
                    await self._reader()
                if self._hung_up:
                    self._end_waits()
                # Let in-flight requests finish; the writer then flushes what is left
                # and ends the session.
                while self._inflight:
                    await self._idle.wait()
                self._reading_done = True
                self._ready.set()
        finally:
            with trio.CancelScope(shield=True):
                await self.stream.aclose()

    def begin_drain(self) -> None:
        """Shutdown: stop reading, end waits and watches, let the rest finish."""
        self._draining = True
        self._read_scope.cancel()
        self._end_waits()

    def _end_waits(self) -> None:
        for op, scope in list(self._inflight.values()):
            if OPERATIONS[op].kind is OpKind.WAIT:
                scope.cancel()

    def kill(self) -> None:
        """Disconnect now."""
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    # -- reading ---------------------------------------------------------------

    async def _reader(self) -> None:
        budget = codec.DecodeBudget.for_requests(self.limits.max_members)
        reader = codec.FrameReader(self.limits.max_frame_bytes, budget=budget)
        while True:
            try:
                data = bytes(await self.stream.receive_some(65536))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                self._hung_up = True
                return
            try:
                bodies = reader.split(data)
            except ApiError as err:
                # The byte stream cannot be resynchronized: answer, then hang up.
                self._hung_up = True
                self._fail(None, err)
                return
            await self._serve(reader, bodies)
            if reader.failed is not None:
                # Requests before the bad frame were served; the stream ends here.
                self._hung_up = True
                self._fail(None, reader.failed)
                return
            while self._queued >= self.limit:
                self._watch_for_stall()
                await self._drained.wait()

    async def _serve(self, reader: codec.FrameReader, bodies: list[bytes]) -> None:
        """Decode, parse and dispatch ``bodies`` in order, up to one the stream
        cannot go on after (its error is then in ``reader.failed``).

        Consecutive commits are applied together, with those of other sessions
        (`batching`), before anything after them is served; replies keep the
        order of the requests.
        """
        unchecked = 0
        commits: list[Request] = []
        try:
            for body in bodies:
                try:
                    if len(body) > HEAVY_FRAME_BYTES:
                        await self._commit(commits)
                        async with self._heavy:
                            began = trio.current_time()
                            req = self._parse(reader, body)
                            # As long again for everyone else before the next large
                            # frame: large frames get at most half of the event loop.
                            await trio.sleep(trio.current_time() - began)
                    else:
                        if unchecked > SLICE_BYTES:
                            await self._commit(commits)
                            await trio.lowlevel.checkpoint()
                            unchecked = 0
                        unchecked += len(body)
                        req = self._parse(reader, body)
                except ApiError:
                    return  # undecodable: in ``reader.failed``, answered by the reader loop
                if type(req) is Request:
                    if req.op == "commit" and not self._draining and req.id not in self._inflight:
                        commits.append(req)
                        continue
                    await self._commit(commits)
                    await self._dispatch(req)
                else:
                    await self._commit(commits)
                    assert isinstance(req, ApiError)
                    self._fail(req.request_id, req)
        finally:
            await self._commit(commits)  # shielded: read, so applied and answered

    def _parse(self, reader: codec.FrameReader, body: bytes) -> Request | ApiError:
        """The request in ``body``, or the error to answer when it is malformed.

        Raises:
            ApiError: the body is undecodable, which ends the stream.
        """
        obj = reader.decode(body)
        try:
            return codec.parse_request(obj)
        except ApiError as err:
            return err

    async def _commit(self, commits: list[Request]) -> None:
        """Apply ``commits`` (with other sessions' of this round: `batching`) and
        queue their replies, in order; empties the list."""
        if not commits:
            return
        run = list(commits)
        commits.clear()
        outcomes = await self._batcher.submit([req.args["fact"] for req in run])
        frames = []
        encode = self._encoder.encode
        for req, outcome in zip(run, outcomes, strict=True):
            if isinstance(outcome, ApiError):
                self.telemetry.api_error(outcome.reason)
                frames.append(encode(codec.error(req.id, outcome)))
            else:
                frames.append(encode(codec.ok(req.id, outcome)))
        self._queue(b"".join(frames), len(frames))  # one chunk: one tag, one wake-up

    async def _dispatch(self, req: Request) -> None:
        if req.id in self._inflight:
            self._fail(
                req.id,
                codec.bad_request(f"request id {req.id} is already in flight", "duplicate_id"),
            )
            return
        op = OPERATIONS[req.op]
        if op.kind is OpKind.SESSION:  # cancel
            target = self._inflight.get(req.args["target"])
            if target is not None:
                target[1].cancel()
            self._reply(codec.ok(req.id, {"cancelled": target is not None}))
            return
        if self._draining:
            down = ApiError(ErrorKind.UNAVAILABLE, "shutting_down", "daemon is shutting down")
            self._fail(req.id, down)
            return
        if op.kind is not OpKind.WAIT:
            try:
                self._reply(codec.ok(req.id, op.run(self.operations, req.args, _no_events)))
            except ApiError as err:
                self._fail(req.id, err)
            return
        await self._slots.acquire()
        scope = trio.CancelScope()
        self._inflight[req.id] = (req.op, scope)
        self._idle = trio.Event()
        assert self._nursery is not None
        self._nursery.start_soon(self._wait, req, scope)

    async def _wait(self, req: Request, scope: trio.CancelScope) -> None:
        def emit(snapshot: Snapshot) -> None:
            self._queue(codec.event_frame(req.id, snapshot.packed))

        try:
            with scope:
                try:
                    result = await OPERATIONS[req.op].run(self.operations, req.args, emit)
                    self._reply(codec.ok(req.id, result))
                except ApiError as err:
                    self._fail(req.id, err)
                except Exception as exc:  # a bug: answer it, log it, keep serving
                    if self.telemetry.may_warn("internal"):
                        log.exception("request failed", op=req.op, request=req.id)
                    text = f"{type(exc).__name__}: {exc}"
                    self._fail(req.id, ApiError(ErrorKind.INTERNAL, "internal", text))
            if scope.cancelled_caught and not self._hung_up:
                if self._draining:
                    end = ApiError(
                        ErrorKind.UNAVAILABLE,
                        "shutting_down",
                        "the daemon is shutting down; ask again after it restarts",
                    )
                else:
                    end = ApiError(
                        ErrorKind.UNAVAILABLE, "cancelled", f"request {req.id} was cancelled"
                    )
                self._fail(req.id, end)
        finally:
            self._slots.release()
            self._inflight.pop(req.id, None)
            if not self._inflight:
                self._idle.set()

    # -- writing -------------------------------------------------------------------

    def _fail(self, rid: int | None, err: ApiError) -> None:
        self.telemetry.api_error(err.reason)
        self._reply(codec.error(rid, err))

    def _reply(self, msg: dict[str, Any]) -> None:
        self._queue(self._encoder.encode(msg))

    def _queue(self, frames: bytes, replies: int = 1) -> None:
        """Hold ``frames`` (``replies`` of them) until what they reveal is durable."""
        self._out.send(frames)
        self._counts.append(replies)
        self._queued += replies
        self._ready.set()
        if self._queued > self.limit:
            self._watch_for_stall()

    def _watch_for_stall(self) -> None:
        """Over the limit while sending: see whether the client still reads."""
        if self._stall_watch or not self._sending or self._nursery is None:
            return
        if self._nursery.cancel_scope.cancel_called:
            return  # disconnected already
        self._stall_watch = True
        self._nursery.start_soon(self._stall_watchdog)

    async def _stall_watchdog(self) -> None:
        """Disconnect the client if it stopped reading (see the module docstring)."""
        try:
            while self._sending and self._queued >= self.limit:
                taken = self._pieces_sent
                await trio.sleep(SEND_STALL_S)
                if self._sending and self._pieces_sent == taken and self._queued >= self.limit:
                    self.telemetry.api_error("client_too_slow")
                    self.telemetry.warn(
                        "client_too_slow", "client too slow; disconnecting", queued=self._queued
                    )
                    self.kill()
                    return
        finally:
            self._stall_watch = False

    async def _writer(self) -> None:
        out = self._out
        while True:
            chunks = out.release()
            if chunks:
                for _ in chunks:
                    self._queued -= self._counts.popleft()
                self._drained.set()
                self._drained = trio.Event()
                self._sending = True
                data = memoryview(b"".join(chunks))
                try:
                    for start in range(0, len(data), SEND_PIECE_BYTES):
                        await self.stream.send_all(data[start : start + SEND_PIECE_BYTES])
                        self._pieces_sent += 1
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    self.kill()
                    return
                finally:
                    self._sending = False
                continue
            if len(out):
                try:
                    await self._durable(out.waiting_for)
                except OSError as exc:
                    await self._answer_held(log_failed(exc))
                    return
                continue
            if self._reading_done:
                self.kill()  # everything answered and flushed: the session is over
                return
            await self._ready.wait()
            self._ready = trio.Event()

    async def _answer_held(self, err: ApiError) -> None:
        """The log failed: what waits for it never leaves; its requests get ``err``."""
        frames = codec.FrameReader(1 << 30).feed(b"".join(self._out.discard()))
        self._counts.clear()
        self._queued = 0
        ids = [f.get("id") for f in frames if isinstance(f, dict) and "event" not in f]
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            for rid in ids:
                self.telemetry.api_error(err.reason)
                await self.stream.send_all(codec.encode_frame(codec.error(rid, err)))
        self.kill()


def _no_events(event: Snapshot) -> None:
    raise AssertionError("only waits emit events")  # pragma: no cover
