"""Footprint: what convergenced daemons cost a GPU host, idle and under load, at N = 16.

N real ``convergenced run`` daemons on loopback (`tests.daemons.LocalCluster`: mutual
TLS, signed records, the default link timer, as deployed), every pair linked (full mesh
below ``mesh_limit`` = 16). Two phases on one cluster:

* **idle**: links up, no stream: heartbeats only;
* **load**: S streams (default 16), each with every node as a member (one rank per
  node); every node commits the next epoch of every stream once per interval (default
  1 s: a checkpoint per second per job, far more often than real training jobs, which
  checkpoint every few minutes). Each commit is a real fsync'd fact; each epoch must
  then converge across the 16 nodes.

For each phase, over the measured span: CPU of every daemon (utime + stime from
``/proc/PID/stat``, as a share of one core), RSS (``VmRSS``), peer frames sent per
second, and for the load phase how far behind the restore point was at the end (did
the cluster keep up?). Reported as the median and the max over the daemons. The
driving process (one trio task per node and stream) and everything else on the
machine are shown as separate CPU shares, because all share the same cores.

Usage::

    .venv/bin/python benchmarks/bench_footprint.py [--quick] [--json] [--out DIR]
        [--nodes N] [--streams S] [--interval-s T] [--span-s SECONDS]

``--quick``: 4 nodes, 4 streams, 3 s spans (a smoke run for ``make test``).
``--out DIR`` writes ``DIR/footprint.md`` (the Markdown section of BENCHMARKS.md).
``--tick-ms``, ``--idle-ticks``, ``--dead-ticks`` run the daemons with another link
timer than the daemon's defaults (`convergenced.daemon.config`), to show what the
heartbeat costs; they write ``DIR/footprint-timer-TICK-IDLE-DEAD.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_daemon as bd
import report

from convergenced.client import AsyncClient
from convergenced.daemon.config import DEFAULT_DEAD_TICKS, DEFAULT_IDLE_TICKS, DEFAULT_TICK_MS

STREAM_PREFIX = "bench-footprint"


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    """Sizes of one run."""

    mode: str
    nodes: int
    streams: int
    interval_s: float
    span_s: float
    """How long each phase is measured."""
    tick_ms: int | None = None
    """Link timer period; None: the daemon's default."""
    idle_ticks: int | None = None
    """Heartbeat period in link-timer ticks; None: the daemon's default."""
    dead_ticks: int | None = None
    """Silence that declares a link down, in ticks; None: the daemon's default."""

    @property
    def default_timer(self) -> bool:
        """The daemon's own link timer (no override)."""
        return self.tick_ms is None and self.idle_ticks is None and self.dead_ticks is None

    def ticks(self) -> tuple[int, int, int]:
        """(tick_ms, idle_ticks, dead_ticks) the daemons run with."""
        return (
            DEFAULT_TICK_MS if self.tick_ms is None else self.tick_ms,
            DEFAULT_IDLE_TICKS if self.idle_ticks is None else self.idle_ticks,
            DEFAULT_DEAD_TICKS if self.dead_ticks is None else self.dead_ticks,
        )

    def timer(self) -> str:
        """The link timer in words."""
        tick, idle, dead = self.ticks()
        return (
            f"a {tick} ms link timer, a heartbeat every {idle} ticks ({tick * idle} ms), "
            f"a silent link down after {dead} ticks ({tick * dead} ms)"
        )


FULL = Config("full", nodes=16, streams=16, interval_s=1.0, span_s=20.0)
QUICK = Config("quick", nodes=4, streams=4, interval_s=1.0, span_s=3.0)


