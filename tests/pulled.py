"""What a `NodeCore` produced, pulled and kept, for tests that look at it over time.

The core is pull-style: `next_event` and `take_pending_facts` hand each item out
once. Tests that assert on everything a node produced since some point use these
accumulating views instead: `events(node)` returns every event pulled so far
(pulling the new ones first), `clear_events(node)` forgets them; the same for the
core's own facts.
"""

from __future__ import annotations

import weakref

from convergenced.core.facts import Fact
from convergenced.core.node import NodeCore, NodeEvent

_EVENTS: weakref.WeakKeyDictionary[NodeCore, list[NodeEvent]] = weakref.WeakKeyDictionary()
_FACTS: weakref.WeakKeyDictionary[NodeCore, list[Fact]] = weakref.WeakKeyDictionary()


def events(node: NodeCore) -> list[NodeEvent]:
    """Every event ``node`` produced since the last `clear_events`."""
    seen = _EVENTS.setdefault(node, [])
    seen.extend(iter(node.next_event, None))
    return seen


def clear_events(node: NodeCore) -> None:
    """Forget the events pulled so far (and pull the pending ones first)."""
    events(node).clear()


def pending_facts(node: NodeCore) -> list[Fact]:
    """Every fact the core produced itself since the last `clear_facts`."""
    seen = _FACTS.setdefault(node, [])
    seen.extend(node.take_pending_facts())
    return seen


def clear_facts(node: NodeCore) -> None:
    """Forget the core's own facts pulled so far."""
    pending_facts(node).clear()
