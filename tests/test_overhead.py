"""The checkpoint overhead figure, without a daemon: the ``report_save`` request's
limits, the daemon's aggregation over recent saves, its text in ``state``, and the
integrations' timer, which must never raise into the training loop."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from convergenced.core import local_api_codec as codec
from convergenced.core.local_api_codec import ApiError
from convergenced.ctl.formatting import format_overhead
from convergenced.daemon.metrics import StateCollector
from convergenced.daemon.overhead import MAX_RANKS, SAVES_PER_RANK, SaveOverheads
from convergenced.integrations.save_timing import SaveTimer


def _parse(**args: Any) -> dict[str, Any]:
    return dict(codec.parse_request({"id": 7, "op": "report_save", "args": args}).args)


def test_a_report_parses_into_seconds() -> None:
    assert _parse(stream="job", rank=3, blocking_s=1, interval_s=30.5) == {
        "stream": "job", "rank": 3, "blocking_s": 1.0, "interval_s": 30.5}  # fmt: skip
    assert _parse(stream="job", rank=0, blocking_s=0.25)["interval_s"] is None
    assert _parse(stream="job", rank=0, blocking_s=1e7, interval_s=0)["blocking_s"] == 1e7


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"blocking_s": -0.1}, "report_save.blocking_s"),
        ({"blocking_s": float("nan")}, "report_save.blocking_s"),
        ({"blocking_s": float("inf")}, "report_save.blocking_s"),
        ({"blocking_s": 1e7 + 1}, "report_save.blocking_s"),
        ({"blocking_s": True}, "report_save.blocking_s"),
        ({"blocking_s": "1"}, "report_save.blocking_s"),
        ({"blocking_s": None}, "report_save.blocking_s"),
        ({"interval_s": -1}, "report_save.interval_s"),
        ({"interval_s": float("nan")}, "report_save.interval_s"),
        ({"interval_s": 1e300}, "report_save.interval_s"),
        ({"rank": -1}, "report_save.rank"),
        ({"rank": 1.0}, "report_save.rank"),
        ({"stream": "no name"}, "report_save.stream"),
        ({"step": 4}, "unknown argument 'step'"),
    ],
)
def test_a_bad_report_is_a_bad_request_naming_the_field(change: dict[str, Any], field: str) -> None:
    args = {"stream": "job", "rank": 0, "blocking_s": 1.0, "interval_s": 10.0, **change}
    with pytest.raises(ApiError) as info:
        _parse(**args)
    assert info.value.kind.value == "bad_request"
    assert field in str(info.value)
    assert info.value.request_id == 7


def test_the_figure_is_blocking_over_interval_for_the_worst_rank() -> None:
    now = [100.0]
    o = SaveOverheads(lambda: now[0])
    assert o.describe("job") is None
    o.add("job", 0, 2.0, None)  # a first save has no interval: no figure yet
    assert o.describe("job") is None and o.tracks("job")
    # Each interval goes with the blocking of the save that began it (a cycle).
    o.add("job", 0, 1.0, 20.0)
    o.add("job", 0, 30.0, 20.0)  # its blocking belongs to the next cycle
    o.add("job", 1, 1.0, 40.0)  # one save: no cycle yet
    now[0] = 105.0
    d = o.describe("job")
    assert d == {"ratio": 0.075, "rank": 0, "saves": 2, "blocking_s": 1.5, "interval_s": 20.0,
                 "ranks": 1, "age_s": 5.0}  # fmt: skip
    # A rank that blocks more sets the figure.
    o.add("job", 1, 20.0, 40.0)
    o.add("job", 1, 1.0, 40.0)
    d = o.describe("job")
    assert d is not None and (d["rank"], d["ranks"]) == (1, 2)
    assert d["ratio"] == pytest.approx(21 / 80)


def test_only_the_recent_saves_count_and_memory_is_bounded() -> None:
    o = SaveOverheads(lambda: 0.0)
    for _ in range(100):
        o.add("job", 0, 10.0, 20.0)  # an old, slow period
    for _ in range(SAVES_PER_RANK + 1):
        o.add("job", 0, 1.0, 100.0)
    d = o.describe("job")
    assert d is not None and d["ratio"] == pytest.approx(0.01) and d["saves"] == SAVES_PER_RANK
    for rank in range(MAX_RANKS + 10):
        o.add("big", rank, 1.0, None)
        o.add("big", rank, 1.0, 10.0)
    ranks = o.ranks("big")
    assert len(ranks) == MAX_RANKS and min(r.rank for r in ranks) == 10  # oldest dropped
    o.prune(["job"])
    assert not o.tracks("big") and o.describe("big") is None and o.tracks("job")


def test_a_zero_interval_gives_zero_not_a_division_error() -> None:
    o = SaveOverheads(lambda: 0.0)
    o.add("job", 0, 0.0, None)
    o.add("job", 0, 0.0, 0.0)
    d = o.describe("job")
    assert d is not None and d["ratio"] == 0.0


class _Source:
    def __init__(self, overhead: dict[str, Any] | None) -> None:
        self.overhead = overhead

    def streams(self) -> list[str]:
        return ["job"]

    def stream_state(self, stream: str) -> dict[str, Any]:
        return {"restore_point": None, "proposal": None, "convergence": [], "skew": None,
                "domain_skew": {}, "knowledge": "incomplete", "stored_bytes": {},
                "stored_epochs": {}, "drain_safe": False, "checkpoint_requested": None,
                "newest": {}, "overhead": self.overhead}  # fmt: skip

    def node_id(self) -> str:
        return "a"

    def peer_links(self) -> list[tuple[str, bool]]:
        return []

    def wal_bytes(self) -> int | None:
        return None

    def local_clients(self) -> int:
        return 0

    def restore_point_age(self, stream: str) -> float | None:
        return None

    def versions(self) -> dict[str, Any]:
        return {"components": {}, "streams": {}}


def _gauge(source: _Source) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for m in StateCollector(source).collect()
            for s in m.samples if s.name == "convergenced_checkpoint_overhead_ratio"]  # fmt: skip


def test_the_gauge_and_the_text_follow_the_state() -> None:
    assert _gauge(_Source(None)) == []
    figure = {"ratio": 0.042, "rank": 3, "saves": 16, "blocking_s": 1.26, "interval_s": 30.0,
              "ranks": 4, "age_s": 2.0}  # fmt: skip
    assert _gauge(_Source(figure)) == [({"stream": "job"}, 0.042)]
    assert format_overhead({"overhead": figure}) == (
        "4.2% (rank 3: 1.3 s blocked every 30.0 s, 16 saves)"
    )
    assert format_overhead({"overhead": None}) == "" == format_overhead({})


class _Pending:
    def __init__(self, error: Exception | None) -> None:
        self.error = error

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        if self.error is not None:
            raise self.error
        return {}


class _Client:
    def __init__(self) -> None:
        self.sent: list[tuple[str, int, float, float | None]] = []
        self.fail: Exception | None = None
        self.refuse: Exception | None = None

    def report_save_nowait(
        self, stream: str, rank: int, blocking_s: float, interval_s: float | None
    ) -> _Pending:
        if self.fail is not None:
            raise self.fail
        self.sent.append((stream, rank, blocking_s, interval_s))
        return _Pending(self.refuse)


def test_the_timer_reports_blocking_and_interval_and_never_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    client = _Client()
    timer = SaveTimer(client, "job", 2, clock=lambda: now[0])
    with timer.timing():
        now[0] = 1.5
    now[0] = 30.0
    with timer.timing():
        now[0] = 31.0
    assert client.sent == [("job", 2, 1.5, None), ("job", 2, 1.0, 30.0)]
    timer.extra_s = 0.5  # a staging wait after the save returned
    timer.saved(60.0, 1.0)
    assert client.sent[-1] == ("job", 2, 1.5, 30.0) and timer.extra_s == 0.0
    caplog.set_level(logging.DEBUG, logger="convergenced.integrations.save_timing")
    client.refuse = ApiError(codec.ErrorKind.REJECTED, "unknown_rank", "no")
    timer.saved(90.0, 1.0)
    client.fail = OSError("socket gone")
    timer.saved(120.0, 1.0)  # dropped, and the refusal before it logged: no raise
    timer.saved(150.0, 1.0)
    assert "socket gone" in caplog.text and "report was refused" in caplog.text
    assert timer.reported == 4
    # A failing save is not reported, and its error reaches the loop unchanged.
    with pytest.raises(KeyError), timer.timing():
        raise KeyError("disk")
    assert timer.reported == 4
    # A client without the operation (an older or fake one) gets no reports.
    SaveTimer(object(), "job", 0).saved(0.0, 1.0)
