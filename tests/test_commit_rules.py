"""What a node accepts from its clients never produces a record its peers refuse.

The rules of `core.admission` on commits, retractions and retirements, driven as the
daemon drives them (`Admission` and `OutputGate`, the log being the gate's list of
unlogged facts); `test_daemon_commits.py` checks the same against real daemons.
"""

from __future__ import annotations

import pytest

from convergenced.core import limits
from convergenced.core.admission import Admission
from convergenced.core.facts import Commit, Declare, Fact, Retire, Retract
from convergenced.core.gate import OutputGate
from convergenced.core.local_api_codec import ApiError
from convergenced.core.node import NodeCore
from convergenced.core.records import Record
from convergenced.core.spec import Policy, StreamSpec

SPEC = StreamSpec.create("job", {"a": [0, 1]}, Policy.all_of("nvme"), retention=2)


class Node:
    """Node ``a`` with ``job`` declared and durable, or rebuilt from ``log``."""

    def __init__(self, log: list[Fact] | None = None) -> None:
        self.core = NodeCore("a", 1 if log is None else 2)
        if log is not None:
            self.core.replay(log)
        self.gate = OutputGate(self.core)
        self.admission = Admission(self.core, self.gate)
        self.log: list[Fact] = list(log or [])
        if log is None:
            self.admission.submit(Declare(SPEC))
        self.sync()

    def sync(self) -> list[Fact]:
        """Make everything durable; return the facts written."""
        facts, position = self.gate.take_unlogged()
        self.gate.synced(position)
        self.log += facts
        return list(facts)

    def refusal(self, fact: Fact) -> str:
        with pytest.raises(ApiError) as info:
            self.admission.submit(fact)
        return info.value.reason


@pytest.mark.parametrize("cls", [Commit, Retract, Retire])
def test_a_fact_about_a_domain_the_policy_does_not_name_is_refused(
    cls: type[Commit] | type[Retract] | type[Retire],
) -> None:
    n = Node()
    n.admission.submit(Commit("job", 0, "nvme", 1))
    n.sync()
    assert n.refusal(cls("job", 0, "nvm", 1)) == "unknown_domain"
    assert n.sync() == []
    assert n.core.status("job").newest == {"a": {}}  # rank 1 holds nothing


def test_a_record_made_from_a_log_with_commits_in_70_domains_is_one_peers_accept() -> None:
    # A log written before the local API refused other domains may hold such commits.
    core = NodeCore("a", 1)
    log: list[Fact] = [Declare(SPEC)]
    for d in ("nvme", *(f"tier{i}" for i in range(70))):
        log += [Commit("job", 0, d, 1), Commit("job", 1, d, 1)]
    core.replay(log)
    rec = core.own_record("job")
    assert rec is not None and rec.newest == (("nvme", 1),)
    assert Record.from_wire(rec.to_wire(), "record") == rec


def test_the_limits_fit_together() -> None:
    # A policy's domains are all a record's newest may name: they must fit in it.
    assert limits.MAX_POLICY_DOMAINS <= limits.MAX_DOMAINS


# -- digests ------------------------------------------------------------------------

A = "sha256:" + "ab" * 32
B = "sha256:" + "cd" * 32
C = "sha256:" + "ef" * 32


@pytest.mark.parametrize(
    "digest",
    [
        "d",
        "ab" * 32,  # no algorithm
        "sha256:" + "ab" * 31,  # too short
        "sha256:" + "ab" * 33,
        "sha256:" + "AB" * 32,  # one spelling only: digests are compared as text
        "sha256:" + "ag" * 32,
        "md6:" + "ab" * 32,
        "sha512:" + "ab" * 32,  # sha512 takes 128 digits
    ],
)
def test_a_digest_that_is_not_algo_hex_of_its_length_is_refused(digest: str) -> None:
    n = Node()
    assert n.refusal(Commit("job", 0, "nvme", 1, digest, 5)) == "bad_digest"
    assert n.sync() == []


@pytest.mark.parametrize("digest", [A, "sha512:" + "0f" * 64, "md5:" + "0" * 32, ""])
def test_a_digest_of_a_known_algorithm_and_length_is_taken(digest: str) -> None:
    n = Node()
    n.admission.submit(Commit("job", 0, "nvme", 1, digest, 5))
    assert n.sync() == [Commit("job", 0, "nvme", 1, digest, 5)]


@pytest.mark.parametrize(("digest", "size"), [(B, 100), (A, 101), (A, 0), ("", 101)])
def test_another_content_for_an_epoch_held_is_a_conflict(digest: str, size: int) -> None:
    n = Node()
    n.admission.submit(Commit("job", 0, "nvme", 5, A, 100))
    n.sync()
    assert n.refusal(Commit("job", 0, "nvme", 5, digest, size)) == "digest_conflict"
    assert n.sync() == []
    assert n.admission.submit(Commit("job", 0, "nvme", 5, A, 100)).repeat  # unchanged


def relaunch(n: Node, generation: int) -> int | None:
    """What a relaunched job does first: ask for ``generation``'s restore point."""
    fact = n.core.freeze_fact("job", generation)
    assert fact is not None
    n.admission.submit(fact)
    n.sync()
    answer = n.core.generation("job", generation)
    assert answer.resolved
    return answer.restore_point


def saved(n: Node, epochs: range, digest: str) -> None:
    for e in epochs:
        for rank in (0, 1):
            n.admission.submit(Commit("job", rank, "nvme", e, digest, e))
    n.sync()


