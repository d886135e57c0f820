"""Strict field checkers for decoded msgpack data.

Every check names the path of the offending field (``TICK.records[3].version``), so
an operator reading a rejection log knows exactly what the peer got wrong. They
raise `RemoteProtocolError` because they only ever run on bytes from outside.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from convergenced.core.errors import RemoteProtocolError
from convergenced.core.limits import MAX_INT, MAX_NAME_CHARS

INT64_MAX = MAX_INT
NAME_RE = re.compile(rf"^[A-Za-z0-9][A-Za-z0-9._/-]{{0,{MAX_NAME_CHARS - 1}}}\Z")
"""Node ids, stream names and domain names: printable, no spaces, 1-128 chars.

Anchored with ``\\Z``, not ``$``: ``$`` also matches before a trailing newline, which
would admit ``"node1\\n"`` as a name distinct from ``"node1"``."""


def fail(path: str, problem: str, reason: str = "invalid_field") -> RemoteProtocolError:
    """Build the error for ``path``; callers ``raise fail(...)``."""
    return RemoteProtocolError(f"{path}: {problem}", reason=reason)


def as_int(value: Any, path: str, *, lo: int = 0, hi: int = INT64_MAX) -> int:
    """An integer (never a bool or float) within ``[lo, hi]``."""
    if type(value) is not int:
        raise fail(path, f"expected an integer, got {type(value).__name__}")
    if value < lo:
        raise fail(path, f"{value} is below {lo}" if lo else f"{value} is negative")
    if value > hi:
        raise fail(path, f"{value} is above {hi}")
    return value


def as_opt_int(value: Any, path: str, *, lo: int = 0, hi: int = INT64_MAX) -> int | None:
    """`as_int`, or None (msgpack nil)."""
    return None if value is None else as_int(value, path, lo=lo, hi=hi)


def as_bool(value: Any, path: str) -> bool:
    """A msgpack boolean."""
    if type(value) is not bool:
        raise fail(path, f"expected a boolean, got {type(value).__name__}")
    return value


def as_bytes(value: Any, path: str, *, min_len: int = 0, max_len: int) -> bytes:
    """A msgpack bin of bounded length."""
    if type(value) is not bytes:
        raise fail(path, f"expected bytes, got {type(value).__name__}")
    if not (min_len <= len(value) <= max_len):
        raise fail(path, f"length {len(value)} outside [{min_len}, {max_len}]")
    return value


def as_str(value: Any, path: str, *, max_len: int = 1024) -> str:
    """A msgpack str of bounded length."""
    if type(value) is not str:
        raise fail(path, f"expected a string, got {type(value).__name__}")
    if len(value) > max_len:
        raise fail(path, f"length {len(value)} above {max_len}")
    return value


def as_name(value: Any, path: str) -> str:
    """A node id, stream or domain name (see `NAME_RE`)."""
    s = as_str(value, path, max_len=MAX_NAME_CHARS)
    if not NAME_RE.match(s):
        raise fail(path, f"{s!r} is not a valid name")
    return s


def as_list(value: Any, path: str, *, max_len: int, length: int | None = None) -> list[Any]:
    """A msgpack array of bounded (or exact) length."""
    if type(value) is not list:
        raise fail(path, f"expected an array, got {type(value).__name__}")
    if length is not None and len(value) != length:
        raise fail(path, f"expected {length} elements, got {len(value)}")
    if len(value) > max_len:
        raise fail(path, f"{len(value)} elements above the limit {max_len}", "limit_exceeded")
    return value


def as_map(value: Any, path: str, *, max_len: int) -> Mapping[Any, Any]:
    """A msgpack map of bounded size (duplicate keys are refused by the unpacker)."""
    if not isinstance(value, Mapping):
        raise fail(path, f"expected a map, got {type(value).__name__}")
    if len(value) > max_len:
        raise fail(path, f"{len(value)} entries above the limit {max_len}", "limit_exceeded")
    return value


def exact_keys(value: Mapping[Any, Any], path: str, required: Sequence[str]) -> None:
    """The map has exactly these string keys: no missing and no unknown field."""
    keys = set(value)
    missing = [k for k in required if k not in keys]
    if missing:
        raise fail(path, f"missing field {missing[0]!r}")
    extra = sorted(str(k) for k in keys - set(required))
    if extra:
        raise fail(path, f"unknown field {extra[0]!r}")
