"""Benchmarks of the daemon: real ``convergenced run`` processes on loopback.

Every number comes from real daemon processes started by `tests.daemons.LocalCluster`
(own write-ahead log with real fsyncs, own TCP listener, own Unix socket), driven
through the public clients from this one process. Three sections:

1. **commit throughput and ack latency**, one daemon, a 1-member stream of 64 ranks
   under ``all of [nvme]``:

   * *sequential*: one blocking `Client`, one commit at a time (round robin over the
     ranks): the ack latency a training rank sees, one local fsync;
   * *group commit*: K concurrent committers (trio tasks, `AsyncClient`), each
     committing successive epochs for its own rank (tasks sharing a rank interleave
     their epochs), so every commit is a new fact and every rank's epochs stay
     contiguous. K = 64 on 64 connections (one per rank, as 64 training processes
     would), K = 64 on one connection, and K = 256 on 16 connections.

   Each configuration runs several times; commits/s is total commits / wall time of
   one run (ramp-up and ramp-down included), the ack latency is measured per request
   by the client. The daemon's CPU time per commit (utime + stime from
   ``/proc/PID/stat``) gives the ceiling one daemon process could reach with a core
   of its own, and this process's CPU time per commit what the clients' side costs
   on the same cores; commits per fsync come from the daemon's ``wal_fsyncs`` counter.
   Target (issue): >= 20,000 commits/s with group commit.

2. **convergence latency**, N = 3, 8, 16 daemons, one stream with every node as a
   member (one rank each). Per sample, ``wait(stream, e)`` is issued on every node,
   then every node commits epoch e for its rank concurrently; the latency is (the
   moment the last node's ``wait`` returned) - (the moment the last commit was
   acknowledged). Samples are separated by a jittered pause so each one starts from
   a quiet cluster. The idle load of the cluster (heartbeats) is measured first, and
   the peer frames and daemon CPU each sample adds to it are reported too. Target
   (issue) at N = 16: p50 <= 5 ms, p99 <= 20 ms.

3. **daemon RSS**, N = 16 daemons: ``VmRSS`` of every daemon idle (0 streams), then
   after 100 streams (each with all 16 members) got a few epochs committed on every
   node and converged everywhere.

Throughput and RSS sections take the median over several runs (fresh clusters for
RSS); convergence reports percentiles over all samples and the spread of the
per-run medians. Everything shares the machine's cores: the daemons *and* this
measuring process (with 16 daemons on 2 cores, the client competes with them), and
whatever else runs on the machine: every section reports the CPU share of the
daemons, of this process and of everything else, so a noisy run shows as one.
Nothing here is tuned to meet a target.

Usage::

    .venv/bin/python benchmarks/bench_daemon.py [--quick] [--json] [--tick-ms MS]
        [--nodes N [N ...]] [--only throughput|convergence|rss]

``--quick`` is a smoke run (N = 3 only, few samples, < 20 s); ``--json``
additionally prints one JSON object with every number on the last line;
``--tick-ms`` sets the daemons' link timer (default 50, the daemon's default);
``--nodes`` the node counts of the convergence section; ``--only`` (repeatable)
runs only the named sections.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import random
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from convergenced.client import AsyncClient, Client  # noqa: E402
from convergenced.daemon.config import DEFAULT_TICK_MS  # noqa: E402
from tests.daemons import LocalCluster  # noqa: E402

MS = 1e-3

THROUGHPUT_TARGET = 20_000.0
"""Commits per second with group commit (issue)."""
CONVERGENCE_P50_TARGET_S = 5 * MS
CONVERGENCE_P99_TARGET_S = 20 * MS
TARGET_NODES = 16

DOMAIN = "nvme"
POLICY = {"mode": "all", "domains": [DOMAIN]}
TPUT_STREAM = "bench-throughput"
TPUT_RANKS = 64
CONV_STREAM = "bench-convergence"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- configuration -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Concurrency:
    """One group-commit configuration: K tasks over C connections."""

    tasks: int
    connections: int


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    """Sizes of one run of the whole benchmark."""

    mode: str
    tick_ms: int | None
    """The daemons' link timer period (None: the daemon's default)."""
    tput_runs: int
    seq_commits: int
    group_commits: int
    """Commits per run of a group-commit configuration (split evenly over tasks)."""
    concurrency: tuple[Concurrency, ...]
    conv_nodes: tuple[int, ...]
    conv_runs: int
    conv_samples: int
    """Samples per run (per node count)."""
    conv_warmup: int
    pause_ms: tuple[float, float]
    """Quiet time between convergence samples: uniform in [lo, hi] ms."""
    idle_s: float
    """How long the idle load of each cluster is measured before sampling."""
    rss_nodes: int
    rss_streams: int
    rss_epochs: int
    rss_runs: int
    insecure: bool = False
    """Plaintext links and unsigned records (to measure what TLS and signing cost)."""


FULL = Config(
    mode="full",
    tick_ms=None,
    tput_runs=5,
    seq_commits=2000,
    group_commits=12_800,
    concurrency=(Concurrency(64, 64), Concurrency(64, 1), Concurrency(256, 16)),
    conv_nodes=(3, 8, 16),
    conv_runs=3,
    conv_samples=50,
    conv_warmup=5,
    pause_ms=(40.0, 80.0),
    idle_s=3.0,
    rss_nodes=16,
    rss_streams=100,
    rss_epochs=3,
    rss_runs=2,
)

QUICK = Config(
    mode="quick",
    tick_ms=None,
    tput_runs=3,
    seq_commits=200,
    group_commits=1280,
    concurrency=(Concurrency(64, 64), Concurrency(256, 16)),
    conv_nodes=(3,),
    conv_runs=2,
    conv_samples=15,
    conv_warmup=2,
    pause_ms=(20.0, 40.0),
    idle_s=1.0,
    rss_nodes=3,
    rss_streams=10,
    rss_epochs=2,
    rss_runs=1,
)


# -- statistics and /proc -----------------------------------------------------------


def daemon_timer(cfg: Config) -> dict[str, int | None]:
    """`LocalCluster` arguments for the daemon's own link timer (heartbeat and failure
    detection as deployed), with ``--tick-ms`` changing only the tick period."""
    return {"tick_ms": cfg.tick_ms, "idle_ticks": None, "dead_ticks": None}


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return float(ordered[max(math.ceil(q / 100 * len(ordered)) - 1, 0)])


def median(values: Sequence[float]) -> float:
    """Median (nan when empty)."""
    return float(statistics.median(values)) if values else math.nan


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rpartition(")")[2].split()
    # After the command name: state is field 3, utime 14 and stime 15 (1-based).
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_status_kib(pid: int, key: str) -> int:
    """A ``kB`` line of ``/proc/PID/status`` (VmRSS, VmHWM...)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def machine_busy_s() -> float:
    """CPU seconds every process on the machine spent busy so far (``/proc/stat``)."""
    with open("/proc/stat", encoding="ascii") as f:
        values = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice: inside user]
    return (sum(values[:8]) - values[3] - values[4]) / CLK_TCK


