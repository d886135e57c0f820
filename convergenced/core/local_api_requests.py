"""The local API's requests: one parser per operation, each with its arguments' limits.

`parse_request` turns a decoded ``{"id", "op", "args"}`` map into a typed `Request`
or raises a ``bad_request`` `ApiError` naming the field; `request` builds the map a
client sends. The operations and their arguments are specified in
``proto/LOCAL_API.md``; `convergenced.core.local_api_codec` re-exports all of this.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from convergenced.core.errors import RemoteProtocolError, SpecError
from convergenced.core.facts import (
    Commit,
    ComponentReport,
    Declare,
    Retire,
    Retract,
    RolloutNote,
    Undeclare,
)
from convergenced.core.limits import MAX_DIGEST_CHARS
from convergenced.core.local_api_errors import ApiError, bad_request
from convergenced.core.locations import parse_location
from convergenced.core.spec import StreamSpec
from convergenced.core.validate import (
    INT64_MAX,
    as_bool,
    as_int,
    as_list,
    as_map,
    as_name,
    as_str,
)
from convergenced.core.versions import (
    MAX_COMPONENTS,
    MAX_NOTE_CHARS,
    MAX_VERSION_CHARS,
    MAX_VERSIONS,
)

MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_SAVE_SECONDS = 1e7
"""The longest save, or time between two saves, a ``report_save`` may state (about
116 days): finite and far above any real one, so a sum of them stays exact enough."""


class Request(NamedTuple):
    """A validated request. ``args`` holds typed values (facts, names, numbers).

    A named tuple rather than a frozen dataclass: as immutable, and made in a third
    of the time (one per request)."""

    id: int
    op: str
    args: Mapping[str, Any]


_NAMES: set[str] = set()
"""Names `_name` found valid lately: the same few stream and domain names come in
every commit, and a set lookup is cheaper than the pattern."""
_MAX_NAMES = 4096


def _name(value: Any, path: str) -> str:
    """`as_name`, remembering the valid names (a bounded number of them)."""
    if type(value) is str and value in _NAMES:
        return value
    name = as_name(value, path)
    if len(_NAMES) >= _MAX_NAMES:
        _NAMES.clear()  # a client inventing names only ever costs the pattern again
    _NAMES.add(name)
    return name


def _int(value: Any, path: str) -> int:
    """`as_int` with the bounds of a rank, an epoch or a size."""
    if type(value) is int and 0 <= value <= INT64_MAX:
        return value
    return as_int(value, path)


def _stream(a: Mapping[Any, Any], p: str) -> dict[str, Any]:
    return {"stream": _name(a.get("stream"), f"{p}.stream")}


def _epoch_fact(cls: type[Commit] | type[Retract] | type[Retire]) -> Any:
    # The paths of the fields are made only for an error: a commit is parsed tens of
    # thousands of times a second.
    def parse(a: Mapping[Any, Any], p: str) -> dict[str, Any]:
        stream = _name(a.get("stream"), p + ".stream")
        rank = _int(a.get("rank"), p + ".rank")
        domain = _name(a.get("domain"), p + ".domain")
        epoch = _int(a.get("epoch"), p + ".epoch")
        if cls is Commit:
            digest = a.get("digest", "")
            if type(digest) is not str or len(digest) > MAX_DIGEST_CHARS:
                as_str(digest, p + ".digest", max_len=MAX_DIGEST_CHARS)  # raises
            size = _int(a.get("size", 0), p + ".size")
            where = a.get("location")
            location = "" if where is None else parse_location(where, p + ".location").to_text()
            return {"fact": Commit(stream, rank, domain, epoch, digest, size, location)}
        return {"fact": cls(stream, rank, domain, epoch)}

    return parse


def _timeout(a: Mapping[Any, Any], p: str) -> float | None:
    t = a.get("timeout")
    if t is None:
        return None
    if type(t) not in (int, float) or not 0 <= t <= MAX_TIMEOUT_S:  # NaN fails the range
        raise bad_request(f"{p}.timeout: {t!r}; expected seconds from 0 to {MAX_TIMEOUT_S:.0f}")
    return float(t)


def _declare(a: Mapping[Any, Any], p: str) -> dict[str, Any]:
    allow = as_bool(a.get("allow_unknown_members", False), f"{p}.allow_unknown_members")
    try:
        fact = Declare(StreamSpec.from_wire(a.get("spec")))
    except SpecError as exc:
        raise bad_request(f"{p}.{exc}", "bad_spec") from None
    return {"fact": fact, "allow_unknown_members": allow}


def _undeclare(a: Mapping[Any, Any], p: str) -> dict[str, Any]:
    return {"fact": Undeclare(as_name(a.get("stream"), f"{p}.stream"))}


def _wait(a: Mapping[Any, Any], p: str) -> dict[str, Any]:
    out = _stream(a, p)
    out["epoch"] = as_int(a.get("epoch"), f"{p}.epoch")
    out["timeout"] = _timeout(a, p)
    return out


def _restore_point(a: Mapping[Any, Any], p: str) -> dict[str, Any]:
    out = _stream(a, p)
    out["generation"] = as_int(a.get("generation"), f"{p}.generation")
    out["timeout"] = _timeout(a, p)
    return out


def _next_generation(a: Mapping[Any, Any], p: str) -> dict[str, Any]:
    out = _stream(a, p)
    out["timeout"] = _timeout(a, p)
    return out


def _drill(a: Mapping[Any, Any], p: str) -> dict[str, Any]:
    out = _stream(a, p)
    epoch, domain = a.get("epoch"), a.get("domain")
    out["epoch"] = None if epoch is None else as_int(epoch, f"{p}.epoch")
    out["domain"] = None if domain is None else _name(domain, f"{p}.domain")
    return out


def _seconds(a: Mapping[Any, Any], p: str, name: str) -> float:
    t: Any = a.get(name)
    # NaN and the infinities fail the range; a bool is not a duration.
    if type(t) not in (int, float) or not 0 <= t <= MAX_SAVE_SECONDS:
        raise bad_request(f"{p}.{name}: {t!r}; expected seconds from 0 to {MAX_SAVE_SECONDS:g}")
    return float(t)


def _report_save(a: Mapping[Any, Any], p: str) -> dict[str, Any]:
    out = _stream(a, p)
    out["rank"] = _int(a.get("rank"), f"{p}.rank")
    out["blocking_s"] = _seconds(a, p, "blocking_s")
    out["interval_s"] = None if a.get("interval_s") is None else _seconds(a, p, "interval_s")
    return out


MAX_DRAIN_STREAMS = 256
"""Streams one drain request may name."""


def _version(v: Any, path: str) -> str:
    return as_str(v, path, max_len=MAX_VERSION_CHARS)


def _report_version(a: Mapping[Any, Any], p: str) -> dict[str, Any]:
    running = _version(a.get("running"), f"{p}.running")
    accepts = as_list(a.get("accepts", [running]), f"{p}.accepts", max_len=MAX_VERSIONS)
    vs = tuple(_version(v, f"{p}.accepts[{i}]") for i, v in enumerate(accepts))
    return {"fact": ComponentReport(as_name(a.get("component"), f"{p}.component"), running, vs)}


def _versions(a: Mapping[Any, Any], p: str) -> dict[str, Any]:
    stream = a.get("stream")
    return {"stream": None if stream is None else _name(stream, f"{p}.stream")}


def _note_rollout(a: Mapping[Any, Any], p: str) -> dict[str, Any]:
    return {"fact": RolloutNote(as_str(a.get("text"), f"{p}.text", max_len=MAX_NOTE_CHARS))}


def _drain(a: Mapping[Any, Any], p: str) -> dict[str, Any]:
    names = as_list(a.get("streams", []), f"{p}.streams", max_len=MAX_DRAIN_STREAMS)
    moves = as_map(a.get("versions", {}), f"{p}.versions", max_len=MAX_COMPONENTS)
    return {
        "versions": {
            as_name(c, f"{p}.versions"): _version(v, f"{p}.versions.{c}") for c, v in moves.items()
        },
        "node": as_name(a.get("node"), f"{p}.node"),
        "streams": tuple(sorted({_name(n, f"{p}.streams[{i}]") for i, n in enumerate(names)})),
        "checkpoint": as_bool(a.get("checkpoint", False), f"{p}.checkpoint"),
        "timeout": _timeout(a, p),
    }


def _cancel(a: Mapping[Any, Any], p: str) -> dict[str, Any]:
    return {"target": as_int(a.get("target"), f"{p}.target")}


def _none(a: Mapping[Any, Any], p: str) -> dict[str, Any]:
    return {}


_OPS: dict[str, tuple[Any, frozenset[str]]] = {
    # op: (parser, allowed argument names)
    "status": (_none, frozenset()),
    "streams": (_none, frozenset()),
    "declare": (_declare, frozenset(("spec", "allow_unknown_members"))),
    "undeclare": (_undeclare, frozenset(("stream",))),
    "commit": (
        _epoch_fact(Commit),
        frozenset(("stream", "rank", "domain", "epoch", "digest", "size", "location")),
    ),
    "retract": (_epoch_fact(Retract), frozenset(("stream", "rank", "domain", "epoch"))),
    "retire": (_epoch_fact(Retire), frozenset(("stream", "rank", "domain", "epoch"))),
    "state": (_stream, frozenset(("stream",))),
    "wait": (_wait, frozenset(("stream", "epoch", "timeout"))),
    "restore_point": (_restore_point, frozenset(("stream", "generation", "timeout"))),
    "next_generation": (_next_generation, frozenset(("stream", "timeout"))),
    "watch": (_stream, frozenset(("stream",))),
    "drain": (_drain, frozenset(("node", "streams", "checkpoint", "timeout", "versions"))),
    "drill": (_drill, frozenset(("stream", "epoch", "domain"))),
    "report_version": (_report_version, frozenset(("component", "running", "accepts"))),
    "versions": (_versions, frozenset(("stream",))),
    "note_rollout": (_note_rollout, frozenset(("text",))),
    "report_save": (_report_save, frozenset(("stream", "rank", "blocking_s", "interval_s"))),
    "cancel": (_cancel, frozenset(("target",))),
}
OPS = tuple(_OPS)
"""Every operation the local API knows."""
_REQUEST_FIELDS = frozenset(("id", "op", "args"))


def parse_request(obj: Any) -> Request:
    """Validate a decoded request map.

    Raises:
        ApiError: ``bad_request``, naming the field (``commit.epoch: -1 is negative``).
            When the id itself was readable, it is in ``ApiError.request_id``.
    """
    # Each check has a fast test for what a well-formed request holds (decoded maps
    # are dicts), and falls back to the checker that names what is wrong.
    try:
        m = obj if type(obj) is dict and len(obj) <= 3 else as_map(obj, "request", max_len=3)
        rid = _int(m.get("id"), "request.id")
    except RemoteProtocolError as exc:
        raise bad_request(str(exc)) from None
    try:
        if not _REQUEST_FIELDS.issuperset(m):
            unknown = sorted(str(k) for k in m if k not in _REQUEST_FIELDS)
            raise bad_request(f"request: unknown field {unknown[0]!r}")
        op: Any = m.get("op")  # checked next: an op of the table is a short str
        entry = _OPS.get(op) if type(op) is str else None
        if entry is None:
            op = as_str(m.get("op"), "request.op", max_len=64)
            raise bad_request(
                f"request.op: {op!r} is not an operation; expected one of {', '.join(OPS)}",
                "unknown_op",
            )
        parser, allowed = entry
        args = m.get("args", {})
        if type(args) is not dict or len(args) > 16:
            args = as_map(args, f"{op}.args", max_len=16)
        if not allowed.issuperset(args):
            extra = sorted(str(k) for k in args if k not in allowed)
            raise bad_request(f"{op}.args: unknown argument {extra[0]!r}")
        return Request(rid, op, parser(args, op))
    except RemoteProtocolError as exc:
        err = bad_request(str(exc))
        err.request_id = rid
        raise err from None
    except ApiError as err:
        err.request_id = rid
        raise


def request(rid: int, op: str, **args: Any) -> dict[str, Any]:
    """Build a request map (clients); ``None`` arguments are left out."""
    if op not in _OPS:
        raise ValueError(f"unknown operation {op!r}")
    return {"id": rid, "op": op, "args": {k: v for k, v in args.items() if v is not None}}


# -- replies ----------------------------------------------------------------------
