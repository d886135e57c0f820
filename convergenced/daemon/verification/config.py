"""``[verification]``: how often the daemon reads its ranks' checkpoints again, and how
fast (docs/verification.md)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

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


def parse_verification(raw: Mapping[str, Any], source: str) -> VerificationConfig:
    """Validate the ``[verification]`` table of ``raw`` (absent: the defaults).

    Raises:
        ConfigError: naming the key.
    """
    table = raw.get("verification", {})
    if not isinstance(table, Mapping):
        raise ConfigError(source, "verification", "expected a table")
    for key in table:
        if key not in _KEYS:
            raise ConfigError(
                source, f"verification.{key}", f"unknown key; expected one of {sorted(_KEYS)}"
            )

    def seconds(key: str, default: float, hi: float) -> float:
        value = table.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= hi:
            raise ConfigError(source, f"verification.{key}", f"{value!r}; expected 0 to {hi:g}")
        return float(value)

    return VerificationConfig(
        period_s=seconds("period_s", DEFAULT_PERIOD_S, 30 * 24 * 3600.0),
        bandwidth_mb_s=seconds("bandwidth_mb_s", DEFAULT_BANDWIDTH_MB_S, 1e6),
    )
