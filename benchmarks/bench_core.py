"""Benchmarks of the sans-IO core (run by ``make bench-core``).

Three scenarios, each timed with ``time.perf_counter_ns`` over repeated runs and
reported as the median and the 90th percentile (nearest rank):

1. **wire**: a TICK carrying 50 realistic records (a recoverable set of three
   ranges, three domains in ``newest``, proposal / restore point / high-water set,
   a 32-byte spec digest, unsigned), encoded with `encode_message` and decoded back
   through a `FrameDecoder` and `decode_message`. Target: round trip < 100 us.
2. **merge**: 1,000 freshly built records (their fingerprints not yet cached, as
   when they come off the wire) merged into a fresh `View` with `View.merge_all`,
   and 999 peer records of a 1,000-member stream delivered to a `NodeCore` with
   `NodeCore.receive` (which also re-evaluates agreement). Target: < 5 ms.
3. **recoverable**: a node hosting 64 ranks under ``all_of`` 4 domains applies
   64 x 4 x 1,000 `Commit` facts through `NodeCore.apply` (domains lag each other as
   asynchronous saves do); then the recoverable set is recomputed from scratch
   (`StreamFacts._recompute_all`) and single commits are applied at the end.
   Informational rows repeat the last two with *sparse* epochs (step numbers saved
   every 100 steps, so every set has 1,000 ranges). No targets were set for these.

The garbage collector stays enabled (the daemon runs with it); it is collected
before each sample that has its own setup. Targets are compared with the median.
Nothing here is tuned to meet a target.

Usage::

    .venv/bin/python benchmarks/bench_core.py [--quick] [--json]

``--quick`` runs a small smoke version (fewer samples, 50 epochs instead of 1,000);
``--json`` additionally prints one JSON object with every number on the last line;
``--builds N`` sets how often the commit stream is rebuilt (the slowest part).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgpack

from convergenced.core.facts import Commit, Declare, StreamFacts
from convergenced.core.interval_set import IntervalSet
from convergenced.core.messages import Tick
from convergenced.core.node import NodeCore
from convergenced.core.records import Record, View
from convergenced.core.spec import Policy, StreamSpec
from convergenced.core.wire import FrameDecoder, decode_message, encode_message

T = TypeVar("T")

US = 1_000
MS = 1_000_000

ROUND_TRIP_TARGET_NS = 100 * US
MERGE_TARGET_NS = 5 * MS

STREAM = "llama-70b-pretrain"
BASE_EPOCH = 152_000
"""Realistic step-sized epochs (they need 5 bytes in msgpack, as real ones do)."""
HOLE_POOL = tuple(BASE_EPOCH + d for d in (10, 14, 19, 23, 27, 31))
"""Epochs a retraction removed on some members: gives each set three ranges."""
RECORD_DOMAINS = ("gpu", "nvme", "ram")

RECOVERY_NODE = "gpu-node-0007"
RECOVERY_DOMAINS = ("gpu", "ram", "nvme", "s3")
RECOVERY_LAG = {"gpu": 0, "ram": 1, "nvme": 2, "s3": 4}
"""How many epochs each domain trails the fastest one (asynchronous saves)."""
RECOVERY_RANKS = 64
SPARSE_STRIDE = 100


# -- configuration and results -------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    """Sample counts for one run."""

    mode: str
    wire_warmup: int
    wire_samples: int
    merge_warmup: int
    merge_samples: int
    steady_samples: int
    epochs: int
    builds: int
    recompute_samples: int
    incremental_epochs: int
    sparse_recompute_samples: int
    sparse_commit_samples: int


FULL = Config(
    mode="full",
    wire_warmup=300,
    wire_samples=3000,
    merge_warmup=5,
    merge_samples=100,
    steady_samples=2000,
    epochs=1000,
    builds=3,
    recompute_samples=300,
    incremental_epochs=16,
    sparse_recompute_samples=15,
    sparse_commit_samples=30,
)

QUICK = Config(
    mode="quick",
    wire_warmup=20,
    wire_samples=200,
    merge_warmup=1,
    merge_samples=8,
    steady_samples=100,
    epochs=50,
    builds=1,
    recompute_samples=30,
    incremental_epochs=2,
    sparse_recompute_samples=2,
    sparse_commit_samples=3,
)


@dataclasses.dataclass(slots=True)
class Result:
    """One row of the table."""

    key: str
    label: str
    samples_ns: list[int]
    target_ns: int | None = None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def median_ns(self) -> float:
        """Median of the samples."""
        return float(statistics.median(self.samples_ns))

    @property
    def p90_ns(self) -> float:
        """90th percentile of the samples (nearest rank)."""
        ordered = sorted(self.samples_ns)
        return float(ordered[max(math.ceil(0.9 * len(ordered)) - 1, 0)])

    @property
    def status(self) -> str:
        """PASS / MISS against the target, compared with the median; ``-`` without one."""
        if self.target_ns is None:
            return "-"
        return "PASS" if self.median_ns <= self.target_ns else "MISS"

    def to_json(self) -> dict[str, Any]:
        """The row as plain JSON values."""
        return {
            "key": self.key,
            "label": self.label,
            "samples": len(self.samples_ns),
            "median_ns": self.median_ns,
            "p90_ns": self.p90_ns,
            "min_ns": min(self.samples_ns),
            "max_ns": max(self.samples_ns),
            "target_ns": self.target_ns,
            "status": self.status,
            "info": self.info,
        }


# -- timing --------------------------------------------------------------------


def time_calls(run: Callable[[], object], samples: int, warmup: int) -> list[int]:
    """Time ``run`` alone, ``samples`` times after ``warmup`` untimed calls."""
    clock = time.perf_counter_ns
    for _ in range(warmup):
        run()
    gc.collect()
    out = [0] * samples
    for i in range(samples):
        t0 = clock()
        run()
        out[i] = clock() - t0
    return out


def time_with_setup(
    setup: Callable[[], T], run: Callable[[T], object], samples: int, warmup: int
) -> list[int]:
    """Time ``run(setup())``; the setup and a GC pass are outside the timed region."""
    clock = time.perf_counter_ns
    for _ in range(warmup):
        run(setup())
    out = [0] * samples
    for i in range(samples):
        arg = setup()
        gc.collect()
        t0 = clock()
        run(arg)
        out[i] = clock() - t0
    return out


def timer_overhead_ns() -> float:
    """Median cost of one empty ``perf_counter_ns`` pair, for the reader's reference."""
    return statistics.median(time_calls(lambda: None, 20_000, 1_000))


