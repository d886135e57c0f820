"""``[verification]``: how often the daemon reads its ranks' checkpoints again, and how
fast; ``[drill]``: test restores on a schedule (docs/verification.md)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from convergenced.core.validate import NAME_RE
from convergenced.errors import ConfigError

DEFAULT_PERIOD_S: Final = 3600.0
DEFAULT_BANDWIDTH_MB_S: Final = 50.0
"""A fraction of one NVMe drive or object-store connection: verification must not
compete with training I/O (a checkpoint save, a data loader)."""
_KEYS: Final = {"period_s", "bandwidth_mb_s"}


@dataclass(frozen=True, slots=True)
class VerificationConfig:
    """``[verification]`` (every key optional)."""

    period_s: float = DEFAULT_PERIOD_S
    """A pass over every retained epoch that has a location starts this often (a pass
    that takes longer is followed at once by the next). 0 turns verification off."""
    bandwidth_mb_s: float = DEFAULT_BANDWIDTH_MB_S
    """The most the verifier reads, in MB (10^6 bytes) per second on average; 0: no cap."""

    @property
    def enabled(self) -> bool:
        """Whether the verifier runs."""
        return self.period_s > 0

    @property
    def bytes_per_s(self) -> float:
        """The cap in bytes per second (0: none)."""
        return self.bandwidth_mb_s * 1e6


def _table(raw: Mapping[str, Any], name: str, keys: set[str], source: str) -> Mapping[str, Any]:
    """The table ``name`` of ``raw`` ({} when absent), with no key outside ``keys``.

    Raises:
        ConfigError: not a table, or an unknown key.
    """
    table = raw.get(name, {})
    if not isinstance(table, Mapping):
        raise ConfigError(source, name, "expected a table")
    for key in table:
        if key not in keys:
            raise ConfigError(
                source, f"{name}.{key}", f"unknown key; expected one of {sorted(keys)}"
            )
    return table


def parse_verification(raw: Mapping[str, Any], source: str) -> VerificationConfig:
    """Validate the ``[verification]`` table of ``raw`` (absent: the defaults).

    Raises:
        ConfigError: naming the key.
    """
    table = _table(raw, "verification", _KEYS, source)

    def seconds(key: str, default: float, hi: float) -> float:
        value = table.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= hi:
            raise ConfigError(source, f"verification.{key}", f"{value!r}; expected 0 to {hi:g}")
        return float(value)

    return VerificationConfig(
        period_s=seconds("period_s", DEFAULT_PERIOD_S, 30 * 24 * 3600.0),
        bandwidth_mb_s=seconds("bandwidth_mb_s", DEFAULT_BANDWIDTH_MB_S, 1e6),
    )


_DRILL_KEYS: Final = {"every_s", "streams", "hook", "scratch", "hook_timeout_s"}
MAX_HOOK_ARGS: Final = 64


@dataclass(frozen=True, slots=True)
class DrillConfig:
    """``[drill]`` (every key optional)."""

    every_s: float = 0.0
    """A drill of each stream runs this often (0: only on request)."""
    streams: tuple[str, ...] = ()
    """The streams scheduled drills restore (empty: every stream declared here)."""
    hook: tuple[str, ...] = ()
    """A command run after the bytes were restored and checked (its argv; empty:
    none); exit status 0 passes the drill."""
    scratch: Path | None = None
    """Where drills restore the bytes to (removed afterwards); None: they are read and
    checked only."""
    hook_timeout_s: float = 3600.0
    """A hook still running after this long is killed, and fails the drill."""


def parse_drill(raw: Mapping[str, Any], source: str) -> DrillConfig:
    """Validate the ``[drill]`` table of ``raw`` (absent: the defaults).

    Raises:
        ConfigError: naming the key.
    """
    table = _table(raw, "drill", _DRILL_KEYS, source)
    every = table.get("every_s", 0)
    if isinstance(every, bool) or not isinstance(every, int | float) or not 0 <= every <= 1e8:
        raise ConfigError(source, "drill.every_s", f"{every!r}; expected seconds, 0 for none")
    if 0 < every < 1:
        raise ConfigError(source, "drill.every_s", f"{every!r}; at least 1 second")

    def strings(key: str, limit: int, check: Callable[[str], bool], what: str) -> tuple[str, ...]:
        value = table.get(key, [])
        if (
            not isinstance(value, list)
            or len(value) > limit
            or not all(isinstance(v, str) and check(v) for v in value)
        ):
            raise ConfigError(source, f"drill.{key}", f"{value!r}; expected a list of {what}")
        return tuple(value)

    streams = strings("streams", 1024, lambda v: bool(NAME_RE.match(v)), "stream names")
    hook = strings("hook", MAX_HOOK_ARGS, lambda v: 0 < len(v) <= 4096 and "\0" not in v,
                   "arguments (the command, then its arguments)")  # fmt: skip
    if hook and not Path(hook[0]).is_absolute():
        raise ConfigError(source, "drill.hook", f"{hook[0]!r}: name the command by its full path")
    scratch = table.get("scratch")
    if scratch is not None and (not isinstance(scratch, str) or not Path(scratch).is_absolute()):
        raise ConfigError(source, "drill.scratch", f"{scratch!r}; expected an absolute path")
    timeout = table.get("hook_timeout_s", 3600.0)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= 1e6:
        raise ConfigError(source, "drill.hook_timeout_s", f"{timeout!r}; expected seconds above 0")
    return DrillConfig(float(every), streams, hook, None if scratch is None else Path(scratch),
                       float(timeout))  # fmt: skip
