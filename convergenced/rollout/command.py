"""``convergenced rollout PLAN``: walk a staged rollout plan (`driver`)."""

from __future__ import annotations

import argparse
import json
import sys

from convergenced.rollout.driver import Rollout, summary
from convergenced.rollout.plan import PlanError, load

HELP = "walk a staged driver, firmware or OS rollout, each node gated by the epoch handshake"

DESCRIPTION = (
    "Upgrade the nodes of PLAN (a TOML file: docs/maintenance.md) wave by wave: a canary, "
    "then waves that never hold more than max_down_per_job members of one job. Each node "
    "passes its drain gate with the new version (every stream has a restore point every "
    "member published, every member of its jobs accepts the version and acknowledged "
    "that), runs the upgrade hook, reports the new version, and is done once every member "
    "acknowledged it; each step is noted in the node's own log, so the rollout may be run "
    "again after any stop and goes on where it was. The first failure stops the rollout. "
    "Exit 0 when every node runs the version, 1 when the rollout stopped on a failed node, "
    "2 on a bad plan."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The rollout's options, on its subparser."""
    p.add_argument("plan", metavar="PLAN", help="the rollout plan (TOML)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the waves and whether each node could drain now; change "
                   "nothing")  # fmt: skip
    p.add_argument(
        "--retry-failed",
        action="store_true",
        help="take again the nodes whose last run of this plan failed",
    )
    p.add_argument(
        "--json", action="store_true", help="print the report as one JSON line at the end"
    )


def run(args: argparse.Namespace) -> int:
    """Run the rollout; returns the exit code (see `DESCRIPTION`)."""
    try:
        plan = load(args.plan)
    except PlanError as exc:
        print(f"convergenced rollout: {exc}", file=sys.stderr)
        return 2

    def say(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    report = Rollout(plan, say=say, retry_failed=args.retry_failed).run(dry_run=args.dry_run)
    say(summary(report, plan.nodes))
    if args.json:
        print(json.dumps(report.to_json(), sort_keys=True), flush=True)
    return 0 if report.ok else 1
