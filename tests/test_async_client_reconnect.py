"""The trio client through daemon restarts, under trio's MockClock: a fake daemon in the
same trio run, on a real Unix socket, dies and comes back; unanswered requests are sent
again once reconnected, after the declarations and the hooks; backoff and the bound; a
wait keeps its timeout; a watch is subscribed again; reconnecting off fails at once."""

from __future__ import annotations

import socket
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from convergenced.client import AsyncClient, DaemonUnreachable, Reconnected
from convergenced.core import local_api_codec as codec

SPEC = {
    "name": "job",
    "members": {"node-1": [0]},
    "policy": {"mode": "all", "domains": ["nvme"]},
    "retention": 0,
}
DIE = object()
SILENT = object()
Answer = Callable[["Daemon", str, dict[str, Any]], Any]


def acknowledge(daemon: Daemon, op: str, args: dict[str, Any]) -> Any:
    if op in ("commit", "retract", "retire"):
        return {"stream": args["stream"], "epoch": args["epoch"], "durable": True}
    if op == "wait":
        return {"stream": args["stream"], "restore_point": args["epoch"]}
    return {"restore_point": 1}


class Daemon:
    """A fake daemon: each life listens at ``path`` until `die`."""

    def __init__(self, path: Path, nursery: trio.Nursery, answer: Answer = acknowledge) -> None:
        self.path = path
        self.nursery = nursery
        self.answer = answer
        self.incarnation = 0
        self.connections: list[list[tuple[str, dict[str, Any]]]] = []
        self.held: list[tuple[trio.SocketStream, int]] = []
        self._scope: trio.CancelScope | None = None

    def ops(self, connection: int = -1) -> list[str]:
        return [op for op, _ in self.connections[connection]]

    async def start(self) -> None:
        self.incarnation += 1
        # Bound here, not with trio's bind: that runs in a thread, and the MockClock
        # would jump while it does.
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.bind(str(self.path))
        raw.listen(16)
        sock = trio.socket.from_stdlib_socket(raw)
        await trio.lowlevel.checkpoint()
        self._scope = trio.CancelScope()
        self.nursery.start_soon(self._run, trio.SocketListener(sock), self._scope)

    def die(self) -> None:
        """Every connection and the socket go, unanswered."""
        assert self._scope is not None
        self._scope.cancel()
        self.path.unlink(missing_ok=True)
        self.held.clear()

    async def _run(self, listener: trio.SocketListener, scope: trio.CancelScope) -> None:
        with scope:
            async with listener, trio.open_nursery() as nursery:
                while True:
                    stream = await listener.accept()
                    nursery.start_soon(self._serve, stream)

    async def _serve(self, stream: trio.SocketStream) -> None:
        seen: list[tuple[str, dict[str, Any]]] = []
        self.connections.append(seen)
        reader = codec.FrameReader()
        async with stream:
            while data := await stream.receive_some(65536):
                for frame in reader.feed(data):
                    rid, op, args = frame["id"], frame["op"], dict(frame.get("args", {}))
                    seen.append((op, args))
                    if op == "status":
                        result: Any = {"node": "node-1", "incarnation": self.incarnation}
                    elif op == "declare":
                        result = {"stream": args["spec"]["name"], "digest": "00"}
                    elif op == "cancel":
                        continue
                    else:
                        result = self.answer(self, op, args)
                    if result is DIE:
                        self.die()
                        return
                    if result is SILENT:
                        self.held.append((stream, rid))
                        continue
                    await self.reply(stream, rid, result, event=op == "watch")

    @staticmethod
    async def reply(stream: trio.SocketStream, rid: int, result: Any, *, event: bool) -> None:
        frame = codec.event(rid, result) if event else codec.ok(rid, result)
        await stream.send_all(codec.encode_frame(frame))


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


@pytest.fixture
def sock_path() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="cvg-", dir="/tmp") as d:
        yield Path(d) / "fake.sock"


def back_after(seconds: float, daemon: Daemon) -> Callable[[], Awaitable[None]]:
    async def later() -> None:
        await trio.sleep(seconds)
        await daemon.start()

    return later


