"""What the write-ahead log holds: facts and incarnations, and their msgpack form.

Each entry is a tagged array (``["commit", stream, rank, domain, epoch, digest,
size]``...), so the log can be read without the code that wrote it, and a new kind
of entry is refused by an older version instead of being misread. The file format
around the entries is `log_file`'s.
"""

from __future__ import annotations

from typing import Any

from convergenced.core.facts import (
    CloseGenerations,
    Commit,
    ComponentReport,
    Declare,
    Fact,
    Freeze,
    HighWater,
    Horizon,
    Incarnation,
    RankState,
    Retire,
    Retract,
    RolloutNote,
    Settled,
    Undeclare,
)
from convergenced.core.interval_set import IntervalSet
from convergenced.core.spec import StreamSpec
from convergenced.errors import ConvergencedError

__all__ = ["Entry", "Incarnation", "decode_entry", "encode_entry"]

Entry = Fact
"""Every entry of the log is a fact (incarnations included)."""


def encode_entry(entry: Entry) -> list[Any]:
    """The msgpack-ready payload of one entry."""
    if isinstance(entry, Incarnation):
        return ["incarnation", entry.number, *([True] if entry.unsure else [])]
    if isinstance(entry, Settled):
        # The bound is absent when 0 (as in logs before it).
        return ["settled", entry.stream, *([entry.taken_below] if entry.taken_below else [])]
    if isinstance(entry, RolloutNote):
        return ["rollout_note", entry.text]
    if isinstance(entry, ComponentReport):
        return ["component", entry.component, entry.running, list(entry.accepts)]
    if isinstance(entry, Declare):
        return ["declare", entry.spec.to_wire()]
    if isinstance(entry, Undeclare):
        return ["undeclare", entry.stream]
    if isinstance(entry, Commit):
        return [
            "commit",
            entry.stream,
            entry.rank,
            entry.domain,
            entry.epoch,
            entry.digest,
            entry.size,
            *([entry.location] if entry.location else []),
        ]
    if isinstance(entry, Retract):
        return ["retract", entry.stream, entry.rank, entry.domain, entry.epoch]
    if isinstance(entry, Retire):
        return ["retire", entry.stream, entry.rank, entry.domain, entry.epoch]
    if isinstance(entry, Freeze):
        return ["freeze", entry.stream, entry.generation, entry.epochs.encode()]
    if isinstance(entry, HighWater):
        out: list[Any] = [
            "high_water",
            entry.stream,
            entry.epoch,
            [list(e) for e in entry.evidence],
        ]
        if entry.membership != 0:
            out.append(entry.membership)  # absent: membership 0 (as logs before it)
        return out
    if isinstance(entry, Horizon):
        return ["horizon", entry.stream, entry.epoch]
    if isinstance(entry, RankState):
        return [
            "rank_state",
            entry.stream,
            entry.rank,
            entry.domain,
            entry.available.encode(),
            entry.retired.encode(),
        ]
    return ["close", entry.stream, entry.below]


def decode_entry(obj: Any) -> Entry:
    """Inverse of `encode_entry`.

    Raises:
        ValueError: an entry this version does not know or cannot parse.
    """
    if not isinstance(obj, list) or not obj or not isinstance(obj[0], str):
        raise ValueError("entry is not a tagged array")
    kind, args = obj[0], obj[1:]
    try:
        if kind == "incarnation":
            number, *rest = args
            if rest not in ([], [True]):
                raise ValueError("bad unsure flag")
            return Incarnation(int(number), bool(rest))
        if kind == "settled":
            stream, *rest = args
            if not isinstance(stream, str):
                raise ValueError("bad stream")
            if len(rest) > 1 or not all(type(b) is int and b > 0 for b in rest):
                raise ValueError("bad generation bound")
            return Settled(stream, *rest)
        if kind == "rollout_note":
            (text,) = args
            if not isinstance(text, str):
                raise ValueError("bad rollout note")
            return RolloutNote(text)
        if kind == "component":
            component, running, accepts = args
            if not all(isinstance(x, str) for x in (component, running, *accepts)):
                raise ValueError("bad component report")
            return ComponentReport(component, running, tuple(accepts))
        if kind == "declare":
            (spec,) = args
            return Declare(StreamSpec.from_wire(spec))
        if kind == "undeclare":
            (stream,) = args
            return Undeclare(stream)
        if kind == "commit":
            stream, rank, domain, epoch, digest, size, *where = args
            if len(where) > 1 or not all(isinstance(w, str) for w in where):
                raise ValueError("bad commit location")
            return Commit(stream, rank, domain, epoch, digest, size, *where)
        if kind == "retract":
            return Retract(*args)
        if kind == "retire":
            return Retire(*args)
        if kind == "freeze":
            stream, generation, flat = args
            return Freeze(stream, generation, IntervalSet.decode(flat))
        if kind == "high_water":
            stream, epoch, evidence, *rest = args
            membership = rest[0] if len(rest) == 1 else 0
            if len(rest) > 1 or not (membership is None or type(membership) is int):
                raise ValueError("bad membership")
            return HighWater(stream, epoch, tuple((m, i, v) for m, i, v in evidence), membership)
        if kind == "horizon":
            stream, epoch = args
            if type(epoch) is not int or epoch < 0:
                raise ValueError("bad epoch")
            return Horizon(stream, epoch)
        if kind == "rank_state":
            stream, rank, domain, available, retired = args
            return RankState(
                stream, rank, domain, IntervalSet.decode(available), IntervalSet.decode(retired)
            )
        if kind == "close":
            stream, below = args
            return CloseGenerations(stream, below)
    except (TypeError, ValueError, ConvergencedError) as exc:
        raise ValueError(f"{kind} entry: {exc}") from None
    raise ValueError(f"unknown entry kind {kind!r}")