# -- realistic data ------------------------------------------------------------


def member_spec(members: int, ranks_per_member: int = 8) -> StreamSpec:
    """A stream of ``members`` nodes hosting 8 ranks each, all of [nvme]."""
    return StreamSpec.create(
        STREAM,
        {
            f"node-{i:04d}": range(i * ranks_per_member, (i + 1) * ranks_per_member)
            for i in range(members)
        },
        Policy.all_of("nvme"),
        retention=2,
    )


def realistic_record(rng: random.Random, origin: str, spec_digest: bytes) -> Record:
    """One member's record: three ranges, three domains, every scalar set, unsigned."""
    lo = BASE_EPOCH + rng.randint(0, 3)
    top = BASE_EPOCH + 40 + rng.randint(0, 4)
    h1, h2 = sorted(rng.sample(HOLE_POOL, 2))
    recoverable = IntervalSet([(lo, h1 - 1), (h1 + 1, h2 - 1), (h2 + 1, top)])
    assert len(recoverable.ranges) == 3
    proposal = BASE_EPOCH + 40 - rng.randint(0, 1)
    restore_point = proposal - rng.randint(0, 2)
    return Record(
        stream=STREAM,
        origin=origin,
        incarnation=rng.randint(1, 6),
        version=rng.randint(100, 50_000),
        spec_digest=spec_digest,
        recoverable=recoverable,
        newest=tuple((d, top + rng.randint(0, 3)) for d in RECORD_DOMAINS),
        proposal=proposal,
        restore_point=restore_point,
        high_water=restore_point,
    )


def realistic_records(origins: Sequence[str], spec_digest: bytes, seed: int) -> list[Record]:
    """Fresh `Record` objects (no cached fingerprint), identical for a given seed."""
    rng = random.Random(seed)
    return [realistic_record(rng, o, spec_digest) for o in origins]


