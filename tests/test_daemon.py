"""Real daemon processes on loopback: convergence, wait and watch, kill -9 in the middle
of a burst of commits, restarts, a link cut mid-frame, and a client that stops reading.

Every daemon here is a `convergenced run` process with its own write-ahead log, TCP
listener and Unix socket; the tests talk to them only through the public clients.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from daemons import LocalCluster, until

from convergenced.client import ApiError, Client, DaemonUnreachable, ErrorKind
from convergenced.core import local_api_codec as codec


def _rp(c: Client, stream: str = "job") -> int | None:
    rp = c.state(stream)["restore_point"]
    return None if rp is None else int(rp)


def _rp_after_wait(c: Client, epoch: int) -> int:
    return int(c.wait("job", epoch, timeout=20)["restore_point"])


def _epochs(intervals: list[list[int]] | None) -> set[int]:
    return {e for lo, hi in intervals or [] for e in range(lo, hi + 1)}


def _declare_all(cluster: LocalCluster, spec: dict[str, Any]) -> list[Client]:
    clients = [cluster.client(i) for i in range(1, cluster.n + 1)]
    for c in clients:
        c.declare(spec)
    return clients


def _in_parallel(calls: list[Callable[[], Any]]) -> list[Any]:
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def _commit_round(clients: list[Client], epoch: int) -> None:
    for rank, c in enumerate(clients):
        c.commit("job", rank, "nvme", epoch)


# -- convergence, wait, watch ----------------------------------------------------------


def test_five_daemons_converge_and_agree_on_restore_points() -> None:
    with LocalCluster(5) as cluster:
        cluster.start_all()
        clients = _declare_all(cluster, cluster.spec(retention=1))
        for e in range(1, 4):
            _commit_round(clients, e)
        states = [c.wait("job", 3, timeout=20) for c in clients]
        assert [s["restore_point"] for s in states] == [3] * 5
        assert all(s["convergence"] == [[1, 3]] for s in states)
        # Everyone has heard everyone's proposal: the highest level the protocol offers.
        until(lambda: all(c.state("job")["knowledge"] == "published" for c in clients))
        assert all(c.state("job")["skew"] == 0 for c in clients)
        # One node lagging shows as skew and holds the restore point back.
        for c, rank in zip(clients[:4], range(4), strict=True):
            c.commit("job", rank, "nvme", 4)
        until(lambda: clients[0].state("job")["skew"] == 1, what="skew 1")
        assert _rp(clients[0]) == 3
        clients[4].commit("job", 4, "nvme", 4)
        assert [c.wait("job", 4, timeout=20)["restore_point"] for c in clients] == [4] * 5
        # A recovery generation: every member returns the same epoch (S2). Each
        # member waits for the others' frozen sets, so the requests run side by side.
        answers = _in_parallel([lambda c=c: c.restore_point("job", 1, timeout=20) for c in clients])
        assert {a["restore_point"] for a in answers} == {4}
        assert all(a["resolved"] for a in answers)
        status = clients[0].status()
        assert status["node"] == "node-1"
        assert sorted(p["id"] for p in status["peers"] if p["connected"]) == [
            "node-2",
            "node-3",
            "node-4",
            "node-5",
        ]


def test_wait_times_out_with_a_typed_error_and_watch_streams_changes() -> None:
    with LocalCluster(2) as cluster:
        cluster.start_all()
        a, b = _declare_all(cluster, cluster.spec())
        with pytest.raises(ApiError) as info:
            a.wait("job", 1, timeout=0.2)
        assert info.value.kind is ErrorKind.TIMEOUT
        with pytest.raises(ApiError) as info:
            a.wait("nope", 1, timeout=0.2)
        assert info.value.kind is ErrorKind.REJECTED
        assert info.value.reason == "unknown_stream"

        events: list[dict[str, Any]] = []
        watcher = cluster.client(2)

        def watch() -> None:
            for ev in watcher.watch("job"):
                events.append(ev)
                if ev["restore_point"] == 3:
                    return

        t = threading.Thread(target=watch)
        t.start()
        for e in (1, 2, 3):
            a.commit("job", 0, "nvme", e)
            b.commit("job", 1, "nvme", e)
        t.join(timeout=20)
        assert not t.is_alive()
        seen = [ev["restore_point"] for ev in events]
        assert seen[0] is None or seen[0] <= 3  # the first event is the state at the start
        assert seen[-1] == 3
        assert seen == sorted(seen, key=lambda x: -1 if x is None else x)  # never backwards
        # A wait started before the epoch exists returns once it is agreed.
        result: list[int] = []
        t = threading.Thread(
            target=lambda: result.append(a.wait("job", 4, timeout=20)["restore_point"])
        )
        t.start()
        time.sleep(0.1)
        a.commit("job", 0, "nvme", 4)
        b.commit("job", 1, "nvme", 4)
        t.join(timeout=20)
        assert result == [4]


# -- crashes --------------------------------------------------------------------------


class Committer(threading.Thread):
    """Commits successive epochs for one rank as fast as acks come; records acks."""

    def __init__(self, socket_path: Path, rank: int) -> None:
        super().__init__(daemon=True)
        self.socket_path = socket_path
        self.rank = rank
        self.acked: list[int] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        epoch = 0
        try:
            # No reconnecting: a kill ends the burst at once (else each killed
            # daemon's committer would wait out the reconnect bound).
            with Client(self.socket_path, reconnect=0) as c:
                while not self.stop.is_set():
                    epoch += 1
                    c.commit("job", self.rank, "nvme", epoch)
                    self.acked.append(epoch)
        except DaemonUnreachable:
            pass  # killed under us: everything acked before must survive
        except BaseException as exc:  # pragma: no cover - reported by the test
            self.error = exc


@pytest.mark.parametrize("victims", [(2,), (2, 3)], ids=["one-killed", "two-killed"])
def test_kill_9_mid_burst_loses_no_acknowledged_commit(victims: tuple[int, ...]) -> None:
    with LocalCluster(3) as cluster:
        cluster.start_all()
        _declare_all(cluster, cluster.spec())
        committers = [Committer(cluster.socket_path(i), i - 1) for i in range(1, 4)]
        for t in committers:
            t.start()
        until(lambda: all(len(t.acked) >= 30 for t in committers), what="a burst of commits")
        for i in victims:
            assert cluster.kill(i, signal.SIGKILL) == -signal.SIGKILL
        for t in committers:
            t.stop.set()
            t.join(timeout=20)
            assert t.error is None
        for i in victims:
            cluster.start(i)
        # Every acknowledged commit is still there, on the restarted node and, through
        # the links, in what the others believe about it.
        for i in victims:
            acked = set(committers[i - 1].acked)
            c = cluster.client(i)
            assert acked <= _epochs(c.state("job")["recoverable"])
            assert c.status()["incarnation"] == 2
        clients = [cluster.client(i) for i in range(1, 4)]
        top = max(max(t.acked) for t in committers) + 1
        _commit_round(clients, top)
        # Each node now holds 1..its last ack plus `top`; the agreed point is `top`
        # (recoverable sets differ below, but `top` is in all of them).
        assert [c.wait("job", top, timeout=30)["restore_point"] for c in clients] == [top] * 3
        common = set.intersection(*(set(t.acked) for t in committers)) | {top}
        for c in clients:
            assert _epochs(c.state("job")["convergence"]) >= common


def test_a_peer_restarting_gracefully_is_survived() -> None:
    with LocalCluster(3) as cluster:
        cluster.start_all()
        clients = _declare_all(cluster, cluster.spec())
        _commit_round(clients, 1)
        assert clients[0].wait("job", 1, timeout=20)["restore_point"] == 1
        assert cluster.kill(3, signal.SIGTERM) == 0
        assert "stopped" in cluster.log(3)
        clients[0].commit("job", 0, "nvme", 2)
        clients[1].commit("job", 1, "nvme", 2)
        cluster.start(3)
        c3 = cluster.client(3)
        c3.commit("job", 2, "nvme", 2)
        for c in (clients[0], clients[1], c3):
            assert c.wait("job", 2, timeout=20)["restore_point"] == 2
        until(
            lambda: (
                clients[0].status()["counters"].get("peer_reconnects", 0) >= 1
                or any(p["connected"] for p in clients[0].status()["peers"] if p["id"] == "node-3")
            )
        )


# -- a link cut in the middle of a frame ------------------------------------------------


class CuttingProxy:
    """A TCP proxy that forwards faithfully, except that when ``cut`` is set it
    forwards half of the next chunk and resets both sides (a frame cut in two)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.cut = threading.Event()
        self.cuts = 0
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                down.close()
                continue
            self.connections += 1
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b, down, up), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, *pair: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
                if not data:
                    break
                if self.cut.is_set() and len(data) > 1:
                    self.cut.clear()
                    self.cuts += 1
                    dst.sendall(data[: len(data) // 2])
                    for s in pair:  # RST, not FIN: the peer sees a reset mid-frame
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
                        s.close()
                    return
                dst.sendall(data)
            except OSError:
                break
        for s in pair:
            with contextlib.suppress(OSError):
                s.close()

    def close(self) -> None:
        self.listener.close()


def test_a_link_reset_mid_frame_is_survived() -> None:
    with LocalCluster(2) as cluster:
        # node-1 dials node-2 (the lower id dials); route that link through the proxy.
        proxy = CuttingProxy(cluster.base_port + 1)
        cfg = cluster.configs[0]
        cfg.write_text(cfg.read_text().replace(f":{cluster.base_port + 1}", f":{proxy.port}"))
        try:
            cluster.start_all()
            a, b = _declare_all(cluster, cluster.spec())
            _commit_round([a, b], 1)
            assert a.wait("job", 1, timeout=20)["restore_point"] == 1
            proxy.cut.set()
            _commit_round([a, b], 2)  # the next frames are cut in half
            until(lambda: proxy.cuts == 1, what="the cut")
            _commit_round([a, b], 3)
            assert a.wait("job", 3, timeout=30)["restore_point"] == 3
            assert b.wait("job", 3, timeout=30)["restore_point"] == 3
            assert proxy.connections >= 2  # the dialler reconnected
            assert a.status()["counters"].get("peer_reconnects", 0) >= 1
        finally:
            proxy.close()


# -- a client that stops reading ---------------------------------------------------------


def test_a_stuck_client_is_disconnected_and_never_stalls_the_others() -> None:
    with LocalCluster(1) as cluster:
        cluster.start_all()
        good = cluster.client(1)
        good.declare(cluster.spec())
        stuck = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.connect(str(cluster.socket_path(1)))
        # Ask for much more than the daemon will queue for one client, never read.
        burst = b"".join(
            codec.encode_frame(codec.request(i, "state", stream="job")) for i in range(1, 5001)
        )
        sender = threading.Thread(target=lambda: _send_quietly(stuck, burst), daemon=True)
        sender.start()
        # Meanwhile the well-behaved client is served promptly, commit after commit.
        for e in range(1, 51):
            good.commit("job", 0, "nvme", e)
        until(
            lambda: good.status()["counters"].get("api_errors_client_too_slow", 0) >= 1,
            what="the stuck client to be disconnected",
        )
        assert good.wait("job", 50, timeout=10)["restore_point"] == 50
        stuck.close()


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):
        sock.sendall(data)


# -- bad input on the local socket --------------------------------------------------------


def test_bad_requests_get_typed_errors_and_change_nothing() -> None:
    with LocalCluster(1) as cluster:
        cluster.start_all()
        c = cluster.client(1)
        c.declare(cluster.spec())
        c.commit("job", 0, "nvme", 1)
        before = c.state("job")
        cases: list[tuple[dict[str, Any], str]] = [
            (
                {
                    "op": "commit",
                    "args": {"stream": "job", "rank": 0, "domain": "nvme", "epoch": -1},
                },
                "bad_request",
            ),
            (
                {
                    "op": "commit",
                    "args": {"stream": "job", "rank": 9, "domain": "nvme", "epoch": 2},
                },
                "unknown_rank",
            ),
            ({"op": "explode", "args": {}}, "unknown_op"),
            ({"op": "commit", "args": {"stream": "job", "extra": 1}}, "bad_request"),
            ({"op": "declare", "args": {"spec": {"name": "job"}}}, "bad_spec"),
            ({"op": "wait", "args": {"stream": "job", "epoch": 1, "timeout": -5}}, "bad_request"),
        ]
        for body, reason in cases:
            with pytest.raises(ApiError) as info:
                c.call(body["op"], **body["args"]) if body["op"] in codec.OPS else _raw(
                    cluster.socket_path(1), body
                )
            assert info.value.reason == reason, (body, info.value)
        # An oversized frame is refused before it is read, and only that client is closed.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(cluster.socket_path(1)))
            s.sendall((1 << 30).to_bytes(4, "big") + b"x" * 100)
            reply = codec.FrameReader().feed(s.recv(65536))[0]
            assert reply["error"]["reason"] == "frame_too_large"
            assert s.recv(65536) == b""
        after = c.state("job")
        assert after == before


def _raw(path: Path, body: dict[str, Any]) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(path))
        s.sendall(codec.encode_frame({"id": 1, **body}))
        reader = codec.FrameReader()
        while True:
            replies = reader.feed(s.recv(65536))
            if replies:
                raise codec.error_from_wire(replies[0]["error"])


