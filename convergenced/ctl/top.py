"""`convergencectl top`: the live view of one stream, drawn and redrawn.

``top [STREAM] [--interval S] [--count N] [--no-clear] [--json]`` is the live view of
one stream (default: the first one ``streams`` lists): a header (node, cluster, time of
the last update), the membership in force and the domains' scopes, the restore point,
proposal, knowledge, convergence interval, skew and per-domain skew, GC horizon, what
this node's ranks store per domain (bytes and epochs), and the members that moved on to
a newer membership; the epoch lattice (a row per member, a column per domain, the
newest epoch all the member's ranks hold there, ``-`` for none;
``*`` marks the lowest epoch of a domain whose members differ, ``!`` an epoch older than
the restore point); then the links (peer, state, in sync) and configured peers with no
link. It draws a frame on every ``watch`` event and whenever a link comes up, goes down
or changes sync, asking the daemon's ``status`` at most every ``--interval`` seconds
(default 1). On a terminal it redraws in place (ANSI; colours unless ``$NO_COLOR`` is
set); with ``--no-clear`` or when stdout is not a terminal it prints the frames one
after another, separated by a blank line. With ``--json`` each frame is one JSON line
instead (`top_frame`: the watch event, its lattice, the links). `render_top` draws one
frame from a state map and a status map and nothing else.

A configured peer without a link is ``down`` when the overlay links the two nodes
(always in a full mesh), and its member row says ``link down``; ``relayed`` when the
overlay does not (its records come through other nodes); ``no link`` when the daemon
does not say (the ``overlay_link`` of its status).

The drawing (`lattice` and `links` as data, `render_top` drawing them) is pure, so tests
draw frames from hand-made maps; the loop (`_top`) feeds it. The blocking client takes concurrent
requests on one connection, so the watch runs in a thread (`_Watcher`) and the status
requests in the loop.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from convergenced.client import Client, DaemonUnreachable
from convergenced.ctl.formatting import (
    _fail,
    _fields,
    _moved_on,
    _names,
    _scopes,
    _skew,
    _value,
    format_intervals,
    format_last_drill,
    format_overhead,
    format_stored,
    format_verification,
)
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


def _peer_links(status: Mapping[str, Any] | None) -> dict[str, str]:
    """Each configured peer's link: ``up``, ``down`` (the overlay links the two nodes,
    yet there is no link), ``relayed`` (the overlay does not link them: records reach
    it through other nodes) or ``none`` (no link; the daemon did not say whether one is
    expected)."""
    links: dict[str, str] = {}
    for p in (status or {}).get("peers") or []:
        expected = p.get("overlay_link")
        if p.get("connected"):
            links[str(p.get("id"))] = "up"
        else:
            links[str(p.get("id"))] = {True: "down", False: "relayed"}.get(expected, "none")
    return links


def lattice(state: Mapping[str, Any], status: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The epoch lattice of a state map, as data: ``domains``, and per member (sorted)
    its ``newest`` epoch in each domain (nil: none yet), the ``marks`` of each epoch
    (`LAGGARD_MARK`, `STALE_MARK`) and its ``notes`` (``this node``, ``not heard
    from``, ``different spec``, ``moved on`` to a newer membership, ``link down``).
    Pure; ``top`` draws it and ``top --json`` prints it."""
    spec = state.get("spec") or {}
    newest: Mapping[str, Mapping[str, int]] = state.get("newest") or {}
    policy_domains = (spec.get("policy") or {}).get("domains") or []
    domains = sorted(set(policy_domains).union(*(d.keys() for d in newest.values())))
    members = sorted(set(spec.get("members") or {}) | set(newest))
    node = None if status is None else status.get("node")
    missing = set(state.get("missing") or [])
    conflicting = {m for m, _ in state.get("conflicts") or []}
    moved = set(state.get("moved_on") or {})
    down = {peer for peer, link in _peer_links(status).items() if link == "down"}
    restore_point = state.get("restore_point")
    lowest = {}
    for d in domains:
        epochs = [newest[m][d] for m in members if d in newest.get(m, {})]
        if len(set(epochs)) > 1:
            lowest[d] = min(epochs)
    rows = []
    for m in members:
        mine = newest.get(m, {})
        marks = {}
        for d, epoch in mine.items():
            mark = STALE_MARK if restore_point is not None and epoch < restore_point else ""
            mark += LAGGARD_MARK if lowest.get(d) == epoch else ""
            if mark:
                marks[d] = mark
        notes = [
            text
            for text, applies in (
                ("this node", m == node),
                ("not heard from", m in missing),
                ("different spec", m in conflicting),
                ("moved on", m in moved),
                ("link down", m in down),
            )
            if applies
        ]
        rows.append({"member": m, "newest": {d: mine.get(d) for d in domains},
                     "marks": marks, "notes": notes})  # fmt: skip
    return {"domains": domains, "members": rows}


_ALARMS = frozenset({"not heard from", "different spec", "link down"})
"""Notes drawn in red."""


