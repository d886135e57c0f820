"""The local API codec: framing limits, request validation that names the field, and
replies that round-trip into typed errors. Pure functions: no daemon needed."""

from __future__ import annotations

import contextlib
import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from convergenced.core import local_api_codec as codec
from convergenced.core import local_api_requests as requests
from convergenced.core import local_api_results as results
from convergenced.core.facts import (
    Commit,
    ComponentReport,
    Declare,
    Retire,
    Retract,
    RolloutNote,
    Undeclare,
)
from convergenced.core.local_api_codec import ApiError, ErrorKind
from convergenced.core.spec import Policy, StreamSpec

SPEC = StreamSpec.create("job", {"a": [0, 1], "b": [2]}, Policy.any_of("nvme", "s3"), 2)


def _parse(op: str, **args: Any) -> codec.Request:
    return codec.parse_request({"id": 7, "op": op, "args": args})


def _bad(obj: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        codec.parse_request(obj)
    assert info.value.kind is ErrorKind.BAD_REQUEST
    return info.value


# -- framing -------------------------------------------------------------------------


def test_frames_split_anywhere_come_out_whole() -> None:
    frames = b"".join(codec.encode_frame({"id": i, "op": "status"}) for i in range(50))
    reader = codec.FrameReader()
    out: list[Any] = []
    for i in range(len(frames)):  # one byte at a time
        out.extend(reader.feed(frames[i : i + 1]))
    assert [m["id"] for m in out] == list(range(50))
    assert reader.buffered == 0


def test_an_oversized_length_is_refused_before_the_body_arrives() -> None:
    reader = codec.FrameReader(max_frame=1024)
    with pytest.raises(ApiError) as info:
        reader.feed(struct.pack(">I", 1025))
    assert info.value.reason == "frame_too_large"


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"\xc1", "reserved byte"),
        (b"\x82\xa1a\x01\xa1a\x02", "duplicate key"),
        (b"\xd4\x01\x00", "ext type"),
        (b"\xdd\xff\xff\xff\xff", "huge array header"),
        (b"\x91", "truncated array"),
    ],
)
def test_undecodable_bodies_are_typed_errors(body: bytes, why: str) -> None:
    with pytest.raises(ApiError) as info:
        codec.FrameReader().feed(struct.pack(">I", len(body)) + body)
    assert info.value.reason == "undecodable", why


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_garbage_never_escapes_as_anything_but_api_error(data: bytes) -> None:
    reader = codec.FrameReader(max_frame=4096)
    try:
        for obj in reader.feed(data):
            with contextlib.suppress(ApiError):
                codec.parse_request(obj)
    except ApiError:
        pass


# -- requests ----------------------------------------------------------------------------


