"""The demo's output: one line per event, and a live progress line.

`Console` prints each event with the time since the demo started and, every half
second, a progress line polled from the daemons by a monitor thread: the step, per node
the newest ``nvme`` and ``s3`` epochs and the restore point (or ``down``), and the epoch
skew. On a terminal the progress line is redrawn in place under the events; otherwise it
is printed whenever it changes.
"""

from __future__ import annotations

import shutil
import threading
import time
from typing import Any, TextIO

from convergenced.client import Client, DaemonUnreachable
from convergenced.core.local_api_codec import ApiError
from convergenced.tools.cluster import node_name
from convergenced.tools.demo.nodes import DemoCluster
from convergenced.tools.demo.trainer import NODES, STREAM, Progress


class Console:
    """Event lines and the progress line of one demo run."""

    def __init__(
        self, out: TextIO, started: float, cluster: DemoCluster, progress: Progress, steps: int
    ) -> None:
        """Print to ``out``; times count from ``started`` (``time.monotonic``)."""
        self.out = out
        self.tty = out.isatty()
        self.started = started
        self.cluster = cluster
        self.progress = progress
        self.steps = steps
        self.nodes: list[int] = list(range(1, NODES + 1))
        """The nodes the progress line shows (those hosting the stream's ranks)."""
        self._print_lock = threading.Lock()
        self._status_line = ""
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None

    def elapsed(self) -> float:
        """Seconds since the demo started."""
        return time.monotonic() - self.started

    def event(self, text: str) -> None:
        """Print one event line (above the live line on a terminal)."""
        with self._print_lock:
            stamp = f"[{self.elapsed():5.1f}s] "
            if self.tty:
                self.out.write(f"\r\x1b[K{stamp}{text}\n{self._status_line}")
            else:
                self.out.write(f"{stamp}{text}\n")
            self.out.flush()

    def _status(self, line: str) -> None:
        with self._print_lock:
            if self.tty:
                width = shutil.get_terminal_size().columns - 1
                self._status_line = line if len(line) <= width else line[: width - 3] + "..."
                self.out.write(f"\r\x1b[K{self._status_line}")
            elif line != self._status_line:
                self._status_line = line
                self.out.write(f"[{self.elapsed():5.1f}s] {line}\n")
            self.out.flush()

    def start(self) -> None:
        """Start the monitor thread that keeps the progress line up to date."""
        self._monitor = threading.Thread(target=self._monitor_loop, name="progress", daemon=True)
        self._monitor.start()

    def stop(self) -> None:
        """Stop the monitor; end the live line on a terminal."""
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(5)
        if self.tty and self._status_line:
            with self._print_lock:
                self.out.write("\n")
                self.out.flush()

    def _monitor_loop(self) -> None:
        clients: dict[int, Client] = {}
        try:
            while not self._stop.wait(0.5):
                self._status(self.describe(clients))
        finally:
            for c in clients.values():
                c.close()

    def _state(self, clients: dict[int, Client], i: int) -> dict[str, Any] | None:
        # A connection to a daemon that restarted is stale: reconnect once at once.
        for _ in range(2):
            try:
                if i not in clients:
                    # It reconnects itself, once, at the next look: never blocks.
                    clients[i] = Client(self.cluster.socket_path(i), timeout=0.5, reconnect=0)
                return clients[i].state(STREAM)
            except (DaemonUnreachable, ApiError, OSError):
                stale = clients.pop(i, None)
                if stale is None:
                    return None
                stale.close()
        return None

    def describe(self, clients: dict[int, Client]) -> str:
        """The progress line now, from the daemons of `nodes` (``clients`` caches them)."""
        steps = self.progress.step
        step = str(min(steps.values())) if len(steps) == NODES else "-"  # "-": restoring
        parts = [f"step {step:>3}/{self.steps}"]
        skew: Any = "?"
        for i in list(self.nodes):
            st = self._state(clients, i)
            if st is None:
                parts.append(f"{node_name(i)} down")
                continue
            newest = st.get("newest", {}).get(node_name(i), {})

            def show(domain: str, newest: dict[str, int] = newest) -> str:
                value = newest.get(domain)
                return f"{value:>3}" if value is not None else "  -"

            rp = st.get("restore_point")
            parts.append(
                f"{node_name(i)} nvme {show('nvme')} s3 {show('s3')} "
                f"rp {rp if rp is not None else '-':>3}"
            )
            if i == 1 and st.get("skew") is not None:
                skew = st["skew"]
        return " | ".join([*parts, f"skew {skew}"])