def _lattice(lat: Mapping[str, Any], color: bool) -> tuple[list[str], set[str]]:
    """The epoch lattice drawn, and the marks it used."""
    domains: list[str] = lat["domains"]
    if not lat["members"]:
        return ["  no members"], set()
    used: set[str] = set()
    rows: list[list[tuple[str, str]]] = [
        [("member", _BOLD), *((d, _BOLD) for d in domains), ("", "")]
    ]
    for row in lat["members"]:
        cells = [(str(row["member"]), "")]
        for d in domains:
            epoch = row["newest"].get(d)
            if epoch is None:
                cells.append(("-", _DIM))
                continue
            marks = row["marks"].get(d, "")
            code = _RED if STALE_MARK in marks else _YELLOW if LAGGARD_MARK in marks else _GREEN
            used.update(marks)
            cells.append((f"{epoch}{marks}", code))
        notes = row["notes"]
        cells.append((", ".join(notes), _RED if _ALARMS.intersection(notes) else _DIM))
        rows.append(cells)
    lines = _grid(rows, color)
    if not domains:
        lines.append("  no domains reported yet")
    return lines, used


def links(status: Mapping[str, Any] | None) -> list[dict[str, Any]] | None:
    """The links to peers, then the configured peers with no link, as data: ``peer``,
    ``state`` (the link's, or ``down``, ``relayed``, ``no link``: see `_peer_links`)
    and ``in_sync`` (nil without a link). Nil when the status is not known."""
    if status is None:
        return None
    rows = [
        {"peer": link.get("peer"), "state": str(link.get("state", "")),
         "in_sync": bool(link.get("in_sync"))}
        for link in status.get("links") or []
    ]  # fmt: skip
    linked = {row["peer"] for row in rows}
    for peer, link in _peer_links(status).items():
        if peer not in linked:
            state = {"down": "down", "relayed": "relayed"}.get(link, "no link")
            rows.append({"peer": peer, "state": state, "in_sync": None})
    return rows


def _links(status: Mapping[str, Any] | None, color: bool) -> list[str]:
    """Links to peers, then configured peers with no link."""
    table = links(status)
    if table is None:
        return ["links  unknown"]
    if not table:
        return ["links  none"]
    rows: list[list[tuple[str, str]]] = [[("peer", _BOLD), ("state", _BOLD), ("sync", _BOLD)]]
    for row in table:
        in_sync = row["in_sync"]
        if in_sync is None:
            code = _DIM if row["state"] == "relayed" else _RED
            rows.append([(str(row["peer"]), ""), (row["state"], code), ("-", _DIM)])
            continue
        rows.append(
            [
                (_value(row["peer"], "?"), ""),
                (row["state"], ""),
                ("in sync" if in_sync else "not in sync", _GREEN if in_sync else _YELLOW),
            ]
        )
    return ["links", *_grid(rows, color)]


def top_frame(
    state: Mapping[str, Any], status: Mapping[str, Any] | None, *, updated: float | None = None
) -> dict[str, Any]:
    """One frame of ``top --json``: the ``state`` (the watch event, as ``watch --json``
    prints it), its `lattice`, the `links`, and from the status ``node``, ``cluster``
    and ``warnings``; ``updated`` is the wall-clock time of the frame. Pure."""
    return {
        "updated": updated,
        "node": None if status is None else status.get("node"),
        "cluster": None if status is None else status.get("cluster"),
        "warnings": list((status or {}).get("warnings") or []),
        "state": dict(state),
        "lattice": lattice(state, status),
        "links": links(status),
    }


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
    membership = str(state.get("membership", 0))
    if state.get("spec"):
        membership += f" ({_scopes(state['spec'])})"
    pairs = [
        ("stream", stream),
        ("membership", membership),
        ("restore point", _value(state.get("restore_point"))),
        ("proposal", _value(state.get("proposal"))),
        ("knowledge", _value(state.get("knowledge"), "unknown")),
        ("convergence", format_intervals(state.get("convergence"))),
        ("skew", _skew(state)),
        ("gc horizon", _value(state.get("gc_horizon"))),
        ("stored", format_stored(state)),
    ]
    if verified := format_verification(state):
        pairs.append(("verified", verified))
    if drill := format_last_drill(state):
        pairs.append(("last drill", drill))
    if overhead := format_overhead(state):
        pairs.append(("save overhead", overhead))
    if state.get("missing"):
        pairs.append(("missing", _names(state["missing"])))
    if state.get("conflicts"):
        pairs.append(("conflicts", _names(m for m, _ in state["conflicts"])))
    if state.get("moved_on"):
        pairs.append(("moved on", _moved_on(state)))
    pairs += [("warning", str(w)) for w in (status or {}).get("warnings") or []]
    drawn, marks = _lattice(lattice(state, status), color)
    lines = [_paint(head, _BOLD, color), *_fields(pairs), "", "epoch lattice", *drawn]
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
            if args.json:  # one object a line, for programs: no screen to clear
                print(json.dumps(top_frame(state, status, updated=time.time()), sort_keys=True),
                      flush=True)  # fmt: skip
            else:
                frame = render_top(state, status, updated=time.time(), color=color)
                print((CLEAR_SCREEN if clear else "\n" if frames else "") + frame, flush=True)
            frames += 1
            if args.count is not None and frames >= args.count:
                return EXIT_OK
    finally:
        client.close()  # ends the watch (its thread sees the connection closed)
        watcher.join(timeout=5)
