"""The arguments of `convergencectl`: the parser, its small argument types, and the
spec ``declare`` sends (read from a JSON or TOML file, or built from the inline options).

Everything here happens before the daemon is asked anything, so whatever goes wrong here
is a usage error (`UsageError`, exit 2), never a failed request. The exit codes live here
too, next to the help text that lists them in every subcommand's epilog; the modules
that run the commands (`convergenced.ctl.top`, `convergenced.ctl.commands`) return them.
"""

from __future__ import annotations

import argparse
import json
import textwrap
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from convergenced import __version__
from convergenced.core.errors import SpecError
from convergenced.core.spec import StreamSpec

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_INTERRUPTED = 130

EXIT_CODES_HELP = """\
exit codes:
  0    done (watch, top: stopped by --count, Ctrl-C or a closed output pipe)
  1    failed: the daemon answered with an error (rejected, timeout, ...);
       top: no stream declared on this node
  2    usage: bad arguments, unreadable or invalid spec file
  3    daemon unreachable: not listening, connection lost, or shutting down
  130  interrupted by Ctrl-C (any command but watch and top)
"""

SOCKET_HELP = (
    "the daemon's socket (default: $CONVERGENCED_SOCKET, else /run/convergenced/convergenced.sock)"
)
JSON_HELP = (
    "print the daemon's result as JSON (one line; watch: one line per event; top: one "
    "line per frame)"
)


class UsageError(Exception):
    """Arguments argparse accepted but that make no request (exit 2)."""


# -- argument types -------------------------------------------------------------------