class CpuMeter:
    """CPU used by given processes, by this one, and by everything else, over a span."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.wall0 = time.perf_counter()
        self.daemons0 = sum(proc_cpu_s(p) for p in self.pids)
        self.own0 = self_cpu_s()
        self.busy0 = machine_busy_s()

    def stop(self) -> dict[str, float]:
        """Shares of one core (1.0 = one core busy) since construction."""
        wall = time.perf_counter() - self.wall0
        daemons = sum(proc_cpu_s(p) for p in self.pids) - self.daemons0
        own = self_cpu_s() - self.own0
        busy = machine_busy_s() - self.busy0
        return {
            "wall_s": wall,
            "daemons": daemons / wall,
            "client": own / wall,
            "other": max(0.0, busy - daemons - own) / wall,
        }


def self_cpu_s() -> float:
    """CPU seconds of this (measuring) process."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


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


def loadavg() -> str:
    """The 1/5/15-minute load averages."""
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cpu_count": os.cpu_count(),
        "nproc": affinity if affinity is not None else os.cpu_count(),
        "cpu": cpu_model(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_at_start": loadavg(),
    }


def ms(seconds: float) -> str:
    """Seconds as milliseconds, three significant digits."""
    if math.isnan(seconds):
        return "-"
    return f"{seconds * 1e3:.3g} ms"


# -- 1. commit throughput -----------------------------------------------------------


@dataclasses.dataclass(slots=True)
class TputRun:
    """One run of one configuration."""

    commits: int
    latencies_s: list[float]
    cpu: dict[str, float]
    """`CpuMeter.stop` of the run: wall time and shares of one core."""
    fsyncs: int | None = None
    """fsyncs of the log during the run (daemon counter ``wal_fsyncs``, if it has it)."""

    @property
    def wall_s(self) -> float:
        """Wall time of the run."""
        return self.cpu["wall_s"]

    @property
    def rate(self) -> float:
        """Commits per second over the run."""
        return self.commits / self.wall_s


@dataclasses.dataclass(slots=True)
class TputResult:
    """Every run of one configuration."""

    key: str
    label: str
    tasks: int
    connections: int
    runs: list[TputRun]
    target: float | None

    @property
    def rate(self) -> float:
        """Median commits/s over the runs."""
        return median([r.rate for r in self.runs])

    def lat(self, q: float) -> float:
        """Median over the runs of the run's ``q``-th latency percentile."""
        return median([percentile(r.latencies_s, q) for r in self.runs])

    @property
    def daemon_cpu_per_commit_s(self) -> float:
        """Median over the runs of daemon CPU seconds per commit."""
        return median([r.cpu["daemons"] * r.wall_s / r.commits for r in self.runs])

    @property
    def client_cpu_per_commit_s(self) -> float:
        """Median over the runs of this (measuring) process's CPU seconds per commit:
        the clients' side, which shares the machine's cores with the daemon."""
        return median([r.cpu["client"] * r.wall_s / r.commits for r in self.runs])

    def share(self, who: str) -> float:
        """Median over the runs of ``who``'s CPU time / wall time (1.0 = one core)."""
        return median([r.cpu[who] for r in self.runs])

    @property
    def commits_per_fsync(self) -> float:
        """Median over the runs of commits per fsync (nan when not counted)."""
        return median([r.commits / r.fsyncs for r in self.runs if r.fsyncs])

    @property
    def status(self) -> str:
        """PASS / MISS against the target (median); ``-`` without one."""
        if self.target is None:
            return "-"
        return "PASS" if self.rate >= self.target else "MISS"

    def to_json(self) -> dict[str, Any]:
        """Plain JSON values."""
        return {
            "key": self.key,
            "label": self.label,
            "tasks": self.tasks,
            "connections": self.connections,
            "runs": len(self.runs),
            "commits_per_run": self.runs[0].commits if self.runs else 0,
            "commits_per_s_median": self.rate,
            "commits_per_s_runs": [r.rate for r in self.runs],
            "ack_p50_s": self.lat(50),
            "ack_p90_s": self.lat(90),
            "ack_p99_s": self.lat(99),
            "daemon_cpu_per_commit_s": self.daemon_cpu_per_commit_s,
            "client_cpu_per_commit_s": self.client_cpu_per_commit_s,
            "daemon_cpu_share": self.share("daemons"),
            "client_cpu_share": self.share("client"),
            "other_processes_cpu_share": self.share("other"),
            "commits_per_fsync": self.commits_per_fsync,
            "target_commits_per_s": self.target,
            "status": self.status,
        }


