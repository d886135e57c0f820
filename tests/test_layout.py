"""The package's shape: no import cycle, no room over 600 lines, tooling outside.

Imports are read from the source (every ``import`` and ``from ... import`` of a
``convergenced`` module, including those inside functions and under
``TYPE_CHECKING``: a cycle that only type checking sees is still two modules that
cannot be understood one without the other).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "convergenced"
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The package's modules that the module at ``path`` imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            # "from pkg import mod" imports pkg.mod when that is a module.
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    graph = {name: _imports(path, name, known) for name, path in modules.items()}
    # A package's __init__ is imported with any of its modules; it is no edge of its own.
    for name, deps in graph.items():
        deps.discard(name.rpartition(".")[0])
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return [*stack[stack.index(m) :], m]
            if m not in state and (found := visit(m)) is not None:
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)) is not None:
            return found
    return None


def test_the_package_has_no_import_cycle() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_of_the_package_is_over_600_lines() -> None:
    big = {
        name: n
        for name, path in _modules().items()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert big == {}, f"split along their ideas: {big}"


def test_the_daemon_imports_no_tooling_and_the_core_no_adapter() -> None:
    graph = _graph()
    for name, deps in graph.items():
        if name.startswith("convergenced.daemon"):
            assert not any(d.startswith("convergenced.tools") for d in deps), name
        if name.startswith("convergenced.core"):
            layers = ("convergenced.daemon", "convergenced.sim", "convergenced.security")
            assert not any(d.startswith(layers) for d in deps), name
