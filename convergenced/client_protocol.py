"""What the blocking and the trio client of the local daemon share.

Where the daemon's socket is, the error a client raises when it cannot reach the
daemon, how a reply turns into a result or an `ApiError`, and the rules of
reconnecting. `convergenced.client` (`Client`) and `convergenced.async_client`
(`AsyncClient`) build on it; training code imports both clients from
`convergenced.client`.

**Reconnecting.** A daemon restarts under running jobs (``Restart=on-failure``, an
upgrade, ``kill -9``). When its connection ends, a client connects again with
backoff (50 ms, doubling up to 1 s) for at most the *reconnect bound*
(`reconnect_bound`: the ``reconnect`` argument, else ``$CONVERGENCED_RECONNECT_S``,
else 60 s), then raises `DaemonUnreachable` naming the socket and how long it tried.
Calls made meanwhile wait for the connection (never past the bound). Once connected,
the client declares again the streams it declared, and sends again every request
still unanswered (`RETRIED`), each of which may be sent twice because:

* ``status``, ``streams``, ``state``, ``restore_point``, ``wait``,
  ``next_generation``: reads (a wait, restore_point or next_generation keeps what is
  left of its timeout; it is not extended);
* ``watch``: subscribed again, it starts with the state now;
* ``drain``: asked again, its targets are fixed anew, never older than before (the
  epochs the node holds only grow between two losses), and it keeps what is left
  of its timeout;
* ``declare``: idempotent for the same spec;
* ``commit``: a commit the daemon already holds, with the same digest, is
  acknowledged once durable and adds no fact, so it is never counted twice;
* ``retract``: the epoch is not held either way;
* ``versions``: a read; ``report_version``: the same report again is a repeat,
  acknowledged and not logged twice;
* ``retire``: a retirement that already happened is refused (``not_safe_to_delete``:
  the epoch is no longer held) and the caller keeps its file; the checkpoint store
  deletes it when the daemon later refuses its commit as ``retired``.

``cancel`` is never sent again (what it cancelled is gone with the connection), nor
``report_save``: the figure it feeds lives in the daemon's memory, which a restart
clears anyway, and a save reported twice would count twice. A
refusal for good (``not_allowed``: this uid may not use the daemon) is not retried.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from convergenced.core import local_api_codec as codec
from convergenced.core.spec import StreamSpec
from convergenced.errors import ConvergencedError

__all__ = [
    "DEFAULT_RECONNECT_S",
    "MAX_REPLY_BYTES",
    "RECONNECT_ENV",
    "RETRIED",
    "TIMED",
    "DaemonUnreachable",
    "Outage",
    "Reconnected",
    "closes_for_good",
    "declare_args",
    "default_socket",
    "going_away",
    "reconnect_bound",
    "redeclaration",
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


def declare_args(
    spec: StreamSpec | Mapping[str, Any], allow_unknown_members: bool = False
) -> dict[str, Any]:
    """The arguments of a ``declare`` request: what the client sends, and sends again
    after a reconnect (the flag is left out unless set, as older daemons expect)."""
    args: dict[str, Any] = {"spec": spec_wire(spec)}
    if allow_unknown_members:
        args["allow_unknown_members"] = True
    return args


def redeclaration(before: Mapping[str, Any] | None, args: dict[str, Any]) -> dict[str, Any]:
    """What to declare again after a reconnect, once ``args`` were accepted: a
    declaration of the same spec that allowed unknown members still does (the later
    one, without the flag, was a repeat), so a daemon that lost its state takes it."""
    if before and before.get("allow_unknown_members") and before["spec"] == args["spec"]:
        return args | {"allow_unknown_members": True}
    return args


def result_of(reply: Mapping[str, Any]) -> Any:
    """The result of a reply (``ok``, or a watch's ``event``).

    Raises:
        ApiError: the reply is an error.
    """
    if "error" in reply:
        raise codec.error_from_wire(reply["error"])
    return reply.get("ok", reply.get("event"))


# -- reconnecting ---------------------------------------------------------------------

RECONNECT_ENV = "CONVERGENCED_RECONNECT_S"
"""The environment variable of the default reconnect bound, in seconds."""
DEFAULT_RECONNECT_S = 60.0
"""The reconnect bound without an argument or environment variable: long enough for
systemd to restart a daemon (``RestartSec`` plus its start), short enough that a job
whose daemon is gone for good learns it within a minute."""
FIRST_PAUSE_S = 0.05
MAX_PAUSE_S = 1.0

RETRIED = frozenset(
    {
        "status",
        "streams",
        "versions",
        "report_version",
        "declare",
        "commit",
        "retract",
        "retire",
        "state",
        "wait",
        "restore_point",
        "next_generation",
        "watch",
        "drain",
    }
)
"""The operations sent again after a reconnect (see the module docstring for why
each may be sent twice). Not ``cancel``."""

TIMED = frozenset({"wait", "restore_point", "next_generation", "drain"})
"""The operations whose ``timeout`` keeps running through an outage: sent again, they
carry what is left of it."""

_FOR_GOOD = frozenset({"not_allowed"})


def reconnect_bound(value: float | None = None) -> float:
    """The reconnect bound in seconds: ``value``, else ``$CONVERGENCED_RECONNECT_S``,
    else `DEFAULT_RECONNECT_S`; 0 turns reconnecting off.

    Raises:
        ValueError: not a finite number of seconds >= 0.
    """
    if value is None:
        env = os.environ.get(RECONNECT_ENV)
        if env is None or not env.strip():
            return DEFAULT_RECONNECT_S
        try:
            bound = float(env)
        except ValueError:
            bound = math.nan
        where = f"${RECONNECT_ENV}={env!r}"
    else:
        bound = float(value)
        where = f"reconnect={value!r}"
    if not (math.isfinite(bound) and bound >= 0):
        raise ValueError(f"{where}: expected a finite number of seconds >= 0")
    return bound


@dataclass(frozen=True, slots=True)
class Reconnected:
    """What a reconnect hook is told: the daemon's incarnation before (None: this
    client had not asked yet) and now, and how long the client was without it."""

    previous: int | None
    incarnation: int | None
    after_s: float


def going_away(reply: Mapping[str, Any]) -> bool:
    """Whether ``reply`` says only that the daemon is stopping (the request is then
    answered by its next life, if it comes back within the bound)."""
    err = reply.get("error")
    return isinstance(err, Mapping) and err.get("reason") == "shutting_down"


def closes_for_good(error: codec.ApiError) -> bool:
    """Whether the daemon's reason for closing the connection holds for every
    connection of this client (trying again cannot help)."""
    return error.reason in _FOR_GOOD


class Outage:
    """One lost connection: the attempts to connect again and when to give up."""

    def __init__(self, bound: float, started: float, why: str) -> None:
        self.bound = bound
        self.started = started
        self.why = why
        """Why the connection ended."""
        self.attempts = 0
        self.last_error = why
        self._pause = FIRST_PAUSE_S

    def failed(self, error: str, now: float) -> float | None:
        """Count a failed attempt; the pause before the next one, or None once the
        bound has passed (a pause never reaches past it)."""
        self.attempts += 1
        self.last_error = error
        left = self.started + self.bound - now
        if left <= 1e-9:
            return None
        pause = min(self._pause, left)
        self._pause = min(self._pause * 2, MAX_PAUSE_S)
        return pause

    def give_up(self, socket_path: Path, now: float) -> str:
        """The message of the `DaemonUnreachable` raised once the bound has passed."""
        return (
            f"cannot reach the daemon at {socket_path}: tried to reconnect for "
            f"{now - self.started:.1f} s ({self.attempts} attempts, reconnect bound "
            f"{self.bound:g} s, ${RECONNECT_ENV}) after {self.why}; last error: "
            f"{self.last_error}"
        )
