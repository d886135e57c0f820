"""``convergenced marker`` as a process: bad input gets a clear error, and changes nothing.

One real daemon (node-1 of a two-node configuration, node-2 never started), and the
marker run as a real process against it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemons import LocalCluster


@pytest.fixture(scope="module")
def node() -> Iterator[LocalCluster]:
    with LocalCluster(2) as c:
        c.start(1)
        c.client(1).declare(c.spec("job"))
        (c.dir / "ckpt").mkdir()
        yield c


def marker(
    c: LocalCluster, *args: str, socket: Path | None = None
) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "convergenced.cli", "marker",
            "--socket", str(socket or c.socket_path(1)), *args]  # fmt: skip
    return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60)


def base(c: LocalCluster, *extra: str) -> list[str]:
    return ["--format", "megatron", "--dir", str(c.dir / "ckpt"), "--domain", "nvme", *extra]


def test_an_unknown_format_is_a_usage_error(node: LocalCluster) -> None:
    r = marker(node, "--format", "orbax", "--dir", "/tmp", "--domain", "nvme", "--stream", "job")
    assert r.returncode == 2 and "invalid choice: 'orbax'" in r.stderr


def test_a_directory_it_cannot_list_is_refused_naming_it(node: LocalCluster) -> None:
    missing = node.dir / "nowhere"
    r = marker(node, "--format", "deepspeed", "--dir", str(missing), "--domain", "nvme",
               "--stream", "job", "--once")  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.strip() == f"convergenced marker: {missing}: not a directory"


def test_a_spec_that_does_not_name_this_node_is_refused_and_not_declared(
    node: LocalCluster, tmp_path: Path
) -> None:
    spec = tmp_path / "other.json"
    spec.write_text(json.dumps({
        "name": "elsewhere", "members": {"node-2": [0]},
        "policy": {"mode": "all", "domains": ["nvme"]},
    }))  # fmt: skip
    r = marker(node, *base(node, "--spec", str(spec), "--once"))
    assert r.returncode == 2
    assert "does not name this node (node-1) among its members (node-2)" in r.stderr, r.stderr
    assert "elsewhere" not in node.client(1).streams()


def test_a_domain_the_policy_does_not_name_is_refused(node: LocalCluster) -> None:
    r = marker(node, "--format", "megatron", "--dir", str(node.dir / "ckpt"), "--domain", "s3",
               "--stream", "job", "--once")  # fmt: skip
    assert r.returncode == 2 and "domain 's3' is not in the stream's policy (nvme)" in r.stderr


def test_a_world_that_is_not_the_specs_ranks_is_refused(node: LocalCluster) -> None:
    r = marker(node, *base(node, "--stream", "job", "--tp", "4", "--dp", "1", "--once"))
    assert r.returncode == 2 and "are not 0..3" in r.stderr, r.stderr
    r = marker(node, *base(node, "--stream", "job", "--tp", "3", "--once"))
    assert r.returncode == 2 and "not a multiple of tp * pp = 3" in r.stderr


def test_a_stream_not_declared_here_asks_for_a_spec(node: LocalCluster) -> None:
    r = marker(node, *base(node, "--stream", "nosuch", "--once"))
    assert r.returncode == 2 and "'nosuch' is not declared on this node: give --spec" in r.stderr


def test_options_of_another_format_are_refused(node: LocalCluster) -> None:
    r = marker(node, *base(node, "--stream", "job", "--zero-stage", "2", "--once"))
    assert r.returncode == 2 and "--zero-stage and --bf16-optimizer are DeepSpeed's" in r.stderr


def test_an_unreachable_daemon_exits_3(node: LocalCluster) -> None:
    r = marker(node, *base(node, "--stream", "job", "--once"), socket=node.dir / "no.sock")
    assert r.returncode == 3 and "daemon unreachable" in r.stderr


def test_once_with_nothing_agreed_leaves_no_latest_file(node: LocalCluster) -> None:
    ckpt = node.dir / "ckpt"
    (ckpt / "latest_checkpointed_iteration.txt").write_text("100")  # never agreed
    r = marker(node, *base(node, "--stream", "job", "--settle", "0", "--once"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "latest: none"
    assert not (ckpt / "latest_checkpointed_iteration.txt").exists()
    assert node.client(1).state("job")["recoverable"] == []  # nothing committed
