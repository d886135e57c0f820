"""The demo's command line: its help texts, its options and how they are checked.

Kept apart from the run so that `convergenced.cli` can build the ``demo`` subcommand's
parser without importing the trainers or the story, and so that the trainers can name
`Options` without importing the story that launches them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

__all__ = ["DESCRIPTION", "HELP", "SCENARIOS", "Options", "add_arguments", "options_from"]

HELP = "run a local cluster, crash a node mid-checkpoint (restart or replace it), restore, verify"
DESCRIPTION = (
    "Start a 3-node cluster of real daemons on loopback (in a temporary directory; a "
    "fourth, a spare, with --scenario replace), run "
    "a small deterministic training job on it that checkpoints every few steps to a local "
    "nvme tier and a lagging s3 tier, kill one node's trainer and daemon in the middle of a "
    "checkpoint, restore every rank from the agreed restore point, finish, and verify that "
    "the final weights equal an uninterrupted run bit for bit; also report what a latest "
    "marker would have restored. The scenario says what happens to the node that died: "
    "'restart' (the default) restarts its daemon on its own disk; 'replace' loses the host "
    "for good, disk included, and a spare node-4 that runs from the start takes over its "
    "rank from the shared s3 tier, the job relaunching with the new member map. No "
    "configuration needed. Exit 0 when verified, 1 on any mismatch or failure, 130 when "
    "interrupted."
)

SCENARIOS = ("restart", "replace")
"""What happens to the node that dies: its daemon restarts, or a spare replaces it."""


# -- options -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """What one demo run does (the command line's values, checked)."""

    steps: int = 60
    every: int = 5
    crash_at: int = 30
    step_s: float = 0.08
    upload_lag_s: float = 0.3
    retention: int = 5
    tick_ms: int = 50
    json: bool = False
    keep: bool = False
    scenario: str = "restart"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser`` (the ``demo`` subcommand's parser)."""
    parser.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default="restart",
        help="restart: node-3's daemon restarts on its own disk (the default); replace: "
        "node-3's host is gone for good and a spare node-4 takes over its rank from the "
        "shared tier",
    )
    parser.add_argument(
        "--json", action="store_true", help="print a final JSON object (progress goes to stderr)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a shorter, faster run (24 steps, checkpoint every 4, little sleeping)",
    )
    parser.add_argument("--steps", type=int, metavar="N", help="training steps (default 60)")
    parser.add_argument(
        "--every", type=int, metavar="K", help="checkpoint every K steps (default 5)"
    )
    parser.add_argument(
        "--crash-at",
        type=int,
        metavar="E",
        help="the checkpoint epoch during which node-3 dies (default: the middle one)",
    )
    parser.add_argument(
        "--step-ms", type=float, metavar="MS", help="compute time per step (default 80)"
    )
    parser.add_argument(
        "--upload-lag-ms",
        type=float,
        metavar="MS",
        help="mean extra time an s3 upload takes (default 300)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the cluster directory (logs, tiers) at the end"
    )


def options_from(args: argparse.Namespace) -> Options:
    """`Options` from parsed arguments.

    Raises:
        ValueError: inconsistent values (the message names the option).
    """
    quick = bool(getattr(args, "quick", False))
    steps = args.steps if args.steps is not None else (24 if quick else 60)
    every = args.every if args.every is not None else (4 if quick else 5)
    step_ms = args.step_ms if args.step_ms is not None else (15.0 if quick else 80.0)
    lag_ms = args.upload_lag_ms if args.upload_lag_ms is not None else (80.0 if quick else 300.0)
    if every < 1:
        raise ValueError(f"--every {every}: expected at least 1")
    if steps < 3 * every:
        raise ValueError(f"--steps {steps}: expected at least 3 checkpoints (3 x --every)")
    scenario = getattr(args, "scenario", None) or "restart"
    if scenario not in SCENARIOS:
        raise ValueError(f"--scenario {scenario}: expected one of {', '.join(SCENARIOS)}")
    # A replacement restores from the shared tier, which lags: the upload of the last
    # checkpoint before the crash is still on its way, so one more must come before it.
    first = (3 if scenario == "replace" else 2) * every
    crash_at = args.crash_at if args.crash_at is not None else (steps // 2 // every) * every
    if crash_at % every or not first <= crash_at < steps:
        raise ValueError(
            f"--crash-at {crash_at}: expected a checkpoint epoch (a multiple of --every) "
            f"from {first} to below {steps}"
            + (" with --scenario replace" if scenario == "replace" else "")
        )
    if step_ms < 0 or lag_ms < 0:
        raise ValueError("--step-ms and --upload-lag-ms must not be negative")
    return Options(
        steps=steps,
        every=every,
        crash_at=crash_at,
        step_s=step_ms / 1000,
        upload_lag_s=lag_ms / 1000,
        retention=every,
        json=bool(args.json),
        keep=bool(args.keep),
        scenario=scenario,
    )
