"""The results of `convergencectl` for people: ``status``, ``state``, ``restore-point``,
the fact commands, one line per ``watch`` event, and the error line on stderr.

Functions from the daemon's result maps (LOCAL_API.md) to text, with no I/O but `_fail`,
which prints the error line. ``--json`` bypasses all of them. The small helpers
(`_value`, `_names`, `_fields`, `_skew`) are shared with `convergenced.ctl.top`, which
shows the same fields in its frames.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from convergenced.core.interval_set import IntervalSet

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


_BYTE_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def format_bytes(n: int) -> str:
    """``512 B``, ``1.5 KiB``, ``12.3 GiB``: binary units, three significant digits."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in _BYTE_UNITS:
        value /= 1024
        if value < 1023.5 or unit == _BYTE_UNITS[-1]:  # never "1024 KiB"
            return f"{value:.0f} {unit}" if value >= 100 else f"{value:.3g} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def format_stored(st: Mapping[str, Any]) -> str:
    """``nvme 1.5 GiB in 3 epochs, s3 0 B in 0 epochs``: what this node's ranks hold
    per domain, from a state map (``unknown`` from a daemon that does not say)."""
    sizes: Mapping[str, int] | None = st.get("stored_bytes")
    if sizes is None:
        return "unknown"
    counts: Mapping[str, int] = st.get("stored_epochs") or {}
    parts = []
    for d, size in sorted(sizes.items()):
        n = counts.get(d)
        epochs = "" if n is None else f" in {n} epoch{'' if n == 1 else 's'}"
        parts.append(f"{d} {format_bytes(size)}{epochs}")
    return ", ".join(parts) or "none"


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
    # The warnings (insecure mode) come right after the node, where nobody misses them.
    warnings = [("warning", str(w)) for w in st.get("warnings") or []]
    lines = _fields(
        [
            ("node", f"{st['node']} (cluster {st['cluster']})"),
            *warnings,
            *(
                [("labels", ", ".join(f"{k}={v}" for k, v in sorted(st["labels"].items())))]
                if st.get("labels")
                else []
            ),
            ("version", f"convergenced {st['version']}, incarnation {st['incarnation']}"),
            ("uptime", format_duration(float(st["uptime_s"]))),
            ("socket", str(st.get("socket", ""))),
            ("peers", peer_text),
            ("clients", str(st["clients"])),
            ("streams", _names(st["streams"])),
            *_stored_total(st),
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


def _stored_total(st: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The ``stored`` line of ``status``: bytes over every stream and domain."""
    by_stream: Mapping[str, Mapping[str, int]] | None = st.get("stored_bytes")
    if by_stream is None:
        return []  # a daemon that does not say
    total = sum(sum(domains.values()) for domains in by_stream.values())
    return [("stored", f"{format_bytes(total)} by this node's ranks")]


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
            *_membership(st),
            ("restore point", _value(st["restore_point"])),
            *([("why none", why)] if (why := st.get("why_no_restore_point")) else []),
            ("proposal", _value(st["proposal"])),
            ("knowledge", str(st["knowledge"])),
            ("convergence", format_intervals(st["convergence"])),
            ("recoverable", format_intervals(st["recoverable"])),
            ("high water", _value(st.get("high_water"))),
            ("rollback floor", _value(st.get("rollback_floor"))),
            ("gc horizon", _value(st["gc_horizon"])),
            ("safe to delete", format_intervals(st["safe_to_delete"])),
            ("stored", format_stored(st)),
            *([("verified", v)] if (v := format_verification(st)) else []),
            *([("last drill", d)] if (d := format_last_drill(st)) else []),
            *([("save overhead", o)] if (o := format_overhead(st)) else []),
            ("skew", skew),
            ("generations", _generations(st)),
            ("missing", _names(st["missing"])),
            ("conflicts", _names(conflicts)),
            ("newest epochs", ""),
        ]
    )
    return "\n".join(lines + _newest_table(spec, st["newest"]))


def format_verification(st: Mapping[str, Any]) -> str:
    """``nvme 12 s ago, pfs never (last: mismatch at 41)``: how long ago the restore
    point last passed verification per domain ("" when nothing is verified here)."""
    parts = []
    for domain, v in sorted(st.get("verification", {}).items()):
        age = f"{v['age_s']:.0f} s ago" if v["verified"] and v["age_s"] is not None else "not yet"
        bad = v["last_outcome"] not in (None, "ok")
        last = f" (last: {v['last_outcome']} at {v['last_epoch']})" if bad else ""
        parts.append(f"{domain} {age}{last}")
    return ", ".join(parts)


def format_last_drill(st: Mapping[str, Any]) -> str:
    """``epoch 40 passed 3 min ago, nvme 812.0 MB/s`` ("" when none ran here)."""
    d = st.get("drill")
    if not d:
        return ""
    rates = ", ".join(f"{k} {v} MB/s" for k, v in sorted(d["mb_s"].items()))
    verdict = "passed" if d["passed"] else "FAILED"
    return f"epoch {d['epoch']} {verdict} {d['age_s']:.0f} s ago" + (f", {rates}" if rates else "")


def format_overhead(st: Mapping[str, Any]) -> str:
    """``4.2% (rank 3: 1.3 s blocked every 30.0 s, 16 saves)``: the share of time the
    recent saves blocked training, worst rank ("" when no integration reported)."""
    o = st.get("overhead")
    if not o:
        return ""
    return (f"{100 * o['ratio']:.1f}% (rank {o['rank']}: {o['blocking_s']:.1f} s blocked "
            f"every {o['interval_s']:.1f} s, {o['saves']} saves)")  # fmt: skip


MAX_MEMBERS_SHOWN = 16
"""``state`` names this many members with their ranks, then counts the others."""


def _ranks(ranks: Iterable[int]) -> str:
    """``0-7, 9``: ranks in a short form."""
    return format_intervals(IntervalSet.of(*ranks).ranges)


def _membership(st: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The member map in force (PROTOCOL.md 8.1): its membership, members and ranks,
    the domains' scopes, and the members whose records name a newer membership."""
    spec = st["spec"]
    membership = st.get("membership", spec.get("membership", 0))
    since = (f" (this member map applies from generation {membership} on)" if membership
             else " (the stream's first member map)")  # fmt: skip
    members = sorted(spec["members"].items())
    shown = [f"{m}: {_ranks(r)}" for m, r in members[:MAX_MEMBERS_SHOWN]]
    if len(members) > MAX_MEMBERS_SHOWN:
        shown.append(f"and {len(members) - MAX_MEMBERS_SHOWN} more")
    pairs = [("membership", f"{membership}{since}"), ("members", ", ".join(shown)),
             ("scopes", _scopes(spec))]  # fmt: skip
    moved = _moved_on(st)
    if moved:
        pairs.append(("moved on", f"{moved} (a member map this node is not in, or has not "
                      "declared yet)"))  # fmt: skip
    return pairs


def _moved_on(st: Mapping[str, Any]) -> str:
    """``node-1, node-2 to membership 3``: members whose records name a newer
    membership than this node's spec ('' when none)."""
    by: dict[int, list[str]] = {}
    for member, membership in sorted((st.get("moved_on") or {}).items()):
        by.setdefault(membership, []).append(member)
    return "; ".join(f"{', '.join(ms)} to membership {g}" for g, ms in sorted(by.items()))


def _scopes(spec: Mapping[str, Any]) -> str:
    """``shared s3; node-local nvme``: the scope of each of the policy's domains."""
    shared = spec.get("shared") or []
    local = [d for d in spec["policy"]["domains"] if d not in shared]
    parts = [f"shared {', '.join(shared)}" if shared else "",
             f"node-local {', '.join(local)}" if local else ""]  # fmt: skip
    return "; ".join(p for p in parts if p)


def _generations(st: Mapping[str, Any]) -> str:
    """Open generations; those of an older member map marked (never answered again)."""
    older = set(st.get("older_map_generations") or [])
    gens = list(st.get("generations") or [])
    current = [str(g) for g in gens if g not in older]
    text = _names(current) if current or not older else ""
    if older:
        text += "; " if text else ""
        text += (f"older member map: {', '.join(str(g) for g in gens if g in older)} "
                 "(protecting their epochs, never answered again)")  # fmt: skip
    return text


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
    if st.get("checkpoint_requested"):
        line += f", checkpoint requested after {st['checkpoint_requested']['after']}"
    return line


def format_drain(r: Mapping[str, Any]) -> str:
    """The ``drain`` result for people: the verdict, then one line per stream."""
    verdict = "safe to drain" if r["safe"] else "NOT safe to drain"
    lines = [f"{r['node']}: {verdict}"]
    if not r["streams"]:
        lines.append("  (a member of no stream)")
    for name, v in sorted(r["streams"].items()):
        mark = "ok" if v["safe"] else "waiting"
        why = f": {v['reason']}" if v["reason"] else ""
        lines.append(f"  {name}: {mark}, target {v['target']}, restore point "
                     f"{_value(v['restore_point'])} ({v['knowledge']}){why}")  # fmt: skip
    for m in r.get("versions", []):
        mark = "ok" if m["safe"] else "waiting"
        why = f": {m['reason']}" if m["reason"] else ""
        lines.append(f"  {m['stream']}: {mark} to move to {m['component']} {m['version']}{why}")
    return "\n".join(lines)


def format_versions(r: Mapping[str, Any]) -> str:
    """The ``versions`` result for people: the components, then each job's handshake."""
    lines = [f"{r['node']}:"]
    if not r["components"]:
        lines.append("  no component catalogue configured ([components.NAME] versions)")
    for name, c in sorted(r["components"].items()):
        runs = (f"runs {c['running']}, accepts {', '.join(c['accepts'])}"
                if c["running"] is not None else "reports no version")  # fmt: skip
        fleet = ", ".join(c["fleet_accepts"]) or "nothing in common"
        lines.append(f"  {name}: {runs}; {c['fleet_nodes']} nodes heard from accept {fleet}")
    for stream, per_component in sorted(r["streams"].items()):
        for name, h in sorted(per_component.items()):
            head = f"  {stream} {name}: "
            if not h["declared"]:
                lines.append(head + "this node reports no version")
                continue
            if h["accepted_by_all"] is None:
                lines.append(head + f"waiting for {_names(h['missing'])}")
                continue
            accepted = ", ".join(h["accepted_by_all"]) or "none"
            compat = {True: "compatible", False: "INCOMPATIBLE", None: "?"}[h["compatible"]]
            lines.append(head + f"{compat}; all accept {accepted}; acknowledged "
                         f"{_value(h['acknowledged'])} ({h['knowledge']})")  # fmt: skip
            runs = ", ".join(f"{m} {v}" for m, v in sorted(h["running"].items()))
            lines.append(f"    running: {runs}")
            if h["droppable"]:
                lines.append(f"    no member needs: {', '.join(h['droppable'])}")
    return "\n".join(lines)


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


def _format_fact(verb: str) -> Callable[[Mapping[str, Any], argparse.Namespace], str]:
    def show(r: Mapping[str, Any], args: argparse.Namespace) -> str:
        durable = " (durable)" if r.get("durable") else ""
        return f"{verb} {r['stream']} rank {args.rank} {args.domain} epoch {r['epoch']}{durable}"

    return show


# -- errors ------------------------------------------------------------------------------


def _fail(kind: str, message: str) -> None:
    print(f"convergencectl: {kind}: {message}", file=sys.stderr, flush=True)


def format_drill(r: dict[str, Any]) -> str:
    """A drill's result: the verdict, one line per rank and per domain, the hook."""
    lines = [f"drill of {r['stream']} epoch {r['epoch']}: "
             f"{'passed' if r['passed'] else 'FAILED'} in {r['seconds']:.3f} s"]  # fmt: skip
    for x in r["ranks"]:
        why = f" ({x['detail']})" if x["detail"] else ""
        lines.append(f"  rank {x['rank']} {x['domain']}: {x['outcome']}{why}, "
                     f"{x['bytes']} bytes in {x['seconds']:.3f} s, {x['mb_s']} MB/s")  # fmt: skip
    for name, d in sorted(r["domains"].items()):
        lines.append(f"  domain {name}: {d['ranks']} ranks, {d['bytes']} bytes, {d['mb_s']} MB/s")
    hook = r["hook"]
    if hook is not None:
        lines.append(f"  hook: exit {hook['exit']} in {hook['seconds']:.3f} s")
        lines.extend("    " + line for line in hook["output"].splitlines()[-10:])
    return "\n".join(lines)
