"""`convergencectl top`: `render_top` on hand-made maps, and the command against real
daemons on loopback (a 2-node cluster for the module, a 1-node one for exits).

``tests/`` is not a package and pytest puts it on ``sys.path``, hence
``from daemons import ...`` (see tests/test_ctl.py).
"""

from __future__ import annotations

import itertools
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from daemons import LocalCluster, interruptible

from convergenced.client import Client
from convergenced.ctl import CLEAR_SCREEN, main, render_top

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def state_map(**fields: Any) -> dict[str, Any]:
    """A state map as LOCAL_API.md section 4 has it: two members, all of nvme and s3."""
    base: dict[str, Any] = {
        "stream": "job",
        "spec": {
            "name": "job",
            "members": {"node-1": [0], "node-2": [1]},
            "policy": {"mode": "all", "domains": ["nvme", "s3"]},
            "retention": 0,
        },
        "recoverable": [[1, 5]],
        "convergence": [[1, 3], [6, 6]],
        "proposal": 6,
        "restore_point": 5,
        "knowledge": "published",
        "high_water": 5,
        "rollback_floor": 5,
        "gc_horizon": 5,
        "safe_to_delete": [[1, 4]],
        "missing": [],
        "conflicts": [],
        "newest": {"node-1": {"nvme": 7, "s3": 6}, "node-2": {"nvme": 5, "s3": 6}},
        "skew": 1,
        "domain_skew": {"s3": 0, "nvme": 2},
        "generations": [],
    }
    return base | fields


def status_map(**fields: Any) -> dict[str, Any]:
    """A status result of node-1, linked to node-2, with node-3 configured but unlinked."""
    base: dict[str, Any] = {
        "node": "node-1",
        "cluster": "rack7",
        "warnings": [],
        "peers": [
            {"id": "node-2", "address": "127.0.0.1:7001", "connected": True},
            {"id": "node-3", "address": "127.0.0.1:7002", "connected": False},
        ],
        "links": [
            {"peer": "node-2", "address": "127.0.0.1:7001", "state": "HOLDING", "in_sync": True}
        ],
        "streams": ["job", "other"],
    }
    return base | fields


def section(frame: str, title: str) -> list[str]:
    """The lines of one section of a frame (after ``title``, up to a blank line)."""
    lines = frame.splitlines()
    start = lines.index(title) + 1
    end = lines.index("", start) if "" in lines[start:] else len(lines)
    return lines[start:end]


def cells(frame: str) -> dict[str, list[str]]:
    """The epoch lattice as {member: [cell, ...]}, the header under ``member``."""
    rows = [line.split() for line in section(frame, "epoch lattice") if line.startswith("  ")]
    return {row[0]: row[1:] for row in rows if not row[0].startswith(("*", "!"))}


# -- render_top -------------------------------------------------------------------------


def test_frame_shows_the_stream_the_lattice_and_the_links() -> None:
    frame = render_top(state_map(), status_map(), updated=0.0)
    head, *rest = frame.splitlines()
    assert head.startswith("convergencectl top  node-1 (cluster rack7)  updated ")
    assert re.search(r"updated \d\d:\d\d:\d\d$", head)
    for line in (
        "stream         job (other streams: other)",
        "restore point  5",
        "proposal       6",
        "knowledge      published",
        "convergence    1-3, 6",
        "skew           1 (nvme 2, s3 0)",
        "gc horizon     5",
    ):
        assert line in rest
    lattice = cells(frame)
    assert lattice["member"] == ["nvme", "s3"]
    # nvme differs between the members: its lowest is marked; s3 does not.
    assert lattice["node-1"] == ["7", "6", "this", "node"]
    assert lattice["node-2"] == ["5*", "6"]
    assert "  * lowest of its domain" in frame.splitlines()
    assert section(frame, "links") == [
        "  peer    state    sync",
        "  node-2  HOLDING  in sync",
        "  node-3  no link  -",
    ]
    assert "\x1b" not in frame


def test_epochs_older_than_the_restore_point_are_marked() -> None:
    state = state_map(
        spec=state_map()["spec"] | {"policy": {"mode": "any", "domains": ["nvme", "s3"]}},
        newest={"node-1": {"nvme": 7, "s3": 4}, "node-2": {"nvme": 7, "s3": 6}},
        domain_skew={"nvme": 0, "s3": 2},
    )
    frame = render_top(state, status_map())
    assert cells(frame)["node-1"][:2] == ["7", "4!*"]
    assert cells(frame)["node-2"] == ["7", "6"]
    assert "  * lowest of its domain; ! older than the restore point" in frame.splitlines()
    assert "updated" not in frame.splitlines()[0]