# -- 1. wire -------------------------------------------------------------------


def bench_wire(cfg: Config) -> list[Result]:
    """Encode, decode and round-trip a TICK of 50 records."""
    spec = member_spec(50)
    records = realistic_records(spec.member_ids, spec.digest, seed=1)
    tick = Tick(seq=48_213, digest=bytes(range(16)), match=False, records=tuple(records))
    frame = encode_message(tick)
    decoder = FrameDecoder()

    def decode(data: bytes) -> Tick:
        decoder.feed(data)
        got = decoder.next_frame()
        assert got is not None
        msg = decode_message(*got)
        assert isinstance(msg, Tick)
        return msg

    assert decode(frame) == tick, "round trip changed the message"
    assert decoder.buffered == 0

    size = {"frame_bytes": len(frame), "records": len(records)}
    per_record = {"bytes_per_record": round((len(frame) - 12) / len(records), 1)}
    return [
        Result(
            "wire.encode",
            "TICK(50 records) encode_message",
            time_calls(lambda: encode_message(tick), cfg.wire_samples, cfg.wire_warmup),
            info=size | per_record,
        ),
        Result(
            "wire.decode",
            "TICK(50 records) FrameDecoder+decode_message",
            time_calls(lambda: decode(frame), cfg.wire_samples, cfg.wire_warmup),
            info=size,
        ),
        Result(
            "wire.round_trip",
            "TICK(50 records) round trip",
            time_calls(lambda: decode(encode_message(tick)), cfg.wire_samples, cfg.wire_warmup),
            target_ns=ROUND_TRIP_TARGET_NS,
            info=size,
        ),
    ]


# -- 2. merge ------------------------------------------------------------------


def fresh_member_node(spec: StreamSpec, me: str) -> NodeCore:
    """A node of ``spec`` with its own nvme commits for 42 epochs applied."""
    core = NodeCore(me, incarnation=3)
    core.apply(Declare(spec))
    for epoch in range(BASE_EPOCH, BASE_EPOCH + 42):
        for rank in spec.ranks_of(me):
            core.apply(Commit(STREAM, rank, "nvme", epoch))
    core.take_pending_facts()
    while core.next_event() is not None:
        pass
    return core


def bench_merge(cfg: Config) -> list[Result]:
    """1,000 records into a View; 999 peer records into a NodeCore of 1,000 members."""
    spec = member_spec(1000)
    me = spec.member_ids[0]
    peers = spec.member_ids[1:]
    digest = spec.digest

    def view_setup() -> list[Record]:
        return realistic_records(spec.member_ids, digest, seed=2)

    def view_run(records: list[Record]) -> None:
        kept = View().merge_all(records)
        assert len(kept) == len(records)

    warm = view_setup()
    for r in warm:
        _ = r.fingerprint

    def view_warm_run() -> None:
        View().merge_all(warm)

    def node_setup() -> tuple[NodeCore, list[Record]]:
        return fresh_member_node(spec, me), realistic_records(peers, digest, seed=3)

    def node_run(arg: tuple[NodeCore, list[Record]]) -> None:
        core, records = arg
        kept = core.receive(records)
        assert len(kept) == len(records)

    # Sanity (untimed): after the delivery the node knows the interval and agrees.
    check_core, check_records = node_setup()
    check_core.receive(check_records)
    status = check_core.status(STREAM)
    assert status.convergence, "no convergence interval"
    assert status.restore_point is not None, "no restore point"
    agreed = {"restore_point": status.restore_point, "knowledge": status.knowledge.name}

    # Steady state: all 999 peers known; each sample delivers one updated record.
    steady_core, steady_records = node_setup()
    steady_core.receive(steady_records)
    rng = random.Random(4)
    updates: list[Record] = []
    for i in range(cfg.steady_samples + cfg.merge_warmup):
        old = steady_records[i % len(steady_records)]
        new = realistic_record(rng, old.origin, digest)
        updates.append(
            Record(
                stream=new.stream,
                origin=new.origin,
                incarnation=old.incarnation,
                version=old.version + 1 + i,
                spec_digest=new.spec_digest,
                recoverable=new.recoverable,
                newest=new.newest,
                proposal=new.proposal,
                restore_point=new.restore_point,
                high_water=new.high_water,
            )
        )
    pending = iter(updates)

    def steady_run() -> None:
        kept = steady_core.receive([next(pending)])
        assert len(kept) == 1

    n, w = cfg.merge_samples, cfg.merge_warmup
    return [
        Result(
            "merge.view",
            "View.merge_all, 1,000 fresh records",
            time_with_setup(view_setup, view_run, n, w),
            target_ns=MERGE_TARGET_NS,
            info={"records": 1000},
        ),
        Result(
            "merge.view_cached_fp",
            "  same, fingerprints already cached (info)",
            time_calls(view_warm_run, n, w),
            info={"records": 1000},
        ),
        Result(
            "merge.node",
            "NodeCore.receive, 999 peers of 1,000 members",
            time_with_setup(node_setup, node_run, n, w),
            target_ns=MERGE_TARGET_NS,
            info={"records": len(peers), "members": 1000} | agreed,
        ),
        Result(
            "merge.node_steady",
            "  NodeCore.receive, 1 update, 1,000 known (info)",
            time_calls(steady_run, cfg.steady_samples, w),
            info={"members": 1000},
        ),
    ]