def sequential_run(path: Path, pid: int, commits: int, cursor: list[int]) -> TputRun:
    """One blocking client, one commit at a time, round robin over the ranks.

    ``cursor[r]`` is the next epoch of rank r: every commit is a new fact and every
    rank's epochs stay contiguous across runs (no holes that would fragment the sets).
    """
    clock = time.perf_counter
    lat = [0.0] * commits
    with Client(path) as c:
        fsyncs0 = c.status()["counters"].get("wal_fsyncs")  # connected, untimed
        meter = CpuMeter([pid])
        for i in range(commits):
            rank = i % TPUT_RANKS
            epoch = cursor[rank]
            cursor[rank] = epoch + 1
            t0 = clock()
            c.commit(TPUT_STREAM, rank, DOMAIN, epoch)
            lat[i] = clock() - t0
        cpu = meter.stop()
        fsyncs1 = c.status()["counters"].get("wal_fsyncs")
    fsyncs = None if fsyncs0 is None or fsyncs1 is None else fsyncs1 - fsyncs0
    return TputRun(commits, lat, cpu, fsyncs)


async def group_run(
    path: Path, pid: int, conc: Concurrency, commits: int, cursor: list[int]
) -> TputRun:
    """K tasks over C connections, each committing successive epochs for its rank.

    The tasks sharing a rank interleave its epochs from ``cursor[rank]`` on, so the
    rank's epochs stay contiguous; ``cursor`` is advanced past them.
    """
    clock = time.perf_counter
    k = conc.tasks
    per_task = max(1, commits // k)
    lat: list[float] = []
    share = [len(range(r, k, TPUT_RANKS)) for r in range(TPUT_RANKS)]  # tasks per rank
    first = list(cursor)
    for r in range(TPUT_RANKS):
        cursor[r] += per_task * share[r]
    async with AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(AsyncClient.connect(path))
            for _ in range(conc.connections)
        ]
        for c in clients[1:]:
            await c.status()  # every connection up and served once, untimed
        fsyncs0 = (await clients[0].status())["counters"].get("wal_fsyncs")

        async def worker(t: int) -> None:
            c = clients[t % len(clients)]
            rank, slot = t % TPUT_RANKS, t // TPUT_RANKS
            out = lat.append
            for j in range(per_task):
                epoch = first[rank] + j * share[rank] + slot
                t0 = clock()
                await c.commit(TPUT_STREAM, rank, DOMAIN, epoch)
                out(clock() - t0)

        meter = CpuMeter([pid])
        async with trio.open_nursery() as nursery:
            for t in range(k):
                nursery.start_soon(worker, t)
        cpu = meter.stop()
        fsyncs1 = (await clients[0].status())["counters"].get("wal_fsyncs")
    fsyncs = None if fsyncs0 is None or fsyncs1 is None else fsyncs1 - fsyncs0
    return TputRun(len(lat), lat, cpu, fsyncs)