async def test_a_call_in_flight_is_sent_again_after_the_declarations_and_the_hooks(
    autojump_clock: trio.testing.MockClock, sock_path: Path
) -> None:
    with trio.fail_after(100):  # virtual seconds: a hang fails at once
        async with trio.open_nursery() as nursery:
            died: list[bool] = []

            def answer(daemon: Daemon, op: str, args: dict[str, Any]) -> Any:
                if op == "commit" and not died:
                    died.append(True)
                    nursery.start_soon(back_after(0.3, daemon))
                    return DIE
                return acknowledge(daemon, op, args)

            daemon = Daemon(sock_path, nursery, answer)
            await daemon.start()
            told: list[tuple[Reconnected, float]] = []

            async with AsyncClient.connect(sock_path, reconnect=30) as c:

                async def hook(info: Reconnected) -> None:
                    told.append((info, trio.current_time()))
                    await c.commit("job", 0, "nvme", 1)  # the hook's own calls go through

                c.add_reconnect_hook(hook)
                await c.declare(SPEC)
                started = trio.current_time()
                ack = await c.commit("job", 0, "nvme", 5, digest="sha256:ab", size=3)
                assert ack == {"stream": "job", "epoch": 5, "durable": True}
                # Attempts at 0, 0.05, 0.15, 0.35 s: back after 0.3 s.
                assert trio.current_time() - started == pytest.approx(0.35)
            assert daemon.ops(0) == ["declare", "commit"]
            assert daemon.ops(1) == ["status", "declare", "commit", "commit"]
            assert daemon.connections[1][3][1]["digest"] == "sha256:ab"
            assert [info for info, _ in told] == [Reconnected(None, 2, pytest.approx(0.35))]
            nursery.cancel_scope.cancel()


async def test_the_bound_passes_naming_the_socket_then_a_later_call_tries_again(
    autojump_clock: trio.testing.MockClock, sock_path: Path
) -> None:
    with trio.fail_after(100):  # virtual seconds: a hang fails at once
        async with trio.open_nursery() as nursery:
            daemon = Daemon(sock_path, nursery, lambda d, op, a: DIE)
            await daemon.start()
            async with AsyncClient.connect(sock_path, reconnect=5) as c:
                started = trio.current_time()
                with pytest.raises(DaemonUnreachable) as info:
                    await c.state("job")
                assert trio.current_time() - started == pytest.approx(5)  # never past the bound
                message = str(info.value)
                assert (
                    f"cannot reach the daemon at {sock_path}: tried to reconnect for 5.0 s"
                    in message
                )
                assert "10 attempts, reconnect bound 5 s" in message
                daemon.answer = acknowledge
                nursery.start_soon(back_after(0.1, daemon))
                assert (await c.wait("job", 3))["restore_point"] == 3
            nursery.cancel_scope.cancel()


async def test_a_wait_sent_again_keeps_what_is_left_of_its_timeout(
    autojump_clock: trio.testing.MockClock, sock_path: Path
) -> None:
    with trio.fail_after(100):  # virtual seconds: a hang fails at once
        async with trio.open_nursery() as nursery:
            died: list[bool] = []

            def answer(daemon: Daemon, op: str, args: dict[str, Any]) -> Any:
                if not died:
                    died.append(True)
                    nursery.start_soon(back_after(2.0, daemon))
                    return DIE
                return acknowledge(daemon, op, args)

            daemon = Daemon(sock_path, nursery, answer)
            await daemon.start()
            async with AsyncClient.connect(sock_path, reconnect=30) as c:
                started = trio.current_time()
                await c.wait("job", 7, timeout=10)
                outage = trio.current_time() - started
            assert outage >= 2
            assert daemon.connections[0][-1][1]["timeout"] == 10
            assert daemon.connections[1][-1][1]["timeout"] == pytest.approx(10 - outage)
            nursery.cancel_scope.cancel()


