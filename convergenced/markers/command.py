"""``convergenced marker``: the command line of the marker.

It is a subcommand of ``convergenced`` rather than of ``convergencectl`` because it is
a long-running companion process, like ``convergenced run``: it survives restarts of
the daemon (its client reconnects, and it commits again what it holds), while every
``convergencectl`` command is one request that reports a lost connection at once.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from convergenced.core.errors import SpecError
from convergenced.core.local_api_codec import ApiError, ErrorKind
from convergenced.markers.layouts import FORMATS, LayoutError, World, make_layout
from convergenced.markers.marker import Marker, MarkerError

HELP = "commit an unmodified framework's finished checkpoints and keep its latest file agreed"

DESCRIPTION = (
    "Run beside a DeepSpeed, Megatron-LM or PyTorch DCP job on each node. Watch the "
    "framework's checkpoint directory, commit a step for the ranks this node hosts in "
    "the stream's spec once every file it needs is complete in the framework's format "
    "(.pt files whole zip archives, DCP files holding every byte their metadata names) "
    "and unchanged for --settle seconds, with the sha256 of each rank's files; point "
    "the framework's latest file (DeepSpeed's latest, Megatron's "
    "latest_checkpointed_iteration.txt, and --step-file) only at the restore point the "
    "daemons agreed on, written atomically, rolled back with it, removed when there is "
    "none. With --generation G (a relaunch), the generation's restore point, the same "
    "on every node, held until the job saves a new step. Exit 0 after --once or "
    "SIGTERM/SIGINT, 1 when the daemon refuses or --once times out, 2 on bad input "
    "(options, an unreadable directory, a spec that does not name this node), 3 when "
    "the daemon cannot be reached. See docs/markers.md."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The marker's options, on its subparser."""
    p.add_argument("--format", required=True, choices=FORMATS, help="the framework's layout")
    p.add_argument("--dir", required=True, type=Path, metavar="DIR",
                   help="the framework's checkpoint directory (DeepSpeed's save_dir, "
                   "Megatron's --save)")  # fmt: skip
    p.add_argument(
        "--domain",
        required=True,
        metavar="D",
        help="the persistence domain DIR is in (one the stream's policy names)",
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--spec", type=Path, metavar="FILE",
                       help="declare the stream from this JSON or TOML spec file first "
                       "(as convergencectl declare --spec)")  # fmt: skip
    which.add_argument("--stream", metavar="NAME", help="a stream declared already")
    p.add_argument(
        "--membership",
        type=int,
        metavar="GEN",
        help="with --spec: declare it as the member map from generation GEN on",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="tensor (model) parallel size of the saving world (default 1)",
    )
    p.add_argument(
        "--pp",
        type=int,
        default=1,
        metavar="N",
        help="pipeline parallel size (default 1; megatron formats only)",
    )
    p.add_argument(
        "--dp",
        type=int,
        metavar="N",
        help="data parallel size (default: the spec's ranks / (tp * pp))",
    )
    p.add_argument(
        "--zero-stage",
        type=int,
        default=0,
        choices=(0, 1, 2, 3),
        help="deepspeed: ZeRO stage (1-3 add per-rank optimizer state files)",
    )
    p.add_argument(
        "--bf16-optimizer",
        action="store_true",
        help="deepspeed: the optimizer files are bf16_zero_pp_rank_*",
    )
    p.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="megatron: each mp_rank directory also holds distrib_optim.pt",
    )
    p.add_argument("--tag", metavar="PATTERN",
                   help="deepspeed: tag names, holding {step} (default global_step{step}); "
                   "dcp: step directory names (default step-{step})")  # fmt: skip
    p.add_argument(
        "--check",
        choices=("world", "node"),
        default="world",
        help="world (default): DIR is shared and every rank's files must be "
        "complete; node: DIR is this node's own storage, holding its ranks' files",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=2.0,
        metavar="S",
        help="seconds a file must keep its size and mtime to count (default 2)",
    )
    p.add_argument(
        "--period",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds between two looks at DIR (default 1)",
    )
    p.add_argument("--generation", type=int, metavar="G",
                   help="this launch's recovery generation (convergencectl "
                   "next-generation, asked once for every node)")  # fmt: skip
    p.add_argument(
        "--once",
        action="store_true",
        help="one settled pass (with --generation: until it resolves), then exit",
    )
    p.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help="with --once: seconds to wait for the generation (default: no limit)",
    )
    p.add_argument("--step-file", type=Path, metavar="FILE",
                   help="also write the agreed step to FILE (a plain number: NVRx's "
                   "--ft-checkpoint-iteration-file)")  # fmt: skip
    p.add_argument(
        "--gc",
        action="store_true",
        help="delete steps the daemon lists in safe_to_delete, retiring first",
    )
    p.add_argument("--socket", type=Path, metavar="PATH",
                   help="the daemon's socket (default $CONVERGENCED_SOCKET, else "
                   "/run/convergenced/convergenced.sock)")  # fmt: skip


class _Usage(Exception):
    pass


def _names_node(spec: dict[str, Any], node: str) -> None:
    members = spec.get("members")
    if isinstance(members, dict) and node not in members:
        raise _Usage(
            f"the stream {spec.get('name')!r} does not name this node ({node}) among its "
            f"members ({', '.join(sorted(map(str, members)))})"
        )


