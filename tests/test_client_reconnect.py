"""The blocking client through daemon restarts, against a fake daemon on a real Unix
socket and a virtual clock (`fake_daemon`): unanswered requests are sent again once
reconnected, after the declarations and the hooks; backoff and the bound; a wait keeps
its timeout; commit_nowait answers and watches survive; reconnecting off or refused
for good fails at once."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_daemon import DIE, SILENT, FakeClock, FakeDaemon, answer_everything

from convergenced.client import Client, DaemonUnreachable, Reconnected
from convergenced.client_protocol import RECONNECT_ENV, reconnect_bound
from convergenced.core import local_api_codec as codec
from convergenced.core.local_api_codec import ApiError, ErrorKind

SPEC = {
    "name": "job",
    "members": {"node-1": [0]},
    "policy": {"mode": "all", "domains": ["nvme"]},
    "retention": 0,
}


@pytest.fixture
def sock_path() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="cvg-", dir="/tmp") as d:
        yield Path(d) / "fake.sock"


def within(fn: Callable[[], Any], seconds: float = 20.0) -> Any:
    """Run ``fn`` on a thread; fail (instead of hanging) if it does not return."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(("ok", fn()))
        except BaseException as exc:
            out.append(("raised", exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"{fn} did not return within {seconds} s"
    kind, value = out[0]
    if kind == "raised":
        raise value
    return value


def dies_at_first(op_name: str, restart_after: float, clock: FakeClock) -> Any:
    """An answer that dies at the first ``op_name`` and comes back ``restart_after``
    virtual seconds later; everything else is acknowledged."""
    died = threading.Event()

    def answer(daemon: FakeDaemon, op: str, args: dict[str, Any]) -> Any:
        if op == op_name and not died.is_set():
            died.set()
            clock.at(restart_after, daemon.start)
            return DIE
        return answer_everything(daemon, op, args)

    return answer


def test_a_request_in_flight_is_sent_again_after_the_declarations_and_the_hooks(
    sock_path: Path,
) -> None:
    clock = FakeClock()
    daemon = FakeDaemon(sock_path, dies_at_first("commit", 0.3, clock))
    daemon.start()
    c = Client(sock_path, reconnect=30, clock=clock.now, sleep=clock.sleep)
    told: list[Reconnected] = []

    def hook(info: Reconnected) -> None:
        told.append(info)
        c.commit("job", 0, "nvme", 1)  # the hook's own calls go through

    c.add_reconnect_hook(hook)
    c.declare(SPEC)
    ack = within(lambda: c.commit("job", 0, "nvme", 5, digest="sha256:ab", size=3))
    assert ack == {"stream": "job", "epoch": 5, "durable": True}
    assert daemon.ops(0) == ["declare", "commit"]
    assert daemon.ops(1) == ["status", "declare", "commit", "commit"]
    assert daemon.connections[1][3] == (
        "commit",
        {
            "stream": "job",
            "rank": 0,
            "domain": "nvme",
            "epoch": 5,
            "digest": "sha256:ab",
            "size": 3,
        },
    )
    assert told == [Reconnected(None, 2, pytest.approx(0.35))]
    assert clock.sleeps == pytest.approx([0.05, 0.1, 0.2])  # 0.35 s: back after 0.3 s
    c.close()
    daemon.die()


def test_backoff_doubles_to_one_second_and_gives_up_at_the_bound_naming_the_socket(
    sock_path: Path,
) -> None:
    clock = FakeClock()
    daemon = FakeDaemon(sock_path, lambda d, op, a: DIE)
    daemon.start()
    c = Client(sock_path, reconnect=5, clock=clock.now, sleep=clock.sleep)
    with pytest.raises(DaemonUnreachable) as info:
        within(lambda: c.state("job"))
    assert clock.sleeps == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8, 1, 1, 1, 0.45])
    assert sum(clock.sleeps) == pytest.approx(5)  # never past the bound
    message = str(info.value)
    assert f"cannot reach the daemon at {sock_path}: tried to reconnect for 5.0 s" in message
    assert "10 attempts, reconnect bound 5 s" in message
    # The next call tries again, for a bound of its own: the daemon is back.
    daemon.answer = answer_everything
    clock.at(0.1, daemon.start)
    assert within(lambda: c.wait("job", 3)) == {"stream": "job", "restore_point": 3}
    c.close()
    daemon.die()


