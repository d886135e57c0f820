"""The checkpoint shard file: its bytes, its verification, and where it lives in a tier.

A shard is one rank's part of one checkpoint epoch of a stream. This module is what a
shard is on disk and nothing more (no daemon, no store, no threads), so the store
(`convergenced.integrations.files`), the PyTorch integration and offline tools encode,
read and check shards the same way.

**On disk.** Shard of rank R of epoch E: ``<tier>/<stream>/epoch-<E>/rank-<R>.shard``
(`shard_path`). The file is one header line, ``CVGSHARD1 <json>\\n``, then the
payload. The JSON header holds the stream, rank, epoch, the payload's SHA-256 and
size, and, for a payload saved as a mapping of named parts, the parts' names and
sizes.

**Guarantees.** `decode_shard` and `read_shard` return a payload only when the header
and the digest match it, and the header names the stream, rank and epoch expected
(`CorruptShardError` otherwise). `load_consistent` refuses to assemble shards of
different epochs (`MixedEpochError`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

from convergenced.integrations.errors import CorruptShardError, MixedEpochError

__all__ = [
    "DIGEST_PREFIX",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "Payload",
    "Shard",
    "decode_shard",
    "encode_shard",
    "load_consistent",
    "read_shard",
    "shard_location",
    "shard_path",
]

MAGIC = b"CVGSHARD1 "
"""The first bytes of every shard file (format version 1)."""

MAX_HEADER_BYTES = 64 * 1024
"""A header line longer than this is corrupt (it holds a few names and numbers)."""

DIGEST_PREFIX = "sha256:"

Payload: TypeAlias = bytes | dict[str, bytes]
"""What a rank saves: raw bytes, or named parts (model, optimizer, ...) as bytes."""

_EPOCH_DIR = re.compile(r"^epoch-(0|[1-9][0-9]*)$")


def shard_location(where: Path | str) -> dict[str, str]:
    """The ``location`` a commit of the shard at ``where`` (a path, or an object's URL)
    states, so the daemon can verify it later (`convergenced.core.locations`)."""
    url = where if isinstance(where, str) and "://" in where else Path(where).absolute().as_uri()
    return {"kind": "shard", "url": url}


# -- data -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Shard:
    """One verified shard: its metadata, its payload and where it was read."""

    stream: str
    rank: int
    epoch: int
    digest: str
    """``sha256:<hex>`` of the payload bytes (the digest committed to the daemon)."""
    size: int
    """Payload size in bytes (the size committed to the daemon)."""
    payload: Payload
    path: Path | str | None = None
    """Where it was read: a file's path, or an object's URL."""
    domain: str | None = None
    committed: bool = True
    """False for a save the daemon did not count (an epoch it had retired; see
    `CheckpointStore.save`): nothing of it was kept."""


# -- encoding -------------------------------------------------------------------------


def _body(payload: Payload) -> tuple[bytes, list[list[Any]] | None]:
    if isinstance(payload, bytes | bytearray | memoryview):
        return bytes(payload), None
    if not isinstance(payload, Mapping):
        raise TypeError(f"payload: expected bytes or a mapping of str to bytes, not {payload!r}")
    parts: list[list[Any]] = []
    chunks: list[bytes] = []
    for name, value in payload.items():
        if not isinstance(name, str):
            raise TypeError(f"payload part name {name!r}: expected str")
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError(f"payload part {name!r}: expected bytes, not {type(value).__name__}")
        data = bytes(value)
        parts.append([name, len(data)])
        chunks.append(data)
    return b"".join(chunks), parts


def encode_shard(stream: str, rank: int, epoch: int, payload: Payload) -> tuple[bytes, str, int]:
    """The bytes of a shard file, the payload's digest (``sha256:<hex>``) and its size."""
    body, parts = _body(payload)
    digest = DIGEST_PREFIX + hashlib.sha256(body).hexdigest()
    header = {
        "format": 1,
        "stream": stream,
        "rank": rank,
        "epoch": epoch,
        "digest": digest,
        "size": len(body),
        "parts": parts,
    }
    line = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return MAGIC + line + b"\n" + body, digest, len(body)


def decode_shard(
    data: bytes,
    *,
    path: Path | str | None = None,
    domain: str | None = None,
    stream: str | None = None,
    rank: int | None = None,
    epoch: int | None = None,
) -> Shard:
    """Parse and verify a shard file's bytes.

    ``stream``, ``rank`` and ``epoch``, when given, must match the header.

    Raises:
        CorruptShardError: bad magic or header, a digest or size mismatch, or a header
            that names another stream, rank or epoch than expected.
    """
    if not data.startswith(MAGIC):
        raise CorruptShardError(path, "no shard header (bad magic)")
    end = data.find(b"\n", 0, len(MAGIC) + MAX_HEADER_BYTES)
    if end < 0:
        raise CorruptShardError(path, "header line not terminated")
    try:
        header = json.loads(data[len(MAGIC) : end])
    except ValueError as exc:
        raise CorruptShardError(path, f"header is not JSON: {exc}") from None
    if not isinstance(header, dict) or header.get("format") != 1:
        raise CorruptShardError(path, "header is not a format-1 shard header")
    h_stream, h_rank, h_epoch = header.get("stream"), header.get("rank"), header.get("epoch")
    h_digest, h_size, h_parts = header.get("digest"), header.get("size"), header.get("parts")
    if not (
        isinstance(h_stream, str)
        and type(h_rank) is int
        and type(h_epoch) is int
        and isinstance(h_digest, str)
        and type(h_size) is int
    ):
        raise CorruptShardError(path, "header fields missing or of the wrong type")
    for name, want, got in (("stream", stream, h_stream), ("rank", rank, h_rank)):
        if want is not None and got != want:
            raise CorruptShardError(path, f"header {name} is {got!r}, expected {want!r}")
    if epoch is not None and h_epoch != epoch:
        raise CorruptShardError(path, f"header epoch is {h_epoch}, expected {epoch}")
    body = data[end + 1 :]
    if len(body) != h_size:
        raise CorruptShardError(path, f"payload is {len(body)} bytes, header says {h_size}")
    digest = DIGEST_PREFIX + hashlib.sha256(body).hexdigest()
    if digest != h_digest:
        raise CorruptShardError(path, f"payload digest {digest} does not match {h_digest}")
    payload: Payload
    if h_parts is None:
        payload = body
    else:
        if not isinstance(h_parts, list):
            raise CorruptShardError(path, "header parts is not a list")
        payload = {}
        offset = 0
        for item in h_parts:
            if not (
                isinstance(item, list)
                and len(item) == 2
                and isinstance(item[0], str)
                and type(item[1]) is int
                and item[1] >= 0
            ):
                raise CorruptShardError(path, f"header part {item!r} is malformed")
            payload[item[0]] = body[offset : offset + item[1]]
            offset += item[1]
        if offset != len(body):
            raise CorruptShardError(path, "header parts do not add up to the payload size")
    return Shard(h_stream, h_rank, h_epoch, h_digest, h_size, payload, path, domain)


def read_shard(
    path: Path,
    *,
    domain: str | None = None,
    stream: str | None = None,
    rank: int | None = None,
    epoch: int | None = None,
) -> Shard:
    """Read and verify the shard file at ``path`` (see `decode_shard`).

    Raises:
        FileNotFoundError: there is no such file.
        CorruptShardError: it cannot be read or does not verify.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CorruptShardError(path, f"cannot read: {exc}") from None
    return decode_shard(data, path=path, domain=domain, stream=stream, rank=rank, epoch=epoch)


# -- where a shard lives --------------------------------------------------------------


def _stream_dir(stream: str) -> str:
    # Stream names may contain "/" but never "%": keep each stream in one directory.
    return stream.replace("/", "%2F")


def shard_path(directory: Path, stream: str, epoch: int, rank: int) -> Path:
    """Where rank ``rank``'s shard of ``epoch`` lives under a tier's ``directory``."""
    return directory / _stream_dir(stream) / f"epoch-{epoch}" / f"rank-{rank}.shard"


# -- assembling a state ---------------------------------------------------------------


def load_consistent(shards: Iterable[Shard], *, epoch: int | None = None) -> dict[int, Payload]:
    """Assemble shards of several ranks into ``{rank: payload}``, all of one epoch.

    Raises:
        MixedEpochError: the shards do not all belong to the same stream and epoch (or
            not to ``epoch`` when given), or a rank appears twice.
    """
    shards = list(shards)
    epochs = {s.rank: s.epoch for s in shards}
    streams = {s.stream for s in shards}
    if len(streams) > 1:
        raise MixedEpochError(
            f"refusing to assemble shards of different streams: {sorted(streams)}", epochs
        )
    if len(epochs) != len(shards):
        ranks = [s.rank for s in shards]
        dup = sorted({r for r in ranks if ranks.count(r) > 1})
        raise MixedEpochError(f"refusing to assemble: rank(s) {dup} offered twice", epochs)
    found = set(epochs.values())
    if len(found) > 1 or (epoch is not None and found and found != {epoch}):
        listing = ", ".join(f"rank {r} at epoch {e}" for r, e in sorted(epochs.items()))
        want = f" (expected epoch {epoch})" if epoch is not None else ""
        raise MixedEpochError(
            f"refusing to assemble a state from mixed epochs: {listing}{want}", epochs
        )
    return {s.rank: s.payload for s in shards}
