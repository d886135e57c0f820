"""A fact sent again: acknowledged once durable, never applied, logged or counted twice.

A client that reconnects after its daemon restarted sends again what it got no answer
for. These tests drive the node's `Admission` and `OutputGate` as the daemon does
(the log is the gate's list of unlogged facts); `test_daemon_commits.py` does the same
against a real daemon across kill -9 and log compaction.
"""

from __future__ import annotations

from convergenced.core.admission import Admission
from convergenced.core.commits import Verdict
from convergenced.core.facts import Commit, Declare, Fact, Freeze, Retract
from convergenced.core.gate import OutputGate
from convergenced.core.interval_set import IntervalSet
from convergenced.core.node import NodeCore
from convergenced.core.spec import Policy, StreamSpec

SPEC = StreamSpec.create("job", {"a": [0, 1]}, Policy.all_of("nvme"))
DIGEST = "sha256:" + "ab" * 32
OTHER = "sha256:" + "cd" * 32


class Node:
    """Node ``a`` with ``job`` declared and durable."""

    def __init__(self, facts: list[Fact] | None = None) -> None:
        self.core = NodeCore("a", 1)
        if facts is not None:
            self.core.replay(facts)
        self.gate = OutputGate(self.core)
        self.admission = Admission(self.core, self.gate)
        if facts is None:
            self.admission.submit(Declare(SPEC))
        self.sync()

    def sync(self) -> list[Fact]:
        """Make everything durable; return the facts written."""
        facts, position = self.gate.take_unlogged()
        self.gate.synced(position)
        return list(facts)


def test_a_commit_sent_again_is_acknowledged_and_neither_applied_nor_logged() -> None:
    n = Node()
    first = n.admission.submit(Commit("job", 0, "nvme", 5, DIGEST, 100))
    assert not first.repeat
    assert n.sync() == [Commit("job", 0, "nvme", 5, DIGEST, 100)]
    again = n.admission.submit(Commit("job", 0, "nvme", 5, DIGEST, 100))
    assert again.repeat
    assert again.reply == first.reply == {"stream": "job", "epoch": 5, "durable": True}
    assert n.sync() == []


def test_the_reply_to_a_repeat_waits_for_the_fsync_of_the_commit_it_repeats() -> None:
    n = Node()
    out = n.gate.output()
    n.admission.submit(Commit("job", 0, "nvme", 5, DIGEST, 100))  # not durable yet
    assert n.admission.submit(Commit("job", 0, "nvme", 5, DIGEST, 100)).repeat
    out.send(b"reply to the repeat")  # what a session does with the reply
    assert out.releasable() == 0
    n.sync()
    assert out.release() == [b"reply to the repeat"]


def test_a_commit_that_states_no_digest_of_an_epoch_held_is_a_repeat() -> None:
    n = Node()
    n.admission.submit(Commit("job", 0, "nvme", 5, DIGEST, 100))
    n.sync()
    assert n.admission.submit(Commit("job", 0, "nvme", 5)).repeat
    assert n.sync() == []
    assert n.core.judge(Commit("job", 0, "nvme", 5, DIGEST, 100)) is Verdict.REPEAT


def test_a_commit_held_without_a_digest_and_sent_again_without_one_is_a_repeat() -> None:
    n = Node()
    n.admission.submit(Commit("job", 0, "nvme", 5))
    assert n.sync() == [Commit("job", 0, "nvme", 5)]
    assert n.admission.submit(Commit("job", 0, "nvme", 5)).repeat
    assert n.sync() == []


def test_a_commit_stating_the_content_of_an_epoch_held_without_one_is_applied() -> None:
    n = Node()
    n.admission.submit(Commit("job", 0, "nvme", 5))
    n.sync()
    assert not n.admission.submit(Commit("job", 0, "nvme", 5, DIGEST, 100)).repeat
    assert n.sync() == [Commit("job", 0, "nvme", 5, DIGEST, 100)]
    assert n.admission.submit(Commit("job", 0, "nvme", 5, DIGEST, 100)).repeat


def test_the_same_epoch_of_another_rank_or_domain_is_not_a_repeat() -> None:
    n = Node()
    n.admission.submit(Commit("job", 0, "nvme", 5, DIGEST, 100))
    n.sync()
    assert n.core.judge(Commit("job", 1, "nvme", 5, DIGEST, 100)) is Verdict.NEW
    assert n.core.judge(Commit("job", 0, "nvme", 6, DIGEST, 100)) is Verdict.NEW


def test_an_epoch_lost_and_committed_again_is_new() -> None:
    n = Node()
    n.admission.submit(Commit("job", 0, "nvme", 5, DIGEST, 100))
    n.admission.submit(Retract("job", 0, "nvme", 5))
    n.sync()
    assert not n.admission.submit(Commit("job", 0, "nvme", 5, DIGEST, 100)).repeat
    assert n.sync() == [Commit("job", 0, "nvme", 5, DIGEST, 100)]


def test_a_declaration_sent_again_is_acknowledged_and_not_logged() -> None:
    n = Node()
    again = n.admission.submit(Declare(SPEC))
    assert again.repeat
    assert again.reply == {"stream": "job", "digest": SPEC.digest.hex()}
    assert n.sync() == []


def test_a_repeat_is_recognised_after_a_restart_from_the_log() -> None:
    n = Node()
    n.admission.submit(Commit("job", 0, "nvme", 5, DIGEST, 100))
    log = [Declare(SPEC), *n.sync()]
    restarted = Node(log)
    assert restarted.admission.submit(Commit("job", 0, "nvme", 5, DIGEST, 100)).repeat
    assert restarted.sync() == []


def test_a_repeat_is_recognised_after_log_compaction() -> None:
    n = Node()
    for epoch in range(1, 6):
        for rank in (0, 1):
            n.admission.submit(Commit("job", rank, "nvme", epoch, f"sha256:{epoch:064x}", epoch))
    n.sync()
    restarted = Node(n.core.compacted_facts())
    for epoch in range(1, 6):
        again = Commit("job", 1, "nvme", epoch, f"sha256:{epoch:064x}", epoch)
        assert restarted.admission.submit(again).repeat
    assert restarted.core.judge(Commit("job", 1, "nvme", 3, OTHER, 3)) is Verdict.CONFLICT
    assert restarted.sync() == []


def test_compaction_keeps_when_each_content_came_relative_to_the_open_generations() -> None:
    pair = StreamSpec.create("pair", {"a": [0], "b": [1]}, Policy.all_of("nvme"))
    n = Node()
    n.admission.submit(Declare(pair))
    n.admission.submit(Commit("pair", 0, "nvme", 1, DIGEST, 1))
    n.admission.submit(Freeze("pair", 3, IntervalSet.of(1)))  # b's set unknown: open
    n.admission.submit(Commit("pair", 0, "nvme", 2, DIGEST, 2))
    n.admission.submit(Freeze("pair", 7, IntervalSet.of(1)))
    n.admission.submit(Commit("pair", 0, "nvme", 3, DIGEST, 3))
    n.sync()
    compacted = n.core.compacted_facts()
    rebuilt = NodeCore("a", 2)
    rebuilt.replay(compacted)
    facts = rebuilt._streams["pair"].facts
    after = [c.after for e in (1, 2, 3) if (c := facts.content(0, "nvme", e)) is not None]
    assert after == [None, 3, 7]
    assert rebuilt.compacted_facts() == compacted