def test_calls_in_flight_or_waiting_when_the_bound_passes_raise_without_trying_again(
    sock_path: Path,
) -> None:
    clock = FakeClock()
    daemon = FakeDaemon(sock_path, lambda d, op, a: SILENT)
    daemon.start()
    c = Client(sock_path, reconnect=1, clock=clock.now, sleep=None)
    errors: list[BaseException] = []

    def call(fn: Callable[[], Any]) -> threading.Thread:
        def run() -> None:
            try:
                fn()
            except DaemonUnreachable as exc:
                errors.append(exc)

        t = threading.Thread(target=run)
        t.start()
        return t

    in_flight = call(c.streams)
    within(lambda: _until(lambda: len(daemon.held) == 1))
    waiting: list[threading.Thread] = []

    def sleep(seconds: float) -> None:
        if not waiting:  # the first pause: a call arrives while the client reconnects
            waiting.append(call(lambda: c.state("job")))
            _until(lambda: c._connection.waiting == 1)
        clock.sleep(seconds)

    c._connection._sleep = sleep
    daemon.die()
    in_flight.join(20)  # it ends after the first pause, so `waiting` is filled by then
    for t in waiting:
        t.join(20)
    assert len(waiting) == 1 and not in_flight.is_alive() and not waiting[0].is_alive()
    assert len(errors) == 2 and all("tried to reconnect for 1.0 s" in str(e) for e in errors)
    assert sum(clock.sleeps) == pytest.approx(1)  # one outage: the waiting call began none
    c.close()


def test_a_wait_sent_again_keeps_what_is_left_of_its_timeout(sock_path: Path) -> None:
    clock = FakeClock()
    daemon = FakeDaemon(sock_path, dies_at_first("wait", 2.0, clock))
    daemon.start()
    c = Client(sock_path, reconnect=30, clock=clock.now, sleep=clock.sleep)
    within(lambda: c.wait("job", 7, timeout=10))
    first, again = daemon.connections[0][-1][1], daemon.connections[1][-1][1]
    assert first["timeout"] == 10
    assert again["timeout"] == pytest.approx(10 - sum(clock.sleeps))
    assert sum(clock.sleeps) >= 2
    c.close()
    daemon.die()


def test_commit_nowait_answers_pending_at_the_restart_still_come(sock_path: Path) -> None:
    clock = FakeClock()
    daemon = FakeDaemon(sock_path, lambda d, op, a: SILENT)
    daemon.start()
    c = Client(sock_path, reconnect=30, clock=clock.now, sleep=clock.sleep)
    pending = [c.commit_nowait("job", 0, "nvme", e) for e in (1, 2, 3)]
    within(lambda: _until(lambda: len(daemon.held) == 3))
    daemon.answer = answer_everything
    clock.at(0.1, daemon.start)
    daemon.die()
    assert [within(lambda p=p: p.result(timeout=20))["epoch"] for p in pending] == [1, 2, 3]
    assert daemon.ops(1) == ["status", "commit", "commit", "commit"]
    assert not c._connection.requests  # answered one-shot requests are forgotten
    c.close()
    daemon.die()


