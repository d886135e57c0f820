"""Version constraint sets in the core: the companion streams, the two phases, and
what a node may move to (sans-IO, two and three NodeCores exchanging their views)."""

from __future__ import annotations

import pytest
from pulled import events

from convergenced.core.agreement import Knowledge
from convergenced.core.errors import FactError
from convergenced.core.events import RestorePointChanged
from convergenced.core.facts import Commit, ComponentReport, Declare, Undeclare
from convergenced.core.node import NodeCore
from convergenced.core.spec import Policy, StreamSpec
from convergenced.core.versions import (
    Catalogue,
    VersionError,
    check_report,
    is_reserved,
    judge_move,
)
from convergenced.daemon.durability.entries import decode_entry, encode_entry

DRIVER = Catalogue.create("driver", ["535.161.08", "550.54.15", "555.42.02"])
JOB = StreamSpec.create("job", {"a": [0, 1], "b": [2, 3], "c": [4]}, Policy.all_of("nvme"))


def nodes(*ids: str, catalogue: Catalogue = DRIVER) -> list[NodeCore]:
    return [NodeCore(i, 1, catalogues=[catalogue]) for i in ids]


def sync(*ns: NodeCore) -> None:
    for _ in range(6):
        for x in ns:
            for y in ns:
                if x is not y:
                    y.receive(list(x.view), via=x.node_id)


def report(running: str, *accepts: str) -> ComponentReport:
    return ComponentReport("driver", running, tuple(accepts) or (running,))


def cluster(**reports: ComponentReport) -> list[NodeCore]:
    ns = nodes("a", "b", "c")
    for n in ns:
        n.apply(Declare(JOB))
        if n.node_id in reports:
            n.apply(reports[n.node_id])
    sync(*ns)
    return ns


def test_companions_are_hidden_from_the_jobs_streams_but_published() -> None:
    (a, *_) = cluster(a=report("550.54.15"), b=report("550.54.15"), c=report("550.54.15"))
    assert a.streams() == ["job"]
    companion = DRIVER.companion_name("job")
    assert is_reserved(companion) and companion.startswith("convergenced.versions/driver/")
    rec = a.view.get((companion, "a"))
    assert rec is not None and rec.recoverable.max() == 1


def test_phase_one_and_two_give_the_newest_version_every_member_accepts() -> None:
    a, b, c = cluster(
        a=report("550.54.15", "550.54.15", "555.42.02"),
        b=report("550.54.15", "535.161.08", "550.54.15", "555.42.02"),
        c=report("555.42.02", "550.54.15", "555.42.02"),
    )
    for n in (a, b, c):
        (view,) = n.versions("job")
        assert view.accepted_by_all == ("550.54.15", "555.42.02")
        assert view.acknowledged == "555.42.02"
        assert view.knowledge == Knowledge.PUBLISHED
        assert view.running == {"a": "550.54.15", "b": "550.54.15", "c": "555.42.02"}
        assert view.compatible is True
        assert view.droppable == ("535.161.08",)  # older than what anyone runs
        assert judge_move(view, "555.42.02") == ""
        assert "not every member accepts" in judge_move(view, "535.161.08")


def test_a_member_that_does_not_accept_the_new_version_blocks_the_move() -> None:
    a, *_ = cluster(
        a=report("550.54.15", "550.54.15", "555.42.02"),
        b=report("550.54.15"),
        c=report("550.54.15", "550.54.15", "555.42.02"),
    )
    (view,) = a.versions("job")
    assert view.accepted_by_all == ("550.54.15",)
    assert view.acknowledged == "550.54.15"
    assert judge_move(view, "555.42.02") == "job: not every member accepts driver 555.42.02"


def test_a_member_not_heard_from_keeps_the_handshake_waiting() -> None:
    a, *_ = cluster(a=report("550.54.15"), b=report("550.54.15"))  # c reports nothing
    (view,) = a.versions("job")
    assert view.accepted_by_all is None and view.acknowledged is None
    assert view.compatible is None
    assert judge_move(view, "550.54.15") == "job: waits to hear the driver versions of c"


def test_members_running_versions_some_member_does_not_accept_are_incompatible() -> None:
    a, *_ = cluster(
        a=report("555.42.02", "550.54.15", "555.42.02"),
        b=report("550.54.15"),
        c=report("550.54.15", "550.54.15", "555.42.02"),
    )
    (view,) = a.versions("job")
    assert view.compatible is False


def test_dropping_the_acknowledged_version_is_a_rollback_and_accepting_it_again_works() -> None:
    a, b, c = cluster(a=report("550.54.15"), b=report("550.54.15"), c=report("550.54.15"))
    companion = DRIVER.companion_name("job")
    assert a.restore_point(companion) == 1
    events(a)
    b.apply(report("555.42.02"))  # b moved on and dropped 550 altogether
    sync(a, b, c)
    assert RestorePointChanged(companion, 1, None, True) in events(a)
    (view,) = a.versions("job")
    assert view.compatible is False and view.acknowledged is None
    b.apply(report("555.42.02", "550.54.15", "555.42.02"))  # b rolled back its drop
    sync(a, b, c)
    assert a.versions("job")[0].acknowledged == "550.54.15"


