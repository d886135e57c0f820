"""`convergencectl top`: the live view of one stream, drawn and redrawn.

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

The drawing (`render_top` and its lattice, links and grid) is pure, so tests draw frames
from hand-made maps; the loop (`_top`) feeds it. The blocking client takes concurrent
requests on one connection, so the watch runs in a thread (`_Watcher`) and the status
requests in the loop.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from convergenced.client import Client, DaemonUnreachable
from convergenced.ctl.formatting import _fail, _fields, _names, _skew, _value, format_intervals
from convergenced.ctl.parser import EXIT_FAILED, EXIT_OK

# -- one frame -------------------------------------------------------------------------

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


# -- the loop --------------------------------------------------------------------------


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
