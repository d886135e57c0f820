"""`convergenced`: the daemon's command line.

Subcommands are added as the parts behind them land; `--help` lists exactly what
works today.
"""

from __future__ import annotations

import argparse
import sys

from convergenced import __version__


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(
        prog="convergenced",
        description="Agree on the checkpoint every node can restore, without stopping training.",
    )
    parser.add_argument("--version", action="version", version=f"convergenced {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sim = sub.add_parser(
        "sim",
        help="run the deterministic cluster simulator with faults and the S1-S5 oracle",
        description="Run the real protocol core on a simulated cluster, with seeded faults, "
        "checking S1-S5 against ground truth after every event. Exit 0 when every seed "
        "kept every invariant and converged, 1 otherwise, 2 on bad arguments.",
    )
    from convergenced.sim import runner

    runner.add_arguments(sim)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "sim":
        from convergenced.sim import runner

        return runner.command(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
