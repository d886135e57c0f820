"""How many local clients the process's descriptor limit leaves room for.

Every local client holds a file descriptor, and so do peers, metrics scrapes and
the write-ahead log. The log is the one that must not meet EMFILE: a compaction
that cannot open its new file is put off (the old log goes on, see
`durability.group_commit`), but a log that stays uncompacted grows. A daemon
started from a shell with ``ulimit -n 256`` used to let idle local connections take
every descriptor, then die at its next compaction. So at start the daemon sizes
its client limit from the soft ``RLIMIT_NOFILE``, after raising it towards the hard
limit when that is allowed, and keeps in reserve what the others can hold at most:

* peers: ``limits.max_connections`` (accepted and dialled, those in their TLS
  handshake included) plus one per peer this node dials, and a margin for the
  connections refused the moment they are accepted;
* the metrics endpoint: its concurrent scrapes (`http.MAX_CONCURRENT`) and a margin;
* the log: its file, and a compaction's temporary file, directory and new file;
* the runtime: the listeners, trio's own descriptors, reloads reading their files,
  name lookups of the dialers, the credential checks reading ``/proc``;
* local clients being refused (`REFUSING`: their one error reply).

``limits.max_clients`` is lowered to what is left (and the daemon says so in its
log); when nothing is left the daemon refuses to start, naming the numbers.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

import structlog

from convergenced.daemon.config import Config
from convergenced.daemon.http import MAX_CONCURRENT
from convergenced.daemon.peers.manager import dial_plan
from convergenced.errors import StartupError

log = structlog.get_logger("convergenced.daemon")

LOG_RESERVE = 8
"""The log file, a compaction's temporary file, its directory and the new file, twice."""
RUNTIME_RESERVE = 32
"""Listeners, trio's epoll and wake-up descriptors, reloads, name lookups, /proc reads."""
PEER_MARGIN = 8
"""Peer connections refused the moment they are accepted, closing."""
HTTP_MARGIN = 8
"""Scrapes answered ``busy`` past the concurrent ones, closing."""
REFUSING = 16
"""Local clients being refused at once (more are closed without a reply)."""


@dataclass(frozen=True, slots=True)
class DescriptorBudget:
    """How the soft descriptor limit is shared out."""

    soft_limit: int
    in_use: int
    """Descriptors open when the budget was made."""
    reserve: int
    """Kept for everyone but local clients (see the module docstring)."""
    max_clients: int
    """``limits.max_clients``, or less when the limit leaves less room."""


def reserve_for(cfg: Config) -> int:
    """Descriptors kept for peers, the metrics endpoint, the log and the runtime."""
    peers = cfg.limits.max_connections + len(dial_plan(cfg)) + PEER_MARGIN
    http = MAX_CONCURRENT + HTTP_MARGIN if cfg.metrics_listen is not None else 0
    return LOG_RESERVE + RUNTIME_RESERVE + peers + http + REFUSING


def plan(cfg: Config, soft_limit: int, in_use: int) -> DescriptorBudget:
    """The client limit ``soft_limit`` leaves room for, ``in_use`` being open already.

    Raises:
        StartupError: not one client would fit beside the reserve.
    """
    reserve = reserve_for(cfg)
    room = soft_limit - in_use - reserve
    if room < 1:
        raise StartupError(
            f"the descriptor limit (RLIMIT_NOFILE, soft {soft_limit}) leaves no room for "
            f"local clients: {in_use} are open and {reserve} are kept for peers "
            f"(limits.max_connections = {cfg.limits.max_connections}), the metrics "
            f"endpoint, the log and the runtime; raise it (ulimit -n, LimitNOFILE=) to at "
            f"least {in_use + reserve + cfg.limits.max_clients}, or lower "
            f"limits.max_connections"
        )
    return DescriptorBudget(soft_limit, in_use, reserve, min(cfg.limits.max_clients, room))


def open_descriptors() -> int:
    """Descriptors this process has open (a generous guess where /proc is missing)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listing them
    except OSError:
        return 64


def size_clients(cfg: Config) -> DescriptorBudget:
    """Raise the soft descriptor limit towards what ``cfg`` needs (as far as the hard
    limit allows), then make the budget; log it when it lowers ``limits.max_clients``.

    Raises:
        StartupError: not one client would fit (see `plan`).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = open_descriptors()
    wanted = in_use + reserve_for(cfg) + cfg.limits.max_clients
    if soft < wanted and (hard == resource.RLIM_INFINITY or soft < hard):
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (OSError, ValueError):
            pass  # keep the soft limit we have, and size for it
    budget = plan(cfg, soft, in_use)
    if budget.max_clients < cfg.limits.max_clients:
        log.warning(
            "descriptor limit too low for limits.max_clients; serving fewer local clients",
            max_clients=budget.max_clients,
            configured=cfg.limits.max_clients,
            rlimit_nofile=soft,
            open=in_use,
            reserved=budget.reserve,
            wanted=wanted,
        )
    return budget
