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

SPEC = StreamSpec.create("job", {"a": [0, 1]}, Policy.all_of("nvme"))


class Node:
    """Node ``a`` with ``job`` declared and durable."""

    def __init__(self) -> None:
        self.core = NodeCore("a", 1)
        self.gate = OutputGate(self.core)
        self.admission = Admission(self.core, self.gate)
        self.admission.submit(Declare(SPEC))
        self.sync()

    def sync(self) -> list[Fact]:
        """Make everything durable; return the facts written."""
        facts, position = self.gate.take_unlogged()
        self.gate.synced(position)
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
