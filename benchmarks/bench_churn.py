"""Scale with membership churn: the simulator at N = 16 .. 1024 while the job's member
map changes, and how fast the cluster agrees once the changes stop.

The scale benchmark (`bench_scale.py`) measures a fault-free cluster. This one runs the
same deterministic simulator (`convergenced.sim.world.Simulation`: the real protocol
core, a simulated network, the oracle checking S1-S5 and the output gate) with no
training workload, and during its faulty phase (``--safety-ms``, default 400 ms of
virtual time) makes a **fixed number of membership changes** (``--churn K``, default 8),
evenly spaced, cycling through replace, shrink, grow and leave
(`convergenced.sim.faults.churn_plan`): with K = 8, two of each. A ``replace`` kills a
member's host for good and moves its ranks to a spare that never held a stream; a
``shrink`` moves one member's ranks to the others; a ``grow`` gives a node outside the
job ranks of its own; a ``leave`` relaunches the job and, once a member froze the
launch's generation, takes a member that did not out of it (its host dying for good
half the time). Every change relaunches the whole job: a rank asks
``next_generation``, every member declares the new member map and freezes its answer.
Other faults can be added with ``--faults`` (e.g. ``crash,lose_state``); they fire at
the rates drawn per seed, as in every simulator run.

Why a fixed count and not a fraction of N: each change is one relaunch of the whole
job, and its cost to the protocol (every member's record changes a few times and
every version crosses the overlay) is the same whether it moves one host or ten. A
count makes every N do the same protocol work per node, so the columns compare sizes,
not seeds (drawn rates would give one seed two changes and the next nine); a fraction
of N would be 10 relaunches at N = 1024 for every one at N = 128 and measure the
number of relaunches, not N.

Per run (one seed per N by default, each in a fresh process so that its peak RSS is
its own): the changes made, by kind; the nodes that joined and left the job's member
map and the hosts that died for good; launches (leave makes two); *heal ms*, the
virtual time from the end of the faults to the moment the final commit was durable
everywhere (the cluster had to be quiet first: every link up, the last launch's
member map declared by every member); *rounds*, handshake round trips (2 x 200 us)
from that moment until every member reports the expected restore point (the
simulator's `Result.rounds_to_converge`, held to its S5 bound 2 ceil(log2 N) + 8); CPU
seconds and peak RSS of the run's process; violations. A run that breaks an invariant
or does not converge prints the one `convergenced sim` command line that replays it,
and the script exits 1.

Usage::

    .venv/bin/python benchmarks/bench_churn.py [--quick] [--json] [--out DIR]
        [--nodes N ...] [--seeds K] [--seed S] [--churn K] [--faults LIST]
        [--safety-ms MS] [--jobs J]

``--quick``: N = 16 and 32, K = 4 (a few seconds). ``--out DIR`` writes
``DIR/churn.md``. N = 1024 takes the longest by far (see BENCHMARKS.md, "With
membership churn"); run it alone on a 2-core machine (``--jobs 1``, the default).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for _p in (str(HERE), str(REPO)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import bench_daemon as bd  # noqa: E402
import report  # noqa: E402

from convergenced.sim.faults import MEMBERSHIP_FAULTS  # noqa: E402
from convergenced.sim.runner import parse_faults, replay_command  # noqa: E402
from convergenced.sim.world import FAULTS as ALL_FAULTS  # noqa: E402
from convergenced.sim.world import SimConfig, Simulation, liveness_bound  # noqa: E402

NODES = (16, 32, 64, 128, 256, 512, 1024)
CHURN = 8
FAULTS = "replace,shrink,grow,leave"
SAFETY_MS = 400


@dataclass(frozen=True, slots=True)
class Task:
    """One run: a seed at N nodes."""

    nodes: int
    seed: int
    churn: int
    faults: frozenset[str]
    safety_ms: int

    def config(self) -> SimConfig:
        """The simulator's configuration of this run."""
        return SimConfig(
            nodes=self.nodes, seed=self.seed, faults=self.faults, workload=False,
            safety_us=self.safety_ms * 1000, churn=self.churn,
        )  # fmt: skip


