"""The facts of the version handshake (`versions`): what a node reports of the
components it runs, and the notes a rollout driver keeps in its log. Part of
`facts.Fact`, which re-exports them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ComponentReport:
    """This node runs version ``running`` of ``component`` (a driver, a firmware, ...)
    and works beside peers that run any of ``accepts`` (`versions`). The latest report
    of a component replaces the one before."""

    component: str
    running: str
    accepts: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RolloutNote:
    """One entry of this node's rollout audit trail, written by a rollout driver
    (a node drained, upgraded, failed...): opaque to the core, a JSON object as text.
    The node keeps its newest `versions.MAX_ROLLOUT_NOTES` in the log."""

    text: str
