"""`convergencectl`: the operator's and scripts' client of a local daemon.

Only `--version` exists until the daemon's local API lands; `--help` says so.
"""

from __future__ import annotations

import argparse
import sys

from convergenced import __version__


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    parser = argparse.ArgumentParser(
        prog="convergencectl",
        description="Client of the local convergenced daemon "
        "(the local API is not implemented yet: only --version works).",
    )
    parser.add_argument("--version", action="version", version=f"convergencectl {__version__}")
    parser.parse_args(argv)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