@dataclasses.dataclass(slots=True)
class Phase:
    """One measured span: per-daemon figures and the CPU shares around them."""

    name: str
    wall_s: float
    cpu_share: list[float]
    """Per daemon: CPU seconds / wall seconds (1.0 = one core)."""
    rss_mib: list[float]
    frames_per_s: list[float]
    driver_share: float
    other_share: float
    commits_per_s: float = 0.0
    restore_point_lag: list[int] = dataclasses.field(default_factory=list)
    """Per node and stream at the end: epochs committed everywhere - restore point."""

    def to_json(self) -> dict[str, Any]:
        """Plain JSON values, with the medians and maxima over the daemons."""
        out: dict[str, Any] = dataclasses.asdict(self)
        for key in ("cpu_share", "rss_mib", "frames_per_s"):
            values = getattr(self, key)
            out[f"{key}_median"] = statistics.median(values)
            out[f"{key}_max"] = max(values)
        out["restore_point_lag_max"] = max(self.restore_point_lag, default=0)
        return out


async def _frames(clients: Sequence[AsyncClient]) -> list[int]:
    out = []
    for c in clients:
        out.append(sum(int(link["frames_sent"]) for link in (await c.status())["links"]))
    return out


async def _measure(cluster: bd.LocalCluster, cfg: Config) -> list[Phase]:
    n = cluster.n
    pids = [cluster.procs[i].pid for i in range(1, n + 1)]
    names = [f"{STREAM_PREFIX}-{s:02d}" for s in range(cfg.streams)]
    async with AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(AsyncClient.connect(cluster.socket_path(i)))
            for i in range(1, n + 1)
        ]
        # Every link up before idle is measured: each node sees n - 1 links.
        deadline = time.monotonic() + 60
        while True:
            statuses = [await c.status() for c in clients]
            if all(len(s["links"]) == n - 1 for s in statuses):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("links did not all come up within 60 s")
            await trio.sleep(0.2)
        await trio.sleep(1.0)

        async def span(name: str, body: Any = None) -> Phase:
            frames0 = await _frames(clients)
            cpu0 = [bd.proc_cpu_s(p) for p in pids]
            meter = bd.CpuMeter(pids)
            committed = 0
            if body is None:
                await trio.sleep(cfg.span_s)
            else:
                committed = await body()
            shares = meter.stop()
            wall = shares["wall_s"]
            frames1 = await _frames(clients)
            return Phase(
                name,
                wall,
                [(bd.proc_cpu_s(p) - c0) / wall for p, c0 in zip(pids, cpu0, strict=True)],
                [bd.proc_status_kib(p, "VmRSS") / 1024 for p in pids],
                [(b - a) / wall for a, b in zip(frames0, frames1, strict=True)],
                shares["client"],
                shares["other"],
                committed / wall,
            )

        idle = await span("idle")

        async with trio.open_nursery() as nursery:
            for name in names:
                for c in clients:
                    nursery.start_soon(c.declare, cluster.spec(name))
        epoch = [0]

        async def commit_round(e: int) -> None:
            async with trio.open_nursery() as nursery:
                for name in names:
                    for i, c in enumerate(clients):
                        nursery.start_soon(c.commit, name, i, bd.DOMAIN, e)

        await commit_round(0)  # every stream agreed once before load is measured
        async with trio.open_nursery() as nursery:
            for name in names:
                for c in clients:
                    nursery.start_soon(c.wait, name, 0, 60.0)

        async def load() -> int:
            committed = 0
            start = trio.current_time()
            rounds = max(1, round(cfg.span_s / cfg.interval_s))
            for k in range(1, rounds + 1):
                epoch[0] = k
                await commit_round(k)
                committed += n * cfg.streams
                await trio.sleep_until(start + k * cfg.interval_s)
            return committed

        loaded = await span("load", load)
        # How far behind was the agreement when the load stopped? (0: kept up.)
        lags = []
        for c in clients:
            for name in names:
                rp = (await c.state(name))["restore_point"]
                lags.append(epoch[0] - (rp if rp is not None else -1))
        loaded.restore_point_lag = lags
    return [idle, loaded]


def run(cfg: Config) -> list[Phase]:
    """One fresh cluster, idle then loaded."""
    with bd.LocalCluster(
        cfg.nodes, tick_ms=cfg.tick_ms, idle_ticks=cfg.idle_ticks, dead_ticks=cfg.dead_ticks
    ) as cluster:
        cluster.start_all()
        return trio.run(_measure, cluster, cfg)


