"""The local API's errors: whose move it is (`ErrorKind`) and the error a reply carries
(`ApiError`), shared by the codec, the request parsers, the daemon and the clients."""

from __future__ import annotations

from enum import StrEnum

from convergenced.errors import ConvergencedError


class ErrorKind(StrEnum):
    """Whose move it is after an error."""

    BAD_REQUEST = "bad_request"
    """The request is malformed: fix the caller."""
    REJECTED = "rejected"
    """Well-formed but refused by the rules (unknown stream, spec conflict, retired
    epoch...). Nothing changed."""
    TIMEOUT = "timeout"
    """A wait ran out of time; nothing changed, ask again."""
    UNAVAILABLE = "unavailable"
    """The daemon cannot serve this now (shutting down, too many clients, too slow)."""
    INTERNAL = "internal"
    """A bug in the daemon; the message says what failed."""


class ApiError(ConvergencedError):
    """An error reply: raised by the daemon's handlers, re-raised by the clients."""

    def __init__(self, kind: ErrorKind, reason: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.reason = reason
        self.request_id: int | None = None
        """The id of the request that failed, when it could be read."""

    def to_wire(self) -> dict[str, str]:
        """The ``error`` map of a reply."""
        return {"kind": self.kind.value, "reason": self.reason, "message": str(self)}


def bad_request(message: str, reason: str = "bad_request") -> ApiError:
    """An `ApiError` for a malformed request."""
    return ApiError(ErrorKind.BAD_REQUEST, reason, message)


# -- framing --------------------------------------------------------------------