async def test_a_watch_is_subscribed_again_without_repeating_its_last_event(
    autojump_clock: trio.testing.MockClock, sock_path: Path
) -> None:
    with trio.fail_after(100):  # virtual seconds: a hang fails at once
        async with trio.open_nursery() as nursery:
            daemon = Daemon(sock_path, nursery, lambda d, op, a: SILENT)
            await daemon.start()
            async with AsyncClient.connect(sock_path, reconnect=30) as c:
                async with c.watch("job") as events:
                    await trio.testing.wait_all_tasks_blocked()
                    stream, rid = daemon.held[0]
                    await Daemon.reply(stream, rid, {"restore_point": 1}, event=True)
                    assert await events.__anext__() == {"restore_point": 1}
                    daemon.die()
                    nursery.start_soon(back_after(0.1, daemon))
                    while not daemon.held:
                        await trio.sleep(0.01)
                    stream, rid = daemon.held[0]
                    await Daemon.reply(stream, rid, {"restore_point": 1}, event=True)  # skipped
                    await Daemon.reply(stream, rid, {"restore_point": 2}, event=True)
                    assert await events.__anext__() == {"restore_point": 2}
                while daemon.ops(1)[-1] != "cancel":  # leaving the block ends the watch
                    await trio.sleep(0.01)
                assert daemon.ops(1) == ["status", "watch", "cancel"]
            nursery.cancel_scope.cancel()


async def test_without_reconnecting_a_lost_connection_fails_every_call_at_once(
    autojump_clock: trio.testing.MockClock, sock_path: Path
) -> None:
    with trio.fail_after(100):  # virtual seconds: a hang fails at once
        async with trio.open_nursery() as nursery:
            daemon = Daemon(sock_path, nursery, lambda d, op, a: DIE)
            await daemon.start()
            async with AsyncClient.connect(sock_path, reconnect=0) as c:
                started = trio.current_time()
                with pytest.raises(DaemonUnreachable, match="the daemon closed the connection"):
                    await c.state("job")
                await daemon.start()  # back, but this client does not try again
                with pytest.raises(DaemonUnreachable, match="the daemon closed the connection"):
                    await c.status()
                assert trio.current_time() == started
            nursery.cancel_scope.cancel()


async def test_an_exception_in_the_client_block_is_not_swallowed(
    autojump_clock: trio.testing.MockClock, sock_path: Path
) -> None:
    # Closing the connection at the end of the block used to raise Cancelled (the
    # client's nursery was cancelled first), which replaced the block's exception.
    with trio.fail_after(100):
        async with trio.open_nursery() as nursery:
            daemon = Daemon(sock_path, nursery)
            await daemon.start()
            with pytest.raises(KeyError):
                async with AsyncClient.connect(sock_path) as c:
                    await c.status()
                    raise KeyError("from the block")
            nursery.cancel_scope.cancel()


async def test_calls_on_one_connection_share_writes_and_a_cancelled_one_cuts_no_frame(
    autojump_clock: trio.testing.MockClock, sock_path: Path
) -> None:
    # Frames are queued and one writer task sends what is queued in one write, so a
    # caller cancelled at any point leaves every frame whole, its cancel after it.
    with trio.fail_after(100):
        async with trio.open_nursery() as nursery:
            slow: list[int] = []

            def answer(daemon: Daemon, op: str, args: dict[str, Any]) -> Any:
                if args.get("epoch", 0) % 3 == 0:
                    slow.append(args["epoch"])
                    return SILENT  # never answered: its caller is cancelled
                return acknowledge(daemon, op, args)

            daemon = Daemon(sock_path, nursery, answer)
            await daemon.start()
            async with AsyncClient.connect(sock_path, reconnect=0) as c:
                acks: list[int] = []

                async def commit(epoch: int) -> None:
                    with trio.move_on_after(0.01 * (epoch % 5)):
                        acks.append((await c.commit("job", 0, "nvme", epoch))["epoch"])

                async with trio.open_nursery() as callers:
                    for epoch in range(1, 301):
                        callers.start_soon(commit, epoch)
                assert (await c.status())["incarnation"] == 1  # the stream is whole
            seen = daemon.connections[0]
            commits = [a["epoch"] for op, a in seen if op == "commit"]
            # Each once and none cut, but those cancelled before their first
            # checkpoint (a zero timeout), which are not sent at all.
            assert sorted(commits) == [e for e in range(1, 301) if e % 5]
            assert sorted(acks) == [e for e in range(1, 301) if e % 3 and e % 5]
            # Ids are given in the order requests are queued, so the n-th frame the
            # daemon read has id n: every cancel comes after the request it cancels.
            for n, (op, a) in enumerate(seen, start=1):
                if op == "cancel":
                    assert seen[a["target"] - 1][0] == "commit" and a["target"] < n
            assert sum(op == "cancel" for op, _ in seen) == len(slow)
            nursery.cancel_scope.cancel()
