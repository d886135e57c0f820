"""`convergencectl`: the operator's and scripts' client of the local daemon.

Every subcommand is one request to the daemon through `convergenced.client.Client`::

    convergencectl status
    convergencectl streams
    convergencectl state job
    convergencectl declare job --member node-1=0-7 --member node-2=8-15 --all-of nvme
    convergencectl declare --spec job.toml
    convergencectl commit job --rank 0 --domain nvme --epoch 120 --digest 9f2c --size 4096
    convergencectl retract job --rank 0 --domain nvme --epoch 120
    convergencectl retire job --rank 0 --domain nvme --epoch 100
    convergencectl wait job 120 --timeout 60
    convergencectl restore-point job 3 --timeout 60
    convergencectl watch job --json | jq .restore_point
    convergencectl top job

Output is short text for people; with ``--json`` (before or after the subcommand)
it is the daemon's result map as one JSON line (sorted keys), and ``watch`` prints
one such line per event, flushed, so it works in pipelines. Errors go to stderr as
``convergencectl: <kind>: <message> [<reason>]``.

``top [STREAM] [--interval S] [--count N] [--no-clear]`` is the live view of one
stream (default: the first one ``streams`` lists): a header (node, cluster, time of
the last update), the restore point, proposal, knowledge, convergence interval, skew
and per-domain skew, GC horizon; the epoch lattice (a row per member, a column per
domain, the newest epoch all the member's ranks hold there, ``-`` for none; ``*``
marks the lowest epoch of a domain whose members differ, ``!`` an epoch older than
the restore point); then the links (peer, state, in sync) and configured peers with
no link. It draws a frame on every ``watch`` event and whenever a link comes up, goes
down or changes sync, asking the daemon's ``status`` at most every ``--interval``
seconds (default 1). On a terminal it redraws in place (ANSI; colours unless
``$NO_COLOR`` is set); with ``--no-clear`` or when stdout is not a terminal it
prints the frames one after another, separated by a blank line. `render_top` draws
one frame from a state map and a status map and nothing else.

The socket is ``--socket``, else ``$CONVERGENCED_SOCKET``, else the daemon's default
(`convergenced.client.default_socket`).

Exit codes:

* 0: done (``watch``, ``top``: stopped by ``--count``, Ctrl-C or a closed output pipe).
* 1: failed: the daemon answered with an error (rejected, timeout, ...); ``top``
  without STREAM on a node with no stream declared.
* 2: usage: bad arguments (argparse errors, an unreadable or invalid spec file).
* 3: daemon unreachable: nothing listens on the socket, the connection was lost
  mid-request, or the daemon is shutting down.
* 130: interrupted by Ctrl-C (any command but ``watch`` and ``top``).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import textwrap
import threading
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from convergenced import __version__
from convergenced.client import ApiError, Client, DaemonUnreachable
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
JSON_HELP = "print the daemon's result as JSON (one line; watch: one line per event)"


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
        "watch",
        "print the state now and after every change",
        "Print the state of STREAM now and after every change, one line each, until "
        "Ctrl-C (exit 0) or the daemon goes away (exit 3).",
    )
    p.add_argument("stream", metavar="STREAM")
    p.add_argument("--count", type=_natural, metavar="N", help="stop after N events")
    _add_top(add)
    return parser


def _add_top(add: Callable[[str, str, str], argparse.ArgumentParser]) -> None:
    p = add(
        "top",
        "live view: epoch lattice, restore point, skew, links",
        "Show STREAM live: restore point, proposal, knowledge, convergence interval, "
        "skew and per-domain skew, GC horizon; the epoch lattice (members x domains, "
        "the newest epoch all of a member's ranks hold; '*' marks the lowest epoch of a "
        "domain whose members differ, '!' an epoch older than the restore point); and "
        "the links to the peers. A new frame on every change of the stream (as watch "
        "sees it) and whenever a link comes up, goes down or changes sync. On a "
        "terminal the screen is redrawn in place; otherwise frames follow each other, "
        "separated by a blank line. Until Ctrl-C (exit 0) or the daemon goes away "
        "(exit 3).",
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
            p.add_argument("--digest", default="", metavar="HEX", help="checksum of the data")
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
        inline = [args.member, args.all_of, args.any_of, args.retention]
        if any(v is not None for v in inline):
            raise UsageError("--spec excludes --member, --all-of, --any-of and --retention")
        wire = load_spec_file(args.spec)
        if args.stream is not None and args.stream != wire.get("name"):
            raise UsageError(f"STREAM {args.stream!r} differs from the spec's name")
    else:
        wire = _inline_spec(args)
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
    }


# -- human output --------------------------------------------------------------------------


def format_intervals(ranges: Iterable[Iterable[int]] | None) -> str:
    """``[[1, 5], [7, 7]]`` as ``1-5, 7``; empty as ``none``; nil as ``unknown``."""
    if ranges is None:
        return "unknown"
    parts = [f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in ranges]
    return ", ".join(parts) or "none"


def _value(v: Any, none: str = "none") -> str:
    return none if v is None else str(v)


def _names(items: Iterable[str]) -> str:
    return ", ".join(items) or "none"


def _fields(pairs: Iterable[tuple[str, str]]) -> list[str]:
    """``label  value`` lines with the values aligned."""
    pairs = list(pairs)
    width = max(len(label) for label, _ in pairs)
    return [f"{label:<{width}}  {value}".rstrip() for label, value in pairs]


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    """Rows as left-aligned columns (the first row is the header)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        (indent + "  ".join(f"{c:<{w}}" for c, w in zip(row, widths, strict=True))).rstrip()
        for row in rows
    ]


