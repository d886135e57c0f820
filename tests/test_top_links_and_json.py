"""`convergencectl top`: a node whose link is down is marked so (in the links and on its
lattice row), and ``top --json`` prints one JSON object per frame: the watch event, its
lattice and the links.

Pure functions on hand-made maps first, then the command against real daemons.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from typing import Any

import pytest
from daemons import LocalCluster, until

from convergenced.ctl import main, render_top
from convergenced.ctl.top import lattice, links, top_frame

STATE: dict[str, Any] = {
    "stream": "job",
    "spec": {
        "name": "job",
        "members": {"node-1": [0], "node-2": [1], "node-3": [2]},
        "policy": {"mode": "all", "domains": ["nvme"]},
        "retention": 0,
    },
    "restore_point": 4,
    "proposal": 4,
    "knowledge": "published",
    "convergence": [[1, 4]],
    "gc_horizon": 4,
    "missing": [],
    "conflicts": [],
    "newest": {"node-1": {"nvme": 6}, "node-2": {"nvme": 4}, "node-3": {"nvme": 3}},
    "skew": 3,
    "domain_skew": {"nvme": 3},
}


def _status(node_3: dict[str, Any]) -> dict[str, Any]:
    """node-1's status: linked to node-2; node-3 configured, no link (``node_3`` adds
    what the daemon says of it)."""
    return {
        "node": "node-1",
        "cluster": "local",
        "warnings": [],
        "peers": [
            {"id": "node-2", "connected": True, "overlay_link": True},
            {"id": "node-3", "connected": False, **node_3},
        ],
        "links": [{"peer": "node-2", "state": "HOLDING", "in_sync": True}],
        "streams": ["job"],
    }


def _row(frame: str, first: str) -> list[str]:
    return next(line.split() for line in frame.splitlines() if line.split()[:1] == [first])


# -- a link that is down --------------------------------------------------------------


def test_a_peer_the_overlay_links_without_a_link_is_down() -> None:
    status = _status({"overlay_link": True})
    assert links(status) == [
        {"peer": "node-2", "state": "HOLDING", "in_sync": True},
        {"peer": "node-3", "state": "down", "in_sync": None},
    ]
    frame = render_top(STATE, status)
    assert "  node-3  down     -" in frame.splitlines()


def test_the_member_whose_link_is_down_says_so_on_its_lattice_row() -> None:
    frame = render_top(STATE, _status({"overlay_link": True}))
    assert _row(frame, "node-3")[-2:] == ["link", "down"]
    assert "link" not in _row(frame, "node-2")


def test_a_peer_the_overlay_does_not_link_is_relayed_not_down() -> None:
    status = _status({"overlay_link": False})
    assert (links(status) or [])[-1] == {"peer": "node-3", "state": "relayed", "in_sync": None}
    assert "link down" not in render_top(STATE, status)


def test_a_peer_the_daemon_says_nothing_of_has_no_link() -> None:
    status = _status({})
    assert (links(status) or [])[-1]["state"] == "no link"
    assert "link down" not in render_top(STATE, status)


# -- top --json: the frame as data ----------------------------------------------------


def test_the_lattice_as_data_has_domains_epochs_marks_and_notes() -> None:
    lat = lattice(STATE, _status({"overlay_link": True}))
    assert lat["domains"] == ["nvme"]
    assert lat["members"] == [
        {"member": "node-1", "newest": {"nvme": 6}, "marks": {}, "notes": ["this node"]},
        {"member": "node-2", "newest": {"nvme": 4}, "marks": {}, "notes": []},
        {"member": "node-3", "newest": {"nvme": 3}, "marks": {"nvme": "!*"},
         "notes": ["link down"]},
    ]  # fmt: skip


def test_a_json_frame_holds_the_state_its_lattice_and_the_links() -> None:
    status = _status({"overlay_link": True}) | {"warnings": ["INSECURE: ..."]}
    frame = json.loads(json.dumps(top_frame(STATE, status, updated=12.5)))
    assert frame == {
        "updated": 12.5,
        "node": "node-1",
        "cluster": "local",
        "warnings": ["INSECURE: ..."],
        "state": STATE,
        "lattice": lattice(STATE, status),
        "links": links(status),
    }


# -- against daemons --------------------------------------------------------------------


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(2) as c:
        c.start_all()
        for i in (1, 2):
            c.client(i).declare(c.spec())
        c.client(1).commit("job", 0, "nvme", 1)
        c.client(2).commit("job", 1, "nvme", 1)
        c.client(1).wait("job", 1, timeout=20)
        yield c


def _top_json(cluster: LocalCluster, capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    capsys.readouterr()
    code = main(["--socket", str(cluster.socket_path(1)), *argv])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    return [json.loads(line) for line in out.splitlines()]


def test_top_json_prints_one_object_per_frame(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    (frame,) = _top_json(cluster, capsys, "top", "job", "--json", "--count", "1")
    assert frame["node"] == "node-1" and frame["state"]["stream"] == "job"
    assert frame["state"]["restore_point"] == 1
    assert [m["member"] for m in frame["lattice"]["members"]] == ["node-1", "node-2"]
    assert frame["links"][0]["peer"] == "node-2"


def test_json_before_the_subcommand_works_for_top_too(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    (frame,) = _top_json(cluster, capsys, "--json", "top", "job", "--count", "1")
    assert frame["state"]["stream"] == "job"


def test_a_node_whose_link_is_down_is_marked_in_top(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster.kill(2, signal.SIGKILL)
    c1 = cluster.client(1)
    until(lambda: not c1.status()["links"], what="node-1 to see its link to node-2 go")
    assert c1.status()["peers"][0]["overlay_link"] is True
    (frame,) = _top_json(cluster, capsys, "top", "job", "--json", "--count", "1")
    assert frame["links"] == [{"peer": "node-2", "state": "down", "in_sync": None}]
    row = next(m for m in frame["lattice"]["members"] if m["member"] == "node-2")
    assert "link down" in row["notes"]
