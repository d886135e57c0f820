"""What a newcomer meets first: `convergencectl status` says when the node is
insecure, and the hints of `convergenced ca` name only options that exist.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from daemons import LocalCluster

from convergenced import cli
from convergenced.ctl.formatting import format_status
from convergenced.daemon.peers.security import INSECURE_WARNING

STATUS: dict[str, Any] = {
    "node": "node-1",
    "cluster": "local",
    "version": "0.1.0",
    "incarnation": 1,
    "uptime_s": 3.0,
    "socket": "/tmp/x.sock",
    "peers": [],
    "clients": 0,
    "streams": [],
    "links": [],
    "warnings": [],
}


def _ctl_status(cluster: LocalCluster) -> str:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "convergenced.ctl",
            "--socket",
            str(cluster.socket_path(1)),
            "status",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return proc.stdout


# -- status shows the warnings -----------------------------------------------------


def test_status_text_shows_every_warning_right_after_the_node() -> None:
    lines = format_status({**STATUS, "warnings": [INSECURE_WARNING]}).splitlines()
    assert lines[0].startswith("node")
    assert lines[1].split(None, 1) == ["warning", INSECURE_WARNING]


def test_status_text_has_no_warning_line_without_warnings() -> None:
    assert "warning" not in format_status(STATUS)


def test_status_of_an_insecure_daemon_says_insecure() -> None:
    with LocalCluster(1, insecure=True) as cluster:
        cluster.start(1)
        assert "warning  INSECURE: plaintext peer links" in _ctl_status(cluster)


def test_status_of_a_secure_daemon_has_no_warning() -> None:
    with LocalCluster(1) as cluster:
        cluster.start(1)
        assert "INSECURE" not in _ctl_status(cluster)


# -- convergenced ca: hints that are true ------------------------------------------------


def _ca(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(["ca", *argv])
    return code, capsys.readouterr().err


def test_ca_init_over_an_existing_ca_does_not_offer_a_force_it_lacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _ca(["init", str(tmp_path)], capsys)[0] == 0
    code, err = _ca(["init", str(tmp_path)], capsys)
    assert code == 1
    assert "--force" not in err
    assert "refusing to replace the cluster CA" in err and "another directory" in err
    with pytest.raises(SystemExit):  # ... and indeed it has none
        cli.main(["ca", "init", str(tmp_path), "--force"])


def test_ca_issue_over_existing_files_offers_force_which_re_issues(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _ca(["init", str(tmp_path)], capsys)[0] == 0
    assert _ca(["issue", "n1", "--dir", str(tmp_path)], capsys)[0] == 0
    before = (tmp_path / "n1.crt").read_bytes()
    code, err = _ca(["issue", "n1", "--dir", str(tmp_path)], capsys)
    assert code == 1
    assert (
        err
        == f"convergenced ca issue: {tmp_path / 'n1.crt'}: already exists; --force re-issues it\n"
    )
    assert _ca(["issue", "n1", "--dir", str(tmp_path), "--force"], capsys)[0] == 0
    assert (tmp_path / "n1.crt").read_bytes() != before
