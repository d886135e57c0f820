"""`convergenced rollout` against four real daemons running two jobs.

Job ``a`` runs on node-1 and node-2, job ``b`` on node-3 and node-4; every node runs
driver 550.54.15 and accepts 555.42.02 beside it. The plan moves the four nodes to
555.42.02 with a canary, waves of two and at most one member of a job down at once.
The upgrade hook is a script that can be told to fail on a node, or to wait while
the test kills that node's daemon (kill -9) and starts it again, as a driver
upgrade that reboots the host would. The plan's waves and the job-limit are also
checked without daemons.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemons import LocalCluster, until

from convergenced.rollout.plan import PlanError, parse, waves

OLD, NEW = "550.54.15", "555.42.02"
HOOK = """
import os, pathlib, sys, time
node, d = os.environ["CONVERGENCED_NODE"], pathlib.Path(sys.argv[1])
with open(d / "hook.log", "a") as log:
    log.write(f"{node} {os.environ['CONVERGENCED_VERSION']}\\n")
if (d / f"fail-{node}").exists():
    sys.exit("firmware flash failed")
if (d / f"reboot-{node}").exists():
    (d / f"reboot-{node}").rename(d / f"rebooting-{node}")
    deadline = time.monotonic() + 60
    while not (d / f"rebooted-{node}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
"""


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(4) as c:
        for path in c.configs:
            with path.open("a") as f:
                f.write(f'\n[components.driver]\nversions = ["{OLD}", "{NEW}"]\n'
                        f'running = "{OLD}"\naccepts = ["{OLD}", "{NEW}"]\n')  # fmt: skip
        c.start_all()
        for job, nodes in (("a", (1, 2)), ("b", (3, 4))):
            spec = {"name": job, "members": {c.name(i): [k] for k, i in enumerate(nodes)},
                    "policy": {"mode": "all", "domains": ["nvme"]}, "retention": 1}  # fmt: skip
            for k, i in enumerate(nodes):
                c.client(i).declare(spec)
                for e in (1, 2):
                    c.client(i).commit(job, k, "nvme", e)
        yield c


@pytest.fixture(scope="module")
def plan(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("rollout")
    (d / "hook.py").write_text(HOOK)
    ctl = [sys.executable, "-m", "convergenced.ctl", "--socket",
           f"{cluster.dir}/{{node}}/convergenced.sock"]  # fmt: skip
    text = f"""
component = "driver"
version = "{NEW}"
accepts = ["{OLD}", "{NEW}"]
nodes = ["node-1", "node-2", "node-3", "node-4"]
canary = 1
wave_size = 2
max_down_per_job = 1
checkpoint = false
ctl = {json.dumps(ctl)}
upgrade = {json.dumps([sys.executable, str(d / "hook.py"), str(d)])}
gate_timeout_s = 20
upgrade_timeout_s = 90
back_timeout_s = 30
"""
    (d / "plan.toml").write_text(text)
    return d / "plan.toml"


def rollout(plan: Path, *argv: str) -> tuple[int, dict[str, object], str]:
    argv_ = [sys.executable, "-m", "convergenced.cli", "rollout", str(plan), "--json", *argv]
    p = subprocess.run(argv_, capture_output=True, text=True, timeout=240, check=False)
    return p.returncode, json.loads(p.stdout.splitlines()[-1]), p.stderr


def running(cluster: LocalCluster, i: int) -> str:
    return str(cluster.client(i).versions()["components"]["driver"]["running"])


def notes(cluster: LocalCluster, i: int) -> list[dict[str, object]]:
    return [json.loads(t) for t in cluster.client(i).versions()["rollout_notes"]]


def test_a_dry_run_prints_the_waves_and_changes_nothing(cluster: LocalCluster, plan: Path) -> None:
    until(lambda: all(cluster.client(i).state(j)["knowledge"] == "published"
                      for i, j in ((1, "a"), (3, "b"))), what="restore points")  # fmt: skip
    rc, report, log = rollout(plan, "--dry-run")
    assert rc == 0, log
    assert report["waves"] == [["node-1"], ["node-2", "node-3"], ["node-4"]]
    assert "canary: node-1" in log and "wave 2: node-2, node-3" in log
    assert all(running(cluster, i) == OLD and not notes(cluster, i) for i in (1, 2, 3, 4))
    assert not (plan.parent / "hook.log").exists()


def test_a_failed_upgrade_stops_the_rollout_and_a_second_run_finishes_it(
    cluster: LocalCluster, plan: Path
) -> None:
    d = plan.parent
    (d / "fail-node-3").touch()
    rc, report, log = rollout(plan)
    assert rc == 1, log
    states = {n: v["state"] for n, v in report["nodes"].items()}  # type: ignore[attr-defined]
    assert states == {"node-1": "done", "node-2": "done", "node-3": "failed",
                      "node-4": "skipped"}  # fmt: skip
    assert "firmware flash failed" in report["nodes"]["node-3"]["detail"]  # type: ignore[index]
    assert [running(cluster, i) for i in (1, 2, 3, 4)] == [NEW, NEW, OLD, OLD]
    failed = notes(cluster, 3)[-1]
    assert failed["step"] == "failed" and failed["before"] == OLD
    steps = [n["step"] for n in notes(cluster, 2)]
    assert steps == ["drained", "done"]
    done = notes(cluster, 2)[-1]
    assert done["before"] == OLD and done["after"] == NEW and "at" in done
    assert done["epochs"] == {"a": {"restore_point": 2, "knowledge": "published"}}
    assert done["memberships"] == {"a": 0} and done["generations"] == {"a": []}

    # Run again without --retry-failed: it stops at once, touching nothing.
    rc, report, _ = rollout(plan)
    assert rc == 1 and report["waves"] == [["node-4"]]

    # The flash is fixed; node-4's upgrade reboots it: its daemon dies (kill -9) and
    # comes back in the middle of its step.
    (d / "fail-node-3").unlink()
    (d / "reboot-node-4").touch()

    def reboot() -> None:
        deadline = time.monotonic() + 120
        while not (d / "rebooting-node-4").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        cluster.kill(4)
        cluster.start(4)
        (d / "rebooted-node-4").touch()

    watcher = threading.Thread(target=reboot, daemon=True)
    watcher.start()
    rc, report, log = rollout(plan, "--retry-failed")
    watcher.join(timeout=5)
    assert rc == 0, log
    states = {n: v["state"] for n, v in report["nodes"].items()}  # type: ignore[attr-defined]
    assert states == {"node-1": "already", "node-2": "already", "node-3": "done",
                      "node-4": "done"}  # fmt: skip
    assert (d / "rebooted-node-4").exists()
    assert [running(cluster, i) for i in (1, 2, 3, 4)] == [NEW] * 4
    assert [n["step"] for n in notes(cluster, 4)] == ["drained", "done"]  # kept through kill -9
    for i, job in ((1, "a"), (4, "b")):
        h = cluster.client(i).versions(job)["streams"][job]["driver"]
        assert h["acknowledged"] == NEW and h["knowledge"] == "published" and h["compatible"]
    hooked = (d / "hook.log").read_text().split()
    assert hooked.count("node-3") == 2 and hooked.count("node-4") == 1


def test_waves_never_hold_two_members_of_one_job() -> None:
    jobs = {"n1": ["a"], "n2": ["a", "b"], "n3": ["b"], "n4": ["c"], "n5": ["a"]}
    got = waves(list(jobs), jobs, canary=1, wave_size=3, max_down_per_job=1)
    assert got == [["n1"], ["n2", "n4"], ["n3", "n5"]]
    assert waves(["x", "y"], {}, canary=5, wave_size=1, max_down_per_job=1) == [["x", "y"]]
    two = waves(list(jobs), jobs, canary=1, wave_size=4, max_down_per_job=2)
    assert two == [["n1"], ["n2", "n3", "n4", "n5"]]


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"version": ""}, "version"),
        ({"accepts": ["1"]}, "accepts"),
        ({"nodes": ["a", "a"]}, "nodes"),
        ({"nodes": ["-a"]}, "nodes"),
        ({"upgrade": []}, "upgrade"),
        ({"canary": 0}, "canary"),
        ({"gate_timeout_s": -1}, "gate_timeout_s"),
        ({"checkpoint": "yes"}, "checkpoint"),
        ({"waves": 3}, "waves"),
        ({"component": "dri/ver"}, "component"),
    ],
)
def test_a_bad_plan_is_refused_naming_its_key(change: dict[str, object], key: str) -> None:
    good: dict[str, object] = {"component": "driver", "version": "2", "accepts": ["1", "2"],
                               "nodes": ["a", "b"], "upgrade": ["true"]}  # fmt: skip
    assert parse(good).id == parse(dict(good, canary=3)).id  # waves do not rename a plan
    with pytest.raises(PlanError, match=f"{key}: "):
        parse({**good, **change})


def test_the_command_exits_2_on_a_bad_plan(tmp_path: Path) -> None:
    (tmp_path / "p.toml").write_text('component = "driver"\n')
    argv = [sys.executable, "-m", "convergenced.cli", "rollout", str(tmp_path / "p.toml")]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 2 and "version" in p.stderr


class _FakeNodes:
    """A `Runner` standing in for convergencectl on each node (no daemons)."""

    def __init__(self, versions: dict[str, object] | None = None) -> None:
        self.calls: list[list[str]] = []
        self.versions = versions

    def __call__(self, argv: list[str], timeout: float, env: dict[str, str] | None):  # type: ignore[no-untyped-def]
        self.calls.append(argv)
        if self.versions is None:
            return 3, "", "cannot reach the daemon"
        return 0, json.dumps(self.versions) + "\n", ""


def _plan(**kw: object) -> object:
    return parse({"component": "driver", "version": NEW, "accepts": [OLD, NEW],
                  "nodes": ["node-1"], "upgrade": ["true"], **kw})  # fmt: skip


def test_words_added_to_an_ssh_template_are_quoted_for_the_remote_shell() -> None:
    from convergenced.rollout.driver import Rollout

    fake = _FakeNodes({})
    note = '{"a": "b c"}'
    Rollout(_plan(), runner=fake).ctl("node-1", "rollout-note", note)  # type: ignore[arg-type]
    assert fake.calls[-1] == ["ssh", "node-1", "convergencectl", "--json", "rollout-note",
                              "'{\"a\": \"b c\"}'"]  # fmt: skip
    local = Rollout(_plan(ctl=["convergencectl", "--socket", "/run/{node}.sock"]), runner=fake)  # type: ignore[arg-type]
    local.ctl("node-1", "rollout-note", note)
    assert fake.calls[-1][-1] == note


def test_a_node_out_of_reach_or_a_foreign_note_stops_nothing_with_a_traceback() -> None:
    from convergenced.rollout.driver import Rollout

    said: list[str] = []
    report = Rollout(_plan(), runner=_FakeNodes(None), say=said.append).run()  # type: ignore[arg-type]
    assert not report.ok and report.outcomes == {}
    assert said[-1].startswith("stopped before any node: node-1: convergencectl versions failed")
    versions = {"components": {"driver": {"running": NEW}}, "streams": {},
                "rollout_notes": ["hello", "[1]", '{"plan": "x"}']}  # fmt: skip
    report = Rollout(_plan(), runner=_FakeNodes(versions), say=said.append).run()  # type: ignore[arg-type]
    assert report.ok and report.outcomes["node-1"].state == "already"