def bench_throughput(cfg: Config) -> tuple[list[TputResult], dict[str, Any]]:
    """Section 1 on a fresh single daemon, then the same without group commit."""
    results, info = _throughput_on_one_daemon(cfg, group_commit=True)
    # The same daemon with ``wal_group_commit = false``: one fsync per commit, what a
    # log without grouping pays. Fewer commits per run: it is that much slower.
    slow = dataclasses.replace(cfg, seq_commits=0, group_commits=max(256, cfg.group_commits // 8))
    ungrouped, _ = _throughput_on_one_daemon(slow, group_commit=False)
    return results + ungrouped, info


def _throughput_on_one_daemon(
    cfg: Config, *, group_commit: bool
) -> tuple[list[TputResult], dict[str, Any]]:
    extra = "" if group_commit else "wal_group_commit = false"
    with LocalCluster(1, **daemon_timer(cfg), insecure=cfg.insecure, extra=extra) as cluster:
        cluster.start_all()
        pid = cluster.procs[1].pid
        path = cluster.socket_path(1)
        spec = {
            "name": TPUT_STREAM,
            "members": {cluster.name(1): list(range(TPUT_RANKS))},
            "policy": POLICY,
            "retention": 0,
        }
        with Client(path) as c:
            c.declare(spec)
        cursor = [0] * TPUT_RANKS
        results = []
        if cfg.seq_commits:
            seq = TputResult(
                "throughput.sequential", "sequential, 1 blocking Client", 1, 1, [], None
            )
            for _ in range(cfg.tput_runs):
                seq.runs.append(sequential_run(path, pid, cfg.seq_commits, cursor))
            results.append(seq)
        for conc in cfg.concurrency:
            conns = "conn" if conc.connections == 1 else "conns"
            res = TputResult(
                f"throughput.{'group' if group_commit else 'ungrouped'}_k{conc.tasks}"
                f"_c{conc.connections}",
                f"{'group commit' if group_commit else 'NO group commit'}, K={conc.tasks} on "
                f"{conc.connections} {conns}",
                conc.tasks,
                conc.connections,
                [],
                THROUGHPUT_TARGET if group_commit else None,
            )
            for _ in range(cfg.tput_runs):
                res.runs.append(trio.run(group_run, path, pid, conc, cfg.group_commits, cursor))
            results.append(res)
        with Client(path) as c:
            state = c.state(TPUT_STREAM)
            counters = c.status()["counters"]
        rss = proc_status_kib(pid, "VmRSS") / 1024
    info = {
        "ranks": TPUT_RANKS,
        "policy": "all of [nvme]",
        "final_recoverable": state["recoverable"],
        "final_restore_point": state["restore_point"],
        "facts_commit": counters.get("facts_commit"),
        "daemon_rss_mib_after": round(rss, 1),
    }
    return results, info


def render_throughput(results: Sequence[TputResult], info: dict[str, Any]) -> str:
    """The section 1 table."""
    lines = [
        f"1. commit throughput and ack latency: 1 daemon, 1-member stream of {info['ranks']} "
        f"ranks, {info['policy']}",
        "",
    ]
    width = max(len(r.label) for r in results)
    header = (
        f"{'configuration':<{width}}  {'runs':>4}  {'commits/run':>11}  {'commits/s':>9}  "
        f"{'(min-max)':>13}  {'ack p50':>9}  {'ack p99':>9}  {'per fsync':>9}  "
        f"{'CPU/commit':>10}  {'(client)':>8}  {'daemon':>6}  {'client':>6}  {'other':>6}  result"
    )
    lines += [header, "-" * len(header)]
    for r in results:
        rates = [x.rate for x in r.runs]
        spread = f"{min(rates):,.0f}-{max(rates):,.0f}"
        per_fsync = "-" if math.isnan(r.commits_per_fsync) else f"{r.commits_per_fsync:.1f}"
        lines.append(
            f"{r.label:<{width}}  {len(r.runs):>4}  {r.runs[0].commits:>11,}  {r.rate:>9,.0f}  "
            f"{spread:>13}  {ms(r.lat(50)):>9}  {ms(r.lat(99)):>9}  {per_fsync:>9}  "
            f"{r.daemon_cpu_per_commit_s * 1e6:>7.0f} us  "
            f"{r.client_cpu_per_commit_s * 1e6:>5.0f} us  "
            f"{r.share('daemons'):>6.0%}  {r.share('client'):>6.0%}  {r.share('other'):>6.0%}  "
            f"{r.status}"
        )
    best = max((r for r in results if r.target is not None), key=lambda r: r.rate)
    ceiling = 1 / best.daemon_cpu_per_commit_s
    verdict = "met" if best.rate >= THROUGHPUT_TARGET else "NOT met"
    lines += [
        "",
        f"target >= {THROUGHPUT_TARGET:,.0f} commits/s with group commit: {verdict} "
        f"(best median {best.rate:,.0f}/s, {best.label})",
        f"daemon CPU per commit {best.daemon_cpu_per_commit_s * 1e6:.0f} us there: a daemon "
        f"with a whole core to itself would top out near {ceiling:,.0f} commits/s (its "
        f"clients took {best.client_cpu_per_commit_s * 1e6:.0f} us per commit of the other)",
    ]
    for grouped in results:
        for plain in results:
            if (
                grouped.target is not None
                and plain.key.startswith("throughput.ungrouped")
                and (plain.tasks, plain.connections) == (grouped.tasks, grouped.connections)
            ):
                lines.append(
                    f"group commit vs none at K={plain.tasks} on {plain.connections}: "
                    f"{grouped.rate / plain.rate:.1f}x the commits/s, ack p50 "
                    f"{ms(grouped.lat(50))} against {ms(plain.lat(50))}"
                )
    lines += [
        "NO group commit: a second daemon with wal_group_commit = false (one fsync per "
        "commit, fewer commits per run)",
        "commits/s, CPU columns: median over the runs (min-max: of the runs)",
        "ack p50/p99: median over the runs of each run's percentile, measured by the client",
        "per fsync: commits per fsync of the log (daemon counter wal_fsyncs)",
        "CPU/commit: the daemon's CPU time per commit; (client): this measuring process's, the",
        "  clients' side of each commit",
        "daemon / client / other: CPU time / wall time (100% = one core busy) of the daemon,",
        "  of this measuring process, and of everything else on the machine (other sessions,",
        "  and kernel threads, which includes the ext4 journal work of our own fsyncs)",
        f"daemon RSS after the section: {info['daemon_rss_mib_after']} MiB; final "
        f"recoverable set {info['final_recoverable']}, restore point "
        f"{info['final_restore_point']}",
    ]
    return "\n".join(lines)


# -- 2. convergence latency ---------------------------------------------------------


@dataclasses.dataclass(slots=True)
class Sample:
    """One convergence sample, times relative to the last commit ack (seconds)."""

    epoch: int
    first_seen: float
    last_seen: float
    commit_spread: float
    """Last commit ack - first commit ack."""


@dataclasses.dataclass(slots=True)
class ConvResult:
    """Every sample at one node count, and the load around them."""

    nodes: int
    runs: list[list[Sample]]
    idle: dict[str, float]
    """`CpuMeter.stop` shares over a quiet spell before sampling, plus ``frames_per_s``."""
    busy: dict[str, float]
    """The same over the whole sampling (pauses included)."""
    first_rp_s: float
    """From the first declare until every node had the first restore point."""
    fsyncs_per_sample_node: float = math.nan
    """The log's fsyncs per sample, median over the daemons (``wal_fsyncs``)."""

    @property
    def samples(self) -> list[Sample]:
        """All samples of all runs."""
        return [s for run in self.runs for s in run]

    def pct(self, q: float, attr: str = "last_seen") -> float:
        """Percentile over all samples."""
        return percentile([getattr(s, attr) for s in self.samples], q)

    @property
    def run_p50s(self) -> list[float]:
        """The p50 of each run."""
        return [percentile([s.last_seen for s in run], 50) for run in self.runs]

    @property
    def frames_per_sample(self) -> float:
        """Peer frames a sample adds to the heartbeats (sampling rate - idle rate)."""
        extra = self.busy["frames_per_s"] - self.idle["frames_per_s"]
        return extra / self.busy["samples_per_s"]

    @property
    def cpu_per_sample_node_s(self) -> float:
        """Daemon CPU seconds a sample adds to the idle load, per node."""
        extra = self.busy["daemons"] - self.idle["daemons"]
        return extra / self.busy["samples_per_s"] / self.nodes

    @property
    def all_frames_per_sample(self) -> float:
        """Every peer frame of the sampling, heartbeats and pauses included, per sample.

        With the added figure (`frames_per_sample`) it brackets what one convergence
        costs: busy links send fewer heartbeats than idle ones, so subtracting the
        idle rate takes off too much, and this takes off nothing."""
        return self.busy["frames_per_s"] / self.busy["samples_per_s"]

    @property
    def all_cpu_per_sample_node_s(self) -> float:
        """Every daemon CPU second of the sampling, per sample and node (see
        `all_frames_per_sample`)."""
        return self.busy["daemons"] / self.busy["samples_per_s"] / self.nodes

    def status(self) -> str:
        """PASS / MISS at the target node count, ``-`` elsewhere."""
        if self.nodes != TARGET_NODES:
            return "-"
        ok = self.pct(50) <= CONVERGENCE_P50_TARGET_S and self.pct(99) <= CONVERGENCE_P99_TARGET_S
        return "PASS" if ok else "MISS"

    def to_json(self) -> dict[str, Any]:
        """Plain JSON values."""
        target = {"p50_s": CONVERGENCE_P50_TARGET_S, "p99_s": CONVERGENCE_P99_TARGET_S}
        return {
            "nodes": self.nodes,
            "runs": len(self.runs),
            "samples": len(self.samples),
            "p50_s": self.pct(50),
            "p90_s": self.pct(90),
            "p99_s": self.pct(99),
            "max_s": self.pct(100),
            "run_p50s_s": self.run_p50s,
            "first_seen_p50_s": self.pct(50, "first_seen"),
            "commit_spread_p50_s": self.pct(50, "commit_spread"),
            "idle": self.idle,
            "busy": self.busy,
            "frames_per_sample": self.frames_per_sample,
            "daemon_cpu_per_sample_per_node_s": self.cpu_per_sample_node_s,
            "all_frames_per_sample": self.all_frames_per_sample,
            "all_daemon_cpu_per_sample_per_node_s": self.all_cpu_per_sample_node_s,
            "first_restore_point_s": self.first_rp_s,
            "log_fsyncs_per_sample_per_node": self.fsyncs_per_sample_node,
            "target": target if self.nodes == TARGET_NODES else None,
            "status": self.status(),
        }


async def log_fsyncs(clients: Sequence[AsyncClient]) -> list[float]:
    """fsyncs of each node's log so far (``wal_fsyncs``; nan if a daemon lacks it)."""
    out = []
    for c in clients:
        value = (await c.status())["counters"].get("wal_fsyncs")
        out.append(math.nan if value is None else float(value))
    return out


async def frames_sent(clients: Sequence[AsyncClient]) -> int:
    """Peer frames sent so far by every node (from ``status``)."""
    total = 0
    for c in clients:
        total += sum(int(link["frames_sent"]) for link in (await c.status())["links"])
    return total


async def convergence_samples(cluster: LocalCluster, cfg: Config, rng: random.Random) -> ConvResult:
    """Declare, converge once, measure the idle load, then take the samples."""
    n = cluster.n
    clock = time.perf_counter
    spec = cluster.spec(CONV_STREAM)
    pids = [cluster.procs[i].pid for i in range(1, n + 1)]
    started = clock()
    async with AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(AsyncClient.connect(cluster.socket_path(i)))
            for i in range(1, n + 1)
        ]
        async with trio.open_nursery() as nursery:
            for c in clients:
                nursery.start_soon(c.declare, spec)
        # Epoch 0 everywhere: returns once every link is up and the stream agreed.
        async with trio.open_nursery() as nursery:
            for i, c in enumerate(clients):
                nursery.start_soon(c.commit, CONV_STREAM, i, DOMAIN, 0)
        async with trio.open_nursery() as nursery:
            for c in clients:
                nursery.start_soon(c.wait, CONV_STREAM, 0, 60.0)
        first_rp = clock() - started

        # The load of a quiet cluster: heartbeats only.
        await trio.sleep(0.5)
        frames0, meter = await frames_sent(clients), CpuMeter(pids)
        await trio.sleep(cfg.idle_s)
        idle = meter.stop()
        idle["frames_per_s"] = (await frames_sent(clients) - frames0) / idle["wall_s"]

        async def sample(epoch: int) -> Sample:
            seen = [0.0] * n
            acked = [0.0] * n

            async def waiter(i: int) -> None:
                await clients[i].wait(CONV_STREAM, epoch, 30.0)
                seen[i] = clock()

            async def committer(i: int) -> None:
                await clients[i].commit(CONV_STREAM, i, DOMAIN, epoch)
                acked[i] = clock()

            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(waiter, i)
                # The waits are on their way first (each checks the restore point
                # when it starts, so none can miss it either way).
                await trio.sleep(0.002)
                for i in range(n):
                    nursery.start_soon(committer, i)
            last_ack = max(acked)
            return Sample(
                epoch,
                first_seen=min(seen) - last_ack,
                last_seen=max(seen) - last_ack,
                commit_spread=last_ack - min(acked),
            )

        runs: list[list[Sample]] = []
        epoch = 0
        fsyncs0 = await log_fsyncs(clients)
        frames0, meter = await frames_sent(clients), CpuMeter(pids)
        for _ in range(cfg.conv_runs):
            run: list[Sample] = []
            for s in range(cfg.conv_warmup + cfg.conv_samples):
                await trio.sleep(rng.uniform(*cfg.pause_ms) * MS)
                epoch += 1
                got = await sample(epoch)
                if s >= cfg.conv_warmup:
                    run.append(got)
            runs.append(run)
        busy = meter.stop()
        busy["frames_per_s"] = (await frames_sent(clients) - frames0) / busy["wall_s"]
        busy["samples_per_s"] = epoch / busy["wall_s"]
        fsyncs1 = await log_fsyncs(clients)
    per_node = [(b - a) / epoch for a, b in zip(fsyncs0, fsyncs1, strict=True)]
    return ConvResult(n, runs, idle, busy, first_rp, statistics.median(per_node))


def bench_convergence(cfg: Config) -> list[ConvResult]:
    """Section 2: one fresh cluster per node count."""
    rng = random.Random(7)
    out: list[ConvResult] = []
    for n in cfg.conv_nodes:
        with LocalCluster(n, **daemon_timer(cfg), insecure=cfg.insecure) as cluster:
            cluster.start_all()
            out.append(trio.run(convergence_samples, cluster, cfg, rng))
    return out


def render_convergence(results: Sequence[ConvResult], cfg: Config) -> str:
    """The section 2 table."""
    lines = [
        "2. convergence latency: N daemons, 1 stream with every node a member (1 rank "
        f"each), tick_ms={cfg.tick_ms or DEFAULT_TICK_MS}",
        "   latency = last node's wait() returned - last commit acknowledged",
        "",
    ]
    header = (
        f"{'N':>3}  {'samples':>7}  {'p50':>9}  {'p90':>9}  {'p99':>9}  {'max':>9}  "
        f"{'p50 per run':>20}  {'first seen p50':>14}  result"
    )
    lines += [header, "-" * len(header)]
    for r in results:
        p50s = "/".join(f"{x * 1e3:.3g}" for x in r.run_p50s) + " ms"
        lines.append(
            f"{r.nodes:>3}  {len(r.samples):>7}  {ms(r.pct(50)):>9}  {ms(r.pct(90)):>9}  "
            f"{ms(r.pct(99)):>9}  {ms(r.pct(100)):>9}  {p50s:>20}  "
            f"{ms(r.pct(50, 'first_seen')):>14}  {r.status()}"
        )
    lines += ["", "   load (CPU: share of one core)", ""]
    header = (
        f"{'N':>3}  {'idle: daemons':>13}  {'frames/s':>8}  {'sampling: daemons':>17}  "
        f"{'client':>6}  {'other':>6}  {'frames/s':>8}  {'frames/sample':>13}  "
        f"{'CPU/sample/node':>15}  {'all frames':>10}  {'all CPU':>8}  {'fsyncs/sample/node':>18}"
    )
    lines += [header, "-" * len(header)]
    for r in results:
        lines.append(
            f"{r.nodes:>3}  {r.idle['daemons']:>13.0%}  {r.idle['frames_per_s']:>8,.0f}  "
            f"{r.busy['daemons']:>17.0%}  {r.busy['client']:>6.0%}  {r.busy['other']:>6.0%}  "
            f"{r.busy['frames_per_s']:>8,.0f}  {r.frames_per_sample:>13,.0f}  "
            f"{ms(r.cpu_per_sample_node_s):>15}  {r.all_frames_per_sample:>10,.0f}  "
            f"{ms(r.all_cpu_per_sample_node_s):>8}  {r.fsyncs_per_sample_node:>18.2f}"
        )
    lines += [
        "",
        f"target at N = {TARGET_NODES}: p50 <= {ms(CONVERGENCE_P50_TARGET_S)}, "
        f"p99 <= {ms(CONVERGENCE_P99_TARGET_S)}"
        + ("" if TARGET_NODES in cfg.conv_nodes else " (not measured in this mode)"),
        "p50/p90/p99/max over all samples; p50 per run: each run's own p50",
        "first seen p50: when the first node's wait() returned, same reference",
        f"idle: {cfg.idle_s:g} s of a converged, quiet cluster (heartbeats only); sampling: "
        "all samples, pauses included",
        f"daemons / client / other: CPU time / wall time (100% = one core; {os.cpu_count()} "
        "here) of all daemons,",
        "  of this measuring process (it competes with the daemons for the cores), and of "
        "everything else",
        "frames/s: peer frames sent by all daemons; frames/sample: what a sample adds to the "
        "idle rate",
        "CPU/sample/node: daemon CPU a sample adds to the idle load, per daemon (what one "
        "daemon spends",
        "  per convergence: its floor on a core of its own)",
        "all frames / all CPU: the same without taking off the idle load (heartbeats and "
        "pauses included);",
        "  busy links send fewer heartbeats than idle ones, so a convergence costs between "
        "the two figures",
        "fsyncs/sample/node: fsyncs of a daemon's log per sample (its wal_fsyncs counter; "
        "median over the",
        "  daemons): the commit's, then the high-water mark's before the restore point may be told",
        "heartbeats (tick_ms x idle_ticks) do not gate convergence: a commit wakes the "
        "links at once;",
        "  they only load the CPUs",
    ]
    return "\n".join(lines)


# -- 3. RSS ---------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class RssRun:
    """RSS of every daemon of one cluster, in MiB."""

    idle: list[float]
    loaded: list[float]
    loaded_hwm: list[float]
    setup_s: float
    converge_s: float


async def load_streams(cluster: LocalCluster, streams: int, epochs: int) -> tuple[float, float]:
    """Declare ``streams`` streams on every node, commit ``epochs`` epochs, converge."""
    n = cluster.n
    clock = time.perf_counter
    names = [f"bench-rss-{s:03d}" for s in range(streams)]
    async with AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(AsyncClient.connect(cluster.socket_path(i)))
            for i in range(1, n + 1)
        ]
        t0 = clock()

        async def node_stream(i: int, name: str) -> None:
            c = clients[i]
            await c.declare(cluster.spec(name))
            for e in range(epochs):
                await c.commit(name, i, DOMAIN, e)

        async with trio.open_nursery() as nursery:
            for name in names:
                for i in range(n):
                    nursery.start_soon(node_stream, i, name)
        t1 = clock()
        async with trio.open_nursery() as nursery:
            for name in names:
                for c in clients:
                    nursery.start_soon(c.wait, name, epochs - 1, 120.0)
        t2 = clock()
    return t1 - t0, t2 - t1


