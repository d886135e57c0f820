"""The wire codec against the golden vectors in proto/vectors, and under fuzzing.

The JSON form of messages is implemented here a second time, from
proto/vectors/README.md, so a mistake in the generator's version shows up as a
mismatch instead of being copied into both sides of the comparison.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import string
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from convergenced.core.errors import RemoteProtocolError
from convergenced.core.interval_set import IntervalSet
from convergenced.core.messages import (
    MESSAGE_TYPES,
    Bye,
    Hello,
    Message,
    MessageType,
    Nudge,
    Tick,
    Tock,
)
from convergenced.core.records import Record
from convergenced.core.validate import INT64_MAX
from convergenced.core.wire import (
    DEFAULT_MAX_FRAME,
    HEADER_SIZE,
    FrameDecoder,
    WireLimits,
    decode_message,
    encode_message,
    message_to_obj,
)

VECTORS = Path(__file__).resolve().parent.parent / "proto" / "vectors"
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((VECTORS / name).read_text(encoding="utf-8"))
    return data


MESSAGES = load("messages.json")
MALFORMED = load("malformed.json")


def by_name(vectors: list[dict[str, Any]]) -> list[Any]:
    return [pytest.param(v, id=v["name"]) for v in vectors]


# -- the JSON form (proto/vectors/README.md) ----------------------------------------


def set_from_json(flat: list[int]) -> IntervalSet:
    return IntervalSet(zip(flat[::2], flat[1::2], strict=True))


def record_from_json(d: dict[str, Any]) -> Record:
    return Record(
        stream=d["stream"],
        origin=d["origin"],
        incarnation=d["incarnation"],
        version=d["version"],
        spec_digest=bytes.fromhex(d["spec_digest"]),
        recoverable=set_from_json(d["recoverable"]),
        newest=tuple((dom, e) for dom, e in d["newest"]),
        proposal=d["proposal"],
        restore_point=d["restore_point"],
        high_water=d["high_water"],
        generations=tuple((g, set_from_json(s)) for g, s in d["generations"]),
        membership=d["membership"],
        signature=bytes.fromhex(d["signature"]),
    )


def record_to_json(r: Record) -> dict[str, Any]:
    return {
        "stream": r.stream,
        "origin": r.origin,
        "incarnation": r.incarnation,
        "version": r.version,
        "spec_digest": r.spec_digest.hex(),
        "recoverable": [b for lo_hi in r.recoverable.ranges for b in lo_hi],
        "newest": [[dom, e] for dom, e in r.newest],
        "proposal": r.proposal,
        "restore_point": r.restore_point,
        "high_water": r.high_water,
        "generations": [[g, [b for p in s.ranges for b in p]] for g, s in r.generations],
        "membership": r.membership,
        "signature": r.signature.hex(),
    }


def from_json(kind: str, d: dict[str, Any]) -> Message:
    if kind == "HELLO":
        summary = tuple((s, o, i, v) for s, o, i, v in d["summary"])
        return Hello(
            d["cluster"],
            d["node"],
            d["incarnation"],
            bytes.fromhex(d["digest"]),
            summary,
            creds_from_json(d),
        )
    if kind in ("TICK", "TOCK"):
        cls = Tick if kind == "TICK" else Tock
        records = tuple(record_from_json(r) for r in d["records"])
        links = tuple(d["links"])
        return cls(
            d["seq"], bytes.fromhex(d["digest"]), d["match"], records, links, creds_from_json(d)
        )
    if kind == "NUDGE":
        assert d == {}
        return Nudge()
    assert kind == "BYE"
    return Bye(d["reason"])


def creds_from_json(d: dict[str, Any]) -> tuple[bytes, ...]:
    return tuple(bytes.fromhex(c) for c in d.get("credentials", ()))


def creds_to_json(msg: Hello | Tick | Tock, version: int) -> dict[str, Any]:
    return {"credentials": [c.hex() for c in msg.credentials]} if version >= 3 else {}


def to_json(msg: Message, version: int = 2) -> dict[str, Any]:
    if isinstance(msg, Hello):
        return {
            "cluster": msg.cluster,
            "node": msg.node,
            "incarnation": msg.incarnation,
            "digest": msg.digest.hex(),
            "summary": [list(e) for e in msg.summary],
            **creds_to_json(msg, version),
        }
    if isinstance(msg, Tick | Tock):
        return {
            "seq": msg.seq,
            "digest": msg.digest.hex(),
            "match": msg.match,
            "records": [record_to_json(r) for r in msg.records],
            "links": list(msg.links),
            **creds_to_json(msg, version),
        }
    if isinstance(msg, Nudge):
        return {}
    return {"reason": msg.reason}


def decode_frames(data: bytes, limits: WireLimits | None = None) -> list[Message]:
    """Every complete frame in ``data``; raises on the first bad one."""
    dec = FrameDecoder(limits)
    dec.feed(data)
    out: list[Message] = []
    while (frame := dec.next_frame()) is not None:
        out.append(decode_message(frame[0], frame[1], limits, dec.last_version))
    return out


# -- the vector files ----------------------------------------------------------------


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vector_generator", VECTORS / "generate.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_vector_files_are_what_generate_py_writes() -> None:
    gen = load_generator()
    built = gen.build()
    assert sorted(built) == ["malformed.json", "messages.json"]
    for name, content in built.items():
        on_disk = (VECTORS / name).read_text(encoding="utf-8")
        assert on_disk == gen.render(content), (
            f"proto/vectors/{name} is stale: run .venv/bin/python proto/vectors/generate.py"
        )


def test_generate_py_is_deterministic(tmp_path: Path) -> None:
    gen = load_generator()
    assert gen.main(["--out", str(tmp_path)]) == 0
    first = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert gen.main(["--out", str(tmp_path), "--check"]) == 0
    assert first == {name: (VECTORS / name).read_bytes() for name in first}


def test_vectors_cover_every_message_type() -> None:
    assert {v["type"] for v in MESSAGES["vectors"]} == {t.name for t in MessageType}
    names = [v["name"] for v in MESSAGES["vectors"] + MALFORMED["vectors"]]
    assert len(names) == len(set(names)), "vector names are unique"


def test_tick_vector_exercises_every_record_field() -> None:
    ticks = [v["decoded"] for v in MESSAGES["vectors"] if v["type"] == "TICK"]
    records = [r for tick in ticks for r in tick["records"]]
    assert len(records) >= 3
    for key in ("proposal", "restore_point", "high_water"):
        assert any(r[key] is None for r in records)
        assert any(r[key] is not None for r in records)
    assert any(r["generations"] for r in records)
    assert any(len(r["newest"]) > 1 for r in records)
    assert any(r["signature"] for r in records)
    assert any(not r["signature"] for r in records)
    assert any(r["version"] == INT64_MAX for r in records)


def test_vectors_declare_the_default_limits() -> None:
    for doc in (MESSAGES, MALFORMED):
        assert doc["protocol_version"] == 2
        assert doc["limits"]["max_frame_bytes"] == WireLimits().max_frame_bytes
        assert doc["limits"]["max_records"] == WireLimits().max_records


def test_nudge_frame_known_answer() -> None:
    # Written out by hand from the header table, not by the codec.
    expected = "43564744020400000000000180"
    assert encode_message(Nudge()).hex() == expected
    [vector] = [v for v in MESSAGES["vectors"] if v["type"] == "NUDGE"]
    assert vector["hex"] == expected


def test_at_least_twelve_malformed_vectors_with_distinct_reasons() -> None:
    assert len(MALFORMED["vectors"]) >= 12
    assert {v["error_reason"] for v in MALFORMED["vectors"]} == {
        "bad_magic",
        "unsupported_version",
        "unknown_type",
        "bad_flags",
        "frame_too_large",
        "malformed_body",
        "invalid_field",
        "limit_exceeded",
    }


# -- valid vectors, both ways ----------------------------------------------------------


@pytest.mark.parametrize("vector", by_name(MESSAGES["vectors"]))
def test_decoding_a_vector_gives_its_decoded_form(vector: dict[str, Any]) -> None:
    dec = FrameDecoder()
    dec.feed(bytes.fromhex(vector["hex"]))
    frame = dec.next_frame()
    assert frame is not None
    assert dec.buffered == 0
    kind, body = frame
    assert kind.name == vector["type"]
    assert len(body) == len(vector["hex"]) // 2 - HEADER_SIZE
    version = vector.get("version", 2)
    assert dec.last_version == version
    assert to_json(decode_message(kind, body, None, version), version) == vector["decoded"]


@pytest.mark.parametrize("vector", by_name(MESSAGES["vectors"]))
def test_encoding_a_decoded_form_gives_the_exact_frame(vector: dict[str, Any]) -> None:
    msg = from_json(vector["type"], vector["decoded"])
    assert encode_message(msg, vector.get("version", 2)).hex() == vector["hex"]


@pytest.mark.parametrize("vector", by_name(MESSAGES["vectors"]))
def test_vector_fed_one_byte_at_a_time(vector: dict[str, Any]) -> None:
    data = bytes.fromhex(vector["hex"])
    dec = FrameDecoder()
    for i, byte in enumerate(data):
        assert dec.next_frame() is None, "no frame before its last byte"
        assert dec.buffered == i
        dec.feed(bytes([byte]))
    frame = dec.next_frame()
    assert frame is not None
    version = vector.get("version", 2)
    assert to_json(decode_message(*frame, None, version), version) == vector["decoded"]
    assert dec.next_frame() is None
    assert dec.buffered == 0


def test_stream_of_all_vectors_byte_by_byte() -> None:
    data = b"".join(bytes.fromhex(v["hex"]) for v in MESSAGES["vectors"])
    dec = FrameDecoder()
    got: list[dict[str, Any]] = []
    for i in range(len(data)):
        dec.feed(data[i : i + 1])
        while (frame := dec.next_frame()) is not None:
            version = dec.last_version
            got.append(to_json(decode_message(*frame, None, version), version))
    assert got == [v["decoded"] for v in MESSAGES["vectors"]]
    assert dec.buffered == 0


def test_decoder_accepts_any_valid_msgpack_encoding() -> None:
    # Encoders need not be canonical: wider int formats and other key orders decode alike.
    body = b"\x85" + b"".join(
        [
            msgpack.packb("links"), b"\x90",
            msgpack.packb("records"), b"\x90",
            msgpack.packb("match"), b"\xc3",
            msgpack.packb("digest"), msgpack.packb(bytes(16), use_bin_type=True),
            msgpack.packb("seq"), b"\xcf" + (5).to_bytes(8, "big"),
        ]
    )  # fmt: skip
    assert decode_message(MessageType.TOCK, body) == Tock(5, bytes(16), True, ())


# -- malformed vectors --------------------------------------------------------------------


@pytest.mark.parametrize("vector", by_name(MALFORMED["vectors"]))
def test_malformed_vector_is_refused(vector: dict[str, Any]) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        frames = decode_frames(bytes.fromhex(vector["hex"]))
        pytest.fail(f"accepted as {frames!r}")
    assert info.value.reason == vector["error_reason"]
    assert vector["error_contains"] in str(info.value)


@pytest.mark.parametrize("vector", by_name(MALFORMED["vectors"]))
def test_malformed_vector_fed_one_byte_at_a_time(vector: dict[str, Any]) -> None:
    # Header errors surface as soon as the header (or the first bad magic byte) is in.
    data = bytes.fromhex(vector["hex"])
    dec = FrameDecoder()
    with pytest.raises(RemoteProtocolError) as info:
        for i in range(len(data)):
            dec.feed(data[i : i + 1])
            frame = dec.next_frame()
            if frame is not None:
                decode_message(*frame, None, dec.last_version)
        pytest.fail("never refused")
    assert info.value.reason == vector["error_reason"]


def test_bad_magic_is_refused_from_the_first_byte() -> None:
    dec = FrameDecoder()
    dec.feed(b"G")
    with pytest.raises(RemoteProtocolError, match="frame: bad magic"):
        dec.next_frame()


def test_oversized_frame_is_refused_before_its_body_arrives() -> None:
    dec = FrameDecoder(WireLimits(max_frame_bytes=100))
    dec.feed(bytes.fromhex("435647440202000000000065"))  # 101 bytes declared
    with pytest.raises(RemoteProtocolError) as info:
        dec.next_frame()
    assert info.value.reason == "frame_too_large"


def test_frame_of_exactly_the_limit_is_accepted() -> None:
    frame = encode_message(Bye("x" * 200))
    limits = WireLimits(max_frame_bytes=len(frame) - HEADER_SIZE)
    assert decode_frames(frame, limits) == [Bye("x" * 200)]


def test_incomplete_frame_waits_instead_of_failing() -> None:
    frame = encode_message(Bye("partial"))
    dec = FrameDecoder()
    dec.feed(frame[:-1])
    assert dec.next_frame() is None
    dec.feed(frame[-1:])
    frame_out = dec.next_frame()
    assert frame_out is not None
    assert decode_message(*frame_out) == Bye("partial")


def test_configured_record_limit_is_enforced() -> None:
    rec = Record("s", "o", 1, 1, bytes(32), IntervalSet())
    body = encode_message(Tick(1, bytes(16), False, (rec, rec, rec)))[HEADER_SIZE:]
    with pytest.raises(RemoteProtocolError) as info:
        decode_message(MessageType.TICK, body, WireLimits(max_records=2))
    assert info.value.reason == "limit_exceeded"
    assert "TICK.records: 3 elements above the limit 2" in str(info.value)


def test_default_frame_limit_is_one_mebibyte() -> None:
    assert DEFAULT_MAX_FRAME == WireLimits().max_frame_bytes == 1 << 20


# -- fuzzing ------------------------------------------------------------------------------


def decode_all_or_refuse(data: bytes) -> list[Message]:
    """Decode ``data``; anything but `RemoteProtocolError` fails the test."""
    try:
        return decode_frames(data)
    except RemoteProtocolError as err:
        assert err.reason
        return []


headers = st.builds(
    lambda t, body: b"CVGD\x02" + bytes([t]) + b"\x00\x00" + len(body).to_bytes(4, "big") + body,
    st.integers(1, 5),
    st.binary(max_size=200),
)


@FUZZ
@given(st.binary(max_size=300) | headers)
def test_arbitrary_bytes_raise_only_remote_protocol_errors(data: bytes) -> None:
    decode_all_or_refuse(data)


@FUZZ
@given(st.integers(1, 5), st.binary(max_size=300))
def test_arbitrary_bodies_raise_only_remote_protocol_errors(mtype: int, body: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        decode_message(MessageType(mtype), body)


FIELD_NAMES = ["seq", "digest", "match", "records", "cluster", "node", "incarnation",
               "summary", "reason", "x"]  # fmt: skip
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda children: (
        st.lists(children, max_size=13)
        | st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=5), children, max_size=6)
    ),
    max_leaves=20,
)


@FUZZ
@given(st.sampled_from(list(MessageType)), msgpack_values)
def test_arbitrary_msgpack_bodies_raise_only_remote_protocol_errors(
    kind: MessageType, obj: Any
) -> None:
    body = msgpack.packb(obj, use_bin_type=True)
    with contextlib.suppress(RemoteProtocolError):
        decode_message(kind, body)


@FUZZ
@given(st.data())
def test_mutated_vectors_raise_only_remote_protocol_errors(data: st.DataObject) -> None:
    vector = data.draw(st.sampled_from(MESSAGES["vectors"]))
    frame = bytearray.fromhex(vector["hex"])
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(frame) - 1))
        frame[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(frame)))
    for msg in decode_all_or_refuse(bytes(frame[:cut])):
        # Whatever is accepted is a well-formed message that encodes again.
        version = 3 if getattr(msg, "credentials", ()) else 2
        assert decode_frames(encode_message(msg, version)) == [msg]


# -- round trips of random valid messages ------------------------------------------

names = st.builds(
    str.__add__,
    st.sampled_from(string.ascii_letters + string.digits),
    st.text(string.ascii_letters + string.digits + "._/-", max_size=20),
)
ints = st.integers(0, INT64_MAX)
opt_ints = st.none() | ints
digests = st.binary(min_size=16, max_size=16)


@st.composite
def interval_sets(draw: st.DrawFn) -> IntervalSet:
    bounds = draw(st.lists(ints, max_size=8))
    return IntervalSet(
        (min(a, b), max(a, b)) for a, b in zip(bounds[::2], bounds[1::2], strict=False)
    )


records = st.builds(
    Record,
    stream=names,
    origin=names,
    incarnation=ints,
    version=ints,
    spec_digest=st.binary(min_size=32, max_size=32),
    recoverable=interval_sets(),
    newest=st.dictionaries(names, ints, max_size=4).map(lambda d: tuple(sorted(d.items()))),
    proposal=opt_ints,
    restore_point=opt_ints,
    high_water=opt_ints,
    generations=st.dictionaries(ints, interval_sets(), max_size=3).map(
        lambda d: tuple(sorted(d.items()))
    ),
    signature=st.sampled_from([b""]) | st.binary(min_size=64, max_size=64),
)
messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(
        Hello,
        cluster=names,
        node=names,
        incarnation=ints,
        digest=digests,
        summary=st.lists(st.tuples(names, names, ints, ints), max_size=4).map(tuple),
    ),
    st.builds(Tick, st.integers(1, INT64_MAX), digests, st.booleans(),
              st.lists(records, max_size=3).map(tuple),
              st.lists(names, max_size=3).map(lambda xs: tuple(sorted(set(xs))))),
    st.builds(Tock, st.integers(1, INT64_MAX), digests, st.booleans(),
              st.lists(records, max_size=3).map(tuple),
              st.lists(names, max_size=3).map(lambda xs: tuple(sorted(set(xs))))),
    st.just(Nudge()),
    st.builds(Bye, st.text(max_size=256) | st.text(string.printable, max_size=20)),
)  # fmt: skip


@FUZZ
@given(messages)
def test_random_valid_messages_round_trip(msg: Message) -> None:
    frame = encode_message(msg)
    assert decode_frames(frame) == [msg]
    decoded = decode_frames(frame)[0]
    assert encode_message(decoded) == frame, "encoding is canonical"
    assert from_json(MessageType(frame[5]).name, to_json(msg)) == msg


def slots(obj: Any) -> list[tuple[Any, Any]]:
    """Every (container, key or index) inside a decoded body."""
    out: list[tuple[Any, Any]] = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    for key, value in items:
        out.append((obj, key))
        if isinstance(value, dict | list):
            out.extend(slots(value))
    return out


@FUZZ
@given(messages, st.data())
def test_one_bad_field_in_a_valid_body_raises_only_remote_protocol_errors(
    msg: Message, data: st.DataObject
) -> None:
    # Random bodies rarely get past the top-level checks; this reaches every field.
    obj = message_to_obj(msg)
    where = slots(obj)
    if not where:
        return
    container, key = data.draw(st.sampled_from(where))
    container[key] = data.draw(msgpack_values)
    body = msgpack.packb(obj, use_bin_type=True)
    try:
        decoded = decode_message(MESSAGE_TYPES[type(msg)], body)
    except RemoteProtocolError:
        return
    assert type(decoded) is type(msg)


@settings(max_examples=50, deadline=None)
@given(st.lists(messages, min_size=1, max_size=4), st.lists(st.integers(1, 97), min_size=1))
def test_random_messages_survive_arbitrary_chunking(msgs: list[Message], sizes: list[int]) -> None:
    stream = b"".join(encode_message(m) for m in msgs)
    dec = FrameDecoder()
    got: list[Message] = []
    pos = 0
    for step in itertools.cycle(sizes):
        if pos >= len(stream):
            break
        dec.feed(stream[pos : pos + step])
        pos += step
        while (frame := dec.next_frame()) is not None:
            got.append(decode_message(*frame))
    assert got == msgs
    assert dec.buffered == 0