def run_task(task: Task) -> dict[str, Any]:
    """One run, in a worker process of its own (its peak RSS is this run's)."""
    cfg = task.config()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    sim = Simulation(cfg)
    r = sim.run()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    live, faults = sim.liveness, sim.faults
    counts = r.fault_counts
    return {
        "nodes": task.nodes,
        "seed": task.seed,
        "planned": len(faults.plan),
        "changes": {k: counts.get(k, 0) for k in ("replace", "shrink", "grow", "leave")},
        "other_faults": {k: v for k, v in counts.items() if k not in MEMBERSHIP_FAULTS},
        "skipped": faults.skipped,
        "joined": faults.joined,
        "left": faults.left,
        "gone": len(sim.gone),
        "launches": sim.launches.launch,
        "members_at_end": len(sim.spec.member_ids),
        "cluster_nodes": len(sim.ids),
        "heal_ms": None if live.t_final is None else (live.t_final - cfg.safety_us) / 1000,
        "rounds": r.rounds_to_converge,
        "rounds_bound": liveness_bound(len(sim.ids)),
        "converged": r.converged,
        "violation": None if r.violation is None else str(r.violation),
        "cpu_s": round(cpu, 1),
        "wall_s": round(wall, 1),
        "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "events": r.events,
        "messages": r.messages,
        "bytes": r.bytes,
        "trace_hash": r.trace_hash,
        "replay": replay_command(cfg),
    }


def run_all(tasks: list[Task], jobs: int, log: Any) -> list[dict[str, Any]]:
    """Every task in a fresh process, ``jobs`` at once, logging each as it ends."""
    ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    out: list[dict[str, Any]] = []
    with ctx.Pool(max(1, min(jobs, len(tasks))), maxtasksperchild=1) as pool:
        for row in pool.imap(run_task, tasks, chunksize=1):
            out.append(row)
            log(f"  {_row(row)}\n")
    return out


def failed(row: dict[str, Any]) -> bool:
    """Whether a run broke an invariant or did not converge."""
    return row["violation"] is not None or not row["converged"]


# -- output --------------------------------------------------------------------------

HEADER = (
    "    N seed  changes r/s/g/l  joined left gone launches  heal ms  rounds bound"
    "  MB/node    cpu-s  RSS MB     events  violations"
)


def _row(r: dict[str, Any]) -> str:
    c = r["changes"]
    kinds = f"{c['replace']}/{c['shrink']}/{c['grow']}/{c['leave']}"
    changes = f"{sum(c.values())} ({kinds})"
    heal = "-" if r["heal_ms"] is None else f"{r['heal_ms']:.1f}"
    rounds = "-" if r["rounds"] is None else str(r["rounds"])
    bad = "0" if not failed(r) else ("S5: no convergence" if r["violation"] is None
                                     else r["violation"].split(":")[0])  # fmt: skip
    return (
        f"{r['nodes']:>5} {r['seed']:>4} {changes:>16} {r['joined']:>7} {r['left']:>4} "
        f"{r['gone']:>4} {r['launches']:>8} {heal:>8} {rounds:>7} {r['rounds_bound']:>5} "
        f"{r['bytes'] / r['cluster_nodes'] / 1e6:>8.2f} {r['cpu_s']:>8.1f} "
        f"{r['max_rss_mb']:>7} {r['events']:>10} {bad:>11}"
    )


