"""The local API against clients that leave, flood or watch in numbers.

Sessions run over trio memory streams (or in-process socket pairs where the server's
credential check needs a real socket), the log on an instant or a slow virtual disk,
under `MockClock` where no real socket is involved: what is checked is counted work
and the daemon's own interleavings, never a wall-clock threshold.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from slowdisk import slow_log

from convergenced.core import local_api_codec as codec
from convergenced.core import local_api_results as results
from convergenced.core.admission import Admission
from convergenced.core.facts import Commit, Declare
from convergenced.core.gate import OutputGate
from convergenced.core.link import LinkConfig
from convergenced.core.node import NodeCore
from convergenced.core.spec import Policy, StreamSpec
from convergenced.daemon.config import Limits
from convergenced.daemon.localapi.operations import LocalOperations
from convergenced.daemon.localapi.server import LocalApiServer
from convergenced.daemon.localapi.session import ClientSession
from convergenced.daemon.localapi.watches import StreamFeed
from convergenced.daemon.peers.session import PeerHub
from convergenced.daemon.telemetry import Telemetry

SOLO = StreamSpec.create("job", {"a": [0]}, Policy.all_of("nvme"))
PAIR = StreamSpec.create("pair", {"a": [0], "b": [1]}, Policy.all_of("nvme"))
LINK = LinkConfig(cluster="test", idle_ticks=1, dead_ticks=1000)


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


class Daemon:
    """Node ``a`` with the streams ``job`` (a alone) and ``pair`` (a and b), and
    everything a local session needs; instantly durable unless given a slow disk."""

    def __init__(self, tmp_path: Path | None = None, *, disk_s: float = 0.0,
                 limits: Limits | None = None) -> None:  # fmt: skip
        self.node = NodeCore("a", 1)
        self.telemetry = Telemetry()
        self.limits = limits or Limits()
        self.witness: Any = None
        if tmp_path is not None:
            self.gate, commits, self.witness = slow_log(tmp_path, self.node, disk_s)
            self.durable: Any = commits.durable
        else:
            self.gate = OutputGate(self.node)

            async def durable(position: int | None = None) -> None:
                self.gate.synced(self.gate.take_unlogged()[1])

            self.durable = durable
        self.hub = PeerHub(self.node, self.gate, self.durable, LINK, self.telemetry,
                           tick_seconds=1.0)  # fmt: skip
        self.ops = LocalOperations(self.node, Admission(self.node, self.gate), self.hub,
                                   self.telemetry, durable=self.durable,
                                   status=dict)  # fmt: skip
        self.gate.apply(Declare(SOLO))
        self.gate.apply(Declare(PAIR))
        self.gate.synced(self.gate.take_unlogged()[1])

    def session(self, stream: trio.abc.Stream) -> ClientSession:
        return ClientSession(stream, self.ops, self.gate, self.durable,
                             limits=self.limits, telemetry=self.telemetry)  # fmt: skip

    def server(self) -> LocalApiServer:
        return LocalApiServer(self.ops, self.gate, self.durable, self.limits, self.telemetry)

    def errors(self) -> dict[str, int]:
        return {k: v for k, v in self.telemetry.counters().items() if k.startswith("api_")}


def frames(*requests: dict[str, Any]) -> bytes:
    return b"".join(codec.encode_frame(r) for r in requests)


async def replies(stream: trio.abc.ReceiveStream, reader: codec.FrameReader, n: int) -> list[Any]:
    """The next ``n`` replies on ``stream``."""
    out: list[Any] = []
    while len(out) < n:
        data = await stream.receive_some(65536)
        assert data, f"the connection ended after {out}"
        out += reader.feed(data)
    return out


async def served(session: ClientSession, done: trio.Event) -> None:
    await session.run()
    done.set()


class BrokenOnRead(trio.abc.Stream):
    """A client connection whose reads fail once ``broken`` is set (a reset)."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.broken = trio.Event()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        async with trio.open_nursery() as nursery:
            got: list[bytes] = []

            async def receive() -> None:
                got.append(bytes(await self.inner.receive_some(max_bytes)))
                nursery.cancel_scope.cancel()

            async def reset() -> None:
                await self.broken.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(receive)
            nursery.start_soon(reset)
        if not got:
            raise trio.BrokenResourceError("connection reset by peer")
        return got[0]

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:  # pragma: no cover - not used
        raise NotImplementedError

    async def aclose(self) -> None:
        await self.inner.aclose()


