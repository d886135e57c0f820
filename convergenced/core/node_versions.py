"""`NodeCore`'s part of the version constraint sets (`versions`): the component
reports it holds, the companion streams it keeps in line with them, and the views
its clients read.

The companions are ordinary streams of the node (declared, committed, agreed,
published and logged like a job's) under reserved names, so every rule of the core
holds for them unchanged; this mixin only decides which facts they need
(`versions.reconcile`) and hides them from the job-facing queries: `streams` lists
the jobs' streams only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

from convergenced.core.errors import FactError, SpecError, UnknownStreamError
from convergenced.core.facts import ComponentReport, Declare, Fact, Undeclare
from convergenced.core.interval_set import IntervalSet
from convergenced.core.records import UNDECLARED, View
from convergenced.core.status import StreamStatus
from convergenced.core.stream_state import StreamState
from convergenced.core.versions import (
    Catalogue,
    Companion,
    ComponentView,
    fleet_accepts,
    is_reserved,
    reconcile,
    view_component,
)


class NodeVersions:
    """The version constraint sets of one node (a mixin of `NodeCore`)."""

    node_id: str
    view: View
    _streams: dict[str, StreamState]
    _pending_facts: list[Fact]
    _catalogues: dict[str, Catalogue]
    _reports: dict[str, ComponentReport]
    _version_problems: dict[str, str]
    _rollout_notes: deque[str]

    _apply: Callable[[Fact], str]  # NodeCore's
    status: Callable[[str], StreamStatus]  # NodeCore's

    # -- state ------------------------------------------------------------------

    @property
    def catalogues(self) -> Mapping[str, Catalogue]:
        """The component catalogues of this node's configuration."""
        return self._catalogues

    def reports(self) -> dict[str, ComponentReport]:
        """The latest report of each component (what this node runs and accepts)."""
        return dict(self._reports)

    def rollout_notes(self) -> list[str]:
        """The rollout audit notes this node keeps, oldest first."""
        return list(self._rollout_notes)

    def streams(self) -> list[str]:
        """The streams jobs declared here, sorted (never the companions)."""
        return sorted(s for s in self._streams if not is_reserved(s))

    @staticmethod
    def _triggers(fact: Fact) -> bool:
        """Whether applying ``fact`` may change which companion facts are needed."""
        if isinstance(fact, ComponentReport):
            return True
        if isinstance(fact, Declare):
            return not is_reserved(fact.spec.name)
        return isinstance(fact, Undeclare) and not is_reserved(fact.stream)

    def _reconcile_versions(self) -> list[str]:
        """Apply the facts that bring the companions in line; return the streams
        touched (to refresh). The facts go to the pending facts, to be logged."""
        jobs = [st.facts.spec for name, st in sorted(self._streams.items())
                if not is_reserved(name)]  # fmt: skip
        held = {name: Companion(st.facts.spec, st.facts.available)
                for name, st in self._streams.items() if is_reserved(name)}  # fmt: skip
        touched: dict[str, None] = {}
        for fact in reconcile(self.node_id, jobs, self._catalogues, self._reports, held):
            # Pending before it is applied, as in `NodeCore.apply_many`: a Settled
            # that applying a declaration adds must come after it.
            at = len(self._pending_facts)
            self._pending_facts.append(fact)
            try:
                name = self._apply(fact)
            except (FactError, SpecError) as exc:
                del self._pending_facts[at]
                # A companion the records of a member refuse (its job moved on to a
                # membership this node has not declared): its handshake waits, the
                # job's stream is not affected. Said in the views.
                key = fact.spec.name if isinstance(fact, Declare) else getattr(fact, "stream", "")
                self._version_problems[key] = str(exc)
                continue
            self._version_problems.pop(name, None)
            touched[name] = None
        return [n for n in touched if n in self._streams]

    # -- queries ----------------------------------------------------------------

    def versions(self, stream: str) -> list[ComponentView]:
        """Per component with a catalogue, the version handshake of job ``stream``.

        Raises:
            UnknownStreamError: ``stream`` is not a job's stream declared here.
        """
        st = self._streams.get(stream)
        if st is None or is_reserved(stream):
            raise UnknownStreamError(stream)
        out = []
        for component in sorted(self._catalogues):
            catalogue = self._catalogues[component]
            name = catalogue.companion_name(stream)
            status = self.status(name) if name in self._streams else None
            out.append(view_component(stream, catalogue, status, st.facts.spec.member_ids))
        return out

    def version_problem(self, stream: str, component: str) -> str | None:
        """Why the companion of ``stream`` for ``component`` is not declared (None:
        it is, or nothing went wrong)."""
        catalogue = self._catalogues.get(component)
        if catalogue is None:
            return None
        return self._version_problems.get(catalogue.companion_name(stream))

    def fleet_versions(self) -> dict[str, tuple[tuple[str, ...], int]]:
        """Per component, the versions every node heard from accepts and how many
        nodes that is (`versions.fleet_accepts`)."""
        out = {}
        for component, catalogue in sorted(self._catalogues.items()):
            prefix = catalogue.prefix()
            held: list[tuple[str, IntervalSet]] = []
            for name in self.view.streams():
                if name.startswith(prefix):
                    held.extend((origin, rec.recoverable)
                                for origin, rec in self.view.stream(name).items()
                                if rec.spec_digest != UNDECLARED)  # fmt: skip
            out[component] = fleet_accepts(catalogue, held)
        return out