def test_a_missing_member_keeps_its_row() -> None:
    state = state_map(
        convergence=None,
        proposal=None,
        restore_point=None,
        knowledge="incomplete",
        gc_horizon=None,
        missing=["node-2"],
        newest={"node-1": {"nvme": 3, "s3": 3}},
        skew=None,
        domain_skew={},
    )
    frame = render_top(state, status_map(links=[], streams=["job"]))
    lines = frame.splitlines()
    for line in (
        "stream         job",
        "restore point  none",
        "knowledge      incomplete",
        "convergence    unknown",
        "skew           unknown",
        "missing        node-2",
    ):
        assert line in lines
    assert cells(frame)["node-2"] == ["-", "-", "not", "heard", "from"]
    assert section(frame, "links")[1:] == ["  node-2  no link  -", "  node-3  no link  -"]


def test_no_domains_no_links_and_no_status() -> None:
    state = state_map(
        spec=state_map()["spec"] | {"policy": {"mode": "all", "domains": []}},
        newest={},
        domain_skew={},
    )
    frame = render_top(state, None)
    assert frame.splitlines()[0] == "convergencectl top"
    assert section(frame, "epoch lattice") == [
        "  member",
        "  node-1",
        "  node-2",
        "  no domains reported yet",
    ]
    assert frame.splitlines()[-1] == "links  unknown"
    alone = render_top(state, status_map(links=[], peers=[]))
    assert alone.splitlines()[-1] == "links  none"
    assert "this node" in alone


def test_colours_change_nothing_but_the_colours() -> None:
    for state in (state_map(), state_map(missing=["node-2"], newest={})):
        plain = render_top(state, status_map(), updated=1e9)
        painted = render_top(state, status_map(), updated=1e9, color=True)
        assert painted != plain
        assert ANSI.sub("", painted) == plain


# -- against daemons ------------------------------------------------------------------------

_names = itertools.count(1)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(2) as c:
        c.start_all()
        deadline = time.monotonic() + 10
        for i in (1, 2):
            with Client(c.socket_path(i)) as client:
                while not all(p["connected"] for p in client.status()["peers"]):
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
        yield c


@pytest.fixture
def stream(cluster: LocalCluster) -> Iterator[str]:
    """A fresh stream declared on both nodes, epochs 1-3 committed by both."""
    name = f"top{next(_names)}"
    with Client(cluster.socket_path(1)) as c1, Client(cluster.socket_path(2)) as c2:
        c1.declare(cluster.spec(name))
        c2.declare(cluster.spec(name))
        for epoch in (1, 2, 3):
            c1.commit(name, 0, "nvme", epoch)
            c2.commit(name, 1, "nvme", epoch)
        c1.wait(name, 3, timeout=10)
    yield name


def top(capsys: pytest.CaptureFixture[str], socket: Path, *argv: str) -> tuple[int, list[str], str]:
    """Run ``top`` in-process; returns (code, frames, stderr)."""
    capsys.readouterr()
    code = main(["--socket", str(socket), "top", *argv])
    out, err = capsys.readouterr()
    frames = out.split("\n\nconvergencectl top")
    frames[1:] = ["convergencectl top" + f for f in frames[1:]]
    return code, frames if out else [], err


def test_top_draws_a_frame_per_change(
    cluster: LocalCluster, stream: str, capsys: pytest.CaptureFixture[str]
) -> None:
    stop = threading.Event()

    def commit() -> None:  # rank 0 runs ahead, one epoch every 50 ms
        with Client(cluster.socket_path(1)) as c1:
            for epoch in itertools.count(4):
                if stop.wait(0.05):
                    return
                c1.commit(stream, 0, "nvme", epoch)

    committer = threading.Thread(target=commit)
    committer.start()
    try:
        code, frames, err = top(
            capsys, cluster.socket_path(1), stream, "--count", "2", "--no-clear"
        )
    finally:
        stop.set()
        committer.join()
    assert (code, err) == (0, "")
    assert len(frames) == 2
    assert CLEAR_SCREEN not in "".join(frames)
    for frame in frames:
        assert frame.startswith("convergencectl top  node-1 (cluster local)  updated ")
        assert re.search(r"^restore point  \d+$", frame, re.MULTILINE)
        assert f"stream         {stream}" in frame
        lattice = cells(frame)
        assert lattice["member"] == ["nvme"]
        assert set(lattice) == {"member", "node-1", "node-2"}
        assert section(frame, "links")[1].startswith("  node-2  ")
    # A new frame for a new state (not only a new time in the header).
    assert frames[0].split("\n", 1)[1] != frames[1].split("\n", 1)[1]
    # node-2 commits nothing more: the restore point stays, node-1 runs ahead of it.
    assert int(cells(frames[1])["node-1"][0]) >= 3
    for frame in frames:
        assert "restore point  3" in frame.splitlines()
        if cells(frame)["node-1"][0] != "3":
            assert cells(frame)["node-2"][0] == "3*"


