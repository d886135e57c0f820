"""A rollout plan: which nodes move to which version of a component, in what waves.

The plan is a TOML file (docs/maintenance.md has a complete one)::

    component = "driver"
    version = "555.42.02"                  # the version to move to
    accepts = ["550.54.15", "555.42.02"]   # what an upgraded node accepts beside it
    nodes = ["gpu-001", "gpu-002", "gpu-003"]
    select = { pool = "a100" }             # optional: only nodes with these labels
    canary = 1                             # nodes in the first wave
    wave_size = 4                          # nodes per wave after it
    max_down_per_job = 1                   # members of one job down at once
    checkpoint = true                      # ask the jobs for a checkpoint per drain
    ctl = ["ssh", "{node}", "convergencectl"]             # reaching a node's daemon
    upgrade = ["ssh", "{node}", "sudo", "upgrade-driver", "{version}"]
    gate_timeout_s = 1800
    upgrade_timeout_s = 3600
    back_timeout_s = 600

`waves` cuts the nodes into waves: the canary first, then waves of at most
``wave_size`` nodes, none of which holds more than ``max_down_per_job`` members of
any one job. Waves run one after the other, so no job ever has more members down.
Pure: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from convergenced.core.validate import NAME_RE
from convergenced.core.versions import MAX_VERSION_CHARS, check_component_name
from convergenced.errors import ConvergencedError

MAX_NODES = 100_000
DEFAULT_CTL = ("ssh", "{node}", "convergencectl")
"""How the driver reaches a node's daemon by default: its convergencectl, over ssh."""
TEMPLATE_FIELDS = ("{node}", "{version}", "{component}")


class PlanError(ConvergencedError):
    """A rollout plan that cannot be used, naming the key."""


@dataclass(frozen=True, slots=True)
class Plan:
    """A validated rollout plan (see the module docstring)."""

    component: str
    version: str
    accepts: tuple[str, ...]
    nodes: tuple[str, ...]
    upgrade: tuple[str, ...]
    ctl: tuple[str, ...] = DEFAULT_CTL
    select: Mapping[str, str] = field(default_factory=dict)
    canary: int = 1
    wave_size: int = 1
    max_down_per_job: int = 1
    checkpoint: bool = True
    gate_timeout_s: float = 1800.0
    upgrade_timeout_s: float = 3600.0
    back_timeout_s: float = 600.0

    @property
    def id(self) -> str:
        """Twelve hex chars naming the plan in the audit notes: the component, the
        version and the nodes (editing the waves or timeouts keeps the id)."""
        key = json.dumps([self.component, self.version, sorted(self.nodes)])
        return hashlib.sha256(key.encode()).hexdigest()[:12]

    def argv(self, template: Sequence[str], node: str) -> list[str]:
        """``template`` with ``{node}``, ``{version}`` and ``{component}`` filled in."""
        return [
            part.replace("{node}", node)
            .replace("{version}", self.version)
            .replace("{component}", self.component)
            for part in template
        ]


