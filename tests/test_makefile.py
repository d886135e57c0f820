"""The Makefile's set-up: `make demo` installs only what the demo needs (no PyTorch, no
dev tools), `make test` and its parts the rest (PyTorch pinned to the CPU build); both
create .venv when it is missing and do nothing when nothing changed.

Read from `make -n` (what make would run) in a directory holding only the Makefile and
pyproject.toml, so nothing is installed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_OUTER_MAKE = {"MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES", "MAKE_TERMOUT", "MAKE_TERMERR"}

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy2(REPO / name, tmp_path / name)
    os.utime(tmp_path / "pyproject.toml", (1_000_000, 1_000_000))
    return tmp_path


def _would_run(checkout: Path, target: str) -> list[str]:
    # Under `make test` this runs inside make: drop what the outer make exports
    # (MAKELEVEL makes the inner one print "Entering directory" lines).
    env = {k: v for k, v in os.environ.items() if k not in _OUTER_MAKE}
    out = subprocess.run(
        ["make", "--no-print-directory", "-n", target],
        cwd=checkout,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return out.splitlines()


def _installs(commands: list[str]) -> list[str]:
    return [c for c in commands if "pip install" in c]


def _built(checkout: Path, *stamps: str) -> None:
    """A venv as a previous run left it, with ``stamps`` newer than pyproject.toml."""
    bin_dir = checkout / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text("")
    for stamp in stamps:
        (checkout / ".venv" / stamp).write_text("")


def test_demo_creates_the_venv_and_installs_the_package_without_torch(checkout: Path) -> None:
    commands = _would_run(checkout, "demo")
    assert commands[0] == "python3 -m venv .venv"
    (install,) = _installs(commands)
    assert install.endswith(" -e .")
    assert "torch" not in install and "dev" not in install
    assert commands[-1] == ".venv/bin/convergenced demo"


@pytest.mark.parametrize("target", ["lint", "typecheck", "pytest", "test", "install"])
def test_the_test_targets_create_the_venv_and_install_dev_tools_and_pinned_torch(
    checkout: Path, target: str
) -> None:
    commands = _would_run(checkout, target)
    assert commands[0] == "python3 -m venv .venv"
    (install,) = _installs(commands)
    extras = re.search(r"'\.\[([a-z0-9,]+)\]'", install)
    assert extras is not None
    assert {"dev", "torch", "s3", "torchtitan"} <= set(extras.group(1).split(","))
    assert "'torch==2.13.0'" in install


def test_demo_does_nothing_but_the_demo_when_nothing_changed(checkout: Path) -> None:
    _built(checkout, ".installed-run")
    assert _would_run(checkout, "demo") == [".venv/bin/convergenced demo"]


def test_demo_after_the_test_set_up_installs_nothing_more(checkout: Path) -> None:
    _built(checkout, ".installed-dev", ".installed-run")  # as the dev install leaves them
    assert _installs(_would_run(checkout, "demo")) == []
    assert _installs(_would_run(checkout, "lint")) == []


def test_the_demo_set_up_alone_does_not_satisfy_the_tests(checkout: Path) -> None:
    _built(checkout, ".installed-run")
    commands = _would_run(checkout, "lint")
    assert "python3 -m venv .venv" not in commands  # the venv is there already
    assert len(_installs(commands)) == 1


def test_a_changed_pyproject_reinstalls(checkout: Path) -> None:
    _built(checkout, ".installed-run", ".installed-dev")
    later = time.time() + 10
    os.utime(checkout / "pyproject.toml", (later, later))  # newer than the stamps
    assert len(_installs(_would_run(checkout, "demo"))) == 1
    assert len(_installs(_would_run(checkout, "lint"))) == 1
