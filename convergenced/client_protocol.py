"""What the blocking and the trio client of the local daemon share.

Where the daemon's socket is, the error a client raises when it cannot reach the
daemon, and how a reply turns into a result or an `ApiError`. `convergenced.client`
(`Client`) and `convergenced.async_client` (`AsyncClient`) build on it; training code
imports both clients from `convergenced.client`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from convergenced.core import local_api_codec as codec
from convergenced.core.spec import StreamSpec
from convergenced.errors import ConvergencedError

__all__ = [
    "MAX_REPLY_BYTES",
    "DaemonUnreachable",
    "default_socket",
    "result_of",
    "spec_wire",
]

MAX_REPLY_BYTES = 64 << 20
"""Replies are bounded too: a state with thousands of members stays well below this."""


class DaemonUnreachable(ConvergencedError):
    """The daemon's socket cannot be reached, or the connection was lost."""


def default_socket() -> Path:
    """``$CONVERGENCED_SOCKET``, else the daemon's default socket path."""
    env = os.environ.get("CONVERGENCED_SOCKET")
    return Path(env) if env else Path("/run/convergenced/convergenced.sock")


def spec_wire(spec: StreamSpec | Mapping[str, Any]) -> Any:
    """A spec as the ``declare`` request carries it."""
    return spec.to_wire() if isinstance(spec, StreamSpec) else dict(spec)


def result_of(reply: Mapping[str, Any]) -> Any:
    """The result of a reply (``ok``, or a watch's ``event``).

    Raises:
        ApiError: the reply is an error.
    """
    if "error" in reply:
        raise codec.error_from_wire(reply["error"])
    return reply.get("ok", reply.get("event"))
