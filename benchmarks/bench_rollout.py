"""Rolling a driver out under faults: naive, atomic flip and gated, side by side.

Runs `convergenced sim --rollout` (`convergenced.sim.rollouts`): the same seeds and
faults under each strategy, measured against the simulator's ground truth: how often
the job had members on versions another member does not accept, how many drains
left the node's newest epoch unrestorable, the epochs lost per drain, and how many
nodes were upgraded when the faulty phase ended. ``--quick`` runs a short smoke.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench_daemon import machine  # noqa: E402
from report import command_line, write_fragment  # noqa: E402

from convergenced.sim.config import SimConfig  # noqa: E402
from convergenced.sim.rollouts import STRATEGIES, table  # noqa: E402
from convergenced.sim.runner import run_seeds  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="short smoke run (3 seeds)")
    parser.add_argument("--json", action="store_true", help="print a JSON object last")
    parser.add_argument("--out", type=Path, metavar="DIR", help="also write DIR/rollout.md")
    parser.add_argument("--seeds", type=int, default=None, help="seeds (default 40)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    args = parser.parse_args(argv)
    seeds = args.seeds or (3 if args.quick else 40)
    safety_ms = 400 if args.quick else 1000
    info = machine()
    base = SimConfig(safety_us=safety_ms * 1000)
    by: dict[str, dict[str, int]] = {}
    violations = 0
    start = time.perf_counter()
    for name in STRATEGIES:
        s = run_seeds([replace(base, seed=i, rollout=name) for i in range(seeds)], jobs=args.jobs)
        by[name] = {**s.compare, "runs": s.runs}
        violations += s.violations
    wall = time.perf_counter() - start
    lines = [
        f"driver rollout: {seeds} seeds of 4 nodes, every fault, {safety_ms} ms of faults each",
        *table(by),
        "",
        "incompatible: share of 1 ms samples with a member running a version another "
        "member does not accept",
        "unsafe drains: drains where the node's newest epoch was not restorable by the whole job",
        "epochs lost/drain: newest epoch of the drained node minus the newest the job "
        "could restore",
        f"upgraded: nodes on the new version when the faults end; oracle violations: "
        f"{violations}; wall time {wall:.0f} s",
    ]
    body = "\n".join(lines)
    print(body)
    if args.out:
        cmd = command_line(__file__, sys.argv[1:] if argv is None else argv)
        write_fragment(args.out, "rollout", cmd, info, body)
    if args.json:
        print(json.dumps({"strategies": by, "violations": violations}, sort_keys=True))
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