def test_a_watch_is_subscribed_again_without_repeating_its_last_event(sock_path: Path) -> None:
    clock = FakeClock()
    states = iter([{"restore_point": 1}, {"restore_point": 1}, {"restore_point": 2}])
    daemon = FakeDaemon(sock_path, lambda d, op, a: SILENT)
    daemon.start()
    c = Client(sock_path, reconnect=30, clock=clock.now, sleep=clock.sleep)
    events = c.watch("job")

    def serve_watch() -> None:
        _until(lambda: len(daemon.held) == 1)
        sock, rid, _, _ = daemon.held.pop()
        daemon.reply(sock, rid, next(states), event=True)

    threading.Thread(target=serve_watch, daemon=True).start()
    assert within(lambda: next(events)) == {"restore_point": 1}
    clock.at(0.1, daemon.start)
    daemon.die()  # the watch is sent again on the new connection

    def serve_again() -> None:
        _until(lambda: len(daemon.held) == 1)
        sock, rid, _, _ = daemon.held.pop()
        daemon.reply(sock, rid, next(states), event=True)  # the same state: skipped
        daemon.reply(sock, rid, next(states), event=True)

    threading.Thread(target=serve_again, daemon=True).start()
    assert within(lambda: next(events)) == {"restore_point": 2}
    assert daemon.ops(1) == ["status", "watch"]
    events.close()
    within(lambda: _until(lambda: daemon.ops(1)[-1:] == ["cancel"]))
    c.close()
    daemon.die()


def test_a_reply_saying_the_daemon_shuts_down_is_answered_by_its_next_life(
    sock_path: Path,
) -> None:
    clock = FakeClock()

    def answer(daemon: FakeDaemon, op: str, args: dict[str, Any]) -> Any:
        if daemon.incarnation == 1:
            clock.at(0.1, daemon.start)
            threading.Timer(0.05, daemon.die).start()
            return ApiError(ErrorKind.UNAVAILABLE, "shutting_down", "the daemon is stopping")
        return answer_everything(daemon, op, args)

    daemon = FakeDaemon(sock_path, answer)
    daemon.start()
    c = Client(sock_path, reconnect=30, clock=clock.now, sleep=clock.sleep)
    assert within(lambda: c.retract("job", 0, "nvme", 4))["epoch"] == 4
    c.close()
    daemon.die()


def test_without_reconnecting_a_lost_connection_fails_every_call_at_once(
    sock_path: Path,
) -> None:
    daemon = FakeDaemon(sock_path, lambda d, op, a: DIE)
    daemon.start()
    c = Client(sock_path, reconnect=0)
    with pytest.raises(DaemonUnreachable, match="the daemon closed the connection"):
        within(lambda: c.state("job"))
    daemon.start()  # back, but this client does not try again
    with pytest.raises(DaemonUnreachable, match="the daemon closed the connection"):
        within(c.status)
    c.close()
    daemon.die()


def test_a_daemon_that_refuses_us_for_good_is_not_tried_again(sock_path: Path) -> None:
    clock = FakeClock()
    daemon = FakeDaemon(sock_path)
    daemon.start()
    c = Client(sock_path, reconnect=30, clock=clock.now, sleep=clock.sleep)
    within(lambda: _until(lambda: bool(daemon._socks)))
    sock = daemon._socks[0]
    refused = ApiError(ErrorKind.REJECTED, "not_allowed", "uid 1000 is not allowed")
    sock.sendall(codec.encode_frame(codec.error(None, refused)))
    sock.close()
    with pytest.raises(DaemonUnreachable, match="not allowed"):
        within(c.status)
    assert clock.sleeps == []
    c.close()
    daemon.die()


def test_the_bound_comes_from_the_argument_else_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(RECONNECT_ENV, raising=False)
    assert reconnect_bound() == 60
    monkeypatch.setenv(RECONNECT_ENV, "2.5")
    assert reconnect_bound() == 2.5
    assert reconnect_bound(0) == 0
    monkeypatch.setenv(RECONNECT_ENV, "soon")
    with pytest.raises(ValueError, match=r"\$CONVERGENCED_RECONNECT_S='soon'"):
        reconnect_bound()
    with pytest.raises(ValueError, match="reconnect=-1"):
        reconnect_bound(-1)
    with pytest.raises(ValueError, match="reconnect=inf"):
        reconnect_bound(float("inf"))


def _until(predicate: Callable[[], bool]) -> None:
    while not predicate():
        threading.Event().wait(0.005)