# -- 1. a client that leaves ends its waits and its session -----------------------------


async def test_a_client_killed_with_a_watch_open_ends_its_session_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    d = Daemon()
    client, daemon_side = trio.testing.memory_stream_pair()
    done = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(served, d.session(daemon_side), done)
        await client.send_all(frames(codec.request(1, "watch", stream="job")))
        (first,) = await replies(client, codec.FrameReader(), 1)
        assert first["id"] == 1 and first["event"]["stream"] == "job"
        await client.aclose()  # killed: its end of the connection is gone
        with trio.fail_after(1):  # virtual: fails only if the session waits for a change
            await done.wait()
    assert d.errors() == {}  # a client leaving is not an error of the API


async def test_every_kind_of_wait_ends_when_the_connection_does(
    autojump_clock: trio.testing.MockClock,
) -> None:
    d = Daemon()
    client, daemon_side = trio.testing.memory_stream_pair()
    done = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(served, d.session(daemon_side), done)
        await client.send_all(
            frames(
                codec.request(1, "watch", stream="pair"),
                codec.request(2, "wait", stream="job", epoch=100),  # never reached
                codec.request(3, "restore_point", stream="pair", generation=1),  # b is silent
            )
        )
        await replies(client, codec.FrameReader(), 1)  # the watch's first event
        await trio.sleep(5)
        assert not done.is_set()  # the waits really were waiting
        await client.aclose()
        with trio.fail_after(1):
            await done.wait()


async def test_an_error_on_read_ends_the_session_like_an_end_of_stream(
    autojump_clock: trio.testing.MockClock,
) -> None:
    d = Daemon()
    client, inner = trio.testing.memory_stream_pair()
    daemon_side = BrokenOnRead(inner)
    done = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(served, d.session(daemon_side), done)
        await client.send_all(frames(codec.request(1, "watch", stream="job")))
        await replies(client, codec.FrameReader(), 1)
        daemon_side.broken.set()
        with trio.fail_after(1):
            await done.wait()


