"""The incarnation floor: a node's last incarnation, kept beside its identity key.

Records are ordered per origin by (incarnation, version), so a node's incarnations
must only grow. The write-ahead log remembers them, but a lost state directory
takes the log with it, and a node that came back at incarnation 1 would be hidden
behind its own older records until its peers told it better (`core.lives`). The
identity key lives outside the state directory (it must: a node that lost its key
is a new node), so the last incarnation is also written next to it, as a small
file replaced atomically at every start: the next start, log or no log, begins
above it. Where that directory cannot be written (a read-only mount), the node
falls back on its peers alone, and says so at start.
"""

from __future__ import annotations

import errno
from pathlib import Path

from convergenced import fsutil
from convergenced.errors import StartupError

MAX_FLOOR = 2**62
"""Far above any count of restarts; a larger number is damage."""
_NOT_WRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT}


class IncarnationFloor:
    """The file ``<identity key>.incarnation`` (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> int:
        """The floor (0 when there is none yet).

        Raises:
            StartupError: the file holds something else than a number.
        """
        try:
            text = self.path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            return 0
        except (OSError, UnicodeDecodeError) as exc:
            raise StartupError(f"{self.path}: cannot read the incarnation floor: {exc}") from None
        if not text.isdigit() or int(text) > MAX_FLOOR:
            raise StartupError(
                f"{self.path}: not an incarnation ({text[:40]!r}); it holds the last "
                "incarnation of this node: restore it, or remove it if the state "
                "directory is intact"
            )
        return int(text)

    def write(self, incarnation: int) -> bool:
        """Raise the floor to ``incarnation``, durably; False when the directory
        cannot be written (the node then relies on its peers, `core.lives`)."""
        try:
            fsutil.write_atomic(self.path, f"{incarnation}\n".encode(), chmod=0o600)
        except OSError as exc:
            if exc.errno in _NOT_WRITABLE:
                return False
            raise
        return True
