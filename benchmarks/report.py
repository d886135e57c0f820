"""BENCHMARKS.md from the benchmark scripts' own output.

Each script run with ``--out DIR`` writes ``DIR/<name>.md``: the command that produced
it, the machine, and its tables (and ``DIR/<name>.png`` where it draws a plot).
``python benchmarks/report.py DIR BENCHMARKS.md`` then replaces, in BENCHMARKS.md, the
text between ``<!-- bench:<name> -->`` and ``<!-- /bench:<name> -->`` by that
fragment. The prose around the markers (what is measured and why the numbers are what
they are) is written by hand; the numbers inside them only ever come from a run, so
``make bench`` regenerates every table and plot without touching the explanations.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

IMAGE = re.compile(r"\]\(([\w.-]+\.png)\)")
"""A Markdown image or link to a plot beside the fragment: ``](name.png)``."""
MARKER = re.compile(
    r"(<!-- bench:(?P<name>[a-z0-9_-]+) -->\n)(.*?)(<!-- /bench:(?P=name) -->)", re.S
)


def command_line(script: str, argv: Sequence[str]) -> str:
    """The command that reproduces this run, without ``--out DIR`` and ``--json``."""
    args: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--out":
            skip = True
            continue
        if arg.startswith("--out=") or arg == "--json":
            continue
        args.append(arg)
    rel = Path(script).resolve().relative_to(Path(__file__).resolve().parent.parent)
    return shlex.join([".venv/bin/python", str(rel), *args])


def write_fragment(
    out: Path, name: str, command: str, machine: dict[str, Any], body: str, *, text: str = ""
) -> Path:
    """Write ``out/<name>.md``: the command, the machine, ``text`` (Markdown) and
    ``body`` (a preformatted table) in a code block."""
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        f"Command: `{command}`",
        "",
        f"Machine: {machine.get('cpu_count')} cores ({machine.get('cpu')}), Python "
        f"{machine.get('python')}, load average at start {machine.get('loadavg_at_start')}.",
        "",
    ]
    if text:
        lines += [text.rstrip(), ""]
    lines += ["```", body.rstrip(), "```", ""]
    path = out / f"{name}.md"
    path.write_text("\n".join(lines))
    return path


def splice(document: str, fragments: dict[str, str]) -> tuple[str, list[str]]:
    """``document`` with each marked section replaced by its fragment; also the names
    replaced."""
    done: list[str] = []

    def replace(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in fragments:
            return m.group(0)
        done.append(name)
        return m.group(1) + fragments[name].rstrip() + "\n" + m.group(4)

    return MARKER.sub(replace, document), done


def main(argv: Sequence[str] | None = None) -> int:
    """``report.py DIR DOCUMENT``: splice every ``DIR/*.md`` into DOCUMENT."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: report.py RESULTS_DIR BENCHMARKS.md", file=sys.stderr)
        return 2
    out, doc = Path(args[0]), Path(args[1])
    # Plots sit beside the fragments: point their links there from the document.
    rel = Path(os.path.relpath(out, doc.parent)).as_posix()
    fragments = {
        p.stem: IMAGE.sub(rf"]({rel}/\1)", p.read_text()) for p in sorted(out.glob("*.md"))
    }
    text, done = splice(doc.read_text(), fragments)
    missing = sorted(set(fragments) - set(done))
    if missing:
        print(f"report.py: no markers in {doc} for {', '.join(missing)}", file=sys.stderr)
        return 1
    doc.write_text(text)
    print(f"report.py: {doc}: regenerated {', '.join(done) or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
