"""What other checkpoint tools would have restored (``--compare``).

At fixed instants of the faulty phase, and at every crash, the simulator asks what
a baseline's restore rule would pick if the job restarted now, and scores the pick
with the same test as S1 applies to convergenced's restore points (every rank of
every member committed it in the policy's domains and never deleted it). At the
same instants it applies that test to every node's convergenced restore point.

* ``marker``: a ``latest`` marker written by rank 0 once its own save of an epoch
  reached every policy domain (as DeepSpeed and Megatron write it).
"""

from __future__ import annotations

from typing import Protocol

from convergenced.core.spec import StreamSpec
from convergenced.sim.loop import EventLoop
from convergenced.sim.network import STREAM
from convergenced.sim.node import SimNode
from convergenced.sim.oracle import Truth

SAMPLE_US = 5_000
"""Virtual time between two samples."""


class BaselineWorld(Protocol):
    """What the baselines look at: the world of one run."""

    loop: EventLoop
    nodes: dict[str, SimNode]
    ids: list[str]
    spec: StreamSpec
    truth: Truth
    phase: str


class Baselines:
    """The samples of one run and their scores (see the module docstring)."""

    def __init__(self, world: BaselineWorld) -> None:
        self.world = world
        self.samples = 0
        self.marker_invalid = 0
        self.convergence_invalid = 0

    def start(self) -> None:
        """Schedule the first sample."""
        self.world.loop.at(SAMPLE_US, self.sample)

    def sample(self, reschedule: bool = True) -> None:
        """Score each rule now (and, with ``reschedule``, sample again later)."""
        w = self.world
        if w.phase != "safety":
            return
        if reschedule:
            w.loop.after(SAMPLE_US, self.sample)
        rank0 = w.spec.members[0][1][0]
        domains = w.spec.policy.domains
        saved = [w.truth.ever[(rank0, d)] for d in domains]
        if not all(saved):
            return
        marker = min(max(s) for s in saved)
        self.samples += 1
        # The same yardstick as S1 for convergenced: committed by every rank of
        # every member and never deleted (losses count against neither).
        if not w.truth.valid(marker):
            self.marker_invalid += 1
        for nid in w.ids:
            core = w.nodes[nid].core
            if core is not None and STREAM in core.streams():
                rp = core.restore_point(STREAM)
                if rp is not None and not w.truth.valid(rp):
                    self.convergence_invalid += 1
