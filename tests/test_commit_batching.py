"""Commits applied together: Admission.submit_commits and the sessions' CommitBatcher.

The admission of a run of commits must give each the outcome `submit` one by one
gives (hypothesis, against a node fed one commit at a time); the batcher must apply
the commits of every session of a scheduling round with one refresh, keep each
session's requests in order, and let no acknowledgement out before its fsync (a
slow virtual disk under `MockClock`, as in test_no_byte_before_fsync).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from slowdisk import slow_log

from convergenced.core import local_api_codec as codec
from convergenced.core.admission import Admission, Admitted
from convergenced.core.facts import Commit, Declare, Retire
from convergenced.core.gate import OutputGate
from convergenced.core.link import LinkConfig
from convergenced.core.local_api_codec import ApiError
from convergenced.core.node import NodeCore
from convergenced.core.spec import Policy, StreamSpec
from convergenced.daemon.config import Limits
from convergenced.daemon.localapi.batching import CommitBatcher
from convergenced.daemon.localapi.operations import LocalOperations
from convergenced.daemon.localapi.session import SEND_STALL_S, ClientSession
from convergenced.daemon.peers.session import PeerHub
from convergenced.daemon.telemetry import Telemetry

SPEC = StreamSpec.create("job", {"a": [0, 1, 2, 3]}, Policy.all_of("nvme", "s3"))
LINK = LinkConfig(cluster="test", idle_ticks=1, dead_ticks=1000)
DIGESTS = ["", "sha256:" + "a" * 64, "sha256:" + "b" * 64, "md5:bad"]


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


def admission() -> tuple[NodeCore, Admission]:
    node = NodeCore("a", 1)
    gate = OutputGate(node)
    adm = Admission(node, gate)
    adm.submit(Declare(SPEC))
    return node, adm


def outcome(result: Admitted | ApiError) -> tuple[str, Any]:
    if isinstance(result, ApiError):
        return ("error", result.reason)
    return ("repeat" if result.repeat else "applied", result.reply)


_commits = st.lists(
    st.builds(
        Commit,
        st.sampled_from(["job", "nope"]),
        st.integers(0, 4),  # rank 4 is not hosted
        st.sampled_from(["nvme", "s3", "tape"]),  # tape is outside the policy
        st.integers(0, 5),
        st.sampled_from(DIGESTS),
        st.sampled_from([0, 10]),
    ),
    min_size=1,
    max_size=50,
)


@settings(max_examples=200, deadline=None)
@given(_commits, st.lists(st.integers(1, 12), min_size=1, max_size=10), st.booleans())
def test_a_run_has_the_outcomes_of_submitting_one_by_one(
    commits: list[Commit], cuts: list[int], retire_first: bool
) -> None:
    one, by_one = admission()
    many, in_runs = admission()
    if retire_first:  # a retired epoch is refused in both
        for node in (one, many):
            node.apply(Retire("job", 0, "nvme", 0))
    expected = []
    for fact in commits:
        try:
            expected.append(outcome(by_one.submit(fact)))
        except ApiError as err:
            expected.append(("error", err.reason))
    got: list[tuple[str, Any]] = []
    at, i = 0, 0
    while at < len(commits):
        n = cuts[i % len(cuts)]
        got += [outcome(r) for r in in_runs.submit_commits(commits[at : at + n])]
        at, i = at + n, i + 1
    assert got == expected
    a, b = one.status("job"), many.status("job")
    assert (a.recoverable, a.restore_point, a.newest, a.stored) == (
        b.recoverable,
        b.restore_point,
        b.newest,
        b.stored,
    )


class Daemon:
    """Node a alone in ``job``, its log on a slow virtual disk, sessions over memory
    streams sharing one batcher."""

    def __init__(self, tmp_path: Path) -> None:
        self.node = NodeCore("a", 1)
        self.gate, self.commits, self.witness = slow_log(tmp_path, self.node, 0.03)
        self.telemetry = Telemetry()
        self.hub = PeerHub(self.node, self.gate, self.commits.durable, LINK, self.telemetry,
                           tick_seconds=1.0)  # fmt: skip
        self.ops = LocalOperations(self.node, Admission(self.node, self.gate), self.hub,
                                   self.telemetry, durable=self.commits.durable,
                                   status=dict)  # fmt: skip
        self.batcher = CommitBatcher(self.ops)
        self.gate.apply(Declare(SPEC))
        self.refreshes = 0
        refresh = self.node._refresh

        def counted(name: str) -> None:
            self.refreshes += 1
            refresh(name)

        self.node._refresh = counted  # type: ignore[method-assign]

    def session(self, stream: trio.abc.Stream) -> ClientSession:
        return ClientSession(stream, self.ops, self.gate, self.commits.durable,
                             limits=Limits(), telemetry=self.telemetry,
                             batcher=self.batcher)  # fmt: skip


def commit(rid: int, rank: int, domain: str, epoch: int) -> bytes:
    return codec.encode_frame(
        codec.request(rid, "commit", stream="job", rank=rank, domain=domain, epoch=epoch)
    )


async def test_every_sessions_commits_of_a_round_are_applied_with_one_refresh(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    d = Daemon(tmp_path)
    d.gate.synced(d.gate.take_unlogged()[1])
    pairs = [trio.testing.memory_stream_pair() for _ in range(4)]
    got: list[tuple[int, dict[str, Any], bool]] = []
    for rank, (client, _) in enumerate(pairs):  # all sent before the sessions start
        await client.send_all(commit(1, rank, "nvme", 1) + commit(2, rank, "s3", 1))
    async with trio.open_nursery() as nursery:
        for _, daemon_side in pairs:
            nursery.start_soon(d.session(daemon_side).run)

        async def read(rank: int, client: trio.testing.MemoryStapledStream) -> None:
            reader = codec.FrameReader()
            n = 0
            while n < 2:
                for reply in reader.feed(await client.receive_some(65536)):
                    durable = (rank, "s3", 1) in d.witness.committed()
                    got.append((rank, reply, durable))
                    n += 1

        async with trio.open_nursery() as readers:
            for rank, (client, _) in enumerate(pairs):
                readers.start_soon(read, rank, client)
        nursery.cancel_scope.cancel()
    assert len(got) == 8
    assert all(reply["ok"]["durable"] and durable for _, reply, durable in got)
    assert d.node.restore_point("job") == 1
    assert d.refreshes == 1  # eight commits of four sessions, one refresh


async def test_a_sessions_requests_after_its_commits_see_them(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    d = Daemon(tmp_path)
    client, daemon_side = trio.testing.memory_stream_pair()
    both = [(r, dom) for r in range(4) for dom in ("nvme", "s3")]
    requests = b"".join(commit(i + 1, r, dom, 7) for i, (r, dom) in enumerate(both))
    requests += codec.encode_frame(codec.request(99, "state", stream="job"))
    requests += commit(100, 0, "nvme", 8) + commit(101, 0, "nvme", 8)  # the second: a repeat
    requests += commit(102, 9, "nvme", 8)  # refused: rank 9 is not hosted
    async with trio.open_nursery() as nursery:
        nursery.start_soon(d.session(daemon_side).run)
        await client.send_all(requests)
        reader = codec.FrameReader()
        replies: list[dict[str, Any]] = []
        while len(replies) < 12:
            replies += reader.feed(await client.receive_some(65536))
        nursery.cancel_scope.cancel()
    assert [r["id"] for r in replies] == [*range(1, 9), 99, 100, 101, 102]  # in order
    state = replies[8]["ok"]
    assert state["restore_point"] == 7 and state["recoverable"] == [[7, 7]]
    assert replies[10]["ok"] == {"stream": "job", "epoch": 8, "durable": True}
    assert replies[11]["error"]["reason"] == "unknown_rank"
    counters = d.telemetry.counters()
    assert counters["facts_commit"] == 9 and counters["repeated_commit"] == 1


async def test_a_cancelled_reader_still_gets_its_read_commits_applied(
    autojump_clock: trio.testing.MockClock,
) -> None:
    node = NodeCore("a", 1)
    gate = OutputGate(node)
    telemetry = Telemetry()

    async def durable(position: int | None = None) -> None:
        gate.synced(gate.take_unlogged()[1])

    hub = PeerHub(node, gate, durable, LINK, telemetry, tick_seconds=1.0)
    ops = LocalOperations(node, Admission(node, gate), hub, telemetry, durable=durable,
                          status=dict)  # fmt: skip
    gate.apply(Declare(SPEC))
    batcher = CommitBatcher(ops)
    results: list[Any] = []

    async def follower(scope: trio.CancelScope) -> None:
        with scope:
            results.append(await batcher.submit([Commit("job", 1, "nvme", 3)]))

    async with trio.open_nursery() as nursery:
        scope = trio.CancelScope()
        nursery.start_soon(follower, scope)
        await trio.testing.wait_all_tasks_blocked()
        scope.cancel()  # it leads, and its wait is shielded
        results.append(await batcher.submit([Commit("job", 2, "nvme", 3)]))
    assert [r[0]["epoch"] for r in results] == [3, 3]
    assert node.status("job").newest == {"a": {}}
    assert (1, "nvme") in node._streams["job"].facts.available


async def test_a_client_that_pipelines_and_reads_slowly_is_never_cut(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    # 400 commits in bursts of 50 against a limit of 16, read 4 KiB every half second: the
    # writer is blocked most of the time with the replies past the limit, but the
    # socket keeps taking pieces, so the client is served, not disconnected.
    d = Daemon(tmp_path)
    client, daemon_side = trio.testing.lockstep_stream_pair()
    session = ClientSession(daemon_side, d.ops, d.gate, d.commits.durable,
                            limits=Limits(client_queue=16), telemetry=d.telemetry,
                            batcher=d.batcher)  # fmt: skip
    acks = codec.FrameReader(1 << 20)
    replies: list[Any] = []

    async def read_slowly() -> None:
        while len(replies) < 400:
            replies.extend(acks.feed(await client.receive_some(4096)))
            await trio.sleep(0.5)

    with trio.fail_after(3600):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session.run)
            nursery.start_soon(read_slowly)
            for burst in range(8):  # acks pile up while earlier ones are being sent
                epochs = range(burst * 50, burst * 50 + 50)
                await client.send_all(b"".join(commit(e + 1, 0, "nvme", e) for e in epochs))
                await trio.sleep(0.2)
            while len(replies) < 400:
                await trio.sleep(1)
            nursery.cancel_scope.cancel()
    assert not d.telemetry.counters().get("api_errors_client_too_slow")
    assert [r["id"] for r in replies] == list(range(1, 401))


async def test_a_client_that_stops_reading_its_acks_is_disconnected(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    # A run's replies leave as one chunk, but the limit counts replies: 50 acks held
    # while the daemon is blocked sending earlier ones to a client that does not read
    # are past limits.client_queue (16); once its socket has taken nothing for
    # SEND_STALL_S, that client's session ends.
    d = Daemon(tmp_path)
    client, daemon_side = trio.testing.lockstep_stream_pair()
    session = ClientSession(daemon_side, d.ops, d.gate, d.commits.durable,
                            limits=Limits(client_queue=16), telemetry=d.telemetry,
                            batcher=d.batcher)  # fmt: skip
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session.run)
            for burst in range(2):  # never reads a reply
                epochs = range(burst * 50, burst * 50 + 50)
                await client.send_all(b"".join(commit(e + 1, 0, "nvme", e) for e in epochs))
                await trio.sleep(1)  # the fsync, then the writer blocks sending
            assert not d.telemetry.counters().get("api_errors_client_too_slow")
            await trio.sleep(SEND_STALL_S)
            nursery.cancel_scope.cancel()
    assert d.telemetry.counters()["api_errors_client_too_slow"] == 1


async def test_a_poll_with_timeout_0_gets_a_generation_resolved_in_time(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    # A one-member stream resolves its generation at the first request, but the
    # freeze is still on its way to disk when a zero timeout runs out: the answer
    # stands (after the fsync), it is not a timeout.
    d = Daemon(tmp_path)
    for rank in range(4):
        for domain in ("nvme", "s3"):
            d.gate.apply(Commit("job", rank, domain, 5))
    answer = await d.ops.restore_point("job", 1, 0)
    assert (answer["resolved"], answer["restore_point"]) == (True, 5)
    assert await d.ops.next_generation("job", 0) == {"stream": "job", "generation": 2}
