"""Where the job's ranks run, and how a membership change moves them.

The simulated cluster is fixed from the start (peers and trust are static, as in a
real deployment): the job's first members plus a few pre-provisioned *spares*, nodes
that run a daemon linked to every peer but hold no stream until the job moves ranks
to them. A `Placement` maps every rank to the node that hosts it now; the spec the
job declares says the same (`members`). A membership change computes a new placement:

* `replaced`: a spare takes over every rank of a dead node;
* `shrunk`: the ranks of one member move to the remaining members, spread evenly;
* `grown`: a node outside the job takes some ranks from the members that host more
  than one.

The total set of ranks never changes (a rank that moves keeps its number), so an
epoch is complete when every rank of the job has it, whichever world saved it. A
node that died for good is *gone*: it never runs again, and no placement uses it.
"""

from __future__ import annotations

import random
from collections.abc import Iterable


class Placement:
    """The job's ranks and their hosts (see the module docstring)."""

    def __init__(self, hosts: dict[int, str]) -> None:
        self.hosts = dict(hosts)
        """Rank -> the node that hosts it."""

    def members(self) -> dict[str, list[int]]:
        """Node -> its ranks, sorted (the ``members`` of a spec)."""
        out: dict[str, list[int]] = {}
        for rank in sorted(self.hosts):
            out.setdefault(self.hosts[rank], []).append(rank)
        return dict(sorted(out.items()))

    def node_ids(self) -> list[str]:
        """The members, sorted."""
        return sorted(set(self.hosts.values()))

    def ranks_on(self, node: str) -> list[int]:
        """The ranks ``node`` hosts, sorted (empty for a non-member)."""
        return sorted(r for r, n in self.hosts.items() if n == node)

    def same_as(self, members: Iterable[tuple[str, tuple[int, ...]]]) -> bool:
        """Whether a spec's ``members`` describe this placement."""
        return {r: n for n, ranks in members for r in ranks} == self.hosts

    # -- membership changes ---------------------------------------------------------

    def replaced(self, dead: str, spare: str) -> Placement:
        """``spare`` hosts every rank of ``dead``."""
        return Placement({r: spare if n == dead else n for r, n in self.hosts.items()})

    def shrunk(self, out: str, rng: random.Random) -> Placement:
        """The ranks of ``out`` move to the other members, the least loaded first."""
        rest = [n for n in self.node_ids() if n != out]
        assert rest, "a job keeps at least one member"
        hosts = {r: n for r, n in self.hosts.items() if n != out}
        load = {n: sum(1 for h in hosts.values() if h == n) for n in rest}
        for rank in sorted(r for r, n in self.hosts.items() if n == out):
            least = min(load.values())
            target = rng.choice([n for n in rest if load[n] == least])
            hosts[rank] = target
            load[target] += 1
        return Placement(hosts)

    def grown(self, new: str, rng: random.Random) -> Placement | None:
        """``new`` takes one rank from each of some members hosting more than one
        (None: every member hosts a single rank)."""
        donors = [n for n in self.node_ids() if len(self.ranks_on(n)) > 1]
        if not donors:
            return None
        chosen = rng.sample(donors, rng.randint(1, len(donors)))
        hosts = dict(self.hosts)
        for n in sorted(chosen):
            hosts[rng.choice(self.ranks_on(n))] = new
        return Placement(hosts)
