"""The training workload: ranks saving epochs to several domains at their own pace.

Each rank finishes a training step every ``period`` (with jitter), then its save
lands in each persistence domain after that domain's lag: fast tiers (GPU memory,
RAM) almost at once, slow tiers (NVMe, object store) later and more erratically.
That is what makes domains and nodes disagree at any instant, and it is the same
model the epoch-lattice figure samples.

A domain is node-local or shared (`storage`); `domain_names` names a seed's domains
for either kind of cluster: with a shared tier, the slowest is an object store.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

DOMAIN_NAMES = ("gpu", "ram", "nvme", "s3", "fs", "tape", "peer", "cold")
SHARED_KINDS = frozenset({"s3", "fs", "tape", "cold"})
"""The domains that are shared (readable from any node) where a seed has a shared tier."""


@dataclass(frozen=True, slots=True)
class DomainModel:
    """How late and how erratic one domain is, in microseconds."""

    name: str
    lag: int
    jitter: int


def domain_names(count: int, shared_tier: bool) -> tuple[list[str], frozenset[str]]:
    """The names of ``count`` domains, fastest first, and which of them are shared.

    Without a shared tier, every domain is node-local (whatever its name). With one,
    the slowest domain is an object store (``s3``; with 1-3 domains the names are
    the slowest local tiers then ``s3``, e.g. ram, nvme, s3), and the other domains
    of `SHARED_KINDS` among the names are shared too.
    """
    if not shared_tier:
        return list(DOMAIN_NAMES[:count]), frozenset()
    names = list(DOMAIN_NAMES[:count]) if count > 3 else [*DOMAIN_NAMES[3 - count + 1 : 3], "s3"]
    return names, SHARED_KINDS & set(names)


def domain_models(
    count: int, rng: random.Random, names: list[str] | None = None
) -> list[DomainModel]:
    """``count`` domains from fastest to slowest, with seeded lags (named
    ``names``, default the first of `DOMAIN_NAMES`)."""
    names = names or list(DOMAIN_NAMES[:count])
    out = []
    for i in range(count):
        base = 200 + i * rng.randint(1_500, 4_000)
        out.append(DomainModel(names[i], base, base // 2 + 500))
    return out


class RankSchedule:
    """When each epoch of one rank becomes durable in each domain.

    Completion times are monotone per domain (a tier writes in order) and computed
    lazily, so a run can be as long as it likes.
    """

    def __init__(
        self, rank: int, period: int, domains: list[DomainModel], rng: random.Random
    ) -> None:
        self.rank = rank
        self.period = period
        self.domains = domains
        self._rng = rng
        self._last = {d.name: 0 for d in domains}
        self.epoch = 0

    def next_epoch(self) -> tuple[int, dict[str, int]]:
        """The next epoch and its completion time per domain."""
        self.epoch += 1
        # Data-parallel ranks step together (the all-reduce keeps them in lockstep),
        # so a rank's step ends near the job's step time, not on its own drift.
        step_end = self.epoch * self.period + self._rng.randint(0, self.period // 10)
        times: dict[str, int] = {}
        for d in self.domains:
            t = step_end + d.lag + self._rng.randint(0, d.jitter)
            t = max(t, self._last[d.name] + 1)
            self._last[d.name] = t
            times[d.name] = t
        return self.epoch, times


def lattice_fraction(
    domains: int,
    nodes: int,
    ranks_per_node: int,
    samples: int,
    rng: random.Random,
    *,
    period: int = 30_000,
) -> float:
    """Fraction of sampled instants at which every domain on every node holds the
    same newest epoch (the paper's epoch-lattice figure).

    The default period (a checkpoint every 30 ms of virtual time) is longer than
    the slowest tier's lag, so a single fast domain is usually consistent; every
    tier added brings its own lag and jitter.
    """
    models = domain_models(domains, rng)
    horizon = samples * period // 4 + 20 * period
    # Per (node, domain): the newest epoch all its ranks hold, as a step function.
    per_rank: dict[tuple[int, int, str], list[tuple[int, int]]] = {}
    for n in range(nodes):
        for r in range(ranks_per_node):
            sched = RankSchedule(r, period, models, rng)
            while True:
                e, times = sched.next_epoch()
                if min(times.values()) > horizon:
                    break
                for name, t in times.items():
                    per_rank.setdefault((n, r, name), []).append((t, e))
    hits = 0
    for _ in range(samples):
        t = 20 * period + rng.randint(0, horizon - 21 * period)
        newest = set()
        for n in range(nodes):
            for d in models:
                lows = []
                for r in range(ranks_per_node):
                    lst = per_rank.get((n, r, d.name), [])
                    done = 0
                    for tt, e in lst:
                        if tt <= t:
                            done = e
                        else:
                            break
                    lows.append(done)
                newest.add(min(lows))
        hits += len(newest) == 1
    return hits / samples
