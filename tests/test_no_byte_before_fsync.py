"""The daemon's own code paths, with a slow disk: no byte leaves before the fsync that
covers every fact it reveals, and no ended session leaves a link counted.

Peer sessions and local-API sessions run over trio memory streams, the group commit
over a real log file on a disk that takes 30 ms of trio's virtual time per write
(`slowdisk`), under `MockClock`: the interleavings are the daemon's, with no sleeps.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from slowdisk import slow_log

from convergenced.core import local_api_codec as codec
from convergenced.core.admission import Admission
from convergenced.core.facts import Commit, Declare
from convergenced.core.gate import OutputGate
from convergenced.core.link import LinkConfig, LinkState, Role
from convergenced.core.node import NodeCore
from convergenced.core.records import Record
from convergenced.core.spec import Policy, StreamSpec
from convergenced.daemon.config import Limits
from convergenced.daemon.localapi.operations import LocalOperations
from convergenced.daemon.localapi.session import ClientSession
from convergenced.daemon.peers.session import PeerHub, PeerSession
from convergenced.daemon.telemetry import Telemetry

PAIR = StreamSpec.create("job", {"a": [0, 1], "b": [2]}, Policy.all_of("nvme"))
DISK_S = 0.03
LINK = LinkConfig(cluster="test", idle_ticks=1, dead_ticks=1000)


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


def _instant(node: NodeCore) -> tuple[OutputGate, Any]:
    gate = OutputGate(node)

    async def durable(position: int) -> None:
        gate.synced(gate.take_unlogged()[1])

    return gate, durable


class Pair:
    """Node a on a slow disk, node b instantly durable, linked over memory streams;
    b checks every record of a it receives against what a's log holds."""

    def __init__(self, tmp_path: Path) -> None:
        self.a, self.b = NodeCore("a", 1), NodeCore("b", 1)
        self.gate_a, self.commits_a, self.witness = slow_log(tmp_path, self.a, DISK_S)
        self.gate_b, durable_b = _instant(self.b)
        self.hub_a = PeerHub(self.a, self.gate_a, self.commits_a.durable, LINK, Telemetry(),
                             tick_seconds=0.01)  # fmt: skip
        self.hub_b = PeerHub(self.b, self.gate_b, durable_b, LINK, Telemetry(), tick_seconds=0.01)
        self.gate_a.apply(Declare(PAIR))
        self.gate_b.apply(Declare(PAIR))
        self.early: list[Record] = []
        self.seen = 0
        receive = self.b.receive

        def checked(records: Iterable[Record], *, via: str | None = None) -> list[Record]:
            records = list(records)
            for rec in records:
                if rec.origin == "a":
                    self.seen += 1
                    if not self.witness.reveals_only_durable(rec, (0, 1), "nvme"):
                        self.early.append(rec)
            return receive(records, via=via)

        self.b.receive = checked  # type: ignore[method-assign]

    async def run(self, epochs: int) -> None:
        left, right = trio.testing.memory_stream_pair()
        sa = PeerSession(self.hub_a, left, Role.INITIATOR)
        sb = PeerSession(self.hub_b, right, Role.ACCEPTOR)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.hub_a.run_timer)
            nursery.start_soon(self.hub_b.run_timer)
            nursery.start_soon(sa.run)
            nursery.start_soon(sb.run)

            async def rank(node: str, r: int, pace: float) -> None:
                gate, hub = (self.gate_a, self.hub_a) if node == "a" else (self.gate_b, self.hub_b)
                for epoch in range(1, epochs + 1):
                    gate.apply(Commit("job", r, "nvme", epoch))
                    hub.view_changed()
                    await trio.sleep(pace)

            async with trio.open_nursery() as ranks:
                ranks.start_soon(rank, "a", 0, 0.004)
                ranks.start_soon(rank, "a", 1, 0.007)
                ranks.start_soon(rank, "b", 2, 0.005)
            with trio.fail_after(60):
                while self.b.restore_point("job") != epochs:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()


