"""What the daemon reports when a job moves a stream to a new member map: one log line
naming the members that left, joined and replaced others, and a counter labelled by
stream alone (members are unbounded, so they stay out of the labels)."""

from __future__ import annotations

import structlog.testing
from prometheus_client import generate_latest

from convergenced.core.events import MembershipChanged
from convergenced.core.facts import Undeclare
from convergenced.daemon.telemetry import Telemetry


def change(stream: str = "job") -> MembershipChanged:
    return MembershipChanged(stream, 7, ("node-3", "node-5"), ("node-4",),
                             (2, 3, 4, 9), (("node-3", "node-4"),))  # fmt: skip


def test_a_membership_change_is_logged_with_who_left_joined_and_replaced_whom() -> None:
    t = Telemetry(clock=lambda: 0.0)
    with structlog.testing.capture_logs() as logs:
        t.node_event(change())
    assert logs == [{
        "event": "membership changed", "log_level": "info", "stream": "job",
        "membership": 7, "left": ["node-3", "node-5"], "joined": ["node-4"],
        "replaced": ["node-3 -> node-4"], "moved_ranks": "2-4, 9",
    }]  # fmt: skip


def test_membership_changes_are_counted_by_stream_only() -> None:
    t = Telemetry(clock=lambda: 0.0)
    t.prime([("job", ("nvme", "s3"))], ())
    text = generate_latest(t.registry).decode()
    assert 'convergenced_membership_changes_total{stream="job"} 0.0' in text  # primed
    t.node_event(change())
    t.node_event(change())
    text = generate_latest(t.registry).decode()
    assert 'convergenced_membership_changes_total{stream="job"} 2.0' in text
    assert "node-4" not in text and "node-3" not in text
    assert t.counters()["membership_changes"] == 2
    t.fact_applied(Undeclare("job"))  # the label set stays bounded by declared streams
    assert "convergenced_membership_changes_total{" not in generate_latest(t.registry).decode()
