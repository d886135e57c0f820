"""`convergenced`: the daemon's command line.

Subcommands are added as the parts behind them land; `--help` lists exactly what
works today.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from convergenced import __version__
from convergenced.errors import ConvergencedError

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
        "peers, mesh_limit, log_level, wal_compact_bytes and the trust list. Exit 0 after "
        "a clean shutdown; 1 when it cannot start (bad configuration, state directory in "
        "use, port taken, corrupt log) or when the write-ahead log fails while running.",
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

    check = sub.add_parser(
        "check",
        help="validate a configuration without starting anything",
        description="Read FILE as `run` would and check it without starting, binding or "
        "writing anything: the file's keys, the TLS certificate, key and CA (the key "
        "matching the certificate, issued by the CA to this node), the identity key and "
        "this node's [trust] entry, and whether the socket and the state directory can "
        "be made where it puts them (by the user running the check: run it as the "
        "daemon's user). A port in use or a damaged log only a start can tell. Print "
        "'ok' and exit 0, or the error naming the file and the key and exit 1.",
    )
    check.add_argument(
        "--config",
        type=Path,
        default=DEFAULT_CONFIG,
        metavar="FILE",
        help=f"TOML configuration (default {DEFAULT_CONFIG})",
    )

    cluster = sub.add_parser(
        "cluster",
        help="write the configuration of an N-node cluster on loopback",
        description="Write DIR/node-K.toml for K = 1..N (each node with its own state "
        "directory and socket under DIR/node-K/ and every other node as a peer), plus "
        "the cluster CA (DIR/ca/), a TLS certificate, an Ed25519 identity and the trust "
        "list for every node. Start each node with: convergenced run --config "
        "DIR/node-K.toml. Exit 0 on success, 2 on bad arguments.",
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
    cluster.add_argument("--tick-ms", type=int, default=None,
                         help="link timer period in ms (default: the daemon's, 200)")  # fmt: skip
    cluster.add_argument(
        "--metrics-base-port",
        type=int,
        default=9464,
        metavar="M",
        help="node K serves /metrics on 127.0.0.1:M+K-1 (default 9464)",
    )
    cluster.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext links and unsigned records, no keys or certificates (throwaway "
        "clusters only; the daemons warn about it at start and in every status)",
    )

    health = sub.add_parser(
        "healthcheck",
        help="exit 0 when the local daemon answers, 1 when not (for Docker and k8s probes)",
        description="Ask the daemon for its status over its Unix socket. Exit 0 when it "
        "answers within the timeout, 1 when it does not (not running, stuck, refusing, "
        "or the socket path unknown); the reason goes to stderr.",
    )
    health.add_argument(
        "--config",
        type=Path,
        default=DEFAULT_CONFIG,
        metavar="FILE",
        help=f"read socket_path from this file (default {DEFAULT_CONFIG}; ignored with --socket)",
    )
    health.add_argument("--socket", type=Path, metavar="PATH", help="the daemon's socket")
    health.add_argument(
        "--timeout",
        type=float,
        default=3.0,
        metavar="S",
        help="seconds to wait for the answer (default 3)",
    )

    keygen = sub.add_parser(
        "keygen",
        help="create this node's Ed25519 identity (signs its records)",
        description="Write a new Ed25519 identity for NODE_ID to FILE (mode 0600; an "
        "existing file is kept unless --force), and print the line every other node "
        "puts in its [trust] table. Exit 0 on success, 1 on failure.",
    )
    keygen.add_argument("node_id", metavar="NODE_ID")
    keygen.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="FILE",
        help="where to write the key (the config's identity key)",
    )
    keygen.add_argument("--force", action="store_true", help="replace an existing file")

    ca = sub.add_parser(
        "ca",
        help="a small certificate authority for the peer links' mutual TLS",
        description="ca init DIR creates the cluster CA (ca.crt, ca.key); ca issue NODE_ID "
        "--dir DIR writes NODE_ID.crt and NODE_ID.key signed by it. Copy ca.crt and each "
        "node's pair to that node; keep ca.key off the fleet. Exit 0 on success, 1 on failure.",
    )
    ca_sub = ca.add_subparsers(dest="ca_command", metavar="ACTION", required=True)
    ca_init = ca_sub.add_parser("init", help="create the CA in DIR")
    ca_init.add_argument("dir", type=Path, metavar="DIR")
    ca_init.add_argument("--name", default="convergenced-ca", help="the CA's common name")
    ca_init.add_argument("--days", type=int, default=3650, help="validity (default 3650)")
    ca_issue = ca_sub.add_parser("issue", help="issue a node certificate")
    ca_issue.add_argument("node_id", metavar="NODE_ID")
    ca_issue.add_argument("--dir", type=Path, required=True, metavar="DIR", help="the CA")
    ca_issue.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="where to write the pair (default: the CA directory)",
    )
    ca_issue.add_argument(
        "--host",
        action="append",
        default=None,
        metavar="NAME_OR_IP",
        help="a host name or IP the node is reached at (repeatable; "
        "default 127.0.0.1 and localhost)",
    )
    ca_issue.add_argument("--days", type=int, default=825, help="validity (default 825)")
    ca_issue.add_argument("--force", action="store_true", help="replace existing files")

    from convergenced.tools import demo as demo_mod

    demo = sub.add_parser("demo", help=demo_mod.HELP, description=demo_mod.DESCRIPTION)
    demo_mod.add_arguments(demo)

    from convergenced.markers import command as marker_mod

    marker = sub.add_parser("marker", help=marker_mod.HELP, description=marker_mod.DESCRIPTION)
    marker_mod.add_arguments(marker)

    from convergenced.rollout import command as rollout_mod

    rollout = sub.add_parser("rollout", help=rollout_mod.HELP, description=rollout_mod.DESCRIPTION)
    rollout_mod.add_arguments(rollout)

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
    from convergenced.daemon.durability.log_file import WalCorruptError
    from convergenced.daemon.main import Daemon, StartupError

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


def _check(args: argparse.Namespace) -> int:
    from convergenced.daemon.check import check

    try:
        check(args.config)
    except ConvergencedError as exc:
        print(f"convergenced check: {exc}", file=sys.stderr)
        return 1
    print("ok")
    return 0


def _cluster(args: argparse.Namespace) -> int:
    from convergenced.tools.cluster import write_cluster

    try:
        paths = write_cluster(
            args.dir,
            args.nodes,
            args.base_port,
            cluster=args.cluster,
            tick_ms=args.tick_ms,
            insecure=args.insecure,
            metrics_base_port=args.metrics_base_port,
        )
    except (ValueError, ConvergencedError) as exc:
        print(f"convergenced cluster: {exc}", file=sys.stderr)
        return 2
    for p in paths:
        print(f"convergenced run --config {p}")
    return 0


def _healthcheck(args: argparse.Namespace) -> int:
    import socket

    from convergenced.core import local_api_codec as codec

    path = args.socket
    if path is None:
        from convergenced.daemon import config as config_mod

        try:
            path = config_mod.load(args.config).socket_path
        except config_mod.ConfigError as exc:
            print(f"convergenced healthcheck: {exc}", file=sys.stderr)
            return 1
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(args.timeout)
            s.connect(str(path))
            s.sendall(codec.encode_frame(codec.request(1, "status")))
            reader = codec.FrameReader()
            while True:
                data = s.recv(65536)
                if not data:
                    raise OSError("the daemon closed the connection")
                replies = reader.feed(data)
                if replies:
                    break
    except (OSError, codec.ApiError) as exc:
        print(f"convergenced healthcheck: unhealthy: {path}: {exc}", file=sys.stderr)
        return 1
    reply = replies[0]
    if not isinstance(reply, dict) or "ok" not in reply:
        err = reply.get("error") if isinstance(reply, dict) else reply
        print(f"convergenced healthcheck: unhealthy: {err}", file=sys.stderr)
        return 1
    return 0


def _keygen(args: argparse.Namespace) -> int:
    from convergenced.security.keys import NodeIdentity

    try:
        identity = NodeIdentity.generate(args.node_id)
        args.out.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        identity.save(args.out, overwrite=args.force)
    except (ConvergencedError, OSError) as exc:
        hint = " (--force replaces it)" if "exists" in str(exc) else ""
        print(f"convergenced keygen: {exc}{hint}", file=sys.stderr)
        return 1
    print(f"# {args.out}: identity of {args.node_id}; in every node's [trust] table:")
    print(identity.trust_entry())
    return 0


def _ca(args: argparse.Namespace) -> int:
    from convergenced.security import pki

    prog = f"convergenced ca {args.ca_command}"
    try:
        if args.ca_command == "init":
            files = pki.init_ca(args.dir, name=args.name, days=args.days)
            print(f"CA certificate {files.cert}, key {files.key} (keep the key off the fleet)")
        else:
            hosts = tuple(args.host) if args.host else pki.DEFAULT_HOSTS
            node = pki.issue(
                args.dir,
                args.node_id,
                days=args.days,
                hosts=hosts,
                out_dir=args.out,
                overwrite=args.force,
            )
            print(f"{args.node_id}: certificate {node.cert}, key {node.key}")
    except pki.PkiExistsError as exc:
        # Only `issue` replaces files on request; a CA is never replaced (init_ca's
        # message says what to do instead).
        if args.ca_command == "issue":
            print(f"{prog}: {exc.path}: already exists; --force re-issues it", file=sys.stderr)
        else:
            print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    except (ConvergencedError, OSError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
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
    if args.command == "check":
        return _check(args)
    if args.command == "cluster":
        return _cluster(args)
    if args.command == "healthcheck":
        return _healthcheck(args)
    if args.command == "keygen":
        return _keygen(args)
    if args.command == "ca":
        return _ca(args)
    if args.command == "demo":
        from convergenced.tools import demo as demo_run

        return demo_run.run_demo(args)
    if args.command == "sim":
        from convergenced.sim import runner

        return runner.command(args)
    if args.command == "rollout":
        from convergenced.rollout import command as rollout_run

        return rollout_run.run(args)
    if args.command == "marker":
        from convergenced.markers import command as marker_run

        return marker_run.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
