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
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