def _natural(text: str) -> int:
    """A non-negative integer argument."""
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def _seconds(text: str) -> float:
    """A non-negative number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative number of seconds")
    return value


def _positive_seconds(text: str) -> float:
    """A positive, finite number of seconds."""
    value = _seconds(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _ranks(text: str) -> list[int]:
    """``0,1,2`` or ``0-7,9``: a list of ranks."""
    ranks: list[int] = []
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        first = _natural(lo)
        last = _natural(hi) if dash else first
        if last < first:
            raise argparse.ArgumentTypeError(f"rank range {part!r} runs backwards")
        ranks.extend(range(first, last + 1))
    return ranks


def _member(text: str) -> tuple[str, list[int]]:
    """``NODE=RANKS`` (see `_ranks`)."""
    node, eq, ranks = text.partition("=")
    if not eq or not node or not ranks:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NODE=RANKS, e.g. node-1=0,1 or 0-7")
    return node, _ranks(ranks)


def _domains(text: str) -> list[str]:
    """``nvme,s3``: a list of domain names."""
    domains = [d.strip() for d in text.split(",") if d.strip()]
    if not domains:
        raise argparse.ArgumentTypeError("name at least one domain")
    return domains


# -- the parser ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(
        prog="convergencectl",
        description="Client of the local convergenced daemon: declare streams, report\n"
        "checkpoints, read the agreed restore point.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"convergencectl {__version__}")
    parser.add_argument("--socket", type=Path, metavar="PATH", help=SOCKET_HELP)
    parser.add_argument("--json", action="store_true", help=JSON_HELP)
    # The same options after the subcommand; SUPPRESS keeps them from resetting the
    # values given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--socket", type=Path, metavar="PATH", default=argparse.SUPPRESS, help=SOCKET_HELP
    )
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help=JSON_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, help_text: str, description: str) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            help=help_text,
            description=textwrap.fill(description, 79),
            parents=[common],
            epilog=EXIT_CODES_HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.set_defaults(command_parser=p)
        return p

    add("status", "daemon identity, links, peers, clients", "Show the daemon's status.")
    add("streams", "streams declared on this node", "List the streams, one per line.")
    p = add("state", "one stream as this node sees it", "Show the state of STREAM.")
    p.add_argument("stream", metavar="STREAM")
    _add_declare(add)
    p = add(
        "undeclare",
        "remove a stream from this node",
        "Remove STREAM from this node: it forgets the stream's commits, and tells the "
        "other members it holds nothing of it any more (their restore point goes, as a "
        "rollback, until they undeclare it too). The ranks' checkpoints of it are then "
        "the job's to delete. The name may be declared again afterwards, with any spec.",
    )
    p.add_argument("stream", metavar="STREAM")
    _add_facts(add)
    p = add(
        "wait",
        "block until the restore point reaches EPOCH",
        "Wait until the restore point of STREAM reaches EPOCH, then show the state. "
        "Exit 1 on timeout.",
    )
    p.add_argument("stream", metavar="STREAM")
    p.add_argument("epoch", type=_natural, metavar="EPOCH")
    p.add_argument("--timeout", type=_seconds, metavar="S", help="give up after S seconds")
    p = add(
        "restore-point",
        "the agreed restore point of a recovery generation",
        "Freeze this node's recoverable set for recovery generation GEN (first request "
        "only) and show the restore point every member agrees on for it, once each "
        "member has frozen its own. Exit 1 on timeout.",
    )
    p.add_argument("stream", metavar="STREAM")
    p.add_argument("generation", type=_natural, metavar="GEN")
    p.add_argument("--timeout", type=_seconds, metavar="S", help="give up after S seconds")
    p = add(
        "next-generation",
        "the recovery generation a new launch uses",
        "Print the number of a recovery generation of STREAM that no member has resolved "
        "or closed: a relaunched job asks once, hands it to every rank, and each asks "
        "restore-point for it. Asking changes nothing. Exit 1 on timeout (a daemon that "
        "lost its state has not heard from its peers yet).",
    )
    p.add_argument("stream", metavar="STREAM")
    p.add_argument("--timeout", type=_seconds, metavar="S", help="give up after S seconds")
    p = add(
        "watch",
        "print the state now and after every change",
        "Print the state of STREAM now and after every change, one line each, until "
        "Ctrl-C (exit 0) or the daemon goes away (exit 3).",
    )
    p.add_argument("stream", metavar="STREAM")
    p.add_argument("--count", type=_natural, metavar="N", help="stop after N events")
    p = add(
        "drill",
        "test-restore the restore point of STREAM for this node's ranks",
        "Read every byte of the restore point (or EPOCH) of STREAM that this node's ranks "
        "committed, check it against its commit, restore it into the daemon's scratch "
        "folder if it has one and run its drill hook; report time and bandwidth per rank "
        "and per domain. A checkpoint that no longer matches is retracted. Exit 1 when "
        "the drill fails.",
    )
    p.add_argument("stream", metavar="STREAM")
    p.add_argument("--epoch", type=_natural, metavar="E", help="drill EPOCH, not the restore point")
    p.add_argument("--domain", metavar="D", help="only the copies in domain D")
    _add_gate(add)
    _add_versions(add)
    _add_top(add)
    return parser


def _move(text: str) -> tuple[str, str]:
    """COMPONENT=VERSION."""
    component, sep, version = text.partition("=")
    if not sep or not component or not version:
        raise argparse.ArgumentTypeError(f"{text!r}: expected COMPONENT=VERSION")
    return component, version


def _add_versions(add: Callable[[str, str, str], argparse.ArgumentParser]) -> None:
    p = add(
        "versions",
        "the version handshake of each job",
        "Show the component catalogues, the versions this node runs and accepts, the "
        "versions every node heard from accepts, and, per job (or STREAM): the versions "
        "every member accepts, the newest one every member acknowledged, what each "
        "member runs, and the versions no member needs any more.",
    )
    p.add_argument("stream", nargs="?", metavar="STREAM", help="only this job's stream")
    p = add(
        "report-version",
        "report the version of a component this node runs",
        "Report that this node runs VERSION of COMPONENT and works beside peers that run "
        "any of --accepts (VERSION is always accepted). Durable when it returns; the "
        "latest report of a component replaces the one before. Versions must be in the "
        "component's catalogue ([components.NAME] versions in the configuration).",
    )
    p.add_argument("component", metavar="COMPONENT")
    p.add_argument("version", metavar="VERSION")
    p.add_argument(
        "--accepts",
        type=lambda t: [v for v in t.split(",") if v],
        default=[],
        metavar="V1,V2",
        help="the versions peers may run beside this node (default: VERSION only)",
    )
    p = add(
        "rollout-note",
        "add a note to this node's rollout audit trail",
        "Add TEXT (a JSON object, at most 4096 chars) to this node's rollout audit trail, "
        "kept in its log (the newest 64; `versions` shows them). Written by "
        "`convergenced rollout` at each step of a node.",
    )
    p.add_argument("text", metavar="TEXT")


def _add_gate(add: Callable[[str, str, str], argparse.ArgumentParser]) -> None:
    p = add(
        "gate",
        "wait until NODE may be drained for maintenance",
        "Wait until NODE may go down for maintenance without losing work: every stream "
        "NODE is a member of (or each --stream) has a restore point at least as new as "
        "the newest epoch NODE held when asked, and every member has published it. Ask "
        "NODE's own daemon (its socket). With --checkpoint the jobs are asked to save a "
        "new checkpoint now (an event on watch) and the gate waits for that one. Exit 0 "
        "when the drain is safe, 1 when it is not within --timeout (the gate fails "
        "closed) or NODE is not this daemon's node.",
    )
    p.add_argument("node", metavar="NODE", help="the node to drain: this daemon's node id")
    p.add_argument(
        "--stream",
        action="append",
        default=[],
        metavar="S",
        help="judge only stream S (repeatable; default: every stream NODE is a member of)",
    )
    p.add_argument(
        "--checkpoint",
        action="store_true",
        help="ask the jobs for a new checkpoint and wait for it to be agreed",
    )
    p.add_argument(
        "--version",
        action="append",
        type=_move,
        default=[],
        metavar="COMPONENT=VERSION",
        help="NODE is to come back on VERSION of COMPONENT: wait also until every member "
        "of each of its jobs accepts it and has acknowledged that (repeatable)",
    )
    p.add_argument(
        "--timeout",
        type=_seconds,
        metavar="S",
        help="give up after S seconds and exit 1 (default: wait for ever)",
    )


def _add_top(add: Callable[[str, str, str], argparse.ArgumentParser]) -> None:
    p = add(
        "top",
        "live view: epoch lattice, restore point, skew, links",
        "Show STREAM live: restore point, proposal, knowledge, convergence interval, "
        "skew and per-domain skew, GC horizon; the epoch lattice (members x domains, "
        "the newest epoch all of a member's ranks hold; '*' marks the lowest epoch of a "
        "domain whose members differ, '!' an epoch older than the restore point); and "
        "the links to the peers. A new frame on every change of the stream (as watch "
        "sees it) and whenever a link comes up, goes down or changes sync; a peer the "
        "overlay links to but without a link shows 'down', and its member 'link down'. "
        "On a terminal the screen is redrawn in place; otherwise frames follow each "
        "other, separated by a blank line. With --json each frame is one JSON object on "
        "one line: the state (as watch --json prints it), its lattice (domains, and per "
        "member the newest epochs, their marks and notes) and the links. Until Ctrl-C "
        "(exit 0) or the daemon goes away (exit 3).",
    )
    p.add_argument(
        "stream",
        nargs="?",
        metavar="STREAM",
        help="the stream to show (default: the first one `streams` lists; exit 1 if none)",
    )
    p.add_argument(
        "--interval",
        type=_positive_seconds,
        default=1.0,
        metavar="S",
        help="ask the daemon for its links at most every S seconds (default: 1.0)",
    )
    p.add_argument("--count", type=_natural, metavar="N", help="stop after N frames")
    p.add_argument(
        "--no-clear",
        action="store_true",
        help="never clear the screen: print the frames one after another, separated by "
        "a blank line (the default when stdout is not a terminal)",
    )


def _add_declare(add: Callable[[str, str, str], argparse.ArgumentParser]) -> None:
    p = add(
        "declare",
        "declare a stream",
        "Declare a stream, from a spec file or inline. Every member declares the same "
        "spec; declaring it again is a no-op, a different spec under the same name is "
        "refused (exit 1).",
    )
    p.add_argument("stream", nargs="?", metavar="STREAM", help="stream name (inline form)")
    p.add_argument(
        "--spec",
        type=Path,
        metavar="FILE",
        help="JSON or TOML file holding the spec map: name, members {node: [ranks]}, "
        "policy {mode: all|any, domains: [...]}, retention",
    )
    p.add_argument(
        "--member",
        type=_member,
        action="append",
        metavar="NODE=RANKS",
        help="a member node and the ranks it hosts (0,1,2 or 0-7); repeat per node",
    )
    policy = p.add_mutually_exclusive_group()
    policy.add_argument(
        "--all-of", type=_domains, metavar="D,...", help="an epoch needs every domain"
    )
    policy.add_argument(
        "--any-of", type=_domains, metavar="D,...", help="an epoch needs any one domain"
    )
    p.add_argument(
        "--retention", type=_natural, metavar="K", help="epochs kept below the restore point"
    )
    p.add_argument(
        "--shared",
        type=_domains,
        metavar="D,...",
        help="the policy's domains readable from any host (an object store); the others "
        "are node-local",
    )
    p.add_argument(
        "--membership",
        type=_natural,
        metavar="GEN",
        help="a new member map of a declared stream, from recovery generation GEN on (the "
        "number next-generation gave the relaunch); also with --spec",
    )
    p.add_argument(
        "--allow-unknown-members",
        action="store_true",
        help="accept members that are not (yet) peers or in the trust list of this node",
    )


def _add_facts(add: Callable[[str, str, str], argparse.ArgumentParser]) -> None:
    facts = {
        "commit": ("report an epoch durable", "Report EPOCH durable in DOMAIN for RANK."),
        "retract": (
            "report an epoch lost or corrupt",
            "Report EPOCH lost or corrupt in DOMAIN for RANK (may roll the restore point back).",
        ),
        "retire": (
            "report an epoch deleted",
            "Report EPOCH deleted from DOMAIN for RANK; only epochs in safe_to_delete "
            "(see state) are accepted.",
        ),
    }
    for name, (help_text, description) in facts.items():
        p = add(name, help_text, description)
        p.add_argument("stream", metavar="STREAM")
        p.add_argument("--rank", type=_natural, required=True, metavar="R")
        p.add_argument("--domain", required=True, metavar="D")
        p.add_argument("--epoch", type=_natural, required=True, metavar="E")
        if name == "commit":
            p.add_argument(
                "--digest", default="", metavar="ALGO:HEX", help="checksum (sha256:<hex>)"
            )
            p.add_argument("--size", type=_natural, default=0, metavar="BYTES")


# -- declare: the spec ------------------------------------------------------------------


def load_spec_file(path: Path) -> dict[str, Any]:
    """Read a spec map from a JSON or TOML file (by suffix; else JSON, then TOML).

    A file whose only key is ``spec`` holding a map is read as that map.

    Raises:
        UsageError: unreadable, unparsable, or not a map.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read spec file {path}: {exc}") from None
    suffix = path.suffix.lower()
    parsers: list[Callable[[str], Any]] = (
        [tomllib.loads] if suffix == ".toml" else [json.loads] if suffix == ".json" else
        [json.loads, tomllib.loads]
    )  # fmt: skip
    errors = []
    for parse in parsers:
        try:
            data = parse(text)
            break
        except ValueError as exc:  # JSONDecodeError and TOMLDecodeError both are
            errors.append(str(exc))
    else:
        raise UsageError(f"spec file {path} is neither valid JSON nor TOML: {'; '.join(errors)}")
    if isinstance(data, dict) and set(data) == {"spec"} and isinstance(data["spec"], dict):
        data = data["spec"]
    if not isinstance(data, dict):
        raise UsageError(f"spec file {path}: expected a map, found {type(data).__name__}")
    return data