def bench_rss(cfg: Config) -> list[RssRun]:
    """Section 3: fresh clusters, idle then loaded."""
    out: list[RssRun] = []
    for _ in range(cfg.rss_runs):
        with LocalCluster(cfg.rss_nodes, **daemon_timer(cfg), insecure=cfg.insecure) as cluster:
            cluster.start_all()
            pids = [cluster.procs[i].pid for i in range(1, cluster.n + 1)]
            time.sleep(1.0)  # links up, heartbeats flowing
            idle = [proc_status_kib(p, "VmRSS") / 1024 for p in pids]
            setup, converge = trio.run(load_streams, cluster, cfg.rss_streams, cfg.rss_epochs)
            time.sleep(0.5)  # trailing exchanges (published restore points)
            loaded = [proc_status_kib(p, "VmRSS") / 1024 for p in pids]
            hwm = [proc_status_kib(p, "VmHWM") / 1024 for p in pids]
        out.append(RssRun(idle, loaded, hwm, setup, converge))
    return out


def rss_json(runs: Sequence[RssRun], cfg: Config) -> dict[str, Any]:
    """Plain JSON values (medians over runs of each run's median and max)."""

    def agg(attr: str) -> dict[str, float]:
        per = [getattr(r, attr) for r in runs]
        return {
            "median_mib": median([median(v) for v in per]),
            "max_mib": median([max(v) for v in per]),
        }

    return {
        "nodes": cfg.rss_nodes,
        "streams": cfg.rss_streams,
        "epochs_per_stream": cfg.rss_epochs,
        "runs": len(runs),
        "idle": agg("idle"),
        "loaded": agg("loaded"),
        "loaded_peak_hwm": agg("loaded_hwm"),
        "declare_and_commit_s": median([r.setup_s for r in runs]),
        "converge_all_s": median([r.converge_s for r in runs]),
        "per_run": [dataclasses.asdict(r) for r in runs],
    }