# -- 3. recoverable set ---------------------------------------------------------


def recovery_spec() -> StreamSpec:
    """64 ranks on one node, all of 4 domains."""
    return StreamSpec.create(
        STREAM, {RECOVERY_NODE: range(RECOVERY_RANKS)}, Policy.all_of(*RECOVERY_DOMAINS)
    )


def commit_schedule(epochs: int) -> list[Commit]:
    """Every (rank, domain, epoch) once, in the order asynchronous saves land.

    At step t each domain d commits epoch ``t - lag(d)`` for every rank, so the fast
    domains run ahead and the recoverable set grows when the slowest one lands.
    """
    out: list[Commit] = []
    for step in range(epochs + max(RECOVERY_LAG.values())):
        for domain in RECOVERY_DOMAINS:
            epoch = step - RECOVERY_LAG[domain]
            if 0 <= epoch < epochs:
                out.extend(
                    Commit(STREAM, rank, domain, epoch, digest="sha256:abc", size=1 << 30)
                    for rank in range(RECOVERY_RANKS)
                )
    return out


def stream_facts(core: NodeCore) -> StreamFacts:
    """The node's `StreamFacts` (private state; a benchmark may look inside)."""
    return core._streams[STREAM].facts


def build_recovery_node(
    spec: StreamSpec, commits: Sequence[Commit], per_commit: list[int]
) -> tuple[NodeCore, int]:
    """Apply ``commits`` to a fresh node; return it and the wall time of the loop."""
    core = NodeCore(RECOVERY_NODE, incarnation=1)
    core.apply(Declare(spec))
    clock = time.perf_counter_ns
    apply = core.apply
    times = [0] * len(commits)
    gc.collect()
    start = clock()
    for i, commit in enumerate(commits):
        t0 = clock()
        apply(commit)
        times[i] = clock() - t0
    total = clock() - start
    per_commit.extend(times)
    return core, total


def incremental_commits(
    core: NodeCore, first_epoch: int, epochs: int
) -> tuple[list[int], list[int]]:
    """Apply all commits of ``epochs`` new epochs one by one.

    Returns the per-commit times, and separately those of the commits that completed
    an epoch (the recoverable set grew and a new record was published).
    """
    clock = time.perf_counter_ns
    apply = core.apply
    facts = stream_facts(core)
    every: list[int] = []
    completing: list[int] = []
    gc.collect()
    for epoch in range(first_epoch, first_epoch + epochs):
        for domain in RECOVERY_DOMAINS:
            for rank in range(RECOVERY_RANKS):
                commit = Commit(STREAM, rank, domain, epoch, digest="sha256:abc", size=1 << 30)
                before = facts.recoverable
                t0 = clock()
                apply(commit)
                elapsed = clock() - t0
                every.append(elapsed)
                if facts.recoverable != before:
                    completing.append(elapsed)
        assert facts.recoverable.max() == epoch
    return every, completing