def test_after_a_relaunch_its_saves_above_the_restore_point_supersede() -> None:
    n = Node()
    saved(n, range(1, 6), A)
    n.admission.submit(Retract("job", 1, "nvme", 5))  # rank 1 lost epoch 5
    n.sync()
    assert relaunch(n, 1) == 4
    # The new launch restores 4 and saves 5 again, with other bytes (not deterministic).
    n.admission.submit(Commit("job", 0, "nvme", 5, B, 5))
    assert n.sync() == [Commit("job", 0, "nvme", 5, B, 5)]
    assert n.admission.submit(Commit("job", 0, "nvme", 5, B, 5)).repeat  # its own retry
    # Within the new launch, a third content is a conflict again.
    assert n.refusal(Commit("job", 0, "nvme", 5, C, 5)) == "digest_conflict"
    # The restore point it restored from keeps its content.
    assert n.refusal(Commit("job", 0, "nvme", 4, B, 4)) == "digest_conflict"
    assert n.sync() == []


def test_while_a_generation_is_unresolved_only_epochs_above_its_frozen_set_supersede() -> None:
    pair = StreamSpec.create("pair", {"a": [0], "b": [1]}, Policy.all_of("nvme", "s3"))
    n = Node()
    n.admission.submit(Declare(pair))
    for e in (1, 2, 3):
        for d in ("nvme", "s3"):
            n.admission.submit(Commit("pair", 0, d, e, A, e))
    n.admission.submit(Commit("pair", 0, "nvme", 9, A, 9))  # 9 never reached s3
    n.sync()
    fact = n.core.freeze_fact("pair", 1)  # b's frozen set unknown: unresolved
    assert fact is not None and fact.epochs.max() == 3
    n.admission.submit(fact)
    n.admission.submit(Commit("pair", 0, "nvme", 4, A, 4))  # the old launch, still saving
    n.sync()
    assert not n.core.generation("pair", 1).resolved
    assert n.refusal(Commit("pair", 0, "nvme", 3, B, 3)) == "digest_conflict"
    assert n.refusal(Commit("pair", 0, "nvme", 4, B, 4)) == "digest_conflict"  # after g
    assert not n.admission.submit(Commit("pair", 0, "nvme", 9, B, 9)).repeat
    assert n.sync() == [Commit("pair", 0, "nvme", 9, B, 9)]


def test_the_rules_hold_after_log_compaction_and_a_restart() -> None:
    n = Node()
    saved(n, range(1, 6), A)
    n.admission.submit(Retract("job", 1, "nvme", 5))
    n.sync()
    assert relaunch(n, 1) == 4
    n.admission.submit(Commit("job", 0, "nvme", 6, B, 6))  # new launch, new epoch
    n.sync()
    for log in (n.log, n.core.compacted_facts()):
        m = Node(log)
        assert m.admission.submit(Commit("job", 0, "nvme", 3, A, 3)).repeat
        assert m.refusal(Commit("job", 0, "nvme", 3, B, 3)) == "digest_conflict"
        assert m.refusal(Commit("job", 0, "nvme", 6, C, 6)) == "digest_conflict"
        assert not m.admission.submit(Commit("job", 0, "nvme", 5, B, 5)).repeat  # supersedes
        assert m.sync() == [Commit("job", 0, "nvme", 5, B, 5)]


# -- members ------------------------------------------------------------------------

TRIO = StreamSpec.create("trio", {"a": [0], "b": [1], "typo": [2]}, Policy.all_of("nvme"))


def in_cluster(*nodes: str) -> Node:
    n = Node()
    n.admission.cluster = frozenset(nodes)
    return n


def test_a_declaration_naming_a_member_outside_the_cluster_is_refused() -> None:
    n = in_cluster("a", "b")
    assert n.refusal(Declare(TRIO)) == "unknown_member"
    assert n.sync() == [] and "trio" not in n.core.streams()


def test_a_member_not_configured_yet_is_taken_when_the_declaration_allows_it() -> None:
    n = in_cluster("a", "b")
    assert not n.admission.submit(Declare(TRIO), allow_unknown_members=True).repeat
    assert n.sync() == [Declare(TRIO)]
    # Sent again by a reconnecting client without the flag: still the same stream.
    assert n.admission.submit(Declare(TRIO)).repeat


def test_members_of_the_cluster_are_taken() -> None:
    n = in_cluster("a", "b", "typo")
    n.admission.submit(Declare(TRIO))
    assert n.sync() == [Declare(TRIO)]


def test_a_new_membership_declared_through_admission_is_applied_not_a_repeat() -> None:
    """A relaunch's declaration of a new member map reaches the core through the
    local API's `Admission`: it must move the stream to the new map (a declaration
    of the spec held is the only repeat), and its Declare must reach the log."""
    policy = Policy.any_of("nvme", "s3")
    first = StreamSpec.create("moved", {"a": [0], "c": [1]}, policy, 0, shared=["s3"])
    n = Node()
    n.admission.submit(Declare(first))
    n.sync()
    new = StreamSpec.create("moved", {"a": [0], "d": [1]}, policy, 0, shared=["s3"],
                            membership=1)  # fmt: skip
    assert not n.admission.submit(Declare(new)).repeat
    assert n.core.spec("moved") == new
    assert n.sync() == [Declare(new)]
    assert n.admission.submit(Declare(new)).repeat  # the same map again: a repeat
    assert n.sync() == []