# -- signals, reload, start-up errors ------------------------------------------------------


def test_sigterm_answers_in_flight_requests_and_exits_cleanly() -> None:
    with LocalCluster(1) as cluster:
        cluster.start_all()
        c = cluster.client(1)
        c.declare(cluster.spec())
        errors: list[ApiError] = []

        def waiter() -> None:
            try:
                c.wait("job", 100)
            except ApiError as exc:
                errors.append(exc)

        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.2)  # let the wait reach the daemon
        assert t.is_alive()
        assert cluster.kill(1, signal.SIGTERM) == 0
        t.join(timeout=10)
        assert [(e.kind, e.reason) for e in errors] == [(ErrorKind.UNAVAILABLE, "shutting_down")]
        assert not cluster.socket_path(1).exists()
        log = cluster.log(1)
        assert '"reason": "SIGTERM"' in log and '"event": "stopped"' in log


def test_sighup_reloads_peers_and_log_level_and_names_what_needs_a_restart() -> None:
    with LocalCluster(3) as cluster:
        cfg = cluster.configs[0]
        full = cfg.read_text()
        head, _, _ = full.partition("[[peers]]")
        node2 = full[full.index("[[peers]]") : full.index("[[peers]]", full.index("[[peers]]") + 1)]
        cfg.write_text(head + node2)  # node-1 knows node-2 only
        cluster.start_all()
        c1 = cluster.client(1)
        assert [p["id"] for p in c1.status()["peers"]] == ["node-2"]
        # All peers back, a new log level, and a tick change that needs a restart.
        cfg.write_text(full.replace("tick_ms = 20", 'tick_ms = 25\nlog_level = "debug"'))
        cluster.procs[1].send_signal(signal.SIGHUP)
        until(
            lambda: any(p["connected"] for p in c1.status()["peers"] if p["id"] == "node-3"),
            what="node-3 linked after reload",
        )
        log = cluster.log(1)
        assert "configuration reloaded" in log
        assert "need a restart" in log and "tick_ms" in log
        # A broken file on reload is reported and the running configuration kept.
        cfg.write_text("node_id = 12\n")
        cluster.procs[1].send_signal(signal.SIGHUP)
        until(lambda: "reload failed" in cluster.log(1), what="reload failure logged")
        assert c1.status()["node"] == "node-1"