def sparse_available(spec: StreamSpec, epochs: int) -> dict[tuple[int, str], IntervalSet]:
    """Every (rank, domain) holding ``epochs`` step numbers ``0, 100, 200, ...``."""
    one = IntervalSet((SPARSE_STRIDE * k, SPARSE_STRIDE * k) for k in range(epochs))
    return {(r, d): one for r in spec.ranks_of(RECOVERY_NODE) for d in spec.policy.domains}


def bench_recoverable(cfg: Config) -> list[Result]:
    """Commit stream into a 64-rank x 4-domain node, recompute, and incremental commits."""
    spec = recovery_spec()
    commits = commit_schedule(cfg.epochs)
    per_commit: list[int] = []
    totals: list[int] = []
    core: NodeCore | None = None
    for _ in range(cfg.builds):
        core = None  # let the previous build go before the next one starts
        gc.collect()
        core, total = build_recovery_node(spec, commits, per_commit)
        totals.append(total)
    assert core is not None
    facts = stream_facts(core)
    expected = IntervalSet.span(0, cfg.epochs - 1)
    assert facts.recoverable == expected, facts.recoverable
    assert core.restore_point(STREAM) == cfg.epochs - 1

    shape = {
        "ranks": RECOVERY_RANKS,
        "domains": len(RECOVERY_DOMAINS),
        "epochs": cfg.epochs,
        "commits": len(commits),
    }
    total_result = Result(
        "recoverable.apply_total",
        f"apply {len(commits):,} commits via NodeCore.apply",
        totals,
        info=shape
        | {
            "builds": cfg.builds,
            "mean_per_commit_ns": round(statistics.median(totals) / len(commits), 1),
            "includes_per_commit_timer": True,
        },
    )
    per_result = Result(
        "recoverable.apply_per_commit",
        "  per commit during that build",
        per_commit,
        info={"samples_from_builds": cfg.builds},
    )

    recompute = Result(
        "recoverable.recompute",
        "recompute recoverable set from scratch",
        time_calls(facts._recompute_all, cfg.recompute_samples, 3),
        info={"method": "StreamFacts._recompute_all", "ranges_per_set": 1} | shape,
    )
    assert facts.recoverable == expected

    every, completing = incremental_commits(core, cfg.epochs, cfg.incremental_epochs)
    incremental = Result(
        "recoverable.incremental",
        "one incremental commit at the end",
        every,
        info={"new_epochs": cfg.incremental_epochs},
    )
    completing_result = Result(
        "recoverable.incremental_completing",
        "  commit completing an epoch (set grows)",
        completing,
        info={"new_epochs": cfg.incremental_epochs},
    )
    return [
        total_result,
        per_result,
        recompute,
        incremental,
        completing_result,
        *bench_sparse(cfg, spec),
    ]