def test_top_without_stream_shows_the_first_one(
    cluster: LocalCluster, stream: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with Client(cluster.socket_path(2)) as c2:
        first = c2.streams()[0]
    code, frames, err = top(capsys, cluster.socket_path(2), "--count", "1")
    assert (code, err, len(frames)) == (0, "", 1)
    assert frames[0].startswith("convergencectl top  node-2 (cluster local)")
    assert f"stream         {first}" in frames[0]
    assert cells(frames[0])["node-2"][-2:] == ["this", "node"]


def test_top_of_an_unknown_stream_fails(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    code, frames, err = top(capsys, cluster.socket_path(1), "no-such-stream", "--count", "1")
    assert (code, frames) == (1, [])
    assert "[unknown_stream]" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--interval", "0"], "not a positive number of seconds"),
        (["--count", "-1"], "negative"),
    ],
)
def test_usage_errors_exit_2(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--socket", str(tmp_path / "none.sock"), "top", *argv]) == 2
    assert message in capsys.readouterr().err


def test_unreachable_socket_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, frames, err = top(capsys, tmp_path / "none.sock", "job", "--count", "1")
    assert (code, frames) == (3, [])
    assert err.startswith("convergencectl: unreachable: cannot reach the daemon at ")


def test_help_documents_top(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "live view: epoch lattice, restore point, skew, links" in capsys.readouterr().out
    assert main(["top", "--help"]) == 0
    out = capsys.readouterr().out
    for text in ("--interval S", "--count N", "--no-clear", "epoch lattice", "exit codes"):
        assert text in out


def read_frame(out: IO[str]) -> str:
    """Lines up to the end of a frame of a node with no peers (``links  none``)."""
    lines = []
    while (line := out.readline()) != "links  none\n":
        assert line, "".join(lines)  # not at the end of the output
        lines.append(line)
    return "".join(lines)


def test_no_stream_exits_1_ctrl_c_exits_0_daemon_gone_exits_3() -> None:
    with LocalCluster(1) as c:
        c.start_all()
        argv = [sys.executable, "-m", "convergenced.ctl", "--socket", str(c.socket_path(1)),
                "top"]  # fmt: skip
        none = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        assert (none.returncode, none.stdout) == (1, "")
        assert none.stderr == (
            "convergencectl: failed: no stream is declared on this node "
            "(declare one, or name STREAM)\n"
        )
        with Client(c.socket_path(1)) as client:
            client.declare(c.spec("solo"))
        for stop in ("ctrl-c", "kill"):
            with interruptible(argv) as p:
                try:
                    assert p.stdout is not None and p.stderr is not None
                    first = read_frame(p.stdout)
                    assert first.startswith("convergencectl top  node-1 (cluster local)")
                    assert CLEAR_SCREEN not in first  # not a terminal
                    if stop == "ctrl-c":
                        p.send_signal(signal.SIGINT)
                        assert p.wait(timeout=10) == 0
                        assert p.stderr.read() == ""
                    else:
                        c.kill(1)
                        assert p.wait(timeout=10) == 3
                        assert p.stderr.read().startswith("convergencectl: unreachable: ")
                finally:
                    p.kill()  # a failed assertion must not leave __exit__ waiting


def test_the_frame_shows_the_membership_and_the_members_that_moved_on() -> None:
    spec = state_map()["spec"] | {"shared": ["s3"], "membership": 4}
    frame = render_top(state_map(spec=spec, membership=4), status_map())
    assert "membership     4 (shared s3; node-local nvme)" in frame.splitlines()
    assert "moved on" not in frame
    behind = state_map(membership=0, moved_on={"node-2": 4})
    lines = render_top(behind, status_map()).splitlines()
    assert "membership     0 (node-local nvme, s3)" in lines
    assert "moved on       node-2 to membership 4" in lines
    assert cells("\n".join(lines))["node-2"][-2:] == ["moved", "on"]