def test_a_catalogue_that_differs_is_another_stream_and_never_read_as_the_same() -> None:
    (a, b, _), other = cluster(), Catalogue.create("driver", ["550.54.15", "535.161.08"])
    d = NodeCore("c", 1, catalogues=[other])
    assert other.companion_name("job") != DRIVER.companion_name("job")
    d.apply(Declare(JOB))
    d.apply(ComponentReport("driver", "550.54.15", ("550.54.15",)))
    for n in (a, b):
        n.apply(report("550.54.15"))
    sync(a, b, d)
    (view,) = a.versions("job")
    assert view.accepted_by_all is None and view.missing == ("c",)


def test_undeclaring_the_job_undeclares_its_companions() -> None:
    a, *_ = cluster(a=report("550.54.15"), b=report("550.54.15"), c=report("550.54.15"))
    companion = DRIVER.companion_name("job")
    a.apply(Undeclare("job"))
    assert companion not in a._streams
    tomb = a.view.get((companion, "a"))
    assert tomb is not None and not tomb.recoverable


def test_a_new_membership_of_the_job_carries_over_to_its_companion() -> None:
    ns = cluster(a=report("550.54.15"), b=report("550.54.15"), c=report("550.54.15"))
    grown = StreamSpec.create("job", {"a": [0, 1], "b": [2], "c": [3, 4]},
                              Policy.all_of("nvme"), membership=1)  # fmt: skip
    for n in ns:
        n.apply(Declare(grown))
    sync(*ns)
    companion = DRIVER.companion_name("job")
    assert ns[0].spec(companion).membership == 1
    assert ns[2].spec(companion).ranks_of("c") == (3, 4)
    assert ns[0].versions("job")[0].acknowledged == "550.54.15"


def test_replay_rebuilds_the_companions_and_a_lost_tail_is_reconciled() -> None:
    (a,) = nodes("a")
    solo = StreamSpec.create("solo", {"a": [0]}, Policy.all_of("nvme"))
    a.apply(Declare(solo))
    a.apply(Commit("solo", 0, "nvme", 3))
    a.apply(report("550.54.15", "550.54.15", "555.42.02"))
    said = report("550.54.15", "550.54.15", "555.42.02")
    logged = [Declare(solo), Commit("solo", 0, "nvme", 3), said, *a.take_pending_facts()]
    for log in (logged, logged[:3]):  # the companions' facts written, or lost in a crash
        (b,) = nodes("a")
        b.replay([decode_entry(encode_entry(f)) for f in log])
        assert b.versions("solo")[0].acknowledged == "555.42.02"
        derived = [f for f in b.take_pending_facts() if isinstance(f, Declare | Commit)]
        assert derived == (
            [] if log is logged else [f for f in logged[3:] if isinstance(f, Declare | Commit)]
        )
    (b,) = nodes("a")
    b.replay(a.compacted_facts())
    assert b.versions("solo")[0].acknowledged == "555.42.02"


def test_a_client_may_not_use_a_reserved_name_and_reports_are_checked() -> None:
    with pytest.raises(VersionError, match="not in the catalogue"):
        check_report(report("560.1"), DRIVER)
    with pytest.raises(VersionError, match="accepts the version it runs"):
        check_report(ComponentReport("driver", "550.54.15", ("555.42.02",)), DRIVER)
    with pytest.raises(FactError, match="no catalogue"):
        check_report(ComponentReport("nccl", "2.18", ("2.18",)), None)
    with pytest.raises(VersionError, match="listed twice"):
        Catalogue.create("driver", ["1", "1"])
    with pytest.raises(VersionError, match="component name"):
        Catalogue.create("dri/ver", ["1"])


def test_the_fleet_figure_intersects_every_node_heard_from() -> None:
    a, *_ = cluster(
        a=report("550.54.15", "550.54.15", "555.42.02"),
        b=report("550.54.15", "535.161.08", "550.54.15", "555.42.02"),
        c=report("550.54.15", "550.54.15"),
    )
    assert a.fleet_versions() == {"driver": (("550.54.15",), 3)}


def test_a_fleet_that_rolls_back_acknowledges_the_older_version_again() -> None:
    both = report("555.42.02", "550.54.15", "555.42.02")
    ns = cluster(a=both, b=both, c=both)
    assert ns[0].versions("job")[0].acknowledged == "555.42.02"
    for n in ns:  # the new driver is pulled everywhere: back to 550, 555 dropped
        n.apply(report("550.54.15"))
    sync(*ns)
    for n in ns:
        (view,) = n.versions("job")
        assert view.acknowledged == "550.54.15" and view.knowledge == Knowledge.PUBLISHED