def _spec_from_args(args: argparse.Namespace) -> StreamSpec:
    """The spec `declare` sends, from ``--spec`` or the inline options.

    Raises:
        UsageError: the options do not make one valid spec.
    """
    if args.spec is not None:
        inline = [args.member, args.all_of, args.any_of, args.retention, args.shared]
        if any(v is not None for v in inline):
            raise UsageError(
                "--spec excludes --member, --all-of, --any-of, --retention and --shared"
            )
        wire = load_spec_file(args.spec)
        if args.stream is not None and args.stream != wire.get("name"):
            raise UsageError(f"STREAM {args.stream!r} differs from the spec's name")
    else:
        wire = _inline_spec(args)
    if args.membership is not None:
        wire = {**wire, "membership": args.membership}
    try:
        return StreamSpec.from_wire(wire)
    except SpecError as exc:
        where = f"{args.spec}: " if args.spec is not None else ""
        raise UsageError(f"{where}{exc}") from None


def _inline_spec(args: argparse.Namespace) -> dict[str, Any]:
    if args.stream is None:
        raise UsageError("STREAM is required without --spec")
    if not args.member:
        raise UsageError("name the members with --member NODE=RANKS (or use --spec)")
    if args.all_of is None and args.any_of is None:
        raise UsageError("one of --all-of or --any-of is required (or use --spec)")
    members: dict[str, list[int]] = {}
    for node, ranks in args.member:
        if node in members:
            raise UsageError(f"--member {node}: given twice")
        members[node] = ranks
    mode, domains = ("all", args.all_of) if args.all_of is not None else ("any", args.any_of)
    return {
        "name": args.stream,
        "members": members,
        "policy": {"mode": mode, "domains": domains},
        "retention": args.retention or 0,
        **({"shared": args.shared} if args.shared else {}),
    }
