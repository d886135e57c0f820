"""The protocol core is sans-IO: no module of convergenced.core imports trio or socket.

Each module is imported in a fresh interpreter, so the check is transitive (a helper
that pulls in socket through some other package is caught too) and no module can
hide behind one imported earlier. A direct AST check names the offending line, and a
control case proves the probe really detects a socket import.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import convergenced.core

CORE_DIR = Path(convergenced.core.__file__).parent
CORE_MODULES = sorted(
    "convergenced.core" if p.stem == "__init__" else f"convergenced.core.{p.stem}"
    for p in CORE_DIR.glob("*.py")
)
FORBIDDEN = ("trio", "socket", "_socket")
"""Top-level packages the core must never load, directly or transitively."""
CLOCK_MODULES = ("time", "datetime", "asyncio", "threading", "random")
"""Modules the core must not import itself: no clock, no concurrency, no chance."""

_PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
"""


def _loaded_top_level_packages(module: str) -> set[str]:
    """Import ``module`` in a fresh interpreter and return every top-level package loaded."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, module],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, f"importing {module} failed:\n{proc.stderr}"
    return set(json.loads(proc.stdout))


def _direct_imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level module) of every import statement in ``path``, at any depth."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name.split(".")[0]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def test_core_package_has_modules_to_check() -> None:
    assert "convergenced.core.interval_set" in CORE_MODULES
    assert "convergenced.core.node" in CORE_MODULES
    assert "convergenced.core.link" in CORE_MODULES


def test_probe_detects_a_transitive_socket_import() -> None:
    # Control: socketserver imports socket, so the probe must report it.
    assert "socket" in _loaded_top_level_packages("socketserver")


@pytest.mark.parametrize("module", CORE_MODULES)
def test_core_module_loads_neither_trio_nor_socket(module: str) -> None:
    loaded = _loaded_top_level_packages(module)
    assert not loaded & set(FORBIDDEN), f"{module} loads {sorted(loaded & set(FORBIDDEN))}"


@pytest.mark.parametrize("path", sorted(CORE_DIR.glob("*.py")), ids=lambda p: p.name)
def test_core_module_source_imports_no_io_clock_or_concurrency(path: Path) -> None:
    banned = set(FORBIDDEN) | set(CLOCK_MODULES)
    offending = [(line, mod) for line, mod in _direct_imports(path) if mod in banned]
    assert not offending, f"{path.name} imports {offending}"