def render(rows: list[dict[str, Any]], churn: int, faults: frozenset[str], safety_ms: int) -> str:
    """The table, its legend, and the replay line of every failing run."""
    names = ",".join(f for f in ALL_FAULTS if f in faults)
    lines = [
        f"convergenced, simulator with membership churn: {churn} changes per run at fixed "
        f"times over {safety_ms} ms of faults ({names}), no workload",
        HEADER,
        *(_row(r) for r in rows),
        "(changes: membership changes made, by kind: replace/shrink/grow/leave; joined, "
        "left: nodes the job's member map gained and lost; gone: hosts dead for good; "
        "launches: relaunches of the job; heal ms: virtual ms from the end of the faults "
        "until the final commit was durable everywhere; rounds: handshake round trips "
        "(400 us) from then until every member agreed, bound = the S5 bound "
        "2 ceil(log2 N) + 8 for the cluster's nodes, spares included; MB/node: frame "
        "bytes delivered over the whole run / the cluster's nodes; cpu-s, RSS: CPU time "
        "and peak RSS of the run's process; events: simulator events)",
    ]
    others = {k: v for r in rows for k, v in r["other_faults"].items()}
    if others:
        lines.append("other faults, summed over the runs: " + ", ".join(
            f"{k} {sum(r['other_faults'].get(k, 0) for r in rows)}" for k in sorted(others)
        ))  # fmt: skip
    if any(r["skipped"] for r in rows):
        lines.append("planned changes that found nothing to do: " + ", ".join(
            f"N = {r['nodes']} seed {r['seed']}: {r['skipped']}" for r in rows if r["skipped"]
        ))  # fmt: skip
    bad = [r for r in rows if failed(r)]
    lines.append(f"violations: {sum(1 for r in bad if r['violation'])}, "
                 f"not converged: {sum(1 for r in rows if not r['converged'])}, "
                 f"of {len(rows)} runs")  # fmt: skip
    for r in bad:
        lines += [f"FAILED N = {r['nodes']} seed {r['seed']}: "
                  f"{r['violation'] or 'did not converge'}",
                  f"  replay: {r['replay']}"]  # fmt: skip
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Run every (N, seed), print the table (and JSON with ``--json``); exit 1 when a
    run failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="N = 16 and 32, 4 changes")
    parser.add_argument("--json", action="store_true", help="print a JSON object last")
    parser.add_argument("--out", type=Path, metavar="DIR", help="also write DIR/churn.md")
    parser.add_argument("--nodes", type=int, nargs="+", metavar="N",
                        help=f"these N (default {' '.join(map(str, NODES))})")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=1, help="seeds per N (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--churn", type=int, help=f"membership changes per run (default {CHURN})")
    parser.add_argument("--faults", type=parse_faults, default=parse_faults(FAULTS),
                        help=f"faults (default {FAULTS}); needs a membership fault")  # fmt: skip
    parser.add_argument("--safety-ms", type=int, default=SAFETY_MS,
                        help=f"virtual ms of the faulty phase (default {SAFETY_MS})")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    args = parser.parse_args(argv)
    nodes = sorted(set(args.nodes or ((16, 32) if args.quick else NODES)))
    churn = args.churn if args.churn is not None else (4 if args.quick else CHURN)
    if min(nodes) < 2 or args.seeds < 1 or args.seed < 0 or churn < 1 or args.safety_ms < 1:
        parser.error("--nodes must be at least 2; --seeds, --churn and --safety-ms positive")
    if not args.faults & MEMBERSHIP_FAULTS:
        parser.error("--faults needs a membership fault: replace, shrink, grow or leave")
    info = bd.machine()
    started = time.perf_counter()

    def log(text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.flush()

    tasks = [Task(n, s, churn, args.faults, args.safety_ms)
             for n in nodes for s in range(args.seed, args.seed + args.seeds)]  # fmt: skip
    log(f"churn: {len(tasks)} run(s), {args.jobs} at a time\n{HEADER}\n")
    rows = run_all(tasks, args.jobs, log)
    body = render(rows, churn, args.faults, args.safety_ms)
    elapsed = round(time.perf_counter() - started, 1)
    print(f"churn: membership churn at scale, on os.cpu_count()={info['cpu_count']} "
          f"({info['cpu']}), loadavg at start {info['loadavg_at_start']}")  # fmt: skip
    print(body)
    print(f"elapsed: {elapsed} s (loadavg at end {bd.loadavg()})")
    if args.out:
        command = report.command_line(__file__, sys.argv[1:] if argv is None else argv)
        report.write_fragment(args.out, "churn", command, info, body)
    if args.json:
        out = {"machine": info, "churn": churn, "faults": sorted(args.faults),
               "safety_ms": args.safety_ms, "runs": rows, "elapsed_s": elapsed}  # fmt: skip
        print(json.dumps(out, separators=(",", ":"), sort_keys=True))
    return 1 if any(failed(r) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
