"""msgpack, the one way convergenced uses it: canonical packing, strict unpacking.

The peer wire, the local API and the write-ahead log all decode bytes that may be
hostile or damaged, so every decoder sets every limit of the unpacker explicitly,
refuses ext types and duplicate map keys, and keeps bin and str apart. The codecs
turn `UnpackError` into their own typed errors (a `RemoteProtocolError` for a peer,
a ``bad_request`` for a local client, a corrupt-log error for the log).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack


class UnpackError(ValueError):
    """The bytes are not one msgpack object within the limits."""


@dataclass(frozen=True, slots=True)
class UnpackLimits:
    """The unpacker's limits: lengths of one str, one bin, one array, one map."""

    max_str: int
    max_bin: int
    max_array: int
    max_map: int


def pack(obj: Any) -> bytes:
    """Canonical msgpack: bin type for bytes, str for text."""
    return bytes(msgpack.packb(obj, use_bin_type=True))


def _no_duplicate_keys(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[Any] = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"duplicate map key {k!r}")
            seen.add(k)
    return out


def strict_unpacker(limits: UnpackLimits, size: int) -> msgpack.Unpacker:
    """A streaming unpacker with `unpack_strict`'s settings, for ``size`` bytes fed at
    once. Its `unpack` decodes as strictly as `unpack_strict`; its ``read_*_header``
    and ``skip`` check no limit (a caller that skips must decode what it skipped with
    `unpack_strict` before trusting it)."""
    return msgpack.Unpacker(
        None,
        raw=False,
        strict_map_key=True,
        use_list=True,
        object_pairs_hook=_no_duplicate_keys,
        max_buffer_size=max(size, 1),
        max_str_len=limits.max_str,
        max_bin_len=limits.max_bin,
        max_array_len=limits.max_array,
        max_map_len=limits.max_map,
        max_ext_len=0,
    )


def unpack_strict(body: bytes, limits: UnpackLimits) -> Any:
    """Decode exactly one msgpack object from ``body`` within ``limits``.

    Raises:
        UnpackError: anything msgpack refuses (truncated or trailing bytes, a length
            over a limit, an ext type, a non-string map key), or a duplicate map key;
            the message says which.
    """
    try:
        return msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            use_list=True,
            object_pairs_hook=_no_duplicate_keys,
            max_str_len=limits.max_str,
            max_bin_len=limits.max_bin,
            max_array_len=limits.max_array,
            max_map_len=limits.max_map,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many unrelated types; all mean "bad bytes"
        raise UnpackError(f"{type(exc).__name__}: {exc}") from None
