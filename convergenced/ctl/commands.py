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
    convergencectl next-generation job
    convergencectl restore-point job 3 --timeout 60
    convergencectl watch job --json | jq .restore_point
    convergencectl gate node-3 --checkpoint --timeout 600
    convergencectl gate node-3 --version driver=555.42.02 --timeout 600
    convergencectl report-version driver 555.42.02 --accepts 550.54.15,555.42.02
    convergencectl versions job
    convergencectl drill job --json
    convergencectl top job

Output is short text for people; with ``--json`` (before or after the subcommand)
it is the daemon's result map as one JSON line (sorted keys), ``watch`` prints
one such line per event and ``top`` one per frame, flushed, so they work in
pipelines. Errors go to stderr as ``convergencectl: <kind>: <message> [<reason>]``.

``top`` is the live view of one stream (see `convergenced.ctl.top`).

The socket is ``--socket``, else ``$CONVERGENCED_SOCKET``, else the daemon's default
(`convergenced.client.default_socket`).

Exit codes:

* 0: done (``watch``, ``top``: stopped by ``--count``, Ctrl-C or a closed output pipe).
* 1: failed: the daemon answered with an error (rejected, timeout, ...); ``top``
  without STREAM on a node with no stream declared; ``gate``: the drain is not safe
  within its timeout; ``drill``: the drill failed.
* 2: usage: bad arguments (argparse errors, an unreadable or invalid spec file).
* 3: daemon unreachable: nothing listens on the socket, the connection was lost
  mid-request, or the daemon is shutting down.
* 130: interrupted by Ctrl-C (any command but ``watch`` and ``top``).

This module is the command itself: the table of request-reply commands, ``watch``, and
turning every failure into its message and exit code in `main`. The arguments are
parsed in `convergenced.ctl.parser`, results formatted in `convergenced.ctl.formatting`,
``top`` drawn in `convergenced.ctl.top`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from convergenced.client import ApiError, Client, DaemonUnreachable
from convergenced.ctl.formatting import (
    _fail,
    _format_fact,
    format_drain,
    format_drill,
    format_restore_point,
    format_state,
    format_status,
    format_versions,
    format_watch_event,
)
from convergenced.ctl.parser import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    UsageError,
    _spec_from_args,
    build_parser,
)
from convergenced.ctl.top import _top

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
        lambda c, a: c.declare(a.spec_value, allow_unknown_members=a.allow_unknown_members),
        lambda r, a: f"declared {r['stream']} (spec {r['digest'][:16]})",
    ),
    "undeclare": Command(
        lambda c, a: c.undeclare(a.stream), lambda r, a: f"undeclared {r['stream']}"
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
    "versions": Command(lambda c, a: c.versions(a.stream), lambda r, a: format_versions(r)),
    "rollout-note": Command(lambda c, a: c.note_rollout(a.text), lambda r, a: "noted (durable)"),
    "report-version": Command(
        lambda c, a: c.report_version(a.component, a.version, a.accepts),
        lambda r, a: f"reported {r['component']} {a.version} (durable)",
    ),
    # Just the number, for a launcher script: GEN=$(convergencectl next-generation job)
    "next-generation": Command(
        lambda c, a: c.next_generation(a.stream, a.timeout), lambda r, a: str(r["generation"])
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


def _gate(client: Client, args: argparse.Namespace) -> int:
    """Wait for the drain gate; exit 0 only when the drain is safe (fail closed)."""
    result = client.drain(args.node, streams=args.stream, checkpoint=args.checkpoint,
                          timeout=args.timeout, versions=dict(args.version))  # fmt: skip
    print(_dumps(result) if args.json else format_drain(result), flush=True)
    return EXIT_OK if result["safe"] else EXIT_FAILED


def _drill(client: Client, args: argparse.Namespace) -> int:
    """Run a drill; exit 0 only when it passed."""
    result = client.drill(args.stream, epoch=args.epoch, domain=args.domain)
    print(_dumps(result) if args.json else format_drill(result), flush=True)
    return EXIT_OK if result["passed"] else EXIT_FAILED


def _request(args: argparse.Namespace) -> int:
    """Connect, make the request, print the result; exceptions go to `_run`."""
    # No reconnecting: a command reports a daemon that went away at once (exit 3), and
    # a script runs it again.
    with Client(args.socket, reconnect=0) as client:
        if args.command == "watch":
            return _watch(client, args)
        if args.command == "top":
            return _top(client, args)
        if args.command == "gate":
            return _gate(client, args)
        if args.command == "drill":
            return _drill(client, args)
        command = COMMANDS[args.command]
        result = command.call(client, args)
        text = _dumps(result) if args.json else command.show(result, args)
        if text:
            print(text, flush=True)
    return EXIT_OK


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
    except SystemExit as exc:  # argparse: --help, --version, usage errors
        return _exit_code(exc)
    return _run(args)