def test_a_second_daemon_on_the_same_state_directory_refuses_to_start() -> None:
    import subprocess
    import sys

    with LocalCluster(1) as cluster:
        cluster.start_all()
        proc = subprocess.run(
            [sys.executable, "-m", "convergenced.cli", "run", "--config", str(cluster.configs[0])],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 1
        assert "another convergenced already uses this state directory" in proc.stderr
        assert cluster.client(1).status()["node"] == "node-1"  # the first one is unharmed


def test_the_log_is_compacted_as_it_grows_and_replays_after_kill_9() -> None:
    with LocalCluster(1, extra="wal_compact_bytes = 65536") as cluster:
        cluster.start_all()
        c = cluster.client(1)
        c.declare(cluster.spec(retention=5))
        for e in range(1, 1501):
            c.commit("job", 0, "nvme", e)
        safe = _epochs(c.state("job")["safe_to_delete"])
        for e in sorted(safe)[:1000]:
            c.retire("job", 0, "nvme", e)
        before = c.state("job")
        assert c.status()["counters"].get("wal_compactions", 0) >= 1
        wal = cluster.dir / "node-1" / "state" / "facts.wal"
        assert wal.stat().st_size < 65536 * 2
        cluster.kill(1, signal.SIGKILL)
        cluster.start(1)
        c = cluster.client(1)
        after = c.state("job")
        for key in ("recoverable", "restore_point", "high_water", "newest", "safe_to_delete"):
            assert after[key] == before[key], key
        with pytest.raises(ApiError) as info:  # retired epochs stay retired
            c.commit("job", 0, "nvme", min(safe))
        assert info.value.reason == "retired"
