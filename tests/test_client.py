"""The clients against a real daemon process: `Client` shared by many threads, the
trio `AsyncClient`, and `convergenced cluster`'s command line."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from daemons import LocalCluster

from convergenced import cli
from convergenced.client import ApiError, AsyncClient, Client, DaemonUnreachable, ErrorKind


@pytest.fixture(scope="module")
def solo() -> Iterator[LocalCluster]:
    with LocalCluster(1) as cluster:
        cluster.start_all()
        yield cluster


def _spec(name: str, ranks: int = 1) -> dict[str, object]:
    return {
        "name": name,
        "members": {"node-1": list(range(ranks))},
        "policy": {"mode": "all", "domains": ["nvme"]},
        "retention": 0,
    }


def test_one_client_shared_by_many_threads(solo: LocalCluster) -> None:
    c = solo.client(1)
    c.declare(_spec("threads", ranks=8))
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            for e in range(1, 26):
                assert c.commit("threads", r, "nvme", e)["durable"] is True
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(8)]
    waiter = threading.Thread(target=lambda: c.wait("threads", 25, timeout=20))
    waiter.start()  # a long wait in one thread holds up no commit in another
    for t in threads:
        t.start()
    for t in [*threads, waiter]:
        t.join(timeout=30)
    assert not errors
    assert c.state("threads")["restore_point"] == 25


def test_commit_nowait_returns_at_once_and_its_answer_is_collected_later(
    solo: LocalCluster,
) -> None:
    with Client(solo.socket_path(1)) as c:
        c.declare(_spec("nowait", ranks=2))
        pending = [c.commit_nowait("nowait", r, "nvme", e) for e in range(1, 21) for r in (0, 1)]
        assert pending[-1].result(timeout=10)["durable"] is True
        assert all(p.result(timeout=10)["durable"] for p in pending)
        assert all(p.done() for p in pending)
        assert c.state("nowait")["restore_point"] == 20
        # Answered one-shot requests are forgotten by the reader, collected or not.
        never_collected = c.commit_nowait("nowait", 0, "nvme", 21)
        deadline = time.monotonic() + 10
        while not never_collected.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert never_collected.done() and not c._connection.requests
        # A refusal surfaces when the answer is collected.
        refused = c.commit_nowait("no-such-stream", 0, "nvme", 1)
        with pytest.raises(ApiError) as err:
            refused.result(timeout=10)
        assert err.value.kind is ErrorKind.REJECTED
        assert c.state("nowait")["recoverable"] == [[1, 20]]


def test_commit_nowait_on_a_lost_connection_raises_when_collected(tmp_path: Path) -> None:
    with LocalCluster(1) as cluster:
        cluster.start_all()
        c = cluster.client(1)
        c.declare(_spec("lost"))
        cluster.kill(1)
        with pytest.raises(DaemonUnreachable):
            # Either the send fails, or the answer never comes: both say why.
            c.commit_nowait("lost", 0, "nvme", 1).result(timeout=10)


def test_unreachable_socket_raises_daemon_unreachable(tmp_path: Path) -> None:
    with pytest.raises(DaemonUnreachable, match="cannot reach the daemon"):
        Client(tmp_path / "nobody.sock")


async def test_async_client_does_everything_the_blocking_one_does(solo: LocalCluster) -> None:
    async with AsyncClient.connect(solo.socket_path(1)) as c:
        # Retention 1: the retraction below may roll the restore point back to 1.
        assert (await c.declare({**_spec("async"), "retention": 1}))["stream"] == "async"
        assert "async" in await c.streams()
        assert (await c.status())["node"] == "node-1"
        seen: list[int | None] = []

        async def watch() -> None:
            async with c.watch("async") as events:
                async for ev in events:
                    seen.append(ev["restore_point"])
                    if ev["restore_point"] == 2:
                        return

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch)
                await c.commit("async", 0, "nvme", 1)
                await c.commit("async", 0, "nvme", 2)
                assert (await c.wait("async", 2))["restore_point"] == 2
        assert seen[-1] == 2
        with pytest.raises(ApiError) as info:
            await c.wait("async", 99, timeout=0.05)
        assert info.value.kind is ErrorKind.TIMEOUT
        await c.retract("async", 0, "nvme", 2)
        assert (await c.state("async"))["restore_point"] == 1
        answer = await c.restore_point("async", 1, timeout=10)
        assert answer["resolved"] and answer["restore_point"] == 1
        with pytest.raises(ApiError) as info:
            await c.retire("async", 0, "nvme", 1)
        assert info.value.reason == "not_safe_to_delete"


async def test_async_client_unreachable(tmp_path: Path) -> None:
    with pytest.raises(DaemonUnreachable):
        async with AsyncClient.connect(tmp_path / "nobody.sock"):
            pass  # pragma: no cover


def test_cluster_command_writes_valid_configs_and_refuses_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = Path("/tmp") / f"cvg-cli-{tmp_path.name[-8:]}"
    assert cli.main(["cluster", "--nodes", "3", "--dir", str(d), "--base-port", "31000"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"convergenced run --config {d}/node-{i}.toml" for i in (1, 2, 3)]
    text = (d / "node-2.toml").read_text()
    assert 'listen = "127.0.0.1:31001"' in text and 'id = "node-1"' in text
    assert cli.main(["cluster", "--nodes", "0", "--dir", str(d)]) == 2
    assert "--nodes 0" in capsys.readouterr().err
    assert cli.main(["cluster", "--nodes", "2", "--dir", str(d), "--base-port", "65535"]) == 2
    deep = tmp_path / ("x" * 90)
    assert cli.main(["cluster", "--nodes", "1", "--dir", str(deep)]) == 2
    assert "use a shorter --dir" in capsys.readouterr().err


async def test_abandoned_async_calls_are_cancelled_on_the_daemon(solo: LocalCluster) -> None:
    async with AsyncClient.connect(solo.socket_path(1)) as c:
        await c.declare(_spec("abandon"))
        for _ in range(300):  # more than the connection's 256 request slots
            with trio.move_on_after(0.001):
                await c.wait("abandon", 10**9)
        with trio.fail_after(10):
            assert (await c.status())["node"] == "node-1"


def test_a_declaration_with_more_members_than_the_limit_is_refused() -> None:
    with LocalCluster(1) as cluster:
        cfg = cluster.configs[0]
        cfg.write_text(cfg.read_text() + "\n[limits]\nmax_members = 2\n")
        cluster.start_all()
        c = cluster.client(1)
        spec = {
            "name": "big",
            "members": {"node-1": [0], "n2": [1], "n3": [2]},
            "policy": {"mode": "all", "domains": ["nvme"]},
        }
        with pytest.raises(ApiError) as info:
            c.declare(spec)
        assert info.value.reason == "too_many_members"
        assert c.streams() == []
