"""Typed errors of the core.

Protocol errors say whose fault it is, as h11 does: `LocalProtocolError` means our
caller broke the rules (a bug on this side), `RemoteProtocolError` means the peer
did (bad bytes, a message out of order). Both carry a short machine-readable
`reason`, used as the label of the rejection counter, and a message that names the
field path, e.g. ``TICK.records[3].version: -1 is negative``.
"""

from __future__ import annotations

from convergenced.errors import ConvergencedError

__all__ = [
    "ConvergencedError",
    "FactError",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
    "SpecConflictError",
    "SpecError",
    "UnknownStreamError",
]


class ProtocolError(ConvergencedError):
    """A rule of the peer protocol was broken; `reason` is a short metric label."""

    def __init__(self, message: str, *, reason: str = "invalid") -> None:
        super().__init__(message)
        self.reason = reason


class LocalProtocolError(ProtocolError):
    """We (the caller of the core) tried to do something the protocol forbids."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol forbids."""


class SpecError(ConvergencedError):
    """A stream spec is malformed (empty members, unknown policy, bad retention...)."""


class SpecConflictError(ConvergencedError):
    """Two different specs were declared for the same stream name."""

    def __init__(self, stream: str, ours: str, theirs: str, detail: str = "") -> None:
        msg = f"stream {stream!r}: spec digest {theirs} conflicts with declared {ours}"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)
        self.stream = stream
        self.ours = ours
        self.theirs = theirs


class FactError(ConvergencedError):
    """A local fact (commit, retract, retire) cannot be accepted; nothing changed."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class UnknownStreamError(FactError):
    """The stream has not been declared on this node."""

    def __init__(self, stream: str) -> None:
        super().__init__(f"stream {stream!r} is not declared on this node", reason="unknown_stream")
        self.stream = stream
