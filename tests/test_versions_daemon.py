"""The version handshake against three real daemons on loopback.

Each node's configuration holds the fleet's driver catalogue and seeds its own
report; a job spans the three nodes. The tests go through the local API, the
command line (``versions``, ``report-version``, ``gate --version``) and /metrics,
and kill -9 a daemon to see its reports survive.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import pytest
from daemons import LocalCluster, until
from prometheus_client.parser import text_string_to_metric_families

from convergenced.client import ApiError
from convergenced.core.versions import Catalogue

CATALOGUE = ["535.161.08", "550.54.15", "555.42.02"]
OLD, NEW = "550.54.15", "555.42.02"
SEED = {1: [OLD, NEW], 2: [OLD, NEW], 3: [OLD]}
"""What each node accepts at its first start (it runs OLD)."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(3) as c:
        for i, path in enumerate(c.configs, 1):
            with path.open("a") as f:
                f.write(f"\n[components.driver]\nversions = {json.dumps(CATALOGUE)}\n"
                        f'running = "{OLD}"\naccepts = {json.dumps(SEED[i])}\n')  # fmt: skip
        c.start_all()
        for i in (1, 2, 3):
            c.client(i).declare(c.spec("job"))
            c.client(i).commit("job", i - 1, "nvme", 1)
        yield c


def ctl(cluster: LocalCluster, node: int, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "convergenced.ctl", "--socket", str(cluster.socket_path(node)),
         *argv],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def handshake(cluster: LocalCluster, node: int) -> dict[str, object]:
    return dict(cluster.client(node).versions("job")["streams"]["job"]["driver"])


def version_metrics(cluster: LocalCluster, node: int) -> dict[tuple[str, str], float]:
    url = f"http://127.0.0.1:{cluster.metrics_base_port + node - 1}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.name, s.labels.get("version") or s.labels.get("stream", "")): s.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith(("convergenced_version", "convergenced_component"))
        for s in family.samples
    }


def test_the_members_agree_on_the_newest_version_all_of_them_accept(
    cluster: LocalCluster,
) -> None:
    until(lambda: handshake(cluster, 1)["knowledge"] == "published", what="phase two")
    h = handshake(cluster, 1)
    assert h["accepted_by_all"] == [OLD] and h["acknowledged"] == OLD
    assert h["running"] == {"node-1": OLD, "node-2": OLD, "node-3": OLD}
    assert h["compatible"] is True
    assert cluster.client(1).streams() == ["job"]  # the companion stays out of sight
    out = ctl(cluster, 1, "versions", "job")
    assert out.returncode == 0, out.stderr
    assert f"job driver: compatible; all accept {OLD}; acknowledged {OLD} (published)" in out.stdout
    until(lambda: version_metrics(cluster, 1).get(("convergenced_version_knowledge", "job")) == 3)
    m = version_metrics(cluster, 1)
    assert m[("convergenced_versions_compatible", "job")] == 1
    assert m[("convergenced_component_running", OLD)] == 1


def test_the_gate_holds_a_move_until_every_member_accepts_and_acknowledged_it(
    cluster: LocalCluster,
) -> None:
    until(lambda: cluster.client(1).state("job")["knowledge"] == "published")
    held = ctl(cluster, 1, "gate", "node-1", "--version", f"driver={NEW}", "--timeout", "0.5")
    assert held.returncode == 1, held.stdout + held.stderr
    assert f"job: waiting to move to driver {NEW}: job: not every member accepts" in held.stdout
    said = ctl(cluster, 3, "report-version", "driver", OLD, "--accepts", f"{OLD},{NEW}")
    assert said.returncode == 0, said.stderr
    assert said.stdout.strip() == f"reported driver {OLD} (durable)"
    ok = ctl(cluster, 1, "gate", "node-1", "--version", f"driver={NEW}", "--timeout", "20",
             "--json")  # fmt: skip
    assert ok.returncode == 0, ok.stdout + ok.stderr
    answer = json.loads(ok.stdout)
    assert answer["safe"] and answer["versions"][0]["safe"]
    assert handshake(cluster, 2)["acknowledged"] == NEW


def test_a_report_survives_kill_9_and_the_seed_does_not_override_it(
    cluster: LocalCluster,
) -> None:
    cluster.client(2).report_version("driver", NEW, [OLD, NEW])
    cluster.kill(2)
    cluster.start(2)
    mine = cluster.client(2).versions()["components"]["driver"]
    assert mine["running"] == NEW and mine["accepts"] == [OLD, NEW]
    until(lambda: handshake(cluster, 1)["running"].get("node-2") == NEW, what="node-2 on NEW")  # type: ignore[attr-defined]
    assert handshake(cluster, 1)["compatible"] is True


def test_bad_reports_and_reserved_names_are_refused_and_change_nothing(
    cluster: LocalCluster,
) -> None:
    c = cluster.client(1)
    until(lambda: handshake(cluster, 1)["knowledge"] == "published", what="settled")
    before = c.versions()
    for component, running, reason in (("driver", "560.1", "unknown_version"),
                                       ("nccl", "2.18", "unknown_component")):  # fmt: skip
        with pytest.raises(ApiError) as err:
            c.report_version(component, running)
        assert err.value.reason == reason
    with pytest.raises(ApiError) as err:
        c.report_version("driver", OLD, ["x" * 65])
    assert err.value.reason == "bad_request"
    reserved = cluster.spec("convergenced.versions/driver/x")
    with pytest.raises(ApiError) as err:
        c.declare(reserved)
    assert err.value.reason == "reserved_stream"
    companion = Catalogue.create("driver", CATALOGUE).companion_name("job")  # declared
    for name in (companion, reserved["name"]):
        for call in (c.versions, c.state):
            with pytest.raises(ApiError) as err:
                call(name)
            assert err.value.reason == "unknown_stream"
    assert c.versions() == before
    out = ctl(cluster, 1, "report-version", "driver", "560.1")
    assert out.returncode == 1 and "unknown_version" in out.stderr