def test_every_operation_parses_into_typed_arguments() -> None:
    c = _parse("commit", stream="job", rank=1, domain="nvme", epoch=5, digest="ab", size=9)
    assert c.args["fact"] == Commit("job", 1, "nvme", 5, "ab", 9)
    assert _parse("retract", stream="job", rank=1, domain="nvme", epoch=5).args["fact"] == (
        Retract("job", 1, "nvme", 5)
    )
    assert _parse("retire", stream="job", rank=1, domain="nvme", epoch=5).args["fact"] == (
        Retire("job", 1, "nvme", 5)
    )
    assert _parse("declare", spec=SPEC.to_wire()).args["fact"] == Declare(SPEC)
    assert _parse("undeclare", stream="job").args["fact"] == Undeclare("job")
    assert _parse("wait", stream="job", epoch=3, timeout=1.5).args == {
        "stream": "job",
        "epoch": 3,
        "timeout": 1.5,
    }
    assert _parse("wait", stream="job", epoch=3).args["timeout"] is None
    assert _parse("restore_point", stream="job", generation=2).args["generation"] == 2
    assert _parse("next_generation", stream="job", timeout=3).args == {
        "stream": "job",
        "timeout": 3.0,
    }
    assert _parse("cancel", target=4).args == {"target": 4}
    assert _parse("drain", node="n1", streams=["b", "a", "b"], checkpoint=True).args == {
        "node": "n1",
        "streams": ("a", "b"),
        "checkpoint": True,
        "timeout": None,
        "versions": {},
    }
    assert _parse("drain", node="n1").args["streams"] == ()
    moved = _parse("drain", node="n1", versions={"driver": "555.42.02"})
    assert moved.args["versions"] == {"driver": "555.42.02"}
    said = _parse("report_version", component="driver", running="2", accepts=["1", "2"])
    assert said.args["fact"] == ComponentReport("driver", "2", ("1", "2"))
    assert _parse("report_version", component="d", running="2").args["fact"].accepts == ("2",)
    assert _parse("versions").args == {"stream": None}
    assert _parse("note_rollout", text='{"node": "a"}').args["fact"] == RolloutNote('{"node": "a"}')
    for text in ("x" * 4097, 3):
        with pytest.raises(ApiError):
            _parse("note_rollout", text=text)
    assert _parse("versions", stream="job").args == {"stream": "job"}
    for op, bad in (("drain", {"node": "n1", "versions": {"a": "1", "b": "2", "c": "3", "d": "4",
                                                        "e": "5", "f": "6", "g": "7", "h": "8",
                                                        "i": "9"}}),
                    ("drain", {"node": "n1", "versions": {"driver": "x" * 65}}),
                    ("drain", {"node": "n1", "versions": ["driver"]}),
                    ("report_version", {"component": "d"}),
                    ("report_version", {"component": "-d", "running": "1"}),
                    ("report_version", {"component": "d", "running": "1", "accepts": "1"}),
                    ("versions", {"stream": 3})):  # fmt: skip
        with pytest.raises(ApiError) as info:
            _parse(op, **bad)
        assert info.value.kind.value == "bad_request", (op, bad)
    for bad in ({"streams": ["a"]}, {"node": "n1", "streams": "a"},
                {"node": "n1", "streams": ["a"] * 257}, {"node": "n1", "checkpoint": 1},
                {"node": "n1", "streams": ["-x"]}):  # fmt: skip
        with pytest.raises(ApiError) as info:
            _parse("drain", **bad)
        assert info.value.kind.value == "bad_request", bad
    for op in ("status", "streams"):
        assert _parse(op).args == {}
    assert set(codec.OPS) == {
        "status",
        "streams",
        "declare",
        "undeclare",
        "commit",
        "retract",
        "retire",
        "state",
        "wait",
        "restore_point",
        "next_generation",
        "watch",
        "drain",
        "drill",
        "report_version",
        "versions",
        "note_rollout",
        "report_save",
        "cancel",
    }
    assert _parse("drill", stream="job").args == {"stream": "job", "epoch": None, "domain": None}
    assert _parse("drill", stream="job", epoch=4, domain="nvme").args == {
        "stream": "job", "epoch": 4, "domain": "nvme"}  # fmt: skip
    for bad in ({"stream": "job", "epoch": -1}, {"stream": "job", "domain": "no pe"},
                {"stream": "job", "hook": "rm"}):  # fmt: skip
        with pytest.raises(ApiError):
            _parse("drill", **bad)


_OK = {"stream": "job", "rank": 0, "domain": "nvme", "epoch": 1}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"epoch": -1}, "commit.epoch: -1 is negative"),
        ({"epoch": 1.5}, "commit.epoch: expected an integer"),
        ({"rank": True}, "commit.rank: expected an integer"),
        ({"stream": "bad name"}, "commit.stream"),
        ({"epoch": None}, "commit.epoch: expected an integer, got NoneType"),
        ({"x": 1}, "unknown argument 'x'"),
        ({"epoch": 2**63}, "above"),
        ({"digest": "x" * 300}, "commit.digest"),
    ],
)
def test_bad_commit_arguments_name_the_field(change: dict[str, Any], message: str) -> None:
    args = {**_OK, **change}
    err = _bad({"id": 3, "op": "commit", "args": args})
    assert message in str(err)
    assert err.request_id == 3


@pytest.mark.parametrize("timeout", [-1, float("nan"), float("inf"), "5", 1e12])
def test_bad_timeouts_are_refused(timeout: Any) -> None:
    err = _bad({"id": 1, "op": "wait", "args": {"stream": "j", "epoch": 1, "timeout": timeout}})
    assert "wait.timeout" in str(err)


def test_malformed_envelopes_are_refused() -> None:
    assert _bad([1, 2]).request_id is None
    assert _bad({"op": "status"}).request_id is None
    assert "unknown field 'x'" in str(_bad({"id": 1, "op": "status", "x": 1}))
    err = _bad({"id": 1, "op": "launch"})
    assert err.reason == "unknown_op" and "expected one of" in str(err)
    err = _bad({"id": 1, "op": "declare", "args": {"spec": {"name": "job"}}})
    assert err.reason == "bad_spec" and "declare.spec.members: missing" in str(err)


def test_request_builder_drops_none_and_refuses_unknown_ops() -> None:
    assert codec.request(1, "wait", stream="j", epoch=2, timeout=None) == {
        "id": 1,
        "op": "wait",
        "args": {"stream": "j", "epoch": 2},
    }
    with pytest.raises(ValueError, match="unknown operation"):
        codec.request(1, "nope")


# -- replies -------------------------------------------------------------------------------