def bench_sparse(cfg: Config, spec: StreamSpec) -> list[Result]:
    """The recompute and one commit when epochs are sparse step numbers (info only).

    Building that state through 256,000 `NodeCore.apply` calls takes far too long at
    this density, so the availability sets are installed directly and recomputed.
    """
    available = sparse_available(spec, cfg.epochs)
    facts = StreamFacts(spec, RECOVERY_NODE, available=dict(available))
    assert len(facts.recoverable.ranges) == cfg.epochs
    shape = {"ranges_per_set": cfg.epochs, "stride": SPARSE_STRIDE}
    recompute = Result(
        "recoverable.sparse_recompute",
        f"  sparse: recompute from scratch ({cfg.epochs:,} ranges)",
        time_calls(facts._recompute_all, cfg.sparse_recompute_samples, 1),
        info={"method": "StreamFacts._recompute_all"} | shape,
    )

    core = NodeCore(RECOVERY_NODE, incarnation=1)
    core.apply(Declare(spec))
    node_facts = stream_facts(core)
    node_facts.available = dict(available)
    node_facts._recompute_all()
    # One commit of the next step, so the node publishes the sparse set once, untimed.
    next_epoch = SPARSE_STRIDE * cfg.epochs
    core.apply(Commit(STREAM, 0, RECOVERY_DOMAINS[0], next_epoch))
    clock = time.perf_counter_ns
    times: list[int] = []
    gc.collect()
    for i in range(1, cfg.sparse_commit_samples + 1):
        domain = RECOVERY_DOMAINS[i // RECOVERY_RANKS % len(RECOVERY_DOMAINS)]
        commit = Commit(STREAM, i % RECOVERY_RANKS, domain, next_epoch)
        t0 = clock()
        core.apply(commit)
        times.append(clock() - t0)
    commit_result = Result(
        "recoverable.sparse_incremental",
        f"  sparse: one commit via NodeCore.apply ({cfg.epochs:,} ranges)",
        times,
        info=shape,
    )
    return [recompute, commit_result]


# -- report --------------------------------------------------------------------


def fmt_ns(ns: float) -> str:
    """Human units, three significant digits."""
    if ns < US:
        return f"{ns:.0f} ns"
    if ns < MS:
        return f"{ns / US:.3g} us"
    if ns < 1_000 * MS:
        return f"{ns / MS:.3g} ms"
    return f"{ns / (1_000 * MS):.3g} s"


def cpu_model() -> str:
    """The CPU model from /proc/cpuinfo, when there is one."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "nproc": affinity if affinity is not None else os.cpu_count(),
        "cpu_count": os.cpu_count(),
        "cpu": cpu_model(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "msgpack": ".".join(map(str, msgpack.version)),
        "msgpack_c_extension": msgpack.Packer.__module__.endswith("_cmsgpack"),
    }


def render(results: Sequence[Result], info: dict[str, Any]) -> str:
    """The human-readable table."""
    m = info["machine"]
    lines = [
        f"convergenced core benchmarks ({info['mode']})",
        f"machine: nproc={m['nproc']}  cpu={m['cpu']}",
        f"python {m['python']} ({m['implementation']})  {m['platform']}",
        f"msgpack {m['msgpack']} (C extension: {m['msgpack_c_extension']})"
        f"  timer pair overhead {info['timer_overhead_ns']:.0f} ns",
        "",
    ]
    width = max(len(r.label) for r in results)
    header = f"{'benchmark':<{width}}  {'n':>7}  {'median':>9}  {'p90':>9}  {'target':>9}  result"
    lines += [header, "-" * len(header)]
    for r in results:
        target = f"< {fmt_ns(r.target_ns)}" if r.target_ns is not None else "-"
        lines.append(
            f"{r.label:<{width}}  {len(r.samples_ns):>7}  {fmt_ns(r.median_ns):>9}  "
            f"{fmt_ns(r.p90_ns):>9}  {target:>9}  {r.status}"
        )
    by_key = {r.key: r for r in results}
    wire = by_key["wire.encode"].info
    total = by_key["recoverable.apply_total"].info
    lines += [
        "",
        f"TICK frame: {wire['frame_bytes']:,} bytes for {wire['records']} records "
        f"({wire['bytes_per_record']} bytes per record)",
        f"commit stream: {total['commits']:,} commits ({total['ranks']} ranks x "
        f"{total['domains']} domains x {total['epochs']:,} epochs), median of "
        f"{total['builds']} build(s); mean {fmt_ns(total['mean_per_commit_ns'])} per commit",
        "targets are compared with the median; sparse rows: epochs every "
        f"{SPARSE_STRIDE} steps, state installed directly (info only)",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run every benchmark and print the table (and JSON with ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small, fast smoke run")
    parser.add_argument("--json", action="store_true", help="print a JSON object last")
    parser.add_argument(
        "--builds",
        type=int,
        metavar="N",
        help=f"commit-stream builds (default {FULL.builds}, quick {QUICK.builds})",
    )
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    if args.builds is not None:
        if args.builds < 1:
            parser.error("--builds must be at least 1")
        cfg = dataclasses.replace(cfg, builds=args.builds)

    started = time.perf_counter_ns()
    results = [*bench_wire(cfg), *bench_merge(cfg), *bench_recoverable(cfg)]
    info: dict[str, Any] = {
        "mode": cfg.mode,
        "machine": machine(),
        "timer_overhead_ns": timer_overhead_ns(),
    }
    info["elapsed_s"] = round((time.perf_counter_ns() - started) / 1e9, 1)
    print(render(results, info))
    print(f"elapsed: {info['elapsed_s']} s")
    if args.json:
        payload = info | {"results": [r.to_json() for r in results]}
        print(json.dumps(payload, separators=(",", ":"), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
