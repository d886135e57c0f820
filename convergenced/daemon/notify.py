"""systemd notification (sd_notify) without libsystemd.

When systemd starts the daemon with ``Type=notify`` it sets ``NOTIFY_SOCKET``: a
datagram Unix socket (a path, or an abstract name starting with ``@``). Each message
is ``KEY=VALUE`` lines. Without the variable every call is a silent no-op, so the
daemon behaves the same under any other supervisor.
"""

from __future__ import annotations

import os
import socket


class Notifier:
    """Sends READY, STATUS, WATCHDOG and STOPPING to systemd, if it listens."""

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.address = env.get("NOTIFY_SOCKET") or None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        ours = not pid or pid == str(os.getpid())
        self.watchdog_interval = (
            int(usec) / 2e6 if usec.isdigit() and int(usec) > 0 and ours else None
        )
        """Seconds between WATCHDOG=1 pings (half of WATCHDOG_USEC), or None."""

    @property
    def enabled(self) -> bool:
        """Whether a supervisor listens."""
        return self.address is not None

    def send(self, *lines: str) -> bool:
        """Send one notification; return whether it went out (errors are ignored:
        notification must never take the daemon down)."""
        if self.address is None:
            return False
        addr = self.address
        if addr.startswith("@"):
            addr = "\0" + addr[1:]
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.sendto("\n".join(lines).encode(), addr)
        except OSError:
            return False
        return True

    def ready(self, status: str) -> bool:
        """Listeners are bound: the service is up."""
        return self.send("READY=1", f"STATUS={status}")

    def status(self, status: str) -> bool:
        """A one-line summary for ``systemctl status``."""
        return self.send(f"STATUS={status}")

    def watchdog(self) -> bool:
        """Still alive."""
        return self.send("WATCHDOG=1")

    def stopping(self) -> bool:
        """Shutdown has begun."""
        return self.send("STOPPING=1", "STATUS=stopping")