def render(phases: Sequence[Phase], cfg: Config) -> str:
    """The table and the notes under it."""
    header = (
        f"{'phase':<6}  {'CPU/daemon p50':>14}  {'max':>6}  {'RSS p50':>9}  {'max':>9}  "
        f"{'frames/s p50':>12}  {'commits/s':>9}  {'driver CPU':>10}  {'other CPU':>9}"
    )
    lines = [header, "-" * len(header)]
    for p in phases:
        j = p.to_json()
        lines.append(
            f"{p.name:<6}  {j['cpu_share_median']:>14.1%}  {j['cpu_share_max']:>6.1%}  "
            f"{j['rss_mib_median']:>5.1f} MiB  {j['rss_mib_max']:>5.1f} MiB  "
            f"{j['frames_per_s_median']:>12.1f}  {p.commits_per_s:>9.0f}  "
            f"{p.driver_share:>10.0%}  {p.other_share:>9.0%}"
        )
    load = phases[-1]
    lag = max(load.restore_point_lag, default=0)
    lines += [
        "",
        f"{cfg.nodes} daemons, full mesh, mutual TLS, "
        + ("default link timer" if cfg.default_timer else cfg.timer())
        + f"; each phase measured {cfg.span_s:g} s",
        f"load: {cfg.streams} streams x {cfg.nodes} members, every node commits the next "
        f"epoch of every stream every {cfg.interval_s:g} s",
        f"restore point at the end of the load: at most {lag} epoch(s) behind the last "
        "commit round" + (" (kept up)" if lag <= 1 else " (fell behind)"),
        "CPU/daemon: CPU time / wall time of one daemon (100% = one core); p50/max over the "
        "daemons",
        "driver CPU: the measuring process (the clients); other CPU: everything else on "
        "the machine",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run both phases and print the table (and JSON with ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="4 nodes, 4 streams, 3 s spans")
    parser.add_argument("--json", action="store_true", help="print a JSON object last")
    parser.add_argument("--out", type=Path, metavar="DIR", help="write DIR/footprint.md")
    parser.add_argument("--nodes", type=int, metavar="N", help="daemons (default 16)")
    parser.add_argument("--streams", type=int, metavar="S", help="streams under load")
    parser.add_argument("--interval-s", type=float, metavar="T", help="commit interval")
    parser.add_argument("--span-s", type=float, metavar="SECONDS", help="each phase's span")
    parser.add_argument("--tick-ms", type=int, metavar="MS", help="link timer period")
    parser.add_argument(
        "--idle-ticks", type=int, metavar="K", help="heartbeat every K link-timer ticks"
    )
    parser.add_argument(
        "--dead-ticks", type=int, metavar="K", help="a link silent for K ticks is down"
    )
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    for key in ("nodes", "streams", "interval_s", "span_s", "tick_ms", "idle_ticks", "dead_ticks"):
        value = getattr(args, key)
        if value is not None:
            if value <= 0 or (key == "nodes" and value < 2):
                parser.error(f"--{key.replace('_', '-')}: must be positive (nodes: at least 2)")
            cfg = dataclasses.replace(cfg, **{key: value})
    info: dict[str, Any] = {"mode": cfg.mode, "machine": bd.machine(), "config": cfg}
    started = time.perf_counter()
    phases = run(cfg)
    info["elapsed_s"] = round(time.perf_counter() - started, 1)
    info["loadavg_at_end"] = bd.loadavg()
    table = render(phases, cfg)
    print(f"daemon footprint ({cfg.mode}) at N = {cfg.nodes}")
    print(table)
    print(f"elapsed: {info['elapsed_s']} s  (loadavg at end {info['loadavg_at_end']})")
    if args.out:
        command = report.command_line(__file__, sys.argv[1:] if argv is None else argv)
        name = "footprint"
        if not cfg.default_timer:
            name += "-timer-" + "-".join(map(str, cfg.ticks()))
        report.write_fragment(args.out, name, command, info["machine"], table)
    if args.json:
        info["config"] = dataclasses.asdict(cfg)
        print(json.dumps(info | {"phases": [p.to_json() for p in phases]}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
