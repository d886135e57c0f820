"""`convergenced cluster`: everything needed to run an N-node cluster on loopback.

Writes one configuration file per node (``node-1.toml`` ...), each with its own
state directory and socket under ``DIR/node-K/`` and every other node as a peer, and,
unless ``insecure``, everything the secure defaults need: a cluster CA
(``DIR/ca/``), a TLS certificate and key per node, an Ed25519 identity per node and,
in every config, the trust list of all nodes' public keys.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from convergenced.daemon import config as config_mod
from convergenced.security import pki

MAX_UNIX_PATH = 107
"""sun_path holds 108 bytes including the terminating NUL."""


def free_base_port(n: int) -> int:
    """A base port with ``n`` consecutive ports free on loopback after it (for tests,
    benchmarks and the demo; another process may still take one before it is bound)."""
    rng = random.Random()
    # Below the kernel's ephemeral range: an outgoing connection (a dialling daemon's)
    # takes its local port from that range, and could take a port chosen here before
    # the daemon meant to listen on it is started.
    low = _ephemeral_low()
    lo, hi = (10000, low - n) if low - n > 12000 else (20000, 60000 - n)
    for _ in range(200):
        base = rng.randrange(lo, hi)
        if all(_port_free(p) for p in range(base, base + n)):
            return base
    raise RuntimeError("no free range of local ports found")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def spawn_daemon(
    config: Path, log_path: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``convergenced run --config CONFIG`` as a child process, its JSON log
    appended to ``log_path`` (for the demo, tests and benchmarks)."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "convergenced.cli",
                "run",
                "--config",
                str(config),
                "--log-format",
                "json",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )


def stop_daemons(procs: Iterable[subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    """SIGTERM every daemon still running, then SIGKILL any that has not exited after
    ``grace_s`` seconds."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def node_name(i: int) -> str:
    """The id of the ``i``-th node (1-based)."""
    return f"node-{i}"


def write_cluster(
    directory: Path,
    nodes: int,
    base_port: int,
    *,
    cluster: str = "local",
    tick_ms: int | None = None,
    idle_ticks: int | None = None,
    dead_ticks: int | None = None,
    insecure: bool = False,
    metrics_base_port: int | None = 9464,
) -> list[Path]:
    """Write the configs; return their paths.

    Raises:
        ValueError: bad sizes, ports out of range, or a socket path too long.
    """
    if not 1 <= nodes <= 4096:
        raise ValueError(f"--nodes {nodes}: expected 1 to 4096")
    if not base_port >= 1024 or base_port + nodes - 1 > 65535:
        raise ValueError(
            f"--base-port {base_port}: ports {base_port}..{base_port + nodes - 1} "
            "must lie in 1024..65535"
        )
    directory = directory.resolve()
    for i in range(1, nodes + 1):
        sock = directory / node_name(i) / "convergenced.sock"
        if len(str(sock).encode()) > MAX_UNIX_PATH:
            raise ValueError(
                f"{sock}: longer than the {MAX_UNIX_PATH} bytes a Unix socket "
                "path may have; use a shorter --dir"
            )
    directory.mkdir(parents=True, exist_ok=True)
    security = [] if insecure else _secure(directory, nodes)
    paths: list[Path] = []
    for i in range(1, nodes + 1):
        name = node_name(i)
        home = directory / name
        (home / "state").mkdir(parents=True, exist_ok=True)
        lines = [
            f"# Node {i} of a {nodes}-node loopback cluster (convergenced cluster).",
            f'node_id = "{name}"',
            f'cluster = "{cluster}"',
            f'listen = "127.0.0.1:{base_port + i - 1}"',
            f'socket_path = "{home / "convergenced.sock"}"',
            f'state_dir = "{home / "state"}"',
        ]
        # The link timer: the daemon's defaults unless given (tests use faster ones).
        lines += [f"{key} = {value}" for key, value in
                  (("tick_ms", tick_ms), ("idle_ticks", idle_ticks), ("dead_ticks", dead_ticks))
                  if value is not None]  # fmt: skip
        if metrics_base_port is not None:
            lines.append(f'metrics_listen = "127.0.0.1:{metrics_base_port + i - 1}"')
        else:
            lines.append('metrics_listen = "off"')
        if insecure:
            lines += [
                "# Plaintext links and unsigned records: for a throwaway cluster only.",
                "insecure = true",
            ]
        else:
            lines += [f'identity = "{home / "identity.key"}"']
        lines.append("")
        if not insecure:
            ca = directory / "ca" / "ca.crt"
            files = pki.node_files(home / "tls", name)
            lines += [
                "[tls]",
                f'cert = "{files.cert}"',
                f'key = "{files.key}"',
                f'ca = "{ca}"',
                "",
                "[trust]",
                *security,
                "",
            ]
        for j in range(1, nodes + 1):
            if j != i:
                lines += [
                    "[[peers]]",
                    f'id = "{node_name(j)}"',
                    f'address = "127.0.0.1:{base_port + j - 1}"',
                    "",
                ]
        path = directory / f"{name}.toml"
        path.write_text("\n".join(lines), encoding="utf-8")
        config_mod.load(path)  # what we write must be what we accept
        paths.append(path)
    return paths


def _secure(directory: Path, nodes: int) -> list[str]:
    """CA, certificates and identities; returns the trust list lines."""
    from convergenced.security.keys import NodeIdentity

    ca_dir = directory / "ca"
    if not (ca_dir / "ca.crt").exists():
        pki.init_ca(ca_dir, name="convergenced local cluster CA")
    trust: list[str] = []
    for i in range(1, nodes + 1):
        name = node_name(i)
        home = directory / name
        if not pki.node_files(home / "tls", name).cert.exists():
            pki.issue(ca_dir, name, out_dir=home / "tls")
        key_path = home / "identity.key"
        if key_path.exists():
            identity = NodeIdentity.load(key_path, node_id=name)
        else:
            identity = NodeIdentity.generate(name)
            identity.save(key_path)
        trust.append(identity.trust_entry())
    return trust