async def test_no_record_leaves_a_peer_session_before_its_fsync(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    pair = Pair(tmp_path)
    await pair.run(epochs=40)
    assert pair.seen >= 5  # records coalesce while a write runs: one or two per fsync
    assert pair.early == []


async def test_the_probe_catches_bytes_taken_after_waiting_for_an_earlier_fsync(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The order the daemon used to have: wait for what was pending, then take the
    # link's bytes, including those produced while the fsync ran.
    async def old_flush(self: PeerSession) -> None:
        async with self._send_lock:
            while self.link.next_event() is not None:
                pass
            await self.hub.durable(self.hub.gate.position())
            data = self.link.data_to_send()
            self.hub.gate.synced(10**9)  # let the gate pass it, as nothing gated it
            self._out.send(data)
            out = b"".join(self._out.release())
            if out:
                await self.stream.send_all(out)
            self.hub.view_changed(source=self)
            if self.link.state is LinkState.CLOSED and self._nursery is not None:
                self._nursery.cancel_scope.cancel()

    monkeypatch.setattr(PeerSession, "_flush", old_flush)
    pair = Pair(tmp_path)
    await pair.run(epochs=40)
    assert pair.early, "the probe must see records that left ahead of their fsync"


async def test_a_refusal_waits_for_the_fsync_of_what_it_reveals(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    # Declare A, then a conflicting B, in one read: B's spec_conflict reveals A.
    node = NodeCore("a", 1)
    gate, commits, witness = slow_log(tmp_path, node, DISK_S)
    telemetry = Telemetry()
    hub = PeerHub(node, gate, commits.durable, LINK, telemetry, tick_seconds=1.0)
    ops = LocalOperations(node, Admission(node, gate), hub, telemetry,
                          durable=commits.durable, status=dict)  # fmt: skip
    other = StreamSpec.create("job", {"a": [0, 1], "b": [2]}, Policy.any_of("nvme"))
    client, daemon_side = trio.testing.memory_stream_pair()
    session = ClientSession(
        daemon_side, ops, gate, commits.durable, limits=Limits(), telemetry=telemetry
    )
    replies: list[tuple[Any, bool]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(session.run)
        await client.send_all(
            codec.encode_frame(codec.request(1, "declare", spec=PAIR.to_wire()))
            + codec.encode_frame(codec.request(2, "declare", spec=other.to_wire()))
        )
        reader = codec.FrameReader()
        while len(replies) < 2:
            for reply in reader.feed(await client.receive_some(65536)):
                replies.append((reply, Declare(PAIR) in witness.durable))
        nursery.cancel_scope.cancel()
    by_id = {r["id"]: (r, durable) for r, durable in replies}
    assert by_id[2][0]["error"]["reason"] == "spec_conflict"
    assert by_id[2][1], "the refusal left before the declaration it reveals was durable"
    assert by_id[1][1] and "ok" in by_id[1][0]


async def test_a_cancelled_session_leaves_no_link_counted(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    a, b = NodeCore("a", 1), NodeCore("b", 1)
    (gate_a, durable_a), (gate_b, durable_b) = _instant(a), _instant(b)
    hub_a = PeerHub(a, gate_a, durable_a, LINK, Telemetry(), tick_seconds=0.01)
    hub_b = PeerHub(b, gate_b, durable_b, LINK, Telemetry(), tick_seconds=0.01)
    left, right = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        scope = trio.CancelScope()

        async def cancellable() -> None:
            with scope:
                await PeerSession(hub_a, left, Role.INITIATOR).run()

        nursery.start_soon(cancellable)
        nursery.start_soon(PeerSession(hub_b, right, Role.ACCEPTOR).run)
        while a.neighbours != {"b"}:
            await trio.sleep(0.01)
        scope.cancel()  # the task driving a's session is cancelled mid-link
        await trio.sleep(0.01)
        assert a.neighbours == frozenset()
        while b.neighbours:  # b sees the connection go and drops it too
            await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
