"""Observability with real parts: the HTTP endpoint of real daemons (/metrics, /healthz,
/readyz), a real Prometheus server scraping a 3-node cluster and answering queries for
`convergenced_epoch_skew`, sd_notify against a real datagram socket, and the
healthcheck command.

Prometheus comes from the Debian package `prometheus`; without it the Prometheus test
is skipped with the reason, except under CI (CI=true), where a missing tool fails.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from daemons import LocalCluster, free_base_port, until

from convergenced import cli


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


def _converged_cluster(cluster: LocalCluster, epochs: int = 2) -> None:
    clients = [cluster.client(i) for i in range(1, cluster.n + 1)]
    for c in clients:
        c.declare(cluster.spec())
    for e in range(1, epochs + 1):
        for rank, c in enumerate(clients):
            c.commit("job", rank, "nvme", e)
    for c in clients:
        c.wait("job", epochs, timeout=20)


def test_metrics_and_probes_over_http() -> None:
    with LocalCluster(2) as cluster:
        cluster.start_all()
        _converged_cluster(cluster)
        c1 = cluster.client(1)
        c1.commit("job", 0, "nvme", 3)  # node-1 runs one epoch ahead: skew 1
        with pytest.raises(Exception):  # noqa: B017 - any refusal: counted below
            c1.commit("job", 0, "nvme", -1)
        port = c1.status()["metrics_port"]
        assert port == cluster.metrics_base_port
        base = f"http://127.0.0.1:{port}"
        until(
            lambda: 'convergenced_epoch_skew{stream="job"} 1.0' in _get(base + "/metrics")[1],
            what="skew 1 in /metrics",
        )
        code, text = _get(base + "/metrics")
        assert code == 200
        for line in [
            'convergenced_build_info{version="',
            'convergenced_restore_point_epoch{stream="job"} 2.0',
            'convergenced_domain_divergence{domain="nvme",stream="job"} 1.0',
            'convergenced_rpo_epochs{stream="job"} 1.0',
            'convergenced_knowledge_level{stream="job"}',
            'convergenced_commits_total{domain="nvme",outcome="accepted"} 3.0',
            'convergenced_peer_up{peer="node-2"} 1.0',
            'convergenced_peer_frames_total{direction="sent",peer="node-2",type="TICK"}',
            'convergenced_peer_bytes_total{direction="received",peer="node-2"}',
            "convergenced_peer_exchange_rtt_seconds_bucket",
            "convergenced_wal_fsync_duration_seconds_count",
            "convergenced_restore_point_age_seconds",
            "convergenced_wal_bytes",
            "convergenced_local_clients",
            'convergenced_api_errors_total{reason="bad_request"} 1.0',
        ]:
            assert line in text, line
        assert _get(base + "/healthz") == (200, "ok\n")
        assert _get(base + "/readyz") == (200, "ready\n")
        assert _get(base + "/nope")[0] == 404
        # A malformed request gets a 400, and the endpoint keeps serving.
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"garbage\r\n\r\n")
            assert s.recv(100).startswith(b"HTTP/1.1 400")
        assert _get(base + "/healthz")[0] == 200


def test_healthcheck_command(capsys: pytest.CaptureFixture[str]) -> None:
    with LocalCluster(1) as cluster:
        cluster.start_all()
        assert cli.main(["healthcheck", "--config", str(cluster.configs[0])]) == 0
        assert cli.main(["healthcheck", "--socket", str(cluster.socket_path(1))]) == 0
        cluster.kill(1, signal.SIGTERM)
        assert cli.main(["healthcheck", "--config", str(cluster.configs[0])]) == 1
        assert "unhealthy" in capsys.readouterr().err


def test_sd_notify_ready_watchdog_status_and_stopping() -> None:
    with LocalCluster(1) as cluster, tempfile.TemporaryDirectory(dir="/tmp") as d:
        path = os.path.join(d, "notify.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(path)
        sock.settimeout(10)
        try:
            cluster.start(1, env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"})
            messages: list[str] = []

            def receive_until(marker: str) -> None:
                while not any(marker in m for m in messages):
                    messages.append(sock.recv(4096).decode())

            receive_until("READY=1")
            ready = next(m for m in messages if "READY=1" in m)
            assert "STATUS=" in ready and "peers linked" in ready
            receive_until("WATCHDOG=1")  # every 100 ms: half of WATCHDOG_USEC
            cluster.kill(1, signal.SIGTERM)
            receive_until("STOPPING=1")
        finally:
            sock.close()


def _prometheus() -> str | None:
    found = shutil.which("prometheus")
    if found is None and os.environ.get("CI") == "true":
        pytest.fail("prometheus is not installed (.ci/run installs the Debian package)")
    return found


def test_a_real_prometheus_scrapes_the_cluster_and_answers_for_epoch_skew() -> None:
    prometheus = _prometheus()
    if prometheus is None:
        pytest.skip("prometheus not installed (Debian package 'prometheus')")
    with LocalCluster(3) as cluster, tempfile.TemporaryDirectory(dir="/tmp") as d:
        cluster.start_all()
        _converged_cluster(cluster)
        cluster.client(2).commit("job", 1, "nvme", 3)
        cluster.client(2).commit("job", 1, "nvme", 4)  # node-2 is two epochs ahead
        targets = [f"127.0.0.1:{cluster.metrics_base_port + i}" for i in range(3)]
        config = Path(d) / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: convergenced\n    static_configs:\n"
            f"      - targets: {json.dumps(targets)}\n"
        )
        web_port = free_base_port(1)
        log_path = Path(d) / "prometheus.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [
                    prometheus,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={d}/data",
                    f"--web.listen-address=127.0.0.1:{web_port}",
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        try:
            query = urllib.parse.urlencode({"query": 'max(convergenced_epoch_skew{stream="job"})'})
            url = f"http://127.0.0.1:{web_port}/api/v1/query?{query}"
            values: list[str] = []

            def skew_seen() -> bool:
                try:
                    code, body = _get(url)
                except OSError:
                    return False
                if code != 200:  # 503 "Service Unavailable" until its storage is ready
                    return False
                result = json.loads(body).get("data", {}).get("result", [])
                values[:] = [r["value"][1] for r in result]
                return values == ["2"]

            try:
                until(skew_seen, timeout=60, what=f"Prometheus to report skew 2 (got {values})")
                up = urllib.parse.urlencode({"query": "sum(up)"})
                until(
                    lambda: '"3"' in _get(f"http://127.0.0.1:{web_port}/api/v1/query?{up}")[1],
                    timeout=30,
                    what="all three targets up",
                )
            except AssertionError:
                sys.stderr.write(log_path.read_text(errors="replace")[-3000:])
                raise
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
