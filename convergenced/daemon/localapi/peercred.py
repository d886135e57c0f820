"""Who is at the other end of the local socket, and may they use the daemon.

Why: the local API changes what the whole cluster believes (a commit moves the restore
point of every member), so only the job's own processes may speak to it. File modes
are the first gate (socket 0660 in a 0750 directory); this is the second, which holds
even where modes are looser (a shared volume, a mis-set umask): on every accepted
connection the daemon asks the kernel who connected (``SO_PEERCRED``: pid, uid and
gid, captured by the kernel at ``connect`` time, so they cannot be forged) and serves
only:

- root (uid 0) and the daemon's own effective uid;
- uids listed in ``[local] allowed_uids``;
- processes whose primary gid or any supplementary group is in ``[local] allowed_gids``.

Supplementary groups come from ``SO_PEERGROUPS`` (Linux 4.13+, also captured at
``connect``); where that is unavailable, or the list does not fit the 1,024-byte
buffer Python's ``getsockopt`` allows (more than 256 groups), from the ``Groups:``
line of ``/proc/<pid>/status``. A process that has exited meanwhile simply has no
supplementary groups (it is judged on its uid and primary gid, which the kernel kept).
Groups are only read when the uid alone does not decide.

Everything here is synchronous and free of trio: `allowed` is a pure function, and the
readers take any object with ``getsockopt`` (a `socket.socket` or a trio socket).
"""

from __future__ import annotations

import socket
import struct
import sys
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

_UCRED = struct.Struct("=iII")
"""Linux ``struct ucred``: pid (signed), uid, gid (unsigned: ids go up to 2^32 - 1)."""
_LINUX = sys.platform.startswith("linux")
SO_PEERCRED: int | None = getattr(socket, "SO_PEERCRED", None) if _LINUX else None
"""Linux only: OpenBSD has an option of that name with another field order."""
SO_PEERGROUPS: int | None = getattr(socket, "SO_PEERGROUPS", 59 if SO_PEERCRED == 17 else None)
"""Not exported by Python's socket module; 59 on every Linux architecture whose
``SO_PEERCRED`` is 17 (the asm-generic numbering)."""
_GROUPS_BUFFER = 1024
"""The largest ``getsockopt`` buffer CPython accepts: 256 groups."""
PROC = Path("/proc")


class PeerCredentialsError(OSError):
    """The peer's credentials cannot be read (not a Unix socket, or no SO_PEERCRED)."""


class _HasGetsockopt(Protocol):
    def getsockopt(self, level: int, option: int, buflen: int) -> bytes: ...


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    """The process at the other end of a Unix socket, as the kernel saw it connect."""

    pid: int
    uid: int
    gid: int
    """Primary (effective) group id."""
    groups: frozenset[int] = frozenset()
    """Supplementary group ids (empty until `with_groups`, or when unknown)."""

    def describe(self) -> str:
        """``uid 1234 (gid 1234)``: for messages and logs."""
        return f"uid {self.uid} (gid {self.gid})"


def read_credentials(sock: _HasGetsockopt) -> PeerCredentials:
    """pid, uid and gid of the peer of the connected Unix socket ``sock``.

    Raises:
        PeerCredentialsError: the platform has no ``SO_PEERCRED`` or the socket is not
            a connected Unix socket.
    """
    if SO_PEERCRED is None:
        raise PeerCredentialsError("this platform has no SO_PEERCRED")
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERCRED, _UCRED.size)
    except OSError as exc:
        raise PeerCredentialsError(f"SO_PEERCRED failed: {exc}") from None
    if len(raw) != _UCRED.size:
        raise PeerCredentialsError(f"SO_PEERCRED returned {len(raw)} bytes, expected 12")
    pid, uid, gid = _UCRED.unpack(raw)
    return PeerCredentials(pid, uid, gid)


def read_groups(sock: _HasGetsockopt, pid: int, *, proc: Path = PROC) -> frozenset[int]:
    """Supplementary groups of the peer: ``SO_PEERGROUPS``, else ``/proc/<pid>/status``.

    Never raises: a process that has exited (or is hidden in another pid namespace,
    pid 0) has no groups as far as this daemon can tell.
    """
    if SO_PEERGROUPS is not None:
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, _GROUPS_BUFFER)
        except OSError:
            pass  # old kernel, or more groups than the buffer holds (ERANGE)
        else:
            if len(raw) % 4 == 0:
                return frozenset(struct.unpack(f"{len(raw) // 4}I", raw))
    return proc_groups(pid, proc=proc)


def proc_groups(pid: int, *, proc: Path = PROC) -> frozenset[int]:
    """The ``Groups:`` line of ``/proc/<pid>/status``; empty when unreadable."""
    if pid <= 0:
        return frozenset()
    try:
        text = (proc / str(pid) / "status").read_text(encoding="ascii", errors="replace")
    except OSError:  # gone, or /proc not mounted
        return frozenset()
    return parse_status_groups(text)


def parse_status_groups(text: str) -> frozenset[int]:
    """The group ids of the ``Groups:`` line of a ``/proc/<pid>/status`` text."""
    for line in text.splitlines():
        if line.startswith("Groups:"):
            return frozenset(int(g) for g in line[len("Groups:") :].split() if g.isdigit())
    return frozenset()


def allowed(
    creds: PeerCredentials,
    own_uid: int,
    allowed_uids: Collection[int],
    allowed_gids: Collection[int],
) -> bool:
    """Whether ``creds`` may use the daemon (see the module docstring). Pure."""
    if creds.uid in (0, own_uid) or creds.uid in allowed_uids:
        return True
    return creds.gid in allowed_gids or any(g in allowed_gids for g in creds.groups)


def check(
    sock: _HasGetsockopt,
    own_uid: int,
    allowed_uids: Collection[int],
    allowed_gids: Collection[int],
    *,
    proc: Path = PROC,
) -> tuple[PeerCredentials, bool]:
    """Read the peer's credentials and decide; groups are read only when needed.

    Raises:
        PeerCredentialsError: as `read_credentials` (refuse the connection then).
    """
    creds = read_credentials(sock)
    if allowed(creds, own_uid, allowed_uids, allowed_gids):
        return creds, True
    if allowed_gids:
        groups = read_groups(sock, creds.pid, proc=proc)
        creds = PeerCredentials(creds.pid, creds.uid, creds.gid, groups)
    return creds, allowed(creds, own_uid, allowed_uids, allowed_gids)


def refusal_message(creds: PeerCredentials) -> str:
    """What a refused client is told."""
    return (
        f"{creds.describe()} may not use this daemon: add it to [local] allowed_uids "
        "or a group in allowed_gids"
    )
