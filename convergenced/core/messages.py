"""Peer messages: small frozen dataclasses, one per message type.

The link state machine (`link`) consumes and produces these; the codec (`wire`)
turns them into frames and back. Field meanings are specified in
proto/PROTOCOL.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from convergenced.core.records import Record

SummaryEntry = tuple[str, str, int, int]
"""(stream, origin, incarnation, version)."""


class MessageType(IntEnum):
    """The message type byte of a frame header."""

    HELLO = 1
    TICK = 2
    TOCK = 3
    NUDGE = 4
    BYE = 5


@dataclass(frozen=True, slots=True)
class Hello:
    """First message on a connection, sent by both sides at once."""

    cluster: str
    node: str
    incarnation: int
    digest: bytes
    summary: tuple[SummaryEntry, ...]
    """Stamps of the records the sender holds (possibly truncated to fit a frame)."""
    credentials: tuple[bytes, ...] = ()
    """Version 3: the sender's own credential (`credentials`); empty in version 2."""


@dataclass(frozen=True, slots=True)
class Tick:
    """Sent by the token holder: its deltas for the peer and its view digest."""

    seq: int
    digest: bytes
    match: bool
    """After merging the peer's last message our digest equalled the peer's."""
    records: tuple[Record, ...]
    links: tuple[str, ...] = ()
    """The nodes the sender has an established link with (sorted). The peer does not
    relay to us records whose origin is one of them: that origin sends them itself."""
    credentials: tuple[bytes, ...] = ()
    """Version 3: credentials the peer lacks, to be admitted before the records."""


@dataclass(frozen=True, slots=True)
class Tock:
    """The answer to a TICK with the same seq: deltas back and the merged digest."""

    seq: int
    digest: bytes
    match: bool
    records: tuple[Record, ...]
    links: tuple[str, ...] = ()
    """As in `Tick`."""
    credentials: tuple[bytes, ...] = ()
    """As in `Tick`."""


@dataclass(frozen=True, slots=True)
class Nudge:
    """'I have deltas, please send your TICK': at most one per token period."""


@dataclass(frozen=True, slots=True)
class Bye:
    """Orderly close, with a human-readable reason."""

    reason: str


Message = Hello | Tick | Tock | Nudge | Bye

MESSAGE_TYPES: dict[type[Message], MessageType] = {
    Hello: MessageType.HELLO,
    Tick: MessageType.TICK,
    Tock: MessageType.TOCK,
    Nudge: MessageType.NUDGE,
    Bye: MessageType.BYE,
}
