"""The descriptor limit: local clients get what the log, the peers and the metrics
endpoint can spare, so a low ``ulimit -n`` lowers the client limit instead of
letting idle clients starve the log (whose EMFILE stops the daemon)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import structlog
import trio
from daemons import LocalCluster

from convergenced.core import local_api_codec as codec
from convergenced.core.gate import OutputGate
from convergenced.core.node import NodeCore
from convergenced.daemon import config as config_mod
from convergenced.daemon.config import Config, Limits
from convergenced.daemon.http import MAX_CONCURRENT
from convergenced.daemon.localapi import descriptors
from convergenced.daemon.localapi.descriptors import REFUSING, plan, reserve_for, size_clients
from convergenced.daemon.localapi.server import LocalApiServer
from convergenced.daemon.telemetry import Telemetry
from convergenced.errors import StartupError

DEFAULT = Config(node_id="n1")


def test_the_reserve_covers_peers_the_metrics_endpoint_the_log_and_the_runtime() -> None:
    limits = DEFAULT.limits
    assert reserve_for(DEFAULT) == (
        descriptors.LOG_RESERVE
        + descriptors.RUNTIME_RESERVE
        + limits.max_connections
        + descriptors.PEER_MARGIN
        + MAX_CONCURRENT
        + descriptors.HTTP_MARGIN
        + REFUSING
    )
    no_metrics = Config(node_id="n1", metrics_listen=None)
    assert (
        reserve_for(no_metrics) == reserve_for(DEFAULT) - MAX_CONCURRENT - descriptors.HTTP_MARGIN
    )


def test_a_low_soft_limit_lowers_max_clients_to_what_is_left() -> None:
    budget = plan(DEFAULT, soft_limit=1024, in_use=10)
    assert budget.max_clients == 1024 - 10 - reserve_for(DEFAULT)
    assert budget.max_clients < DEFAULT.limits.max_clients


def test_a_high_soft_limit_keeps_max_clients() -> None:
    assert plan(DEFAULT, soft_limit=8192, in_use=10).max_clients == DEFAULT.limits.max_clients


def test_a_limit_that_leaves_no_room_for_clients_refuses_to_start_naming_the_numbers() -> None:
    with pytest.raises(StartupError) as refused:
        plan(DEFAULT, soft_limit=256, in_use=10)
    message = str(refused.value)
    assert "soft 256" in message and "limits.max_connections = 256" in message
    assert f"at least {10 + reserve_for(DEFAULT) + 1024}" in message


def test_the_soft_limit_is_raised_towards_the_hard_one_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    set_to: list[tuple[int, int]] = []
    monkeypatch.setattr(descriptors.resource, "getrlimit", lambda _: (1024, 4096))
    monkeypatch.setattr(descriptors.resource, "setrlimit", lambda _, v: set_to.append(v))
    monkeypatch.setattr(descriptors, "open_descriptors", lambda: 10)
    with structlog.testing.capture_logs() as logs:
        budget = size_clients(DEFAULT)
    assert set_to == [(10 + reserve_for(DEFAULT) + 1024, 4096)]
    assert budget.max_clients == 1024
    assert logs == []


def test_lowering_max_clients_is_logged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(descriptors.resource, "getrlimit", lambda _: (600, 600))
    monkeypatch.setattr(descriptors, "open_descriptors", lambda: 10)
    with structlog.testing.capture_logs() as logs:
        budget = size_clients(DEFAULT)
    assert budget.max_clients == 600 - 10 - reserve_for(DEFAULT)
    (warning,) = logs
    assert warning["log_level"] == "warning"
    assert warning["max_clients"] == budget.max_clients and warning["configured"] == 1024


class NoOperations:
    pass


async def test_refusals_under_way_are_bounded_and_all_counted() -> None:
    gate = OutputGate(NodeCore("stub", 1))
    telemetry = Telemetry()

    async def durable(position: int) -> None:
        pass

    server = LocalApiServer(NoOperations(), gate, durable, Limits(), telemetry)  # type: ignore[arg-type]
    server.max_clients = 0  # every client is one too many
    peak = 0
    clients = []
    async with trio.open_nursery() as nursery:
        for _ in range(3 * REFUSING):
            ours, theirs = trio.socket.socketpair()
            clients.append(ours)  # never reads its refusal: each would hold on for 1 s
            nursery.start_soon(server.handle, trio.SocketStream(theirs))
            await trio.sleep(0)
            peak = max(peak, server._refusing)
        with trio.fail_after(10):
            while server._refusing:
                await trio.sleep(0.01)
    assert 0 < peak <= REFUSING
    assert telemetry.counters()["api_errors_too_many_clients"] == 3 * REFUSING
    for s in clients:
        s.close()


# -- a real daemon under ``ulimit -n`` ---------------------------------------------------

NOFILE = 200


def ask_streams(path: Path) -> tuple[socket.socket, Any]:
    """A new connection and the reply to its ``streams`` (None: none in 3 s)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(3)
    s.connect(str(path))
    s.sendall(codec.encode_frame(codec.request(1, "streams")))
    try:
        return s, codec.FrameReader().feed(s.recv(65536))[0]
    except (TimeoutError, OSError, IndexError):
        return s, None


def test_a_daemon_under_a_low_descriptor_limit_refuses_clients_and_keeps_its_log() -> None:
    with LocalCluster(1, extra="wal_compact_bytes = 65536") as cluster:
        cfg = cluster.configs[0]
        cfg.write_text(cfg.read_text() + "\n[limits]\nmax_connections = 16\n")
        log = open(cluster.log_path(1), "ab")  # noqa: SIM115 - the daemon's log
        cluster.procs[1] = subprocess.Popen(
            ["sh", "-c", f'ulimit -n {NOFILE} && exec "$0" "$@"', sys.executable, "-m",
             "convergenced.cli", "run", "--config", str(cfg), "--log-format", "json"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
        )  # fmt: skip
        log.close()
        cluster.wait_ready(1)
        committer = cluster.client(1)
        LocalCluster.declare_solo(committer, "job", "nvme")
        idle: list[socket.socket] = []
        refused = None
        try:
            for _ in range(NOFILE):
                s, reply = ask_streams(cluster.socket_path(1))
                idle.append(s)
                if reply is None or "error" in reply:
                    refused = reply
                    break
            assert refused is not None, "no connection was refused (too_many_clients)"
            assert refused["error"]["reason"] == "too_many_clients", refused
            lowered = re.search(r'"max_clients": (\d+)', cluster.log(1))
            assert lowered is not None and int(lowered.group(1)) == len(idle)  # and the committer
            epoch = 0
            deadline = time.monotonic() + 60
            while cluster.log(1).count("write-ahead log compacted") < 2:
                assert cluster.procs[1].poll() is None, cluster.log(1)[-3000:]
                assert time.monotonic() < deadline, "no compaction"
                epoch += 1
                committer.commit("job", 0, "nvme", epoch, digest="sha512:" + "ab" * 64)
            assert "EMFILE" not in cluster.log(1) and "log failed" not in cluster.log(1)
        finally:
            for s in idle:
                s.close()
        assert config_mod.load(cfg).limits.max_clients == 1024  # the file is unchanged
