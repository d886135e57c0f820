"""`convergencectl` against real daemons on loopback.

Most cases call `convergenced.ctl.main` in-process (capsys holds its output); a few
run it as a real process to check exit codes, Ctrl-C and closed pipes. One 2-node
cluster serves the whole module (node-1 hosts rank 0, node-2 rank 1); each test
declares its own stream, so tests do not see each other's facts.

``tests/`` is not a package and pytest puts it on ``sys.path`` (rootdir-relative
"prepend" import mode), hence ``from daemons import ...``.
"""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemons import LocalCluster, interruptible

from convergenced.client import Client
from convergenced.ctl import format_duration, format_intervals, main

_names = itertools.count(1)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(2) as c:
        c.start_all()
        wait_connected(c)
        yield c


def wait_connected(c: LocalCluster) -> None:
    """Return once every node has a link to every peer."""
    deadline = time.monotonic() + 10
    for i in range(1, c.n + 1):
        with Client(c.socket_path(i)) as client:
            while not all(p["connected"] for p in client.status()["peers"]):
                assert time.monotonic() < deadline, client.status()
                time.sleep(0.01)


@pytest.fixture
def c1(cluster: LocalCluster) -> Iterator[Client]:
    with Client(cluster.socket_path(1)) as client:
        yield client


@pytest.fixture
def c2(cluster: LocalCluster) -> Iterator[Client]:
    with Client(cluster.socket_path(2)) as client:
        yield client


@pytest.fixture
def stream(cluster: LocalCluster, c1: Client, c2: Client) -> str:
    """A fresh stream declared on both nodes (all of [nvme], retention 0)."""
    name = f"s{next(_names)}"
    c1.declare(cluster.spec(name))
    c2.declare(cluster.spec(name))
    return name


