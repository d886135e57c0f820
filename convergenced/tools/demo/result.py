"""What one demo run found: `DemoResult`, also the object ``--json`` prints.

Its own module because the story fills it in and the command (`main`) turns it into the
verdict and the JSON, also when the story never got to run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DemoResult:
    """What the demo found; `as_json` is what ``--json`` prints."""

    verified: bool = False
    scenario: str = "restart"
    restore_point: int | None = None
    bitwise_equal: bool = False
    marker_epoch: int | None = None
    marker_valid: bool | None = None
    marker_missing_ranks: list[int] = field(default_factory=list)
    marker_error: str | None = None
    marker_bitwise_equal: bool | None = None
    crash_epoch: int | None = None
    restored: dict[str, int | None] = field(default_factory=dict)
    restored_from: dict[str, str | None] = field(default_factory=dict)
    members: dict[str, list[int]] = field(default_factory=dict)
    launch: dict[str, int] | None = None
    adopted: list[int] = field(default_factory=list)
    final_restore_point: int | None = None
    final_digest: str | None = None
    reference_digest: str | None = None
    metrics: dict[str, str] = field(default_factory=dict)
    steps: int = 0
    every: int = 0
    elapsed_s: float = 0.0
    problems: list[str] = field(default_factory=list)
    verdict: str = ""

    def as_json(self) -> dict[str, Any]:
        """The JSON object printed by ``--json``."""
        return {
            "verified": self.verified,
            "scenario": self.scenario,
            "restore_point": self.restore_point,
            "bitwise_equal": self.bitwise_equal,
            "marker_epoch": self.marker_epoch,
            "marker_valid": self.marker_valid,
            "marker_missing_ranks": self.marker_missing_ranks,
            "marker_error": self.marker_error,
            "marker_bitwise_equal": self.marker_bitwise_equal,
            "crash_epoch": self.crash_epoch,
            "restored": self.restored,
            "restored_from": self.restored_from,
            "members": self.members,
            "launch": self.launch,
            "adopted": self.adopted,
            "final_restore_point": self.final_restore_point,
            "final_digest": self.final_digest,
            "reference_digest": self.reference_digest,
            "metrics": self.metrics,
            "steps": self.steps,
            "every": self.every,
            "elapsed_s": self.elapsed_s,
            "problems": self.problems,
            "verdict": self.verdict,
        }
