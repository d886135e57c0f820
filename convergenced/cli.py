"""`convergenced`: the daemon's command line.

Subcommands are added as the parts behind them land; `--help` lists exactly what
works today.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from convergenced import __version__

DEFAULT_CONFIG = Path("/etc/convergenced/convergenced.toml")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(
        prog="convergenced",
        description="Agree on the checkpoint every node can restore, without stopping training.",
    )
    parser.add_argument("--version", action="version", version=f"convergenced {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser(
        "run",
        help="run the daemon",
        description="Run the daemon: peer links over TCP, the local API on a Unix socket, "
        "facts in a write-ahead log. SIGTERM/SIGINT shut down gracefully; SIGHUP reloads "
        "peers, mesh_limit, log_level and wal_compact_bytes. Exit 0 after a clean shutdown; "
        "1 when it cannot start (bad configuration, state directory in use, port taken, "
        "corrupt log) or when the write-ahead log fails while running.",
    )
    run.add_argument(
        "--config",
        type=Path,
        default=DEFAULT_CONFIG,
        metavar="FILE",
        help=f"TOML configuration (default {DEFAULT_CONFIG})",
    )
    run.add_argument(
        "--log-format",
        choices=("auto", "json", "console"),
        default="auto",
        help="auto: console on a terminal, JSON lines otherwise",
    )

    cluster = sub.add_parser(
        "cluster",
        help="write the configuration of an N-node cluster on loopback",
        description="Write DIR/node-K.toml for K = 1..N (each node with its own state "
        "directory and socket under DIR/node-K/ and every other node as a peer). Start "
        "each node with: convergenced run --config DIR/node-K.toml",
    )
    cluster.add_argument("--nodes", type=int, required=True, metavar="N")
    cluster.add_argument("--dir", type=Path, required=True, metavar="DIR")
    cluster.add_argument(
        "--base-port",
        type=int,
        default=7946,
        metavar="P",
        help="node K listens on P+K-1 (default 7946)",
    )
    cluster.add_argument("--cluster", default="local", help="cluster name (default local)")
    cluster.add_argument("--tick-ms", type=int, default=50, help="link timer period")

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


def _run(args: argparse.Namespace) -> int:
    import trio

    from convergenced.daemon import config as config_mod
    from convergenced.daemon import logs
    from convergenced.daemon.app import Daemon, StartupError
    from convergenced.daemon.wal import WalCorruptError

    try:
        cfg = config_mod.load(args.config)
    except config_mod.ConfigError as exc:
        print(f"convergenced: {exc}", file=sys.stderr)
        return 1
    fmt = {"auto": None, "json": True, "console": False}[args.log_format]
    logs.configure(cfg.log_level, cfg.node_id, json=fmt)
    daemon = Daemon(cfg, config_path=args.config, log_json=fmt)
    try:
        trio.run(daemon.run)
    except (StartupError, WalCorruptError, OSError) as exc:
        print(f"convergenced: cannot start: {exc}", file=sys.stderr)
        return 1
    if daemon.fatal is not None:
        print(f"convergenced: stopped: write-ahead log failed: {daemon.fatal}", file=sys.stderr)
        return 1
    return 0


def _cluster(args: argparse.Namespace) -> int:
    from convergenced.daemon.cluster import write_cluster

    try:
        paths = write_cluster(
            args.dir, args.nodes, args.base_port, cluster=args.cluster, tick_ms=args.tick_ms
        )
    except ValueError as exc:
        print(f"convergenced cluster: {exc}", file=sys.stderr)
        return 2
    for p in paths:
        print(f"convergenced run --config {p}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "run":
        return _run(args)
    if args.command == "cluster":
        return _cluster(args)
    if args.command == "sim":
        from convergenced.sim import runner

        return runner.command(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