def format_duration(seconds: float) -> str:
    """``42.1 s``, ``5 min 3 s``, ``2 h 5 min``, ``3 d 4 h``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    s = int(seconds)
    for unit, size, small, small_size in (
        ("d", 86400, "h", 3600),
        ("h", 3600, "min", 60),
        ("min", 60, "s", 1),
    ):
        if s >= size:
            return f"{s // size} {unit} {s % size // small_size} {small}"
    raise AssertionError("unreachable")  # pragma: no cover


def format_status(st: Mapping[str, Any]) -> str:
    """The ``status`` result for people."""
    peers = st.get("peers", [])
    up = [p["id"] for p in peers if p.get("connected")]
    down = [p["id"] for p in peers if not p.get("connected")]
    peer_text = f"{len(up)}/{len(peers)} connected"
    if up:
        peer_text += f": {', '.join(up)}"
    if down:
        peer_text += f"; not connected: {', '.join(down)}"
    lines = _fields(
        [
            ("node", f"{st['node']} (cluster {st['cluster']})"),
            ("version", f"convergenced {st['version']}, incarnation {st['incarnation']}"),
            ("uptime", format_duration(float(st["uptime_s"]))),
            ("socket", str(st.get("socket", ""))),
            ("peers", peer_text),
            ("clients", str(st["clients"])),
            ("streams", _names(st["streams"])),
            ("links", "none" if not st["links"] else ""),
        ]
    )
    if st["links"]:
        rows = [["peer", "address", "role", "state", "sync"]]
        for link in st["links"]:
            rows.append(
                [
                    _value(link.get("peer"), "?"),
                    str(link.get("address", "")),
                    str(link.get("role", "")),
                    str(link.get("state", "")),
                    "in sync" if link.get("in_sync") else "not in sync",
                ]
            )
        lines += _table(rows)
    return "\n".join(lines)


def format_state(st: Mapping[str, Any]) -> str:
    """The ``state`` result for people."""
    spec = st["spec"]
    policy = spec["policy"]
    ranks = sum(len(r) for r in spec["members"].values())
    skew = _skew(st)
    conflicts = [f"{m} (spec {digest[:16]})" for m, digest in st.get("conflicts", [])]
    lines = _fields(
        [
            ("stream", st["stream"]),
            (
                "spec",
                f"{policy['mode']} of [{', '.join(policy['domains'])}], retention "
                f"{spec['retention']}, {len(spec['members'])} members, {ranks} ranks",
            ),
            ("restore point", _value(st["restore_point"])),
            ("proposal", _value(st["proposal"])),
            ("knowledge", str(st["knowledge"])),
            ("convergence", format_intervals(st["convergence"])),
            ("recoverable", format_intervals(st["recoverable"])),
            ("high water", _value(st.get("high_water"))),
            ("rollback floor", _value(st.get("rollback_floor"))),
            ("gc horizon", _value(st["gc_horizon"])),
            ("safe to delete", format_intervals(st["safe_to_delete"])),
            ("skew", skew),
            ("generations", _names(str(g) for g in st.get("generations", []))),
            ("missing", _names(st["missing"])),
            ("conflicts", _names(conflicts)),
            ("newest epochs", ""),
        ]
    )
    return "\n".join(lines + _newest_table(spec, st["newest"]))


def _skew(st: Mapping[str, Any]) -> str:
    """``2 (nvme 2, s3 0)``: the skew, and per domain."""
    skew = _value(st.get("skew"), "unknown")
    if st.get("domain_skew"):
        skew += " (" + ", ".join(f"{d} {s}" for d, s in sorted(st["domain_skew"].items())) + ")"
    return skew


def _newest_table(spec: Mapping[str, Any], newest: Mapping[str, Mapping[str, int]]) -> list[str]:
    """Per member, per domain, the newest epoch all its ranks hold (``-``: none yet)."""
    domains = sorted(set(spec["policy"]["domains"]).union(*(d.keys() for d in newest.values())))
    members = sorted(set(spec["members"]) | set(newest))
    rows = [["member", *domains]]
    for m in members:
        mine = newest.get(m, {})
        rows.append([m, *(_value(mine.get(d), "-") for d in domains)])
    return _table(rows)


def format_watch_event(st: Mapping[str, Any]) -> str:
    """One line per ``watch`` event."""
    line = (
        f"{time.strftime('%H:%M:%S')} {st['stream']}: restore point "
        f"{_value(st['restore_point'])} ({st['knowledge']}), proposal {_value(st['proposal'])}, "
        f"convergence {format_intervals(st['convergence'])}, "
        f"skew {_value(st.get('skew'), 'unknown')}"
    )
    if st["missing"]:
        line += f", missing {', '.join(st['missing'])}"
    if st["conflicts"]:
        line += f", conflicts {', '.join(m for m, _ in st['conflicts'])}"
    return line


def format_restore_point(r: Mapping[str, Any]) -> str:
    """The ``restore_point`` result for people."""
    head = f"{r['stream']} generation {r['generation']}: "
    if not r["resolved"]:
        return head + f"waiting for {_names(r['waiting_for'])}"
    if r["restore_point"] is None:
        text = head + "no restore point (the frozen sets have no common epoch)"
    else:
        text = head + f"restore point {r['restore_point']}"
    if r.get("lost"):
        text += " (lost since: retracted; open a newer generation)"
    return text


# -- top: one frame ---------------------------------------------------------------------

CLEAR_SCREEN = "\x1b[H\x1b[2J"
_BOLD, _DIM, _RED, _GREEN, _YELLOW, _RESET = (
    "\x1b[1m", "\x1b[2m", "\x1b[31m", "\x1b[32m", "\x1b[33m", "\x1b[0m"
)  # fmt: skip
LAGGARD_MARK = "*"
"""After the lowest epoch of a domain whose members differ (the domain's skew)."""
STALE_MARK = "!"
"""After an epoch older than the restore point."""


def _paint(text: str, code: str, color: bool) -> str:
    return f"{code}{text}{_RESET}" if color and code and text.strip() else text


def _grid(rows: list[list[tuple[str, str]]], color: bool, indent: str = "  ") -> list[str]:
    """Rows of (text, colour) cells as left-aligned columns (padded outside the colour
    codes, which take no width)."""
    widths = [max(len(row[i][0]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            _paint(text, code, color) + " " * (w - len(text))
            for (text, code), w in zip(row, widths, strict=True)
        ]
        lines.append((indent + "  ".join(cells)).rstrip())
    return lines


def _lattice(state: Mapping[str, Any], node: str | None, color: bool) -> tuple[list[str], set[str]]:
    """The epoch lattice, and the marks it used."""
    spec = state.get("spec") or {}
    newest: Mapping[str, Mapping[str, int]] = state.get("newest") or {}
    policy_domains = (spec.get("policy") or {}).get("domains") or []
    domains = sorted(set(policy_domains).union(*(d.keys() for d in newest.values())))
    members = sorted(set(spec.get("members") or {}) | set(newest))
    if not members:
        return ["  no members"], set()
    missing = set(state.get("missing") or [])
    conflicting = {m for m, _ in state.get("conflicts") or []}
    restore_point = state.get("restore_point")
    lowest = {}
    for d in domains:
        epochs = [newest[m][d] for m in members if d in newest.get(m, {})]
        if len(set(epochs)) > 1:
            lowest[d] = min(epochs)
    used: set[str] = set()
    rows: list[list[tuple[str, str]]] = [
        [("member", _BOLD), *((d, _BOLD) for d in domains), ("", "")]
    ]
    for m in members:
        cells = [(m, "")]
        for d in domains:
            epoch = newest.get(m, {}).get(d)
            if epoch is None:
                cells.append(("-", _DIM))
                continue
            marks, code = "", _GREEN
            if restore_point is not None and epoch < restore_point:
                marks, code = STALE_MARK, _RED
            if lowest.get(d) == epoch:
                marks += LAGGARD_MARK
                code = code if code == _RED else _YELLOW
            used.update(marks)
            cells.append((f"{epoch}{marks}", code))
        notes = [
            text
            for text, applies in (
                ("this node", m == node),
                ("not heard from", m in missing),
                ("different spec", m in conflicting),
            )
            if applies
        ]
        cells.append((", ".join(notes), _RED if m in missing | conflicting else _DIM))
        rows.append(cells)
    lines = _grid(rows, color)
    if not domains:
        lines.append("  no domains reported yet")
    return lines, used


def _links(status: Mapping[str, Any] | None, color: bool) -> list[str]:
    """Links to peers, then configured peers with no link."""
    if status is None:
        return ["links  unknown"]
    links = list(status.get("links") or [])
    linked = {link.get("peer") for link in links}
    idle = [p for p in status.get("peers") or [] if p.get("id") not in linked]
    if not links and not idle:
        return ["links  none"]
    rows: list[list[tuple[str, str]]] = [[("peer", _BOLD), ("state", _BOLD), ("sync", _BOLD)]]
    for link in links:
        in_sync = bool(link.get("in_sync"))
        rows.append(
            [
                (_value(link.get("peer"), "?"), ""),
                (str(link.get("state", "")), ""),
                ("in sync" if in_sync else "not in sync", _GREEN if in_sync else _YELLOW),
            ]
        )
    for peer in idle:
        rows.append([(str(peer.get("id")), ""), ("no link", _RED), ("-", _DIM)])
    return ["links", *_grid(rows, color)]


def render_top(
    state: Mapping[str, Any],
    status: Mapping[str, Any] | None,
    *,
    updated: float | None = None,
    color: bool = False,
) -> str:
    """One frame of ``top``: a state map (LOCAL_API.md section 4) and a ``status``
    result (nil: not known) as text, without a trailing newline.

    Pure: ``updated`` is the wall-clock time shown in the header (nil: none shown),
    ``color`` adds ANSI colours (the marks and layout are the same without them).
    """
    node = None if status is None else status.get("node")
    head = "convergencectl top"
    if status is not None:
        head += f"  {node} (cluster {status.get('cluster', '?')})"
    if updated is not None:
        head += f"  updated {time.strftime('%H:%M:%S', time.localtime(updated))}"
    stream = str(state.get("stream", "?"))
    others = [s for s in (status or {}).get("streams") or [] if s != stream]
    if others:
        stream += f" (other streams: {', '.join(others)})"
    pairs = [
        ("stream", stream),
        ("restore point", _value(state.get("restore_point"))),
        ("proposal", _value(state.get("proposal"))),
        ("knowledge", _value(state.get("knowledge"), "unknown")),
        ("convergence", format_intervals(state.get("convergence"))),
        ("skew", _skew(state)),
        ("gc horizon", _value(state.get("gc_horizon"))),
    ]
    if state.get("missing"):
        pairs.append(("missing", _names(state["missing"])))
    if state.get("conflicts"):
        pairs.append(("conflicts", _names(m for m, _ in state["conflicts"])))
    pairs += [("warning", str(w)) for w in (status or {}).get("warnings") or []]
    lattice, marks = _lattice(state, node, color)
    lines = [_paint(head, _BOLD, color), *_fields(pairs), "", "epoch lattice", *lattice]
    legend = []
    if LAGGARD_MARK in marks:
        legend.append(f"{LAGGARD_MARK} lowest of its domain")
    if STALE_MARK in marks:
        legend.append(f"{STALE_MARK} older than the restore point")
    if legend:
        lines.append("  " + "; ".join(legend))
    lines += ["", *_links(status, color)]
    return "\n".join(lines)


def _format_fact(verb: str) -> Callable[[Mapping[str, Any], argparse.Namespace], str]:
    def show(r: Mapping[str, Any], args: argparse.Namespace) -> str:
        durable = " (durable)" if r.get("durable") else ""
        return f"{verb} {r['stream']} rank {args.rank} {args.domain} epoch {r['epoch']}{durable}"

    return show


# -- commands ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Command:
    """One request-reply subcommand: the request, and its result for people."""

    call: Callable[[Client, argparse.Namespace], Any]
    show: Callable[[Any, argparse.Namespace], str]


def _fact_call(op: str) -> Callable[[Client, argparse.Namespace], Any]:
    def call(c: Client, a: argparse.Namespace) -> Any:
        if op == "commit":
            return c.commit(a.stream, a.rank, a.domain, a.epoch, digest=a.digest, size=a.size)
        method = c.retract if op == "retract" else c.retire
        return method(a.stream, a.rank, a.domain, a.epoch)

    return call


COMMANDS: dict[str, Command] = {
    "status": Command(lambda c, a: c.status(), lambda r, a: format_status(r)),
    "streams": Command(lambda c, a: c.streams(), lambda r, a: "\n".join(r)),
    "state": Command(lambda c, a: c.state(a.stream), lambda r, a: format_state(r)),
    "declare": Command(
        lambda c, a: c.declare(a.spec_value),
        lambda r, a: f"declared {r['stream']} (spec {r['digest'][:16]})",
    ),
    "commit": Command(_fact_call("commit"), _format_fact("committed")),
    "retract": Command(_fact_call("retract"), _format_fact("retracted")),
    "retire": Command(_fact_call("retire"), _format_fact("retired")),
    "wait": Command(
        lambda c, a: c.wait(a.stream, a.epoch, a.timeout), lambda r, a: format_state(r)
    ),
    "restore-point": Command(
        lambda c, a: c.restore_point(a.stream, a.generation, a.timeout),
        lambda r, a: format_restore_point(r),
    ),
}


def _dumps(result: Any) -> str:
    return json.dumps(result, sort_keys=True)


def _watch(client: Client, args: argparse.Namespace) -> int:
    """Print events until ``--count`` of them (else until interrupted or lost)."""
    if args.count == 0:
        return EXIT_OK
    events = client.watch(args.stream)
    try:
        for n, event in enumerate(events, 1):
            line = _dumps(event) if args.json else format_watch_event(event)
            print(line, flush=True)
            if args.count is not None and n >= args.count:
                break
    finally:
        events.close()  # ends the watch on the daemon
    return EXIT_OK


class _Watcher:
    """Runs `Client.watch` in a thread and queues its states, then the exception that
    ended it; it ends when the client closes."""

    def __init__(self, client: Client, stream: str) -> None:
        self.events: queue.SimpleQueue[dict[str, Any] | Exception] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, args=(client, stream), name="convergencectl-top", daemon=True
        )
        self._thread.start()

    def _run(self, client: Client, stream: str) -> None:
        try:
            for state in client.watch(stream):
                self.events.put(state)
        except Exception as exc:  # handed to the drawing thread, which raises it
            self.events.put(exc)
        else:  # pragma: no cover - the watch generator only ends by raising
            self.events.put(DaemonUnreachable("the watch ended"))

    def next(self, timeout: float) -> dict[str, Any] | None:
        """The newest state queued within ``timeout`` seconds (older ones are skipped:
        each is a whole state); nil if none came.

        Raises:
            ApiError, DaemonUnreachable: what ended the watch.
        """
        try:
            item = self.events.get(timeout=timeout)
        except queue.Empty:
            return None
        while True:
            if isinstance(item, Exception):
                raise item
            try:
                newer = self.events.get_nowait()
            except queue.Empty:
                return item
            item = newer

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def _link_key(status: Mapping[str, Any]) -> tuple[Any, ...]:
    """What a new ``top`` frame is drawn for: links up or down, in sync or not (not
    the link state, which moves with every token exchange)."""
    links = sorted((str(link.get("peer")), bool(link.get("in_sync"))) for link in status["links"])
    peers = sorted((str(p.get("id")), bool(p.get("connected"))) for p in status["peers"])
    return tuple(links), tuple(peers)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _top(client: Client, args: argparse.Namespace) -> int:
    """Draw frames until ``--count`` of them (else until interrupted or lost)."""
    if args.count == 0:
        return EXIT_OK
    stream = args.stream
    if stream is None:
        streams = client.streams()
        if not streams:
            _fail("failed", "no stream is declared on this node (declare one, or name STREAM)")
            return EXIT_FAILED
        stream = streams[0]
    tty = _isatty(sys.stdout)
    clear = tty and not args.no_clear
    color = tty and not os.environ.get("NO_COLOR")
    status = client.status()
    asked = time.monotonic()
    links = _link_key(status)
    # The blocking client takes concurrent requests on one connection: the watch runs
    # in a thread, the status requests here.
    watcher = _Watcher(client, stream)
    state: dict[str, Any] | None = None
    frames = 0
    try:
        while True:
            event = watcher.next(max(0.0, asked + args.interval - time.monotonic()))
            changed = event is not None
            if event is not None:
                state = event
            if time.monotonic() - asked >= args.interval:
                status = client.status()
                asked = time.monotonic()
                key = _link_key(status)
                changed = changed or key != links
                links = key
            if state is None or not changed:
                continue
            frame = render_top(state, status, updated=time.time(), color=color)
            print((CLEAR_SCREEN if clear else "\n" if frames else "") + frame, flush=True)
            frames += 1
            if args.count is not None and frames >= args.count:
                return EXIT_OK
    finally:
        client.close()  # ends the watch (its thread sees the connection closed)
        watcher.join(timeout=5)


def _request(args: argparse.Namespace) -> int:
    """Connect, make the request, print the result; exceptions go to `_run`."""
    with Client(args.socket) as client:
        if args.command == "watch":
            return _watch(client, args)
        if args.command == "top":
            return _top(client, args)
        command = COMMANDS[args.command]
        result = command.call(client, args)
        text = _dumps(result) if args.json else command.show(result, args)
        if text:
            print(text, flush=True)
    return EXIT_OK


def _fail(kind: str, message: str) -> None:
    print(f"convergencectl: {kind}: {message}", file=sys.stderr, flush=True)


def _run(args: argparse.Namespace) -> int:
    """`_request`, with every failure turned into its message and exit code."""
    try:
        return _request(args)
    except ApiError as err:
        suffix = f" [{err.reason}]" if err.reason and err.reason != err.kind.value else ""
        _fail(err.kind.value, f"{err}{suffix}")
        # A daemon shutting down is going away: the same to a caller as unreachable.
        return EXIT_UNREACHABLE if err.reason == "shutting_down" else EXIT_FAILED
    except DaemonUnreachable as err:
        _fail("unreachable", str(err))
        return EXIT_UNREACHABLE
    except KeyboardInterrupt:
        return EXIT_OK if args.command in ("watch", "top") else EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_OK


def _silence_stdout() -> None:
    """The reader of our output left: drop what is still buffered, quietly."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # stdout without a descriptor (captured in tests)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _usage(args: argparse.Namespace, message: str) -> NoReturn:
    parser: argparse.ArgumentParser = args.command_parser
    parser.error(message)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return EXIT_OK
    return exc.code if isinstance(exc.code, int) else EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (see the module docstring)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        if args.command == "declare":
            try:
                args.spec_value = _spec_from_args(args)
            except UsageError as exc:
                _usage(args, str(exc))
        if args.command == "top" and args.json:
            _usage(args, "top draws for people; for JSON use: watch STREAM --json")
    except SystemExit as exc:  # argparse: --help, --version, usage errors
        return _exit_code(exc)
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