async def test_facts_read_before_a_half_close_are_still_acknowledged_after_their_fsync(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    d = Daemon(tmp_path, disk_s=0.03)
    client, daemon_side = trio.testing.memory_stream_pair()
    done = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(served, d.session(daemon_side), done)
        commit = codec.request(1, "commit", stream="job", rank=0, domain="nvme", epoch=1)
        await client.send_all(frames(commit, codec.request(2, "watch", stream="pair")))
        await client.send_eof()  # done sending, still reading
        reader = codec.FrameReader()
        got: list[Any] = []
        with trio.fail_after(1):
            while data := await client.receive_some(65536):
                got += reader.feed(data)
            await done.wait()
    acks = [r for r in got if r["id"] == 1]
    assert acks == [{"id": 1, "ok": {"stream": "job", "epoch": 1, "durable": True}}]
    assert all("error" not in r for r in got)  # the ended watch is not answered


async def test_killed_watchers_never_fill_max_clients() -> None:
    d = Daemon(limits=Limits(max_clients=4))
    server = d.server()
    async with trio.open_nursery() as nursery:
        with trio.fail_after(10):
            for _ in range(3 * d.limits.max_clients):
                ours, theirs = trio.socket.socketpair()
                nursery.start_soon(server.handle, trio.SocketStream(theirs))
                client = trio.SocketStream(ours)
                await client.send_all(frames(codec.request(1, "watch", stream="job")))
                await replies(client, codec.FrameReader(), 1)
                await client.aclose()
            while server.sessions:
                await trio.sleep(0.01)
            ours, theirs = trio.socket.socketpair()
            nursery.start_soon(server.handle, trio.SocketStream(theirs))
            client = trio.SocketStream(ours)
            await client.send_all(frames(codec.request(1, "streams")))
            (reply,) = await replies(client, codec.FrameReader(), 1)
            await client.aclose()
    assert reply == {"id": 1, "ok": ["job", "pair"]}
    assert d.errors() == {}


# -- 3. decoding costs what the bytes say, and no client's frames stall the others -------

EMPTY_MAPS = b"\x9f" + (b"\xdc\xff\xff" + b"\x80" * 0xFFFF) * 15  # 983,025 empty maps


def framed(body: bytes) -> bytes:
    return codec.LENGTH.pack(len(body)) + body


def map_of(**fields: bytes) -> bytes:
    """A msgpack map from already-packed values (to hand-build hostile bodies)."""
    out = bytes([0x80 | len(fields)])
    for key, value in fields.items():
        out += bytes([0xA0 | len(key)]) + key.encode() + value
    return out


class Decodes:
    """Counts what reaches msgpack's decoder (objects built), by frame size."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, clock: trio.testing.MockClock | None = None,
                 cost_s: float = 0.0) -> None:  # fmt: skip
        self.large = 0
        real = codec.unpack_strict

        def counted(body: bytes, limits: Any) -> Any:
            if len(body) > 8192:
                self.large += 1
                if clock is not None:
                    clock.jump(cost_s)  # the loop is busy for that long (virtual time)
            return real(body, limits)

        monkeypatch.setattr(codec, "unpack_strict", counted)


async def exchange(d: Daemon, data: bytes) -> list[Any]:
    """Send ``data`` on one connection, half-close, read every reply until it closes."""
    client, daemon_side = trio.testing.memory_stream_pair()
    got: list[Any] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(d.session(daemon_side).run)
        await client.send_all(data)
        await client.send_eof()
        reader = codec.FrameReader(64 << 20)
        with trio.fail_after(5):
            while chunk := await client.receive_some(65536):
                got += reader.feed(chunk)
    return got


async def test_a_frame_that_is_not_a_map_is_refused_before_anything_is_built(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    d, decodes = Daemon(), Decodes(monkeypatch)
    assert len(EMPTY_MAPS) < Limits().max_frame_bytes
    (reply,) = await exchange(d, framed(EMPTY_MAPS))
    assert reply["id"] is None and reply["error"]["reason"] == "undecodable"
    assert "one msgpack map" in reply["error"]["message"]
    assert decodes.large == 0
    assert d.errors() == {"api_errors_undecodable": 1}


async def test_a_request_holding_a_million_empty_maps_is_refused_before_they_are_built(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    d, decodes = Daemon(), Decodes(monkeypatch)
    body = map_of(id=b"\x01", op=b"\xa6status", args=map_of(x=EMPTY_MAPS))
    (reply,) = await exchange(d, framed(body))
    assert reply["id"] is None and reply["error"]["reason"] == "too_many_objects"
    assert "limits.max_members" in reply["error"]["message"]
    assert decodes.large == 0
    assert d.errors() == {"api_errors_too_many_objects": 1}


def big_spec(members: int, ranks: int) -> dict[str, Any]:
    names = [f"node-{i:04d}-" + "x" * 118 for i in range(members)]  # 128 characters
    return {
        "name": "big",
        "members": {n: list(range(i * ranks, (i + 1) * ranks)) for i, n in enumerate(names)},
        "policy": {"mode": "all", "domains": ["nvme"]},
        "retention": 0,
    }


def test_the_largest_declaration_the_limits_allow_is_within_the_budget() -> None:
    limits = Limits()
    frame = codec.encode_frame(codec.request(1, "declare", spec=big_spec(limits.max_members, 16)))
    assert len(frame) <= limits.max_frame_bytes
    budget = codec.DecodeBudget.for_requests(limits.max_members)
    reader = codec.FrameReader(limits.max_frame_bytes, budget=budget)
    (req,) = [codec.parse_request(obj) for obj in reader.feed(frame)]
    assert len(req.args["fact"].spec.members) == limits.max_members


def test_a_declaration_past_the_budget_is_refused_by_name() -> None:
    budget = codec.DecodeBudget.for_requests(256)
    spec = big_spec(256, budget.max_objects // 256)  # more ranks than any request holds
    reader = codec.FrameReader(budget=budget)
    with pytest.raises(codec.ApiError) as refused:
        reader.feed(codec.encode_frame(codec.request(1, "declare", spec=spec)))
    assert refused.value.reason == "too_many_objects"


async def test_clients_sending_large_frames_take_turns_and_never_stall_a_commit(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each large frame keeps the event loop busy for 0.2 s (charged in virtual time):
    # eight clients sending six each hold 9.6 s of work. A commit sent meanwhile
    # waits for about one of those frames (it needs several turns of the loop, and
    # it used to wait for a frame of every client at each turn: 3.4 s here).
    cost = 0.2
    decodes = Decodes(monkeypatch, autojump_clock, cost)
    d = Daemon()
    server = d.server()
    pad = b"\xda" + (60000).to_bytes(2, "big") + b"x" * 60000
    hostile = framed(map_of(id=b"\x01", op=b"\xa6status", args=map_of(pad=pad)))
    async with trio.open_nursery() as nursery:

        async def connect() -> trio.testing.MemoryStream:  # type: ignore[name-defined]
            client, daemon_side = trio.testing.memory_stream_pair()
            session = ClientSession(daemon_side, d.ops, d.gate, d.durable, limits=d.limits,
                                    telemetry=d.telemetry,
                                    heavy_frames=server.heavy_frames)  # fmt: skip
            nursery.start_soon(session.run)
            return client

        flooders = [await connect() for _ in range(8)]
        well_behaved = await connect()
        for flooder in flooders:
            await flooder.send_all(hostile * 6)
        while decodes.large < 3:  # the flood is under way
            await trio.sleep(0.01)
        started = trio.current_time()
        commit = codec.request(1, "commit", stream="job", rank=0, domain="nvme", epoch=1)
        await well_behaved.send_all(frames(commit))
        (ack,) = await replies(well_behaved, codec.FrameReader(), 1)
        waited = trio.current_time() - started
        nursery.cancel_scope.cancel()
    assert ack == {"id": 1, "ok": {"stream": "job", "epoch": 1, "durable": True}}
    assert decodes.large < 8 * 6  # and not over
    assert waited <= 2 * cost, f"the commit waited {waited:.1f} s of other clients' frames"


# -- 4. watchers of a stream share one computation of its state per change ---------------


class Watchers:
    """``n`` watches of ``stream`` through the operations, recording their events."""

    def __init__(self, d: Daemon, stream: str, n: int) -> None:
        self.d, self.stream, self.n = d, stream, n
        self.events: list[list[dict[str, Any]]] = [[] for _ in range(n)]

    async def run(self, nursery: trio.Nursery) -> None:
        for i in range(self.n):
            nursery.start_soon(self.d.ops.watch, self.stream, self._emit(i))
        await self.all_have(1)

    def _emit(self, i: int) -> Any:
        return lambda snapshot: self.events[i].append(snapshot.state)

    async def all_have(self, count: int) -> None:
        with trio.fail_after(5):
            while any(len(e) < count for e in self.events):
                await trio.sleep(0.001)


class StateCalls:
    """Counts the computations of each stream's state."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.by_stream: dict[str, int] = {}
        real = results.status_to_wire

        def counted(status: Any, checkpoint_after: int | None = None) -> dict[str, Any]:
            self.by_stream[status.stream] = self.by_stream.get(status.stream, 0) + 1
            return real(status, checkpoint_after)

        monkeypatch.setattr(results, "status_to_wire", counted)


async def test_one_commit_computes_a_watched_stream_once_for_all_its_watchers(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = Daemon()
    calls = StateCalls(monkeypatch)
    job, pair = Watchers(d, "job", 2048), Watchers(d, "pair", 16)
    async with trio.open_nursery() as nursery:
        await job.run(nursery)
        await pair.run(nursery)
        calls.by_stream.clear()
        d.ops.submit(Commit("job", 0, "nvme", 1))
        await job.all_have(2)
        await trio.sleep(1)  # and nothing more happens
        nursery.cancel_scope.cancel()
    assert all(e[-1]["recoverable"] == [[1, 1]] for e in job.events)
    assert all(len(e) == 1 for e in pair.events)  # pair did not change: no event
    # Once to publish it and once to see nothing else changed during its fsync,
    # for 2,048 watchers as for one; pair's state is looked at once, not 16 times.
    assert calls.by_stream == {"job": 2, "pair": 1}


async def test_a_watch_event_waits_for_the_fsync_of_what_it_shows(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    d = Daemon(tmp_path, disk_s=0.03)
    witness_durable: list[bool] = []
    seen: list[dict[str, Any]] = []

    def emit(snapshot: Any) -> None:
        seen.append(snapshot.state)
        shown = {
            (0, "nvme", e) for lo, hi in snapshot.state["recoverable"] for e in range(lo, hi + 1)
        }
        witness_durable.append(shown <= d.witness.committed())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(d.ops.watch, "job", emit)
        for epoch in range(1, 6):
            d.ops.submit(Commit("job", 0, "nvme", epoch))
            await trio.sleep(0.01)  # commits arrive faster than the disk syncs
        with trio.fail_after(5):
            while not seen or seen[-1]["recoverable"] != [[1, 5]]:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert all(witness_durable)
    assert all(a != b for a, b in itertools.pairwise(seen))  # each one is news
    assert len(seen) < 6  # coalesced: one per fsync at most


async def test_a_change_made_while_an_event_waits_for_its_fsync_is_not_missed(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    d = Daemon(tmp_path, disk_s=0.03)
    seen: list[dict[str, Any]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(d.ops.watch, "job", lambda s: seen.append(s.state))
        await trio.sleep(0.1)
        d.ops.submit(Commit("job", 0, "nvme", 1))
        await trio.sleep(0.01)  # the event showing epoch 1 now waits for its fsync
        d.ops.submit(Commit("job", 0, "nvme", 2))  # and nothing changes after this
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert seen[-1]["recoverable"] == [[1, 2]]


async def test_a_watcher_is_never_shown_the_same_state_twice_in_a_row() -> None:
    states = iter([{"v": "A"}, {"v": "B"}, {"v": "A"}, {"v": "A"}, {"v": "C"}])
    changes = trio.Event()
    current: list[dict[str, Any]] = [next(states)]

    async def changed() -> None:
        await changes.wait()

    async def durable() -> None:
        pass

    feed = StreamFeed(lambda: current[0], changed, durable)
    fast_first = await feed.after(None)
    slow_shown = fast_first  # a watcher that sleeps through B
    current[0] = next(states)
    assert (await feed.after(fast_first)).state == {"v": "B"}
    current[0] = next(states)
    back_to_a = await feed.after(feed.latest)
    assert back_to_a.state == {"v": "A"}
    async with trio.open_nursery() as nursery:
        got: list[Any] = []

        async def slow() -> None:
            got.append(await feed.after(slow_shown))

        nursery.start_soon(slow)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # A again is no news to a watcher that showed A last
        current[0] = next(states)
        current[0] = next(states)
        changes.set()
    assert got[0].state == {"v": "C"}


async def test_a_feed_lives_while_its_stream_is_watched(
    autojump_clock: trio.testing.MockClock,
) -> None:
    d = Daemon()
    async with trio.open_nursery() as nursery:
        scopes = []
        for _ in range(3):
            scope = trio.CancelScope()
            scopes.append(scope)

            async def one(scope: trio.CancelScope = scope) -> None:
                with scope:
                    await d.ops.watch("job", lambda s: None)

            nursery.start_soon(one)
        await trio.sleep(0.1)
        assert d.ops.feeds["job"].watchers == 3
        scopes[0].cancel()  # whoever leads, the others go on
        await trio.sleep(0.1)
        d.ops.submit(Commit("job", 0, "nvme", 1))
        await trio.sleep(0.1)
        assert d.ops.feeds["job"].latest is not None
        assert d.ops.feeds["job"].latest.state["recoverable"] == [[1, 1]]
        for scope in scopes[1:]:
            scope.cancel()
        await trio.sleep(0.1)
        assert d.ops.feeds == {}


def test_a_shared_event_frame_is_the_event_encoded_byte_for_byte() -> None:
    state = {"stream": "job", "recoverable": [[1, 5]], "skew": None, "newest": {"a": {"x": 3}}}
    for rid in (0, 1, 127, 128, 65536, 2**63 - 1):
        packed = codec.encode_frame(state)[4:]
        assert codec.event_frame(rid, packed) == codec.encode_frame(codec.event(rid, state))
