"""Security around real daemon processes: the keygen and ca commands, start-up
refusals for missing or mismatched identities, the loud insecure mode, and a dialled
peer that presents another node's certificate. (Hostile input on both ports is in
test_hostile.py; the building blocks are unit-tested in test_security.py.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemons import LocalCluster

from convergenced import cli


def _run(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "convergenced.cli", "run", "--config", str(config)],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_keygen_and_ca_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = tmp_path / "ids" / "n1.key"
    assert cli.main(["keygen", "n1", "--out", str(key)]) == 0
    out = capsys.readouterr().out
    assert '"n1" = "' in out and key.stat().st_mode & 0o777 == 0o600
    assert cli.main(["keygen", "n1", "--out", str(key)]) == 1
    assert "--force" in capsys.readouterr().err
    assert cli.main(["keygen", "n1", "--out", str(key), "--force"]) == 0
    ca = tmp_path / "ca"
    assert cli.main(["ca", "init", str(ca)]) == 0
    assert cli.main(["ca", "init", str(ca)]) == 1
    assert cli.main(["ca", "issue", "n1", "--dir", str(ca), "--host", "10.0.0.1"]) == 0
    assert (ca / "n1.crt").exists() and (ca / "n1.key").stat().st_mode & 0o777 == 0o600
    assert cli.main(["ca", "issue", "n1", "--dir", str(tmp_path / "nope")]) == 1


def test_a_node_without_its_identity_or_with_another_refuses_to_start() -> None:
    with LocalCluster(2) as cluster:
        home = cluster.dir / "node-1"
        (home / "identity.key").rename(home / "elsewhere.key")
        proc = _run(cluster.configs[0])
        assert proc.returncode == 1
        assert "identity.key" in proc.stderr and "convergenced keygen" in proc.stderr
        # node-2's key is a valid identity, but not node-1's.
        shutil.copy2(cluster.dir / "node-2" / "identity.key", home / "identity.key")
        proc = _run(cluster.configs[0])
        assert proc.returncode == 1
        assert "node-2" in proc.stderr


def test_insecure_mode_is_announced_at_start_and_in_every_status(tmp_path: Path) -> None:
    with LocalCluster(2, insecure=True) as cluster:
        cluster.start_all()
        status = cluster.client(1).status()
        assert status["insecure"] is True
        assert any("INSECURE" in w for w in status["warnings"])
        assert "INSECURE" in cluster.log(1)
        c1, c2 = cluster.client(1), cluster.client(2)
        for c in (c1, c2):
            c.declare(cluster.spec())
        c1.commit("job", 0, "nvme", 1)
        c2.commit("job", 1, "nvme", 1)
        assert c1.wait("job", 1, timeout=20)["restore_point"] == 1


def test_a_peer_presenting_another_nodes_certificate_is_refused_and_counted() -> None:
    with LocalCluster(3) as cluster:
        # node-1 dials "node-2" at node-3's port: node-3's certificate names node-3.
        cfg = cluster.configs[0]
        cfg.write_text(
            cfg.read_text().replace(
                f"127.0.0.1:{cluster.base_port + 1}", f"127.0.0.1:{cluster.base_port + 2}"
            )
        )
        cluster.start_all()
        c1 = cluster.client(1)
        deadline = time.monotonic() + 20
        while c1.status()["counters"].get("peer_refused_tls_wrong_peer", 0) == 0:
            assert time.monotonic() < deadline, cluster.log(1)
            time.sleep(0.05)
        # node-1 links to node-3 (its own dial to it is unaffected), never to "node-2".
        while "node-3" not in {link["peer"] for link in c1.status()["links"]}:
            assert time.monotonic() < deadline, cluster.log(1)
            time.sleep(0.05)
        assert "node-2" not in {link["peer"] for link in c1.status()["links"]}