def render_rss(data: dict[str, Any]) -> str:
    """The section 3 table."""
    lines = [
        f"3. daemon RSS: {data['nodes']} daemons, {data['runs']} fresh cluster(s)",
        f"   loaded = {data['streams']} streams x {data['nodes']} members, "
        f"{data['epochs_per_stream']} epochs committed on every node, converged everywhere",
        "",
    ]
    header = f"{'state':<30}  {'median':>9}  {'max':>9}"
    lines += [header, "-" * len(header)]
    for key, label in (
        ("idle", "idle, 0 streams (VmRSS)"),
        ("loaded", f"{data['streams']} streams (VmRSS)"),
        ("loaded_peak_hwm", f"{data['streams']} streams, peak (VmHWM)"),
    ):
        row = data[key]
        lines.append(f"{label:<30}  {row['median_mib']:>5.1f} MiB  {row['max_mib']:>5.1f} MiB")
    per_stream = (data["loaded"]["median_mib"] - data["idle"]["median_mib"]) / data["streams"]
    lines += [
        "",
        f"median/max over the daemons of a cluster (median over clusters); growth per stream "
        f"~{per_stream * 1024:.0f} KiB",
        f"declaring + committing took {data['declare_and_commit_s']:.2f} s, converging every "
        f"stream on every node {data['converge_all_s']:.2f} s",
    ]
    return "\n".join(lines)


