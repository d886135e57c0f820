"""The verifier's logic on a real node core and real files, without a daemon: what a
pass reads, in which order, what it retracts and what it keeps; the commit's
``location`` through the local API's parser, the log and compaction; and the digest
recipes held to the integrations' own (they must never drift apart)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry

from convergenced.core.errors import RemoteProtocolError
from convergenced.core.facts import Commit, Declare, Retract
from convergenced.core.local_api_codec import ApiError, parse_request
from convergenced.core.locations import Location, parse_location
from convergenced.core.node import NodeCore
from convergenced.core.spec import StreamSpec
from convergenced.daemon.durability.entries import decode_entry, encode_entry
from convergenced.daemon.verification.config import VerificationConfig, parse_verification
from convergenced.daemon.verification.digests import Throttle, measure
from convergenced.daemon.verification.verifier import Verifier
from convergenced.errors import ConfigError
from convergenced.integrations.dcp_storage import DcpStorage, files_digest, files_location
from convergenced.integrations.shards import encode_shard, shard_location

STREAM = "job"


def _spec(*domains: str, mode: str = "all") -> StreamSpec:
    return StreamSpec.from_wire({
        "name": STREAM, "members": {"n1": [0, 1]},
        "policy": {"mode": mode, "domains": list(domains)}, "retention": 4,
    })  # fmt: skip


def _write_shard(root: Path, domain: str, rank: int, epoch: int) -> Commit:
    data, digest, size = encode_shard(STREAM, rank, epoch, f"r{rank}e{epoch}".encode() * 100)
    path = root / domain / f"epoch-{epoch}" / f"rank-{rank}.shard"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    loc = parse_location(shard_location(path), "location").to_text()
    return Commit(STREAM, rank, domain, epoch, digest, size, loc)


class _Node:
    """A node with one stream, its facts applied as the local API applies them."""

    def __init__(self, spec: StreamSpec) -> None:
        self.core = NodeCore("n1", 1)
        self.core.apply(Declare(spec))
        self.retracted: list[Retract] = []

    def submit(self, fact: Retract) -> object:
        self.core.apply(fact)
        self.retracted.append(fact)
        return {}

    async def durable(self) -> None:
        return None

    def verifier(self) -> Verifier:
        async def inline(fn: Callable[[], Any]) -> Any:
            return fn()

        return Verifier(self.core, self.submit, self.durable, CollectorRegistry(),
                        VerificationConfig(period_s=10, bandwidth_mb_s=0),
                        clock=trio.current_time, run_blocking=inline)  # fmt: skip


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _path(c: Commit) -> Path:
    return Path(Location.from_text(c.location).url.removeprefix("file://"))


async def test_a_corrupt_shard_of_the_restore_point_is_retracted_and_it_rolls_back(
    tmp_path: Path,
) -> None:
    node = _Node(_spec("nvme"))
    commits = [_write_shard(tmp_path, "nvme", r, e) for e in (1, 2, 3) for r in (0, 1)]
    node.core.apply_many(commits)
    assert node.core.restore_point(STREAM) == 3
    v = node.verifier()
    first = await v.verify_pass()
    # The restore point first, then the newest first.
    assert [(o.check.epoch, o.result) for o in first] == [(3, "ok")] * 2 + [(2, "ok")] * 2 + [
        (1, "ok")
    ] * 2
    assert v.describe(STREAM)["nvme"]["verified"] is True
    _flip(_path(commits[5]))  # rank 1, epoch 3
    second = await v.verify_pass()
    bad = [o for o in second if o.result != "ok"]
    assert [(o.check.rank, o.check.epoch, o.result, o.retracted) for o in bad] == [
        (1, 3, "mismatch", True)
    ]
    assert node.retracted == [Retract(STREAM, 1, "nvme", 3)]
    assert node.core.restore_point(STREAM) == 2
    state = v.describe(STREAM)["nvme"]
    assert state["restore_point"] == 2 and state["last_outcome"] == "ok"
    assert v.outcomes.labels(domain="nvme", outcome="mismatch")._value.get() == 1


async def test_missing_is_evidence_and_unreadable_is_not(tmp_path: Path) -> None:
    node = _Node(_spec("nvme", "s3", mode="any"))
    local = _write_shard(tmp_path, "nvme", 0, 1)
    local1 = _write_shard(tmp_path, "nvme", 1, 1)
    remote = Commit(STREAM, 0, "s3", 1, local.digest, local.size,
                    Location("shard", "nosuchscheme://bucket/k").to_text())  # fmt: skip
    node.core.apply_many([local, local1, remote])
    _path(local).unlink()
    outcomes = {(o.check.rank, o.check.domain): o for o in await node.verifier().verify_pass()}
    assert outcomes[(0, "nvme")].result == "missing" and outcomes[(0, "nvme")].retracted
    assert outcomes[(1, "nvme")].result == "ok"
    assert outcomes[(0, "s3")].result == "unreadable" and not outcomes[(0, "s3")].retracted
    assert node.retracted == [Retract(STREAM, 0, "nvme", 1)]


async def test_an_epoch_committed_again_while_it_was_read_is_left_alone(tmp_path: Path) -> None:
    node = _Node(_spec("nvme"))
    old = _write_shard(tmp_path, "nvme", 0, 1)
    node.core.apply_many([old, _write_shard(tmp_path, "nvme", 1, 1)])
    v = node.verifier()
    _flip(_path(old))
    (check,) = [c for c in v.plan() if c.rank == 0]
    node.core.apply(Retract(STREAM, 0, "nvme", 1))  # the job found it first
    outcome = await v.verify(check)
    assert outcome.result == "mismatch" and not outcome.retracted
    assert node.retracted == []


def test_the_digest_recipes_are_the_integrations_own(tmp_path: Path) -> None:
    c = _write_shard(tmp_path, "nvme", 3, 7)
    assert measure(Location.from_text(c.location), Throttle(0)) == (c.digest, c.size)
    step = tmp_path / "step-7"
    step.mkdir()
    (step / "__3_0.distcp").write_bytes(b"tensor bytes" * 1000)
    (step / ".metadata").write_bytes(b"meta")
    names = ["__3_0.distcp", ".metadata"]
    storage = DcpStorage(str(step))
    loc = parse_location(files_location(storage, names), "location")
    assert measure(loc, Throttle(0)) == files_digest(storage, names)


def test_the_throttle_holds_reads_to_the_cap() -> None:
    now = [0.0]
    slept: list[float] = []
    t = Throttle(1000.0, clock=lambda: now[0], sleep=slept.append)
    t.take(1000)  # the first second's worth is a burst
    t.take(500)
    assert slept == [0.5]
    now[0] = 10.0  # idle time refills the bucket, up to one second's worth
    t.take(1000)
    assert slept == [0.5]


def test_the_location_travels_through_the_api_the_log_and_compaction(tmp_path: Path) -> None:
    req = parse_request({"id": 1, "op": "commit", "args": {
        "stream": STREAM, "rank": 0, "domain": "nvme", "epoch": 1, "digest": "",
        "size": 3, "location": {"kind": "files", "url": "s3://b/step-1",
                                "names": ["b", "a"]}}})  # fmt: skip
    fact = req.args["fact"]
    assert Location.from_text(fact.location) == Location("files", "s3://b/step-1", ("a", "b"))
    assert decode_entry(encode_entry(fact)) == fact
    plain = Commit(STREAM, 0, "nvme", 2, "", 3)
    assert encode_entry(plain)[-1] == 3  # no location: the entry older daemons wrote
    node = _Node(_spec("nvme"))
    node.core.apply_many([fact, Commit(STREAM, 1, "nvme", 1, "", 3)])
    again = NodeCore("n1", 2)
    again.replay(node.core.compacted_facts())
    assert [c.location for _, _, _, c in again.located(STREAM)] == [fact.location]


@pytest.mark.parametrize(
    ("location", "problem"),
    [
        ({"kind": "tape", "url": "file:///x"}, "not one of"),
        ({"kind": "shard", "url": "/no/scheme"}, "not a URL"),
        ({"kind": "shard", "url": "file:///x", "names": ["a"]}, "unknown field"),
        ({"kind": "files", "url": "file:///x", "names": []}, "empty"),
        ({"kind": "files", "url": "file:///x", "names": ["../a"]}, "not a file name"),
        ({"kind": "files", "url": "file:///x", "names": ["a", "a"]}, "twice"),
        ({"kind": "shard", "url": "file:///" + "x" * 2000}, "above"),
        ("file:///x", "expected a map"),
    ],
)
def test_a_bad_location_is_a_bad_request_naming_the_field(location: Any, problem: str) -> None:
    with pytest.raises((ApiError, RemoteProtocolError), match=problem):
        parse_request({"id": 1, "op": "commit", "args": {
            "stream": STREAM, "rank": 0, "domain": "nvme", "epoch": 1,
            "location": location}})  # fmt: skip


def test_the_configuration_is_checked() -> None:
    assert parse_verification({}, "f").period_s == 3600
    cfg = parse_verification({"verification": {"period_s": 0, "bandwidth_mb_s": 5}}, "f")
    assert not cfg.enabled and cfg.bytes_per_s == 5e6
    for bad in ({"period_s": -1}, {"bandwidth_mb_s": "fast"}, {"every": 1}):
        with pytest.raises(ConfigError, match="verification"):
            parse_verification({"verification": bad}, "f")


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


async def test_the_loop_runs_a_pass_every_period(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    node = _Node(_spec("nvme"))
    node.core.apply_many([_write_shard(tmp_path, "nvme", r, 1) for r in (0, 1)])
    v = node.verifier()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(v.run)
        await trio.sleep(25)  # MockClock (autojump): virtual seconds
        nursery.cancel_scope.cancel()
    assert v.passes == 3  # at 0, 10 and 20


def test_state_and_top_say_how_long_ago_the_restore_point_was_verified_and_drilled() -> None:
    from convergenced.ctl.formatting import format_last_drill, format_verification

    st = {
        "verification": {
            "nvme": {
                "restore_point": 9,
                "verified": True,
                "age_s": 12.4,
                "last_outcome": "ok",
                "last_epoch": 9,
            },
            "pfs": {
                "restore_point": 9,
                "verified": False,
                "age_s": 80.0,
                "last_outcome": "mismatch",
                "last_epoch": 10,
            },
        },
        "drill": {
            "epoch": 9,
            "passed": True,
            "age_s": 200.2,
            "seconds": 1.5,
            "mb_s": {"nvme": 812.5},
        },
    }
    assert format_verification(st) == "nvme 12 s ago, pfs not yet (last: mismatch at 10)"
    assert format_last_drill(st) == "epoch 9 passed 200 s ago, nvme 812.5 MB/s"
    assert format_verification({}) == "" and format_last_drill({"drill": None}) == ""


async def test_a_reader_that_fails_unexpectedly_is_unreadable_not_fatal(tmp_path: Path) -> None:
    node = _Node(_spec("nvme"))
    node.core.apply_many([_write_shard(tmp_path, "nvme", r, 1) for r in (0, 1)])

    async def broken(fn: Callable[[], Any]) -> Any:
        raise TypeError("a filesystem's own bug")

    v = Verifier(node.core, node.submit, node.durable, CollectorRegistry(), VerificationConfig(),
                 run_blocking=broken)  # fmt: skip
    outcomes = await v.verify_pass()
    assert {o.result for o in outcomes} == {"unreadable"} and node.retracted == []


async def test_a_hook_that_hangs_is_killed_and_its_output_kept_short(tmp_path: Path) -> None:
    import sys

    from convergenced.daemon.verification.config import DrillConfig
    from convergenced.daemon.verification.drills import HOOK_OUTPUT_CHARS, Drills

    node = _Node(_spec("nvme"))
    node.core.apply_many([_write_shard(tmp_path, "nvme", r, 1) for r in (0, 1)])
    hook = (sys.executable, "-c", "import time; print('x' * 100000, flush=True); time.sleep(60)")
    config = DrillConfig(hook=hook, hook_timeout_s=1.0)
    drills = Drills(node.core, node.verifier(), CollectorRegistry(), config, tmp_path)
    result = await drills.drill(STREAM)
    assert [r["outcome"] for r in result["ranks"]] == ["ok", "ok"]
    assert not result["passed"] and result["hook"]["exit"] == -1
    assert result["hook"]["output"].endswith("(killed after 1 s)")
    assert len(result["hook"]["output"]) < HOOK_OUTPUT_CHARS + 100
