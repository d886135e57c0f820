"""Log compaction: `NodeCore.compacted_facts` rebuilds the same local state as the
full log, refuses the same facts afterwards, tells the same commits sent again, and
survives a round trip through the write-ahead log. (The simulator also compacts every
eighth write of each node's log, so the S1-S5 oracle checks compaction under faults;
see `sim.node`.)"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from convergenced.core.errors import ConvergencedError
from convergenced.core.facts import Commit, Declare, Fact, Freeze, RankState, Retire, Retract
from convergenced.core.interval_set import IntervalSet
from convergenced.core.node import NodeCore
from convergenced.core.spec import Policy, StreamSpec
from convergenced.daemon.durability.entries import Incarnation
from convergenced.daemon.durability.log_file import FactLog

SOLO = StreamSpec.create("solo", {"n": [0, 1]}, Policy.all_of("nvme", "s3"), retention=1)
ANY = StreamSpec.create("any", {"n": [0], "m": [1]}, Policy.any_of("nvme", "s3"))
DOMAINS = ("nvme", "s3", "ram")

epoch_facts = st.tuples(
    st.sampled_from(["commit", "commit", "commit", "retract", "retire", "freeze"]),
    st.sampled_from(["solo", "any"]),
    st.integers(0, 1),
    st.sampled_from(DOMAINS),
    st.integers(0, 12),
)


def _fact(kind: str, stream: str, rank: int, domain: str, epoch: int) -> Fact:
    if stream == "any":
        rank = 0
    if kind == "commit":  # some with a digest and size, some without
        return Commit(stream, rank, domain, epoch, *(("d", 1), ("e", 2), ("", 0))[epoch % 3])
    if kind == "retract":
        return Retract(stream, rank, domain, epoch)
    if kind == "retire":
        return Retire(stream, rank, domain, epoch)
    return Freeze(stream, epoch % 4, IntervalSet.span(0, epoch))


def _build(raw: list[tuple[Any, ...]]) -> NodeCore:
    node = NodeCore("n", 1)
    node.apply(Declare(SOLO))
    node.apply(Declare(ANY))
    for item in raw:
        fact = _fact(*item)
        with contextlib.suppress(ConvergencedError):  # a refusal changes nothing
            node.apply(fact)
    return node


def _local_state(node: NodeCore) -> list[Any]:
    out: list[Any] = []
    for name in node.streams():
        s = node.status(name)
        out.append(
            (
                name,
                s.recoverable,
                s.newest.get("n"),
                s.high_water,
                s.generations,
                s.restore_point,
                s.proposal,
            )
        )
    return out


def _refusals(node: NodeCore) -> list[str | None]:
    probes = [
        Commit(s, r, d, e) for s in ("solo",) for r in (0, 1) for d in DOMAINS for e in range(0, 13)
    ]
    out: list[str | None] = []
    for p in probes:
        try:
            node.check(p)
            out.append(None)
        except ConvergencedError as exc:
            out.append(getattr(exc, "reason", type(exc).__name__))
            continue
        for digest, size in (("d", 1), ("e", 2), ("", 0)):  # new, repeat or other content
            out.append(node.judge(Commit(p.stream, p.rank, p.domain, p.epoch, digest, size)).value)
    return out


@settings(max_examples=150, deadline=None)
@given(st.lists(epoch_facts, max_size=60))
def test_compacted_facts_rebuild_the_same_state(raw: list[tuple[Any, ...]]) -> None:
    full = _build(raw)
    compacted = full.compacted_facts()
    rebuilt = NodeCore("n", 2)
    rebuilt.replay(compacted)
    assert _local_state(rebuilt) == _local_state(full)
    assert _refusals(rebuilt) == _refusals(full)
    assert rebuilt.compacted_facts() == compacted  # compaction is idempotent


def test_compaction_is_bounded_by_ranks_and_domains_not_by_epochs() -> None:
    node = NodeCore("n", 1)
    node.apply(Declare(SOLO))
    for e in range(2000):
        for rank in (0, 1):
            for d in ("nvme", "s3"):
                node.apply(Commit("solo", rank, d, e))
    for e in range(0, 1500):
        for rank in (0, 1):
            for d in ("nvme", "s3"):
                node.apply(Retire("solo", rank, d, e))
    facts = node.compacted_facts()
    assert sum(isinstance(f, RankState) for f in facts) == 4
    assert len(facts) <= 7  # declare, 4 rank states, the high-water mark, the horizon


def test_rank_state_round_trips_through_the_log(tmp_path: Path) -> None:
    wal, _, _ = FactLog.open(tmp_path / "facts.wal")
    entries = [
        Incarnation(3),
        Declare(SOLO),
        RankState("solo", 1, "nvme", IntervalSet([(1, 4), (9, 9)]), IntervalSet([(0, 0)])),
    ]
    for e in entries:
        wal.append(e)
    wal.write_durably(wal.take_pending())
    wal.replace_durably(entries[:2])
    wal.append(entries[2])
    wal.write_durably(wal.take_pending())
    wal.close()
    _, back, report = FactLog.open(tmp_path / "facts.wal")
    assert back == entries and report.torn_tail_bytes == 0