def test_error_replies_round_trip_into_typed_errors() -> None:
    err = ApiError(ErrorKind.REJECTED, "unknown_stream", "stream 'x' is not declared")
    wire = msgpack.unpackb(codec.encode_frame(codec.error(5, err))[4:])
    back = codec.error_from_wire(wire["error"])
    assert (back.kind, back.reason, str(back)) == (err.kind, err.reason, str(err))
    assert wire["id"] == 5
    assert codec.error_from_wire("junk").kind is ErrorKind.INTERNAL
    assert codec.error_from_wire({"kind": "martian"}).kind is ErrorKind.INTERNAL


def test_domain_skew_counts_only_members_that_reported_the_domain() -> None:
    newest = {"a": {"nvme": 10, "s3": 4}, "b": {"nvme": 7}, "c": {}}
    assert results.domain_skew(newest) == {"nvme": 3, "s3": 0}


def test_the_worked_example_in_local_api_md_matches_the_codec() -> None:
    doc = (Path(__file__).parent.parent / "proto" / "LOCAL_API.md").read_text()
    block = doc.split("## 7. Example", 1)[1].split("```")[1]
    request_hex, reply_hex = (
        "".join(part.split()) for part in block.replace("request:", "").split("reply:")
    )
    commit = codec.request(
        1, "commit", stream="job", rank=0, domain="nvme", epoch=5, digest="", size=0
    )
    assert codec.encode_frame(commit).hex() == request_hex
    reply = codec.ok(1, {"stream": "job", "epoch": 5, "durable": True})
    assert codec.encode_frame(reply).hex() == reply_hex


def test_every_operation_of_the_codec_has_one_handler_and_a_kind() -> None:
    from convergenced.daemon.localapi.operations import OPERATIONS, OpKind

    assert set(OPERATIONS) == set(codec.OPS)
    waits = {op for op, o in OPERATIONS.items() if o.kind is OpKind.WAIT}
    assert waits == {"wait", "restore_point", "next_generation", "watch", "drain", "drill"}


@pytest.mark.parametrize(
    ("request_map", "message"),
    [
        ({"id": True, "op": "status"}, "request.id: expected an integer, got bool"),
        ({"id": 1, "op": ["commit"]}, "request.op: expected a string, got list"),
        ({"id": 1, "op": "x" * 100}, "request.op: length 100 above 64"),
        ({"id": 1, "op": "commit", "args": [1]}, "commit.args: expected a map, got list"),
        ({"id": 1, "op": "commit", "args": {**_OK, "stream": [1]}}, "commit.stream: expected"),
        ({"id": 1, "op": "commit", "args": {**_OK, "domain": "x" * 200}}, "commit.domain"),
        ({"id": 1, "op": "commit", "args": {**_OK, "digest": 5}}, "commit.digest: expected"),
        ({"id": 1, "op": "commit", "args": {**_OK, "size": -1}}, "commit.size: -1 is negative"),
        ({"id": 1, "op": "state", "args": {"stream": "no name"}}, "state.stream"),
    ],
)
def test_the_fast_checks_fall_back_to_the_errors_that_name_the_field(
    request_map: dict[str, Any], message: str
) -> None:
    assert message in str(_bad(request_map))


def test_names_are_checked_however_often_a_valid_one_came_before() -> None:
    for _ in range(3):
        _parse("commit", stream="job", rank=0, domain="nvme", epoch=1)
    assert "commit.domain" in str(
        _bad({"id": 1, "op": "commit", "args": {**_OK, "domain": "nvme\n"}})
    )
    for i in range(requests._MAX_NAMES + 10):  # the set of names seen stays bounded
        _parse("state", stream=f"s{i}")
    assert len(requests._NAMES) <= requests._MAX_NAMES


def test_the_frame_encoder_gives_the_bytes_of_encode_frame() -> None:
    encoder = codec.FrameEncoder()
    messages: list[Any] = [
        codec.ok(7, {"stream": "job", "epoch": 3, "durable": True}),
        codec.request(1, "commit", stream="job", rank=0, domain="nvme", epoch=2, digest="", size=0),
        {"id": 2, "ok": {"b": b"\x00\x01", "f": 1.5, "n": None, "l": [1, [2]]}},
    ]
    for message in messages:
        assert encoder.encode(message) == codec.encode_frame(message)
    with pytest.raises(TypeError):
        encoder.encode({"bad": object()})
    assert encoder.encode(messages[0]) == codec.encode_frame(messages[0])  # not left half-full


def test_frames_after_a_leftover_and_frames_whole_in_one_read_come_out_the_same() -> None:
    frames = [codec.encode_frame({"id": i, "op": "status"}) for i in range(6)]
    reader = codec.FrameReader()
    assert [m["id"] for m in reader.feed(b"".join(frames[:2]) + frames[2][:3])] == [0, 1]
    assert reader.buffered == 3
    assert [m["id"] for m in reader.feed(frames[2][3:] + b"".join(frames[3:]))] == [2, 3, 4, 5]
    assert reader.buffered == 0
