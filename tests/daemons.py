"""Real daemon processes on loopback, for tests and benchmarks.

`LocalCluster` writes the configs with `convergenced cluster`'s own code, starts one
``convergenced run`` process per node, and gives blocking clients to each. Sockets
live under a short directory in /tmp (a Unix socket path holds at most 107 bytes,
which pytest's tmp_path can exceed).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from convergenced.client import Client, DaemonUnreachable
from convergenced.tools.cluster import (
    free_base_port,
    node_name,
    spawn_daemon,
    stop_daemons,
    write_cluster,
)

STREAM_SPEC_POLICY = {"mode": "all", "domains": ["nvme"]}


def until(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "") -> None:
    """Poll ``predicate`` until it holds; fail after ``timeout`` seconds naming ``what``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.02)


def interruptible(argv: list[str]) -> subprocess.Popen[str]:
    """Start ``argv`` (text pipes) so that Ctrl-C works in it even when this process
    ignores SIGINT, as anything started in the background by a non-interactive shell
    does: Python keeps an inherited SIG_IGN, but a handled signal is reset on exec."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, old)


class LocalCluster:
    """N daemon processes on loopback; use as a context manager."""

    def __init__(
        self,
        nodes: int,
        *,
        tick_ms: int | None = 20,
        idle_ticks: int | None = 4,
        dead_ticks: int | None = 40,
        extra: str = "",
        insecure: bool = False,
    ) -> None:
        """The link timer defaults to the tests' (a 20 ms tick, a heartbeat every 4 ticks
        and a link down after 40, so failures show within a second); None for any of
        them: the daemon's default (the benchmarks). ``extra``: top-level TOML lines
        for every node."""
        self.n = nodes
        self.dir = Path(tempfile.mkdtemp(prefix="cvg-", dir="/tmp"))
        self.base_port = free_base_port(2 * nodes)
        self.metrics_base_port = self.base_port + nodes
        self.configs = write_cluster(
            self.dir,
            nodes,
            self.base_port,
            tick_ms=tick_ms,
            idle_ticks=idle_ticks,
            dead_ticks=dead_ticks,
            insecure=insecure,
            metrics_base_port=self.metrics_base_port,
        )
        if extra:  # top-level keys: they go before the first table
            for path in self.configs:
                text = path.read_text()
                head, sep, rest = text.partition("\nstate_dir = ")
                line, nl, rest = rest.partition("\n")
                path.write_text(head + sep + line + nl + extra + "\n" + rest)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self._clients: list[Client] = []

    # -- processes ------------------------------------------------------------------

    def name(self, i: int) -> str:
        """Node id of node ``i`` (1-based)."""
        return node_name(i)

    def metrics(self, i: int) -> dict[str, float]:
        """Node ``i``'s Prometheus samples now, by their text before the value
        (``name{labels}``)."""
        port = self.metrics_base_port + i - 1
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def socket_path(self, i: int) -> Path:
        """Local socket of node ``i``."""
        return self.dir / node_name(i) / "convergenced.sock"

    def log_path(self, i: int) -> Path:
        """Where node ``i``'s stderr goes (appended across restarts)."""
        return self.dir / f"{node_name(i)}.log"

    def start(self, i: int, *, wait: bool = True, env: dict[str, str] | None = None) -> None:
        """Start node ``i``; with ``wait``, return once its socket answers. ``env`` adds
        environment variables (such as NOTIFY_SOCKET)."""
        self.procs[i] = spawn_daemon(self.configs[i - 1], self.log_path(i), env)
        if wait:
            self.wait_ready(i)

    def start_all(self) -> None:
        """Start every node and wait until each answers."""
        for i in range(1, self.n + 1):
            self.start(i, wait=False)
        for i in range(1, self.n + 1):
            self.wait_ready(i)

    def wait_ready(self, i: int, timeout: float = 20.0) -> None:
        """Return once node ``i`` answers ``status``."""
        deadline = time.monotonic() + timeout
        while True:
            proc = self.procs[i]
            if proc.poll() is not None:
                raise RuntimeError(f"{node_name(i)} exited with {proc.returncode}:\n{self.log(i)}")
            try:
                with Client(self.socket_path(i), timeout=1, reconnect=0) as c:
                    c.status()
                return
            except DaemonUnreachable:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{node_name(i)} not ready:\n{self.log(i)}") from None
                time.sleep(0.02)

    def kill(self, i: int, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to node ``i`` and wait for it to exit; return its exit code."""
        proc = self.procs[i]
        proc.send_signal(sig)
        return proc.wait(timeout=30)

    def log(self, i: int) -> str:
        """Node ``i``'s log so far."""
        try:
            return self.log_path(i).read_text(errors="replace")
        except OSError:
            return ""

    # -- clients ----------------------------------------------------------------------

    def client(self, i: int, *, reconnect: float = 0) -> Client:
        """A new blocking client of node ``i`` (closed with the cluster). It does not
        reconnect unless ``reconnect`` says for how long: tests that kill a daemon see
        the connection end at once."""
        c = Client(self.socket_path(i), reconnect=reconnect)
        self._clients.append(c)
        return c

    def spec(self, name: str = "job", retention: int = 0, **policy: Any) -> dict[str, Any]:
        """A stream spec with one rank per node (node i hosts rank i-1)."""
        return {
            "name": name,
            "members": {node_name(i): [i - 1] for i in range(1, self.n + 1)},
            "policy": policy or STREAM_SPEC_POLICY,
            "retention": retention,
        }

    @staticmethod
    def declare_solo(
        client: Client,
        name: str,
        *domains: str,
        mode: str = "all",
        retention: int = 0,
        ranks: int = 1,
    ) -> str:
        """Declare a one-member stream (node-1 hosting ``ranks`` ranks); return its name."""
        client.declare(
            {
                "name": name,
                "members": {"node-1": list(range(ranks))},
                "policy": {"mode": mode, "domains": list(domains)},
                "retention": retention,
            }
        )
        return name

    def close(self) -> None:
        """Stop every node (SIGTERM, then SIGKILL) and remove the directory."""
        for c in self._clients:
            c.close()
        stop_daemons(self.procs.values())
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if t is not None:
            for i in range(1, self.n + 1):
                sys.stderr.write(f"--- {node_name(i)} log ---\n{self.log(i)[-4000:]}\n")
        self.close()
