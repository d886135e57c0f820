"""Running many seeds, summarizing them, and the `convergenced sim` command."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from convergenced.sim.baselines import BASELINES
from convergenced.sim.faults import MEMBERSHIP_FAULTS
from convergenced.sim.rollouts import STRATEGIES
from convergenced.sim.rollouts import table as rollout_table
from convergenced.sim.workload import lattice_fraction
from convergenced.sim.world import FAULTS, Result, SimConfig, Simulation, liveness_bound

LATTICE_DOMAINS = (1, 2, 3, 4, 6, 8)


def run_one(cfg: SimConfig) -> Result:
    """Run one seed."""
    return Simulation(cfg).run()


def replay_command(cfg: SimConfig) -> str:
    """One command line that replays exactly this run."""
    faults = "none" if not cfg.faults else ",".join(f for f in FAULTS if f in cfg.faults)
    if set(cfg.faults) == set(FAULTS):
        faults = "all"
    parts = ["convergenced", "sim", "--nodes", str(cfg.nodes), "--seed", str(cfg.seed)]
    parts += ["--faults", faults]
    if cfg.safety_us != SimConfig.safety_us:
        parts += ["--safety-ms", str(cfg.safety_us // 1000)]
    if cfg.ranks_per_node != SimConfig.ranks_per_node:
        parts += ["--ranks", str(cfg.ranks_per_node)]
    if cfg.domains != SimConfig.domains:
        parts += ["--domains", str(cfg.domains)]
    if not cfg.workload:
        parts += ["--no-workload"]
    if cfg.churn:
        parts += ["--churn", str(cfg.churn)]
    if cfg.credentials:
        parts += ["--credentials"]
    if cfg.rollout:
        parts += ["--rollout", cfg.rollout]
    if cfg.compare:
        compared = [b for b in BASELINES if b in cfg.compare]
        parts += ["--compare", "all" if len(compared) == len(BASELINES) else compared[0]]
    return shlex.join(parts)


@dataclass
class Summary:
    """Totals over many seeds."""

    runs: int = 0
    violations: int = 0
    converged: int = 0
    max_rounds_to_converge: int = 0
    rounds: list[int] = field(default_factory=list)
    messages: int = 0
    bytes: int = 0
    wall_seconds: float = 0.0
    failures: list[dict[str, Any]] = field(default_factory=list)
    compare: dict[str, int] = field(default_factory=dict)
    """The baselines' counts, summed over the seeds (`Result.compare`)."""
    fault_counts: dict[str, int] = field(default_factory=dict)
    trace_hash: str | None = None
    bytes_per_node_per_round: list[float] = field(default_factory=list)
    refused_records: int = 0
    """Records refused for their signature (CA-bound trust), summed over the seeds."""

    def add(self, cfg: SimConfig, r: Result) -> None:
        """Fold one result in."""
        self.runs += 1
        self.messages += r.messages
        self.bytes += r.bytes
        self.refused_records += r.refused_records
        for k, v in r.compare.items():
            self.compare[k] = self.compare.get(k, 0) + v
        for k, v in r.fault_counts.items():
            self.fault_counts[k] = self.fault_counts.get(k, 0) + v
        if r.converged and r.rounds_to_converge is not None:
            self.converged += 1
            self.rounds.append(r.rounds_to_converge)
            self.bytes_per_node_per_round.append(r.bytes_per_node_per_round)
            self.max_rounds_to_converge = max(self.max_rounds_to_converge, r.rounds_to_converge)
        if r.violation is not None:
            self.violations += 1
            self.failures.append(
                {
                    "seed": r.seed,
                    "invariant": r.violation.invariant,
                    "detail": r.violation.detail,
                    "replay": replay_command(cfg),
                    "trace": r.trace_tail[-12:],
                }
            )

    def to_json(self) -> dict[str, Any]:
        """The machine-readable summary (`--json`)."""
        rounds = sorted(self.rounds)
        out: dict[str, Any] = {
            "runs": self.runs,
            "violations": self.violations,
            "converged": self.converged,
            "max_rounds_to_converge": self.max_rounds_to_converge,
            "median_rounds_to_converge": rounds[len(rounds) // 2] if rounds else None,
            "messages": self.messages,
            "median_bytes_per_node_per_round": round(
                sorted(self.bytes_per_node_per_round)[len(self.bytes_per_node_per_round) // 2]
            )
            if self.bytes_per_node_per_round
            else None,
            "bytes": self.bytes,
            "messages_per_second": round(self.messages / self.wall_seconds)
            if self.wall_seconds
            else None,
            "wall_seconds": round(self.wall_seconds, 2),
            "fault_counts": dict(sorted(self.fault_counts.items())),
            "refused_records": self.refused_records,
            "failures": self.failures,
        }
        if self.trace_hash is not None:
            out["trace_hash"] = self.trace_hash
        out |= self.compare_json()
        return out

    def compare_json(self) -> dict[str, int]:
        """The ``--compare`` counts: per baseline ``<name>_samples``, ``_mixed``,
        ``_unreadable`` and ``_invalid_restores`` (the two together), and
        ``convergence_samples`` / ``convergence_invalid_restores``."""
        c = self.compare
        out: dict[str, int] = {}
        for name in BASELINES:
            if f"{name}_samples" in c:
                mixed, unreadable = c.get(f"{name}_mixed", 0), c.get(f"{name}_unreadable", 0)
                out |= {f"{name}_samples": c[f"{name}_samples"], f"{name}_mixed": mixed,
                        f"{name}_unreadable": unreadable,
                        f"{name}_invalid_restores": mixed + unreadable}  # fmt: skip
        if "convergence_samples" in c:
            out["convergence_samples"] = c["convergence_samples"]
            out["convergence_invalid_restores"] = c.get("convergence_invalid", 0)
        return out


def _iter_results(configs: list[SimConfig], jobs: int) -> Iterator[tuple[SimConfig, Result]]:
    if jobs <= 1 or len(configs) <= 1:
        for cfg in configs:
            yield cfg, run_one(cfg)
        return
    ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    with ctx.Pool(jobs) as pool:
        yield from zip(configs, pool.imap(run_one, configs, chunksize=4), strict=True)


def run_seeds(configs: list[SimConfig], jobs: int = 1, progress: bool = False) -> Summary:
    """Run every config (one seed each) and summarize."""
    summary = Summary()
    start = time.perf_counter()
    total = len(configs)
    for i, (cfg, r) in enumerate(_iter_results(configs, jobs), 1):
        summary.add(cfg, r)
        if total == 1:
            summary.trace_hash = r.trace_hash
        if progress:
            _progress(i, total, summary)
    summary.wall_seconds = time.perf_counter() - start
    if progress:
        sys.stderr.write("\n")
    return summary


def _progress(done: int, total: int, s: Summary) -> None:
    width = 30
    filled = width * done // total
    bar = "#" * filled + "-" * (width - filled)
    sys.stderr.write(f"\r[{bar}] {done}/{total} seeds  violations {s.violations}")
    sys.stderr.flush()


def lattice_table(nodes: int, ranks: int, seed: int, samples: int = 1000) -> dict[str, float]:
    """The epoch-lattice figure: domains -> fraction of consistent instants."""
    return {
        str(d): round(lattice_fraction(d, nodes, ranks, samples, random.Random(seed)), 4)
        for d in LATTICE_DOMAINS
    }


# -- command line -----------------------------------------------------------------


def parse_faults(text: str) -> frozenset[str]:
    """``none``, ``all`` or a comma-separated list of fault names."""
    if text == "none":
        return frozenset()
    if text == "all":
        return frozenset(FAULTS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAULTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown fault {unknown[0] if unknown else text!r}; "
            f"choose none, all, or some of: {', '.join(FAULTS)}"
        )
    return frozenset(names)


def _int_at_least(lo: int, problem: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"{value} {problem}")
        return value

    return parse


_positive = _int_at_least(1, "must be at least 1")
_non_negative = _int_at_least(0, "must not be negative")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of `convergenced sim`."""
    p.add_argument("--nodes", type=_positive, default=4, help="cluster size (default 4)")
    p.add_argument("--seeds", type=_positive, default=1, help="how many seeds (default 1)")
    p.add_argument(
        "--seed",
        type=_non_negative,
        default=0,
        help="first seed (default 0); with --seeds K runs seeds S .. S+K-1",
    )
    p.add_argument(
        "--faults",
        type=parse_faults,
        default=frozenset(FAULTS),
        metavar="none|all|NAME,...",
        help=f"faults to inject (default all): {', '.join(FAULTS)}",
    )
    p.add_argument(
        "--compare", choices=[*BASELINES, "all"],
        help="also score what a baseline would have restored: marker (a latest marker, as "
        "DeepSpeed and Megatron write it), torchtitan (the newest step with .metadata), all",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="one JSON object on the last line")
    p.add_argument("--jobs", type=_positive, default=1, help="worker processes (default 1)")
    p.add_argument("--ranks", type=_positive, default=2, help="ranks per node (default 2)")
    p.add_argument("--domains", type=_positive, default=3, choices=range(1, 9),
                   metavar="1..8", help="persistence domains (default 3)")  # fmt: skip
    p.add_argument(
        "--safety-ms", type=_positive, default=400,
        help="virtual milliseconds of the faulty phase (default 400)",
    )  # fmt: skip
    p.add_argument(
        "--no-workload", action="store_true",
        help="no training workload: only the final commit (for scale runs)",
    )  # fmt: skip
    p.add_argument(
        "--churn", type=_positive, metavar="K",
        help="make K membership changes at evenly spaced times of the faulty phase instead "
        "of at drawn rates, cycling through the membership faults of --faults (replace, "
        "shrink, grow, leave): the same churn at every N, for scale runs",
    )  # fmt: skip
    p.add_argument(
        "--credentials", action="store_true",
        help="CA-bound trust: links gossip credentials, records are signed and checked "
        "against them, and a lost incarnation floor loses the identity key too",
    )  # fmt: skip
    p.add_argument("--no-lattice", action="store_true", help="skip the epoch-lattice table")
    p.add_argument(
        "--rollout", nargs="?", const="all", choices=[*STRATEGIES, "all"], metavar="STRATEGY",
        help="roll a driver out during the faulty phase and compare the strategies on the "
        "same seeds: naive (a rolling update on a timer), flip (every node at one time), "
        "gated (the drain gate and the version handshake), or all (the default): how often "
        "a job ran incompatible versions, drains without a restorable checkpoint, epochs "
        "lost per drain",
    )  # fmt: skip


def _compared(choice: str | None) -> frozenset[str]:
    if choice is None:
        return frozenset()
    return frozenset(BASELINES) if choice == "all" else frozenset({choice})


def command(args: argparse.Namespace) -> int:
    """Run `convergenced sim`; exit 0 when every seed kept every invariant."""
    if args.churn and not args.faults & MEMBERSHIP_FAULTS:
        # A usage error, reported as argparse reports its own (exit code 2).
        sys.stderr.write("convergenced sim: error: --churn needs a membership fault in "
                         "--faults: replace, shrink, grow or leave\n")  # fmt: skip
        return 2
    base = SimConfig(
        nodes=args.nodes,
        faults=args.faults,
        ranks_per_node=args.ranks,
        domains=args.domains,
        safety_us=args.safety_ms * 1000,
        compare=_compared(args.compare),
        workload=not args.no_workload,
        churn=args.churn or 0,
        credentials=args.credentials,
    )
    configs = [replace(base, seed=s) for s in range(args.seed, args.seed + args.seeds)]
    if args.rollout:
        return _rollouts(configs, args)
    summary = run_seeds(configs, jobs=args.jobs, progress=not args.json and sys.stderr.isatty())
    result = summary.to_json()
    result["nodes"] = args.nodes
    result["faults"] = sorted(args.faults)
    result["rounds_bound"] = liveness_bound(args.nodes)
    result["credentials"] = args.credentials
    if not args.no_lattice:
        result["lattice"] = lattice_table(args.nodes, args.ranks, args.seed)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        _print_human(result)
    return 1 if summary.violations or summary.converged < summary.runs else 0


def _rollouts(configs: list[SimConfig], args: argparse.Namespace) -> int:
    """`convergenced sim --rollout`: the same seeds under each strategy, side by side."""
    chosen = STRATEGIES if args.rollout == "all" else (args.rollout,)
    by: dict[str, dict[str, int]] = {}
    failures: list[dict[str, Any]] = []
    for name in chosen:
        s = run_seeds([replace(c, rollout=name) for c in configs], jobs=args.jobs)
        by[name] = {**s.compare, "runs": s.runs, "violations": s.violations}
        failures += s.failures
    if args.json:
        print(json.dumps({"rollout": by, "failures": failures}, sort_keys=True))
    else:
        faults = ", ".join(sorted(configs[0].faults)) or "none"
        print(f"driver rollout under faults ({faults}), {len(configs)} seeds of "
              f"{configs[0].nodes} nodes each")  # fmt: skip
        print("\n".join(rollout_table(by)))
        for f in failures[:10]:
            print(f"\nVIOLATION {f['invariant']} at seed {f['seed']}: {f['detail']}")
            print(f"  replay: {f['replay']}")
    return 1 if failures else 0


def _print_human(r: dict[str, Any]) -> None:
    rows: Iterable[tuple[str, Any]] = [
        ("nodes", r["nodes"]),
        ("faults", ", ".join(r["faults"]) or "none"),
        ("runs", r["runs"]),
        ("violations", r["violations"]),
        ("converged", f"{r['converged']} / {r['runs']}"),
        (
            "rounds to converge",
            f"median {r['median_rounds_to_converge']}, max {r['max_rounds_to_converge']}",
        ),
        ("messages", f"{r['messages']} ({r['messages_per_second']}/s)"),
        ("wall time", f"{r['wall_seconds']} s"),
    ]
    if "trace_hash" in r:
        rows = [*rows, ("trace hash", r["trace_hash"])]
    if r.get("credentials"):
        rows = [*rows, ("records refused", f"{r['refused_records']} (signature or origin "
                        "unknown: after a lost key, or replayed from no link)")]  # fmt: skip
    for name, label in (("marker", "latest-marker"), ("torchtitan", "torchtitan")):
        if f"{name}_samples" in r:
            rows = [*rows, (f"{label} invalid",
                            f"{r[f'{name}_invalid_restores']} of {r[f'{name}_samples']} sampled "
                            f"restores ({r[f'{name}_mixed']} mixed, "
                            f"{r[f'{name}_unreadable']} unreadable)")]  # fmt: skip
    if "convergence_samples" in r:
        rows = [*rows, ("convergenced invalid", f"{r['convergence_invalid_restores']} of "
                        f"{r['convergence_samples']} sampled restore points")]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if r.get("fault_counts"):
        print("faults injected: " + ", ".join(f"{k} {v}" for k, v in r["fault_counts"].items()))
    if "lattice" in r:
        print("\nepoch lattice: fraction of instants where every domain on every node")
        print("holds the same newest epoch")
        print("  domains  fraction")
        for d, frac in r["lattice"].items():
            print(f"  {d:>7}  {frac:.3f}")
    for f in r["failures"][:10]:
        print(f"\nVIOLATION {f['invariant']} at seed {f['seed']}: {f['detail']}")
        print("  last events:")
        for line in f["trace"]:
            print(f"    {line}")
        print(f"  replay: {f['replay']}")