def _spec_of(client: Any, args: argparse.Namespace, node: str) -> dict[str, Any]:
    if args.spec is not None:
        from convergenced.ctl.parser import UsageError, load_spec_file

        try:
            spec = load_spec_file(args.spec)
        except UsageError as exc:
            raise _Usage(str(exc)) from None
        if args.membership is not None:
            spec["membership"] = args.membership
        _names_node(spec, node)  # before declaring: a refusal changes nothing
        try:
            client.declare(spec)
        except SpecError as exc:
            raise _Usage(f"spec file {args.spec}: {exc}") from None
        except ApiError as exc:
            if exc.kind is not ErrorKind.BAD_REQUEST:
                raise
            raise _Usage(f"spec file {args.spec}: {exc}") from None
        name = spec.get("name")
    else:
        if args.membership is not None:
            raise _Usage("--membership goes with --spec")
        name = args.stream
    try:
        state = client.state(str(name))
    except ApiError as exc:
        if exc.reason == "unknown_stream":
            raise _Usage(f"stream {name!r} is not declared on this node: give --spec") from None
        raise
    return dict(state["spec"])


def build(client: Any, args: argparse.Namespace) -> Marker:
    """The marker the options describe, on ``client``'s node.

    Raises:
        _Usage: the options, the directory or the spec do not fit (exit 2).
    """
    node = str(client.status()["node"])
    spec = _spec_of(client, args, node)
    _names_node(spec, node)
    members: dict[str, list[int]] = {k: list(v) for k, v in spec["members"].items()}
    domains = list(spec["policy"]["domains"])
    if args.domain not in domains:
        raise _Usage(f"domain {args.domain!r} is not in the stream's policy ({', '.join(domains)})")
    world_ranks = sorted(r for ranks in members.values() for r in ranks)
    mp = args.tp * args.pp
    if args.dp is None and (mp < 1 or len(world_ranks) % mp):
        raise _Usage(f"the spec's {len(world_ranks)} ranks are not a multiple of tp * pp = {mp}")
    try:
        world = World(args.tp, args.pp, args.dp if args.dp is not None else len(world_ranks) // mp)
        layout = make_layout(
            args.format, world, zero_stage=args.zero_stage, bf16_optimizer=args.bf16_optimizer,
            distributed_optimizer=args.distributed_optimizer, tag=args.tag,
        )  # fmt: skip
    except LayoutError as exc:
        raise _Usage(str(exc)) from None
    if world_ranks != list(range(world.size)):
        raise _Usage(
            f"the spec's ranks ({len(world_ranks)}) are not 0..{world.size - 1}, "
            f"the ranks of a world of tp {world.tp} x pp {world.pp} x dp {world.dp}"
        )
    if not args.dir.is_dir():
        raise _Usage(f"{args.dir}: not a directory")
    try:
        layout.steps(args.dir)
    except OSError as exc:
        raise _Usage(f"{args.dir}: cannot list the checkpoint directory: {exc}") from None
    if args.settle < 0 or args.period <= 0:
        raise _Usage("--settle must be >= 0 and --period > 0")
    own = sorted(members[node])
    return Marker(
        client, layout, args.dir, stream=str(spec["name"]), ranks=own, domain=args.domain,
        check_ranks=world_ranks if args.check == "world" else own,
        shared_dir=args.check == "world", settle=args.settle, generation=args.generation,
        gc=args.gc, step_file=args.step_file,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Run the marker; returns the exit code (see `DESCRIPTION`)."""
    from convergenced.client import Client, DaemonUnreachable

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="convergenced marker: %(message)s")  # fmt: skip
    prog = "convergenced marker"
    if args.timeout is not None and not args.once:
        print(f"{prog}: --timeout goes with --once", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        with Client(args.socket) as client:
            marker = build(client, args)
            client.add_reconnect_hook(marker.reconnected)
            return _loop(marker, args, stop)
    except _Usage as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except MarkerError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except ApiError as exc:
        print(f"{prog}: {exc.kind.value}: {exc} [{exc.reason}]", file=sys.stderr)
        return 1
    except DaemonUnreachable as exc:
        print(f"{prog}: daemon unreachable: {exc}", file=sys.stderr)
        return 3


def _loop(marker: Marker, args: argparse.Namespace, stop: threading.Event) -> int:
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    while not stop.is_set():
        report = marker.poll()
        # The first ask of a generation freezes this node's set: only once every step
        # on disk had the settle period to count, and what is gone was retracted.
        settled = report.reconciled and not report.unsettled
        if settled and not marker.resolved:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            wait = args.period if left is None else min(args.period, left)
            if marker.resolve(wait):
                report = marker.poll()
        if args.once and settled and marker.resolved:
            print(_summary(marker))
            return 0
        if deadline is not None and time.monotonic() >= deadline:
            print(f"convergenced marker: generation {args.generation} not resolved within "
                  f"--timeout {args.timeout:g} s", file=sys.stderr)  # fmt: skip
            return 1
        stop.wait(args.period)
    return 0


def _summary(marker: Marker) -> str:
    target = marker.target
    return f"latest: {'none' if target is None else marker.layout.dirname(target)}"