# -- main -----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run every section and print the tables (and JSON with ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small smoke run (N = 3 only)")
    parser.add_argument("--json", action="store_true", help="print a JSON object last")
    parser.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="also write DIR/localapi.md (section 1) and DIR/convergence.md (section 2), "
        "for BENCHMARKS.md",
    )
    parser.add_argument(
        "--tick-ms",
        type=int,
        metavar="MS",
        help=f"daemon link timer period (default: the daemon's, {DEFAULT_TICK_MS})",
    )
    parser.add_argument(
        "--nodes",
        type=int,
        nargs="+",
        metavar="N",
        help="node counts of the convergence section (default 3 8 16; quick 3)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext links and unsigned records (default: mutual TLS and signed records, "
        "as deployed); compare the two to see what security costs",
    )
    parser.add_argument(
        "--only",
        choices=("throughput", "convergence", "rss"),
        action="append",
        help="run only this section (repeatable)",
    )
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    if args.tick_ms is not None:
        if args.tick_ms < 1:
            parser.error("--tick-ms must be at least 1")
        cfg = dataclasses.replace(cfg, tick_ms=args.tick_ms)
    if args.nodes is not None:
        if min(args.nodes) < 2:
            parser.error("--nodes: convergence needs at least 2 nodes")
        cfg = dataclasses.replace(cfg, conv_nodes=tuple(args.nodes))
    if args.insecure:
        cfg = dataclasses.replace(cfg, insecure=True)
    sections = set(args.only or ("throughput", "convergence", "rss"))

    info: dict[str, Any] = {
        "mode": cfg.mode,
        "tick_ms": cfg.tick_ms or DEFAULT_TICK_MS,
        "insecure": cfg.insecure,
        "machine": machine(),
    }
    m = info["machine"]
    security = "INSECURE: plaintext, unsigned" if cfg.insecure else "mutual TLS, signed records"
    print(
        f"convergenced daemon benchmarks ({cfg.mode}), real daemon processes on loopback, "
        f"{security}"
    )
    print(
        f"machine: os.cpu_count()={m['cpu_count']} (usable {m['nproc']})  cpu={m['cpu']}  "
        f"loadavg at start {m['loadavg_at_start']}"
    )
    print(f"python {m['python']}  {m['platform']}")
    print(
        "daemons and this measuring client share those cores; other jobs on the machine "
        "may add noise"
    )
    started = time.perf_counter()
    out: dict[str, Any] = {}

    def fragment(name: str, table: str) -> None:
        import report  # benchmarks/report.py, beside this file

        command = report.command_line(__file__, sys.argv[1:] if argv is None else argv)
        report.write_fragment(args.out, name, command, info["machine"], table)

    if "throughput" in sections:
        tput, tinfo = bench_throughput(cfg)
        table = render_throughput(tput, tinfo)
        print()
        print(table)
        if args.out:
            fragment("localapi", table)
        out["throughput"] = {"info": tinfo, "results": [r.to_json() for r in tput]}
    if "convergence" in sections:
        conv = bench_convergence(cfg)
        table = render_convergence(conv, cfg)
        print()
        print(table)
        if args.out:
            fragment("convergence", table)
        out["convergence"] = [r.to_json() for r in conv]
    if "rss" in sections:
        rss = rss_json(bench_rss(cfg), cfg)
        print()
        print(render_rss(rss))
        out["rss"] = rss
    info["elapsed_s"] = round(time.perf_counter() - started, 1)
    info["loadavg_at_end"] = loadavg()
    print()
    print(f"elapsed: {info['elapsed_s']} s  (loadavg at end {info['loadavg_at_end']})")
    if args.json:
        print(json.dumps(info | out, separators=(",", ":"), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
