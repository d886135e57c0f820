"""The demo's cluster: its real daemon processes, started, killed and stopped.

`DemoCluster` writes a loopback cluster with `convergenced cluster`'s own code
(`convergenced.tools.cluster`: mutual TLS, signed records) into a short directory under
/tmp, and starts one ``convergenced run`` process per node. The demo SIGKILLs one of
them mid-checkpoint and restarts it, so starting one node, waiting for it, and killing
it are separate steps here.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from convergenced.client import Client, DaemonUnreachable
from convergenced.core.local_api_codec import ApiError
from convergenced.tools.cluster import (
    free_base_port,
    node_name,
    spawn_daemon,
    stop_daemons,
    write_cluster,
)

READY_TIMEOUT = 60.0


# -- the cluster -------------------------------------------------------------------------


class DemoCluster:
    """``n`` real daemon processes on loopback, in a short directory under /tmp."""

    def __init__(self, n: int, *, tick_ms: int) -> None:
        """Write the configs (nothing runs yet)."""
        self.n = n
        self.tick_ms = tick_ms
        self.dir = Path(tempfile.mkdtemp(prefix="cvg-demo-", dir="/tmp"))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.configs: list[Path] = []
        self._configure()

    def _configure(self) -> None:
        base = free_base_port(2 * self.n)
        self.configs = write_cluster(
            self.dir, self.n, base, tick_ms=self.tick_ms, metrics_base_port=base + self.n
        )

    def socket_path(self, i: int) -> Path:
        """Node ``i``'s local socket."""
        return self.dir / node_name(i) / "convergenced.sock"

    def log_path(self, i: int) -> Path:
        """Node ``i``'s stderr (appended across restarts)."""
        return self.dir / f"{node_name(i)}.log"

    def log_tail(self, i: int, chars: int = 3000) -> str:
        """The end of node ``i``'s log."""
        try:
            return self.log_path(i).read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def start(self, i: int) -> None:
        """Start node ``i`` (returns at once; see `wait_ready`)."""
        self.procs[i] = spawn_daemon(self.configs[i - 1], self.log_path(i))

    def wait_ready(self, i: int, timeout: float = READY_TIMEOUT) -> dict[str, Any]:
        """Wait until node ``i`` answers ``status``; return the status.

        Raises:
            RuntimeError: it exited or did not answer in time.
        """
        deadline = time.monotonic() + timeout
        while True:
            proc = self.procs[i]
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{node_name(i)} exited with {proc.returncode}:\n{self.log_tail(i)}"
                )
            try:
                with Client(self.socket_path(i), timeout=2) as c:
                    return c.status()
            except (DaemonUnreachable, ApiError):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{node_name(i)} not ready after {timeout} s:\n{self.log_tail(i)}"
                    ) from None
                time.sleep(0.05)

    def start_all(self, attempts: int = 3) -> list[dict[str, Any]]:
        """Start every node and wait for each; retry on other ports if one cannot bind."""
        for attempt in range(attempts):
            for i in range(1, self.n + 1):
                self.start(i)
            try:
                return [self.wait_ready(i) for i in range(1, self.n + 1)]
            except RuntimeError:
                self.stop_all()
                if attempt == attempts - 1:
                    raise
                self._configure()  # a port was taken meanwhile: pick others
        raise AssertionError("unreachable")

    def wait_linked(self, timeout: float = READY_TIMEOUT) -> None:
        """Wait until every node is linked to every other one. A daemon that started
        without a log answers next_generation for a stream it has not declared only
        once it has heard from every peer it links to.

        Raises:
            RuntimeError: not linked in time.
        """
        deadline = time.monotonic() + timeout
        want = f"{self.n - 1}/{self.n - 1} "
        for i in range(1, self.n + 1):
            with Client(self.socket_path(i), timeout=2) as c:
                while not c.status()["summary"].startswith(want):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{node_name(i)} not linked to every peer after "
                                           f"{timeout} s:\n{self.log_tail(i)}")  # fmt: skip
                    time.sleep(0.05)

    def kill(self, i: int) -> None:
        """SIGKILL node ``i`` and reap it."""
        proc = self.procs[i]
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

    def wipe(self, i: int) -> None:
        """Node ``i``'s disk is gone: its directory (state, tiers, keys) removed."""
        shutil.rmtree(self.dir / node_name(i), ignore_errors=True)

    def stop_all(self) -> None:
        """SIGTERM every running node, then SIGKILL what has not exited after 10 s."""
        stop_daemons(self.procs.values())

    def remove(self) -> None:
        """Delete the directory."""
        shutil.rmtree(self.dir, ignore_errors=True)