class Ctl:
    """Runs `main` in-process against one node and returns (code, stdout, stderr)."""

    def __init__(self, cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
        self.cluster = cluster
        self.capsys = capsys

    def __call__(self, *argv: str, node: int = 1) -> tuple[int, str, str]:
        self.capsys.readouterr()
        code = main(["--socket", str(self.cluster.socket_path(node)), *argv])
        out, err = self.capsys.readouterr()
        return code, out, err

    def json(self, *argv: str, node: int = 1) -> Any:
        code, out, err = self(*argv, "--json", node=node)
        assert (code, err) == (0, ""), err
        assert out.count("\n") == 1, out
        result = json.loads(out)
        assert out == json.dumps(result, sort_keys=True) + "\n"
        return result


@pytest.fixture
def ctl(cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> Ctl:
    return Ctl(cluster, capsys)


def commit_both(c1: Client, c2: Client, stream: str, epochs: range) -> None:
    for e in epochs:
        c1.commit(stream, 0, "nvme", e)
        c2.commit(stream, 1, "nvme", e)


def run_ctl(*argv: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "convergenced.ctl", *argv],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        **kwargs,
    )


# -- formatting and help ------------------------------------------------------------------


def test_intervals_and_durations_read_like_prose() -> None:
    assert format_intervals([[1, 5], [7, 7]]) == "1-5, 7"
    assert format_intervals([]) == "none"
    assert format_intervals(None) == "unknown"
    assert format_duration(4.25) == "4.2 s"
    assert format_duration(303) == "5 min 3 s"
    assert format_duration(7500) == "2 h 5 min"
    assert format_duration(3 * 86400 + 4 * 3600) == "3 d 4 h"


def test_help_states_exit_codes_and_socket_variable(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for text in ("exit codes", "3    daemon unreachable", "$CONVERGENCED_SOCKET", "restore-point"):
        assert text in out
    assert main(["commit", "--help"]) == 0
    assert "--rank R" in capsys.readouterr().out
    assert main([]) == 2
    assert "usage: convergencectl" in capsys.readouterr().err


# -- reads ---------------------------------------------------------------------------------


def test_status_text_and_json(ctl: Ctl, stream: str) -> None:
    code, out, err = ctl("status")
    assert (code, err) == (0, "")
    assert "node     node-1 (cluster local)" in out
    assert "incarnation 1" in out
    assert "1/1 connected: node-2" in out
    assert stream in out
    status = ctl.json("status")
    assert status["node"] == "node-1"
    assert stream in status["streams"]
    # --json is accepted before the subcommand too.
    code, out, _ = ctl("--json", "status", node=2)
    assert code == 0 and json.loads(out)["node"] == "node-2"


def test_socket_defaults_to_the_environment(
    cluster: LocalCluster, stream: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setenv("CONVERGENCED_SOCKET", str(cluster.socket_path(2)))
    assert main(["streams"]) == 0
    assert stream in capsys.readouterr().out.split("\n")


def test_streams_text_and_json(ctl: Ctl, stream: str) -> None:
    code, out, _ = ctl("streams")
    assert code == 0 and stream in out.splitlines()
    assert stream in ctl.json("streams")


def test_state_text_and_json(ctl: Ctl, c1: Client, c2: Client, stream: str) -> None:
    commit_both(c1, c2, stream, range(1, 4))
    c1.commit(stream, 0, "nvme", 6)
    c1.wait(stream, 3, timeout=10)
    code, out, err = ctl("state", stream)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    for expected in (
        f"stream          {stream}",
        "restore point   3",
        "convergence     1-3",
        "recoverable     1-3, 6",
        "missing         none",
        "conflicts       none",
        "membership      0 (the stream's first member map)",
        "members         node-1: 0, node-2: 1",
        "scopes          node-local nvme",
        "generations     none",
        "  member  nvme",
        "  node-1  6",
        "  node-2  3",
    ):
        assert expected in lines, f"{expected!r} not in:\n{out}"
    assert any(line.startswith("knowledge       ") for line in lines)
    assert any(line.startswith("skew            3") for line in lines)
    state = ctl.json("state", stream, node=2)
    assert state["restore_point"] == 3
    assert state["newest"] == {"node-1": {"nvme": 6}, "node-2": {"nvme": 3}}
    assert (state["membership"], state["older_map_generations"], state["moved_on"]) == (0, [], {})


def test_state_shows_the_member_map_in_force_and_generations_of_older_maps() -> None:
    from convergenced.ctl.formatting import format_state

    spec = {"name": "job", "members": {"node-1": [0, 1, 2, 3, 7], "node-4": [4, 5, 6]},
            "policy": {"mode": "any", "domains": ["nvme", "s3"]}, "retention": 0,
            "shared": ["s3"], "membership": 5}  # fmt: skip
    state = {"stream": "job", "spec": spec, "recoverable": [], "convergence": None,
             "proposal": None, "restore_point": None, "knowledge": "incomplete",
             "gc_horizon": None, "safe_to_delete": [], "missing": [], "conflicts": [],
             "newest": {}, "generations": [3, 5], "membership": 5,
             "older_map_generations": [3], "moved_on": {}}  # fmt: skip
    lines = format_state(state).splitlines()
    for expected in (
        "membership      5 (this member map applies from generation 5 on)",
        "members         node-1: 0-3, 7, node-4: 4-6",
        "scopes          shared s3; node-local nvme",
        "generations     5; older member map: 3 (protecting their epochs, never answered again)",
    ):
        assert expected in lines, f"{expected!r} not in {lines}"
    assert not [line for line in lines if line.startswith("moved on")]
    # A node the job left behind: its members declared a newer map.
    behind = state | {
        "membership": 0,
        "spec": spec | {"membership": 0},
        "generations": [],
        "older_map_generations": [],
        "moved_on": {"node-4": 5, "node-1": 5},
    }
    lines = format_state(behind).splitlines()
    assert ("moved on        node-1, node-4 to membership 5 (a member map this node is not "
            "in, or has not declared yet)") in lines  # fmt: skip
    assert "generations     none" in lines


def test_state_of_an_unknown_stream_fails(ctl: Ctl) -> None:
    code, out, err = ctl("state", "no-such-stream")
    assert (code, out) == (1, "")
    assert err.startswith("convergencectl: rejected: ")
    assert "[unknown_stream]" in err


# -- declare -------------------------------------------------------------------------------


def test_declare_inline(ctl: Ctl, c1: Client) -> None:
    args = ("declare", "inl", "--member", "node-1=0", "--member", "node-2=1-3")
    code, out, err = ctl(*args, "--any-of", "s3,nvme", "--retention", "2")
    assert (code, err) == (0, "")
    assert out.startswith("declared inl (spec ")
    spec = c1.state("inl")["spec"]
    assert spec["members"] == {"node-1": [0], "node-2": [1, 2, 3]}
    assert spec["policy"] == {"mode": "any", "domains": ["nvme", "s3"]}
    assert spec["retention"] == 2
    # Idempotent, and the same on every member.
    first = ctl.json(*args, "--any-of", "nvme,s3", "--retention", "2")
    second = ctl.json(*args, "--any-of", "nvme,s3", "--retention", "2", node=2)
    assert first == second


def test_declare_of_a_member_outside_the_cluster_needs_allow_unknown_members(ctl: Ctl) -> None:
    args = ("declare", "spare", "--member", "node-1=0", "--member", "node-9=1", "--all-of", "nvme")
    code, out, err = ctl(*args)
    assert (code, out) == (1, "")
    assert "unknown_member" in err and "node-9" in err
    code, out, err = ctl(*args, "--allow-unknown-members")
    assert (code, err) == (0, "")
    assert out.startswith("declared spare (spec ")


def test_declare_from_json_and_toml_spec_files(ctl: Ctl, tmp_path: Path) -> None:
    spec = {
        "name": "fromfile",
        "members": {"node-1": [0], "node-2": [1]},
        "policy": {"mode": "all", "domains": ["nvme", "s3"]},
        "retention": 4,
    }
    as_json = tmp_path / "job.json"
    as_json.write_text(json.dumps(spec))
    as_toml = tmp_path / "job.toml"
    as_toml.write_text(
        'name = "fromfile"\nretention = 4\n[members]\nnode-1 = [0]\nnode-2 = [1]\n'
        '[policy]\nmode = "all"\ndomains = ["s3", "nvme"]\n'
    )
    by_json = ctl.json("declare", "--spec", str(as_json), node=1)
    by_toml = ctl.json("declare", "--spec", str(as_toml), node=2)
    assert by_json == by_toml
    assert by_json["stream"] == "fromfile"
    # The inline form of the same spec is the same spec.
    inline = ("--member", "node-1=0", "--member", "node-2=1", "--all-of", "nvme,s3")
    assert ctl.json("declare", "fromfile", *inline, "--retention", "4") == by_json


def test_declare_with_shared_domains_and_a_membership(ctl: Ctl, c1: Client, tmp_path: Path) -> None:
    members = ("--member", "node-1=0", "--member", "node-2=1")
    args = ("declare", "moved", *members, "--any-of", "nvme,s3", "--shared", "s3")
    code, _, err = ctl(*args, "--membership", "3")
    assert (code, err) == (0, "")
    state = c1.state("moved")
    assert (state["spec"]["shared"], state["membership"]) == (["s3"], 3)
    # A launcher's spec file holds the map; the generation comes from next-generation.
    spec = {"name": "moved", "members": {"node-1": [0], "node-2": [1]}, "retention": 0,
            "policy": {"mode": "any", "domains": ["nvme", "s3"]}, "shared": ["s3"]}  # fmt: skip
    path = tmp_path / "moved.json"
    path.write_text(json.dumps(spec))
    by_file = ctl.json("declare", "--spec", str(path), "--membership", "3", node=2)
    assert by_file == ctl.json(*args, "--membership", "3")
    code, _, err = ctl("declare", "--spec", str(path), "--shared", "s3")
    assert code == 2 and "--spec excludes" in err


def test_conflicting_declare_fails(ctl: Ctl, stream: str) -> None:
    code, out, err = ctl("declare", stream, "--member", "node-1=0", "--any-of", "nvme")
    assert (code, out) == (1, "")
    assert err.startswith("convergencectl: rejected: ")
    assert "[spec_conflict]" in err


# -- facts -----------------------------------------------------------------------------------


def test_commit_retract_text_and_json(ctl: Ctl, c1: Client, stream: str) -> None:
    code, out, err = ctl("commit", stream, "--rank", "0", "--domain", "nvme", "--epoch", "5")
    assert (code, err) == (0, "")
    assert out == f"committed {stream} rank 0 nvme epoch 5 (durable)\n"
    result = ctl.json(
        "commit", stream, "--rank", "0", "--domain", "nvme", "--epoch", "6",
        "--digest", "crc32c:9f2c0a1b", "--size", "4096",
    )  # fmt: skip
    assert result == {"stream": stream, "epoch": 6, "durable": True}
    code, out, _ = ctl("retract", stream, "--rank", "0", "--domain", "nvme", "--epoch", "6")
    assert code == 0
    assert out == f"retracted {stream} rank 0 nvme epoch 6 (durable)\n"
    assert c1.state(stream)["newest"]["node-1"] == {"nvme": 5}


def test_rejected_commit_fails_with_the_reason(ctl: Ctl, stream: str) -> None:
    # node-1 hosts rank 0 only.
    code, out, err = ctl("commit", stream, "--rank", "1", "--domain", "nvme", "--epoch", "1")
    assert (code, out) == (1, "")
    assert err.startswith("convergencectl: rejected: ")
    assert "rank 1" in err and err.rstrip().endswith("[unknown_rank]")


def test_retire_safe_epoch_and_refuse_an_unsafe_one(
    ctl: Ctl, c1: Client, c2: Client, stream: str
) -> None:
    commit_both(c1, c2, stream, range(1, 5))
    state = c1.wait(stream, 4, timeout=10)
    (lo, hi), *_ = state["safe_to_delete"]
    assert lo <= 1 <= hi < 4
    code, out, err = ctl("retire", stream, "--rank", "0", "--domain", "nvme", "--epoch", "1")
    assert (code, err) == (0, "")
    assert out == f"retired {stream} rank 0 nvme epoch 1 (durable)\n"
    code, out, err = ctl("retire", stream, "--rank", "0", "--domain", "nvme", "--epoch", "4")
    assert (code, out) == (1, "")
    assert err.startswith("convergencectl: rejected: ")
    assert err.rstrip().endswith("[not_safe_to_delete]")


# -- waiting ---------------------------------------------------------------------------------


def test_wait_prints_the_state_once_reached(ctl: Ctl, c1: Client, c2: Client, stream: str) -> None:
    commit_both(c1, c2, stream, range(1, 3))
    code, out, err = ctl("wait", stream, "2", "--timeout", "10")
    assert (code, err) == (0, "")
    assert "restore point   2" in out.splitlines()
    assert ctl.json("wait", stream, "1", "--timeout", "10")["restore_point"] == 2


def test_wait_timeout_fails(ctl: Ctl, stream: str) -> None:
    started = time.monotonic()
    code, out, err = ctl("wait", stream, "7", "--timeout", "0.2")
    assert (code, out) == (1, "")
    assert err.startswith("convergencectl: timeout: ")
    assert "not yet 7" in err
    assert time.monotonic() - started < 5


def test_restore_point_of_a_generation(
    ctl: Ctl, cluster: LocalCluster, c1: Client, c2: Client, stream: str
) -> None:
    commit_both(c1, c2, stream, range(1, 3))
    c1.wait(stream, 2, timeout=10)
    # The answer needs every member's frozen set: node-2 asks at the same time.
    other: list[dict[str, Any]] = []
    t = threading.Thread(target=lambda: other.append(c2.restore_point(stream, 1, timeout=10)))
    t.start()
    try:
        result = ctl.json("restore-point", stream, "1", "--timeout", "10")
    finally:
        t.join()
    assert result["resolved"] and result["restore_point"] == 2
    assert other == [result]
    code, out, _ = ctl("restore-point", stream, "1", "--timeout", "10", node=2)
    assert (code, out) == (0, f"{stream} generation 1: restore point 2\n")


def test_next_generation_prints_a_generation_no_member_resolved(
    ctl: Ctl, c1: Client, c2: Client, stream: str
) -> None:
    commit_both(c1, c2, stream, range(1, 3))
    c1.wait(stream, 2, timeout=10)
    code, out, err = ctl("next-generation", stream, "--timeout", "10")
    assert (code, out, err) == (0, "1\n", "")  # above the membership declared, 0
    assert ctl.json("next-generation", stream, node=2) == {"stream": stream, "generation": 1}
    other: list[dict[str, Any]] = []
    t = threading.Thread(target=lambda: other.append(c2.restore_point(stream, 0, timeout=10)))
    t.start()
    try:
        assert c1.restore_point(stream, 0, timeout=10)["restore_point"] == 2
    finally:
        t.join()
    # Generation 0 is resolved: the next launch gets 1, whichever node it asks.
    assert ctl("next-generation", stream, node=2)[1] == "1\n"
    # A node asks for a stream it has not declared (a spare about to take over ranks):
    # it answers from the records it holds, here none.
    assert ctl("next-generation", "nosuchstream")[:2] == (0, "0\n")


# -- watch -----------------------------------------------------------------------------------


class Committer:
    """Commits rising epochs of rank 0 on node-1 in a thread until stopped."""

    def __init__(self, client: Client, stream: str) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(client, stream))

    def _run(self, client: Client, stream: str) -> None:
        for epoch in itertools.count(1):
            if self.stop.wait(0.05):
                return
            client.commit(stream, 0, "nvme", epoch)

    def __enter__(self) -> Committer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def test_watch_json_lines_while_another_thread_commits(ctl: Ctl, c1: Client, stream: str) -> None:
    with Committer(c1, stream):
        code, out, err = ctl("watch", stream, "--count", "2", "--json")
    assert (code, err) == (0, "")
    events = [json.loads(line) for line in out.splitlines()]
    assert len(events) == 2
    assert all(e["stream"] == stream for e in events)
    assert events[0] != events[1]
    assert "node-1" in events[1]["newest"]


def test_watch_text_lines(ctl: Ctl, stream: str) -> None:
    code, out, err = ctl("--json", "watch", stream, "--count", "1")
    assert code == 0 and json.loads(out)["stream"] == stream
    code, out, err = ctl("watch", stream, "--count", "1")
    assert (code, err) == (0, "")
    assert f" {stream}: restore point none (" in out
    assert "proposal none, convergence " in out
    assert out.count("\n") == 1


def test_watch_ends_with_3_when_the_daemon_goes_away() -> None:
    with LocalCluster(1) as c:
        c.start_all()
        with Client(c.socket_path(1)) as client:
            client.declare(c.spec("solo"))
        argv = [sys.executable, "-m", "convergenced.ctl", "--socket", str(c.socket_path(1)),
                "watch", "solo", "--json"]  # fmt: skip
        # SIGTERM: the daemon ends the watch (shutting down); SIGKILL: the connection drops.
        for sig, kind in ((signal.SIGTERM, "unavailable"), (signal.SIGKILL, "unreachable")):
            if c.procs[1].poll() is not None:
                c.start(1)
            with subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            ) as p:
                assert p.stdout is not None and p.stderr is not None
                assert json.loads(p.stdout.readline())["stream"] == "solo"
                c.kill(1, sig)
                assert p.wait(timeout=10) == 3
                assert p.stderr.read().startswith(f"convergencectl: {kind}: ")


# -- usage and reachability ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["commit", "s", "--domain", "nvme", "--epoch", "1"], "--rank"),
        (["retire", "s", "--rank", "0", "--epoch", "1"], "--domain"),
        (["commit", "s", "--rank", "-1", "--domain", "nvme", "--epoch", "1"], "negative"),
        (["wait", "s", "soon"], "'soon' is not an integer"),
        (["wait", "s", "1", "--timeout", "nan"], "seconds"),
        (
            ["declare", "s", "--member", "node-1=0", "--all-of", "nvme", "--any-of", "s3"],
            "not allowed with argument",
        ),
        (["declare", "s", "--all-of", "nvme"], "--member"),
        (["declare", "s", "--member", "node-1=0"], "--all-of or --any-of"),
        (["declare", "s", "--member", "node-1", "--all-of", "nvme"], "NODE=RANKS"),
        (["declare", "s", "--member", "n=3-1", "--all-of", "nvme"], "backwards"),
        (["declare", "--member", "node-1=0", "--all-of", "nvme"], "STREAM is required"),
        (["declare", "s", "--member", "a=0", "--member", "b=0", "--all-of", "x"], "rank 0"),
        (["declare", "--spec", "/nonexistent/job.json"], "cannot read spec file"),
        (["declare", "--spec", "job.json", "--any-of", "nvme"], "--spec excludes"),
        (["state"], "STREAM"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_usage_errors_exit_2_before_connecting(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The socket leads nowhere: a usage error must be found before connecting (else 3).
    assert main(["--socket", str(tmp_path / "none.sock"), *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "usage: convergencectl" in captured.err
    assert message in captured.err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "neither valid JSON nor TOML"),
        ('["a list"]', "expected a map"),
        ('{"name": "x", "members": {"n": [0]}, "policy": {"mode": "some", "domains": ["d"]}}',
         "spec.policy.mode"),
    ],
)  # fmt: skip
def test_bad_spec_files_exit_2(
    text: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "spec.txt"
    path.write_text(text)
    code = main(["--socket", str(tmp_path / "none.sock"), "declare", "--spec", str(path)])
    assert code == 2
    assert message in capsys.readouterr().err


def test_unreachable_socket_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--socket", str(tmp_path / "none.sock"), "status"]) == 3
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("convergencectl: unreachable: cannot reach the daemon at ")


# -- as a real process -----------------------------------------------------------------------


def test_exit_codes_of_the_real_process(cluster: LocalCluster, stream: str, tmp_path: Path) -> None:
    sock = str(cluster.socket_path(1))
    ok = run_ctl("--socket", sock, "commit", stream, "--rank", "0", "--domain", "nvme",
                 "--epoch", "1", "--json")  # fmt: skip
    assert (ok.returncode, ok.stderr) == (0, "")
    assert json.loads(ok.stdout)["durable"] is True
    refused = run_ctl("--socket", sock, "commit", stream, "--rank", "1", "--domain", "nvme",
                      "--epoch", "1")  # fmt: skip
    assert refused.returncode == 1
    assert refused.stderr.startswith("convergencectl: rejected: ")
    usage = run_ctl("--socket", sock, "commit", stream, "--domain", "nvme", "--epoch", "1")
    assert usage.returncode == 2 and "--rank" in usage.stderr
    gone = run_ctl("status", env={"CONVERGENCED_SOCKET": str(tmp_path / "none.sock")})
    assert gone.returncode == 3 and "unreachable" in gone.stderr


def test_real_watch_ends_with_0_on_ctrl_c_and_on_a_closed_pipe(
    cluster: LocalCluster, c1: Client, stream: str
) -> None:
    argv = [sys.executable, "-m", "convergenced.ctl", "--socket", str(cluster.socket_path(1)),
            "watch", stream, "--json"]  # fmt: skip
    # Ctrl-C.
    p = interruptible(argv)
    try:
        assert p.stdout is not None and p.stderr is not None
        assert json.loads(p.stdout.readline())["stream"] == stream
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=10) == 0
        assert p.stderr.read() == ""
    finally:
        p.kill()  # never leave a hung watch behind a failed assertion
        p.communicate()
    # The reader of a pipeline goes away (like `| head -n 1`).
    p = interruptible(argv)
    try:
        assert p.stdout is not None and p.stderr is not None
        assert json.loads(p.stdout.readline())["stream"] == stream
        p.stdout.close()
        with Committer(c1, stream):
            assert p.wait(timeout=10) == 0
        assert p.stderr.read() == ""
    finally:
        p.kill()
        p.communicate()


def test_watch_of_an_unknown_stream_fails(ctl: Ctl) -> None:
    code, out, err = ctl("watch", "no-such-stream", "--count", "1")
    assert (code, out) == (1, "")
    assert "[unknown_stream]" in err
