"""`convergenced check --config FILE`: "ok" and exit 0 for a configuration a daemon
would start with, otherwise one error naming the file and the key, and exit 1; either
way nothing is started, bound or written.

The configurations are those `convergenced cluster` writes (via tests/daemons.py); no
daemon is started, since checking starts nothing.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemons import LocalCluster

from convergenced import cli
from convergenced.security.keys import NodeIdentity


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(2) as c:
        yield c


def _check(config: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(["check", "--config", str(config)])
    out, err = capsys.readouterr()
    return code, out, err


def _error(config: Path, capsys: pytest.CaptureFixture[str]) -> str:
    code, out, err = _check(config, capsys)
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"convergenced check: {config}: ")
    return lines[0]


def _tree(root: Path) -> dict[str, tuple[int, float]]:
    return {str(p): (p.stat().st_mode, p.stat().st_mtime) for p in sorted(root.rglob("*"))}


def _home(cluster: LocalCluster) -> Path:
    return cluster.dir / "node-1"


def test_a_good_configuration_prints_ok_and_exits_0(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _check(cluster.configs[0], capsys) == (0, "ok\n", "")


def test_checking_writes_nothing_and_creates_no_state_directory(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.rmtree(_home(cluster) / "state")
    before = _tree(cluster.dir)
    assert _check(cluster.configs[0], capsys)[0] == 0
    assert _tree(cluster.dir) == before
    assert not cluster.socket_path(1).exists()


def test_a_missing_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "file not found" in _error(tmp_path / "absent.toml", capsys)


def test_a_bad_value_names_the_key(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = cluster.configs[0]
    cfg.write_text(cfg.read_text().replace("tick_ms = 20", 'tick_ms = "fast"'))
    assert "tick_ms: 'fast'" in _error(cfg, capsys)


def test_a_tls_key_that_does_not_match_its_certificate_names_tls_key(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    key = _home(cluster) / "tls" / "node-1.key"
    shutil.copy2(cluster.dir / "node-2" / "tls" / "node-2.key", key)
    line = _error(cluster.configs[0], capsys)
    assert f"tls.key: {key}: does not match the certificate" in line


def test_a_missing_ca_file_names_tls_ca(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    ca = cluster.dir / "ca" / "ca.crt"
    ca.unlink()
    assert f"tls.ca: {ca}:" in _error(cluster.configs[0], capsys)


def test_a_certificate_of_another_node_names_tls_cert(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    tls = _home(cluster) / "tls"
    for suffix in ("crt", "key"):
        shutil.copy2(cluster.dir / "node-2" / "tls" / f"node-2.{suffix}", tls / f"node-1.{suffix}")
    line = _error(cluster.configs[0], capsys)
    assert "tls.cert:" in line and "certificate of 'node-2'" in line


def test_a_missing_identity_key_names_identity_and_keygen(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    (_home(cluster) / "identity.key").unlink()
    line = _error(cluster.configs[0], capsys)
    assert "identity:" in line and "convergenced keygen" in line


def test_an_identity_its_trust_entry_does_not_list_names_the_trust_entry(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = cluster.configs[0]
    text = cfg.read_text()
    own = next(line for line in text.splitlines() if line.startswith('"node-1" = '))
    stranger = NodeIdentity.generate("node-1").public_key_hex()
    cfg.write_text(text.replace(own, f'"node-1" = "{stranger}"'))
    line = _error(cfg, capsys)
    assert "trust.node-1: is not the public key of" in line


def test_a_socket_directory_anyone_may_write_names_socket_path(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    os.chmod(_home(cluster), 0o777)
    line = _error(cluster.configs[0], capsys)
    assert "socket_path:" in line and "anyone may write" in line


def test_a_file_where_the_socket_goes_names_socket_path(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster.socket_path(1).write_text("")
    assert "socket_path:" in _error(cluster.configs[0], capsys)


def test_a_state_directory_under_a_file_names_state_dir(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    state = _home(cluster) / "state"
    shutil.rmtree(state)
    state.write_text("")
    cfg = cluster.configs[0]
    cfg.write_text(cfg.read_text().replace(f'state_dir = "{state}"', f'state_dir = "{state}/x"'))
    line = _error(cfg, capsys)
    assert f"state_dir: {state}: not a directory" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_a_directory_this_user_cannot_write_names_state_dir(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    state = _home(cluster) / "state"
    os.chmod(state, 0o500)
    try:
        assert "state_dir:" in _error(cluster.configs[0], capsys)
    finally:
        os.chmod(state, 0o750)


def test_check_is_listed_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "check" in capsys.readouterr().out
