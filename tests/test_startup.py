"""A start that fails says why in one line, exits 1 and leaves the state as it was.

Real `convergenced run` processes (tests/daemons.py): what is checked is what a user
sees on stderr and what is left on disk.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from daemons import LocalCluster


def _run(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "convergenced.cli", "run", "--config", str(config)],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )


@contextmanager
def _busy(port: int) -> Iterator[None]:
    """Someone else listens on 127.0.0.1:``port``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        yield


def _state_dir(cluster: LocalCluster, i: int = 1) -> Path:
    return cluster.dir / cluster.name(i) / "state"


def _one_clean_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "ExceptionGroup" not in proc.stderr
    assert lines[0].startswith("convergenced: cannot start: ")
    return lines[0]


def test_a_busy_metrics_port_is_one_clean_line_and_exit_1() -> None:
    with LocalCluster(1) as cluster, _busy(cluster.metrics_base_port):
        line = _one_clean_line(_run(cluster.configs[0]))
        assert f"cannot serve metrics on 127.0.0.1:{cluster.metrics_base_port}" in line
        assert "Address already in use" in line


def test_a_busy_peer_port_is_one_clean_line_and_exit_1() -> None:
    with LocalCluster(1) as cluster, _busy(cluster.base_port):
        line = _one_clean_line(_run(cluster.configs[0]))
        assert f"cannot listen for peers on 127.0.0.1:{cluster.base_port}" in line


def test_a_failed_first_start_creates_neither_the_state_directory_nor_the_log() -> None:
    with LocalCluster(1) as cluster, _busy(cluster.metrics_base_port):
        shutil.rmtree(_state_dir(cluster))
        _one_clean_line(_run(cluster.configs[0]))
        assert not _state_dir(cluster).exists()
        assert not cluster.socket_path(1).exists()


def test_a_bad_key_file_leaves_a_missing_log_missing() -> None:
    with LocalCluster(2) as cluster:
        key = cluster.dir / "node-1" / "tls" / "node-1.key"
        key.write_text("not a key\n")
        line = _one_clean_line(_run(cluster.configs[0]))
        assert str(key) in line
        assert list(_state_dir(cluster).iterdir()) == []


def test_a_failed_restart_leaves_the_log_and_the_incarnation_as_they_were() -> None:
    with LocalCluster(1) as cluster:
        cluster.start(1)
        c = cluster.client(1)
        cluster.declare_solo(c, "job", "nvme")
        c.commit("job", 0, "nvme", 1)
        c.close()
        assert cluster.kill(1, sig=15) == 0
        wal = _state_dir(cluster) / "facts.wal"
        before = wal.read_bytes()
        with _busy(cluster.base_port):
            _one_clean_line(_run(cluster.configs[0]))
            assert wal.read_bytes() == before
        cluster.start(1)
        status = cluster.client(1).status()
        assert status["incarnation"] == 2  # the failed start spent no incarnation
        assert cluster.client(1).state("job")["restore_point"] == 1


def test_a_certificate_of_another_node_stops_the_start_naming_tls_cert() -> None:
    with LocalCluster(2) as cluster:
        tls = cluster.dir / "node-1" / "tls"
        for suffix in ("crt", "key"):
            source = cluster.dir / "node-2" / "tls" / f"node-2.{suffix}"
            shutil.copy2(source, tls / f"node-1.{suffix}")
        line = _one_clean_line(_run(cluster.configs[0]))
        assert "tls.cert:" in line and "certificate of 'node-2'" in line