def load(path: Path | str) -> Plan:
    """Read and validate a plan file.

    Raises:
        PlanError: naming the file and the key.
    """
    try:
        raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(f"{path}: cannot read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise PlanError(f"{path}: not valid TOML: {exc}") from None
    return parse(raw, str(path))


_KEYS = {
    "component", "version", "accepts", "nodes", "select", "canary", "wave_size",
    "max_down_per_job", "checkpoint", "ctl", "upgrade", "gate_timeout_s",
    "upgrade_timeout_s", "back_timeout_s",
}  # fmt: skip


def parse(raw: Mapping[str, Any], source: str = "<plan>") -> Plan:
    """Validate a parsed plan.

    Raises:
        PlanError: naming the key and what was expected.
    """

    def fail(key: str, problem: str) -> PlanError:
        return PlanError(f"{source}: {key}: {problem}")

    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise fail(unknown[0], f"unknown key; expected some of {', '.join(sorted(_KEYS))}")
    try:
        component = check_component_name(raw.get("component"), "component")
    except ConvergencedError as exc:
        raise fail("component", str(exc)) from None

    def version(v: Any, key: str) -> str:
        if not isinstance(v, str) or not 0 < len(v) <= MAX_VERSION_CHARS or v != v.strip():
            raise fail(key, f"{v!r}; expected a version string of 1 to {MAX_VERSION_CHARS} chars")
        return v

    target = version(raw.get("version"), "version")
    accepts_raw = raw.get("accepts", [target])
    if not isinstance(accepts_raw, list) or not accepts_raw:
        raise fail("accepts", "expected a non-empty list of versions")
    accepts = tuple(version(v, f"accepts[{i}]") for i, v in enumerate(accepts_raw))
    if target not in accepts:
        raise fail("accepts", f"an upgraded node accepts the version it runs ({target})")
    nodes_raw = raw.get("nodes")
    if not isinstance(nodes_raw, list) or not nodes_raw or len(nodes_raw) > MAX_NODES:
        raise fail("nodes", "expected a non-empty list of node ids")
    for n in nodes_raw:
        if not isinstance(n, str) or not NAME_RE.match(n):
            raise fail("nodes", f"{n!r} is not a node id")
    if len(set(nodes_raw)) != len(nodes_raw):
        raise fail("nodes", "a node is listed twice")
    select = raw.get("select", {})
    if not isinstance(select, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in select.items()
    ):
        raise fail("select", 'expected a table of label = "value"')

    def argv(key: str, default: tuple[str, ...] | None) -> tuple[str, ...]:
        v = raw.get(key, default)
        if v is None:
            raise fail(key, "missing: the command to run, as a list of words")
        if not isinstance(v, list | tuple) or not v or not all(isinstance(x, str) for x in v):
            raise fail(key, "expected a non-empty list of words, such as "
                            '["ssh", "{node}", "..."]')  # fmt: skip
        return tuple(v)

    def count(key: str, default: int) -> int:
        v = raw.get(key, default)
        if type(v) is not int or not 1 <= v <= MAX_NODES:
            raise fail(key, f"{v!r}; expected a whole number from 1")
        return v

    def seconds(key: str, default: float) -> float:
        v = raw.get(key, default)
        if not isinstance(v, int | float) or isinstance(v, bool) or not 0 < v <= 7 * 86400:
            raise fail(key, f"{v!r}; expected seconds, more than 0 and at most a week")
        return float(v)

    checkpoint = raw.get("checkpoint", True)
    if not isinstance(checkpoint, bool):
        raise fail("checkpoint", f"{checkpoint!r}; expected true or false")
    return Plan(
        component=component,
        version=target,
        accepts=accepts,
        nodes=tuple(nodes_raw),
        upgrade=argv("upgrade", None),
        ctl=argv("ctl", DEFAULT_CTL),
        select=dict(select),
        canary=count("canary", 1),
        wave_size=count("wave_size", 1),
        max_down_per_job=count("max_down_per_job", 1),
        checkpoint=checkpoint,
        gate_timeout_s=seconds("gate_timeout_s", 1800),
        upgrade_timeout_s=seconds("upgrade_timeout_s", 3600),
        back_timeout_s=seconds("back_timeout_s", 600),
    )


def waves(
    nodes: Sequence[str],
    jobs_of: Mapping[str, Sequence[str]],
    *,
    canary: int,
    wave_size: int,
    max_down_per_job: int,
) -> list[list[str]]:
    """Cut ``nodes`` (in plan order) into waves: ``canary`` nodes first, then waves of
    at most ``wave_size``, each holding at most ``max_down_per_job`` members of any
    one job (``jobs_of``: the jobs each node is a member of). A node goes into the
    first wave with room for it; every wave gets at least one node."""
    left = list(nodes)
    out: list[list[str]] = []
    while left:
        size = canary if not out else wave_size
        wave: list[str] = []
        down: dict[str, int] = {}
        for node in list(left):
            if len(wave) >= size:
                break
            jobs = jobs_of.get(node, ())
            if wave and any(down.get(j, 0) >= max_down_per_job for j in jobs):
                continue
            wave.append(node)
            left.remove(node)
            for j in jobs:
                down[j] = down.get(j, 0) + 1
        out.append(wave)
    return out
