"""Generate the golden wire vectors in this directory from the reference codec.

Run from anywhere::

    .venv/bin/python proto/vectors/generate.py          # rewrite the JSON files
    .venv/bin/python proto/vectors/generate.py --check  # exit 1 if they are stale

Output is deterministic (fixed inputs, no clock, no randomness), so the files are
reviewed like code and `tests/test_wire.py` fails when they drift from the codec.
See README.md for the format.

Valid vectors are built from message objects and encoded by `encode_message`.
Malformed vectors are assembled by hand, field by field, so each one breaks
exactly one rule while everything around it stays valid.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

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
    HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    WireLimits,
    encode_message,
    message_to_obj,
)

HERE = Path(__file__).resolve().parent
FILES = ("messages.json", "malformed.json")

# -- fixed inputs -------------------------------------------------------------

VIEW_DIGEST = bytes(range(16))
OTHER_DIGEST = bytes(range(0xF0, 0x100))
SPEC_DIGEST = hashlib.sha256(b"convergenced golden vector spec").digest()
# Placeholder signature: the codec carries signatures but does not verify them.
SIGNATURE = bytes((7 * i + 3) % 256 for i in range(64))

FULL_RECORD = Record(
    stream="llama-70b",
    origin="node-a",
    incarnation=3,
    version=42,
    spec_digest=SPEC_DIGEST,
    recoverable=IntervalSet([(0, 9), (20, 29), (100, 100)]),
    newest=(("gpu", 100), ("nvme", 29), ("s3", 9)),
    proposal=29,
    restore_point=20,
    high_water=20,
    generations=((1, IntervalSet([(0, 9), (20, 25)])), (2, IntervalSet([(20, 29)]))),
    membership=1,
    signature=SIGNATURE,
)
EMPTY_RECORD = Record(
    stream="llama-70b",
    origin="node-b",
    incarnation=0,
    version=1,
    spec_digest=SPEC_DIGEST,
    recoverable=IntervalSet(),
)
LARGE_RECORD = Record(
    stream="job/eval.v2",
    origin="node-c.rack_7",
    incarnation=2**32,
    version=INT64_MAX,
    spec_digest=bytes(32),
    recoverable=IntervalSet([(2**31, INT64_MAX)]),
    newest=(("ram", INT64_MAX),),
    proposal=INT64_MAX,
    restore_point=None,
    high_water=2**31,
    generations=((INT64_MAX, IntervalSet.of(2**31)),),
    membership=INT64_MAX,
)

CREDENTIAL = bytes(range(256)) * 2
"""Opaque to the codec (PROTOCOL.md 7.6 says what a daemon puts in it)."""

V3 = frozenset(
    {
        "v3_hello_with_credential",
        "v3_hello_without_credential",
        "v3_tick_with_credentials",
        "v3_tock_without_credentials",
    }
)
"""The vectors framed in version 3 (every other one is version 2)."""

VALID: list[tuple[str, Message]] = [
    (
        "hello_with_summary",
        Hello(
            cluster="prod-east",
            node="node-a",
            incarnation=3,
            digest=VIEW_DIGEST,
            summary=(("llama-70b", "node-a", 3, 42), ("llama-70b", "node-b", 0, 1)),
        ),
    ),
    (
        "hello_empty_view",
        Hello(cluster="c", node="n1", incarnation=0, digest=bytes(16), summary=()),
    ),
    (
        "tick_with_records",
        Tick(
            seq=7,
            digest=VIEW_DIGEST,
            match=False,
            records=(FULL_RECORD, EMPTY_RECORD, LARGE_RECORD),
        ),
    ),
    ("tick_heartbeat", Tick(seq=1, digest=VIEW_DIGEST, match=True, records=())),
    (
        "tick_with_links",
        Tick(seq=2, digest=VIEW_DIGEST, match=True, records=(), links=("node-b", "node-c")),
    ),
    ("tock_with_record", Tock(seq=7, digest=OTHER_DIGEST, match=False, records=(EMPTY_RECORD,))),
    ("tock_in_sync", Tock(seq=INT64_MAX, digest=VIEW_DIGEST, match=True, records=())),
    ("nudge", Nudge()),
    (
        "v3_hello_with_credential",
        Hello(
            cluster="c",
            node="n1",
            incarnation=2,
            digest=bytes(16),
            summary=(),
            credentials=(CREDENTIAL,),
        ),
    ),
    ("v3_hello_without_credential", Hello("c", "n1", 2, bytes(16), ())),
    (
        "v3_tick_with_credentials",
        Tick(
            seq=3,
            digest=VIEW_DIGEST,
            match=False,
            records=(EMPTY_RECORD,),
            links=("node-b",),
            credentials=(CREDENTIAL, b"\x01"),
        ),
    ),
    ("v3_tock_without_credentials", Tock(seq=3, digest=VIEW_DIGEST, match=True, records=())),
    ("bye", Bye(reason="shutting down")),
    ("bye_unicode_reason", Bye(reason="wrong_cluster: grüße \u2013 \U0001f6d1")),
]


# -- JSON form of messages ----------------------------------------------------


def record_json(rec: Record) -> dict[str, Any]:
    """A record with its fields by name; bytes as hex, interval sets as flat lists."""
    return {
        "stream": rec.stream,
        "origin": rec.origin,
        "incarnation": rec.incarnation,
        "version": rec.version,
        "spec_digest": rec.spec_digest.hex(),
        "recoverable": rec.recoverable.encode(),
        "newest": [[d, e] for d, e in rec.newest],
        "proposal": rec.proposal,
        "restore_point": rec.restore_point,
        "high_water": rec.high_water,
        "generations": [[g, s.encode()] for g, s in rec.generations],
        "membership": rec.membership,
        "signature": rec.signature.hex(),
    }


def message_json(msg: Message, version: int = PROTOCOL_VERSION) -> dict[str, Any]:
    """The `decoded` form of a message (see README.md)."""
    if isinstance(msg, Hello):
        return {
            "cluster": msg.cluster,
            "node": msg.node,
            "incarnation": msg.incarnation,
            "digest": msg.digest.hex(),
            "summary": [list(e) for e in msg.summary],
            **_credentials_json(msg, version),
        }
    if isinstance(msg, Tick | Tock):
        return {
            "seq": msg.seq,
            "digest": msg.digest.hex(),
            "match": msg.match,
            "records": [record_json(r) for r in msg.records],
            "links": list(msg.links),
            **_credentials_json(msg, version),
        }
    if isinstance(msg, Nudge):
        return {}
    return {"reason": msg.reason}


def _credentials_json(msg: Hello | Tick | Tock, version: int) -> dict[str, Any]:
    return {"credentials": [c.hex() for c in msg.credentials]} if version >= 3 else {}


# -- malformed frames ---------------------------------------------------------


def frame(
    mtype: int,
    body: bytes,
    *,
    magic: bytes = MAGIC,
    version: int = PROTOCOL_VERSION,
    flags: int = 0,
    length: int | None = None,
) -> bytes:
    """A frame with every header field overridable."""
    n = len(body) if length is None else length
    return HEADER.pack(magic, version, mtype, flags, n) + body


def packb(obj: Any) -> bytes:
    """msgpack with the bin type for bytes, as the codec encodes."""
    return bytes(msgpack.packb(obj, use_bin_type=True))


def body_of(msg: Message) -> dict[str, Any]:
    """The msgpack-ready body of a valid message, to be broken by one edit."""
    obj = message_to_obj(msg)
    assert isinstance(obj, dict)
    return obj


def tick_body(version: int = PROTOCOL_VERSION, **changes: Any) -> bytes:
    """A valid one-record TICK body with fields replaced (a value of `DROP` removes it)."""
    obj = message_to_obj(
        Tick(seq=7, digest=VIEW_DIGEST, match=False, records=(EMPTY_RECORD,)), version
    )
    for key, value in changes.items():
        if value is DROP:
            del obj[key]
        else:
            obj[key] = value
    return packb(obj)


def tick_record(index: int, value: Any) -> bytes:
    """A TICK whose only record has field ``index`` of its wire array replaced."""
    wire = FULL_RECORD.to_wire()
    wire[index] = value
    return frame(MessageType.TICK, tick_body(records=[wire]))


def hello_body(**changes: Any) -> bytes:
    """A valid HELLO body with fields replaced."""
    obj = body_of(VALID[0][1])
    obj.update(changes)
    return packb(obj)


DROP = object()
TICK = MessageType.TICK
HELLO = MessageType.HELLO
LIMITS = WireLimits()

# Field indexes of the record wire array (see Record.body).
STREAM, ORIGIN, INCARNATION, VERSION, SPEC, RECOVERABLE, NEWEST = range(7)
PROPOSAL, RESTORE_POINT, HIGH_WATER, GENERATIONS, MEMBERSHIP, SIGNATURE_FIELD = range(7, 13)


def _dup_key_tick() -> bytes:
    # A map header for 5 entries, then "seq" twice: msgpack libraries keep the last
    # value silently unless told not to; the codec must refuse.
    parts = [b"\x85", packb("seq"), packb(1), packb("seq"), packb(2)]
    parts += [packb("digest"), packb(VIEW_DIGEST), packb("match"), packb(False)]
    parts += [packb("records"), packb([])]
    return b"".join(parts)


MALFORMED: list[tuple[str, Callable[[], bytes], str, str]] = [
    # name, frame builder, reason, message substring
    ("bad_magic", lambda: frame(TICK, tick_body(), magic=b"CVGE"), "bad_magic", "frame: bad magic"),
    ("bad_magic_first_byte", lambda: b"HTTP", "bad_magic", "frame: bad magic"),
    ("unsupported_version", lambda: frame(TICK, tick_body(), version=4), "unsupported_version",
     "frame: protocol version 4 not supported"),
    ("v2_with_credentials", lambda: frame(TICK, tick_body(credentials=[])), "invalid_field",
     "TICK: unknown field 'credentials'"),
    ("v3_without_credentials", lambda: frame(TICK, tick_body(), version=3), "invalid_field",
     "TICK: missing field 'credentials'"),
    ("v3_hello_without_credentials", lambda: frame(HELLO, hello_body(), version=3),
     "invalid_field", "HELLO: missing field 'credentials'"),
    ("v3_credential_not_bytes",
     lambda: frame(TICK, tick_body(3, credentials=["x"]), version=3), "invalid_field",
     "TICK.credentials[0]: expected bytes"),
    ("v3_credential_empty", lambda: frame(TICK, tick_body(3, credentials=[b""]), version=3),
     "invalid_field", "TICK.credentials[0]: length 0 outside [1, 4096]"),
    ("v3_too_many_credentials",
     lambda: frame(TICK, tick_body(3, credentials=[b"c"] * 65), version=3), "limit_exceeded",
     "TICK.credentials: 65 elements above the limit"),
    ("version_1_frame", lambda: frame(TICK, tick_body(), version=1), "unsupported_version",
     "frame: protocol version 1 not supported"),
    ("unknown_type", lambda: frame(9, packb({})), "unknown_type", "frame: unknown message type 9"),
    ("type_zero", lambda: frame(0, packb({})), "unknown_type", "frame: unknown message type 0"),
    ("nonzero_flags", lambda: frame(MessageType.NUDGE, packb({}), flags=0x8000), "bad_flags",
     "frame: flags 0x8000 must be 0"),
    ("frame_too_large", lambda: frame(TICK, b"", length=LIMITS.max_frame_bytes + 1),
     "frame_too_large", f"frame: TICK body of {LIMITS.max_frame_bytes + 1} bytes exceeds"),
    ("empty_body", lambda: frame(MessageType.NUDGE, b""), "malformed_body",
     "NUDGE: malformed msgpack body"),
    ("truncated_msgpack", lambda: frame(TICK, tick_body()[:-5]), "malformed_body",
     "TICK: malformed msgpack body"),
    ("garbage_msgpack", lambda: frame(TICK, b"\xc1\xc1\xc1"), "malformed_body",
     "TICK: malformed msgpack body"),
    ("trailing_bytes", lambda: frame(MessageType.NUDGE, packb({}) + b"\x00"), "malformed_body",
     "NUDGE: malformed msgpack body (ExtraData"),
    ("duplicate_map_key", lambda: frame(TICK, _dup_key_tick()), "malformed_body",
     "duplicate map key 'seq'"),
    ("non_string_map_key", lambda: frame(TICK, b"\x81\x01\x02"), "malformed_body",
     "TICK: malformed msgpack body"),
    ("ext_type", lambda: frame(MessageType.BYE, b"\x81" + packb("reason") + b"\xd4\x05\x00"),
     "malformed_body", "BYE: malformed msgpack body"),
    ("timestamp_ext", lambda: frame(TICK, tick_body(seq=msgpack.Timestamp(1, 0))),
     "malformed_body", "TICK: malformed msgpack body"),
    ("invalid_utf8", lambda: frame(MessageType.BYE, b"\x81" + packb("reason") + b"\xa3\xff\xfeA"),
     "malformed_body", "BYE: malformed msgpack body"),
    ("body_not_a_map", lambda: frame(TICK, packb([7, VIEW_DIGEST, False, []])), "invalid_field",
     "TICK: expected a map"),
    ("unknown_field", lambda: frame(TICK, tick_body(extra=1)), "invalid_field",
     "TICK: unknown field 'extra'"),
    ("nudge_with_field", lambda: frame(MessageType.NUDGE, packb({"seq": 1})), "invalid_field",
     "NUDGE: unknown field 'seq'"),
    ("missing_field", lambda: frame(TICK, tick_body(match=DROP)), "invalid_field",
     "TICK: missing field 'match'"),
    ("links_not_array", lambda: frame(TICK, tick_body(links="node-b")), "invalid_field",
     "TICK.links: expected an array"),
    ("links_bad_name", lambda: frame(TICK, tick_body(links=["ok", "bad name"])), "invalid_field",
     "TICK.links[1]"),
    ("seq_as_string", lambda: frame(TICK, tick_body(seq="7")), "invalid_field",
     "TICK.seq: expected an integer"),
    ("seq_as_float", lambda: frame(TICK, tick_body(seq=7.0)), "invalid_field",
     "TICK.seq: expected an integer"),
    ("seq_as_bool", lambda: frame(TICK, tick_body(seq=True)), "invalid_field",
     "TICK.seq: expected an integer"),
    ("seq_zero", lambda: frame(TICK, tick_body(seq=0)), "invalid_field", "TICK.seq: 0 is below 1"),
    ("seq_negative", lambda: frame(MessageType.TOCK, tick_body(seq=-1)), "invalid_field",
     "TOCK.seq: -1 is below 1"),
    ("seq_above_int64", lambda: frame(TICK, tick_body(seq=2**63)), "invalid_field",
     f"TICK.seq: {2**63} is above {INT64_MAX}"),
    ("match_as_int", lambda: frame(TICK, tick_body(match=1)), "invalid_field",
     "TICK.match: expected a boolean"),
    ("digest_too_short", lambda: frame(TICK, tick_body(digest=bytes(15))), "invalid_field",
     "TICK.digest: length 15 outside [16, 16]"),
    ("digest_as_string", lambda: frame(TICK, tick_body(digest="00" * 16)), "invalid_field",
     "TICK.digest: expected bytes"),
    ("too_many_records", lambda: frame(TICK, tick_body(records=[None] * (LIMITS.max_records + 1))),
     "limit_exceeded", f"TICK.records: {LIMITS.max_records + 1} elements above the limit"),
    ("record_wrong_arity", lambda: frame(TICK, tick_body(records=[FULL_RECORD.to_wire()[:12]])),
     "invalid_field", "TICK.records[0]: expected 13 elements, got 12"),
    ("record_negative_membership", lambda: tick_record(MEMBERSHIP, -1), "invalid_field",
     "TICK.records[0].membership: -1 is negative"),
    ("record_negative_version", lambda: tick_record(VERSION, -1), "invalid_field",
     "TICK.records[0].version: -1 is negative"),
    ("record_float_epoch", lambda: tick_record(PROPOSAL, 29.0), "invalid_field",
     "TICK.records[0].proposal: expected an integer"),
    ("record_bad_stream_name", lambda: tick_record(STREAM, "has space"), "invalid_field",
     "TICK.records[0].stream: 'has space' is not a valid name"),
    ("record_name_trailing_newline", lambda: tick_record(ORIGIN, "node-a\n"), "invalid_field",
     "TICK.records[0].origin: 'node-a\\n' is not a valid name"),
    ("record_name_too_long", lambda: tick_record(ORIGIN, "n" * 129), "invalid_field",
     "TICK.records[0].origin: length 129 above 128"),
    ("record_spec_digest_length", lambda: tick_record(SPEC, bytes(31)), "invalid_field",
     "TICK.records[0].spec_digest: length 31 outside [32, 32]"),
    ("interval_set_unsorted", lambda: tick_record(RECOVERABLE, [20, 29, 0, 9]), "invalid_field",
     "TICK.records[0].recoverable: ranges not sorted, disjoint and separated"),
    ("interval_set_overlapping", lambda: tick_record(RECOVERABLE, [0, 9, 5, 12]),
     "invalid_field", "TICK.records[0].recoverable: ranges not sorted, disjoint and separated"),
    ("interval_set_adjacent", lambda: tick_record(RECOVERABLE, [0, 9, 10, 12]),
     "invalid_field", "TICK.records[0].recoverable: ranges not sorted, disjoint and separated"),
    ("interval_set_reversed_range", lambda: tick_record(RECOVERABLE, [9, 0]), "invalid_field",
     "TICK.records[0].recoverable: invalid epoch range (9, 0)"),
    ("interval_set_odd_length", lambda: tick_record(RECOVERABLE, [0, 9, 20]), "invalid_field",
     "TICK.records[0].recoverable: odd number of bounds"),
    ("interval_set_negative_bound", lambda: tick_record(RECOVERABLE, [-1, 9]), "invalid_field",
     "TICK.records[0].recoverable[0]: -1 is negative"),
    ("generation_set_unsorted",
     lambda: tick_record(GENERATIONS, [[1, [0, 9]], [2, [30, 39, 20, 29]]]), "invalid_field",
     "TICK.records[0].generations[1].epochs: ranges not sorted"),
    ("generations_not_sorted", lambda: tick_record(GENERATIONS, [[2, []], [1, []]]),
     "invalid_field", "TICK.records[0].generations: generations not sorted and unique"),
    ("newest_not_sorted", lambda: tick_record(NEWEST, [["s3", 1], ["gpu", 2]]), "invalid_field",
     "TICK.records[0].newest: domains not sorted and unique"),
    ("newest_pair_wrong_arity", lambda: tick_record(NEWEST, [["gpu"]]), "invalid_field",
     "TICK.records[0].newest[0]: expected 2 elements, got 1"),
    ("signature_wrong_length", lambda: tick_record(SIGNATURE_FIELD, bytes(10)), "invalid_field",
     "TICK.records[0].signature: expected 0 or 64 bytes"),
    ("hello_wrong_cluster_type", lambda: frame(HELLO, hello_body(cluster=None)), "invalid_field",
     "HELLO.cluster: expected a string"),
    ("hello_incarnation_uint64", lambda: frame(HELLO, hello_body(incarnation=2**64 - 1)),
     "invalid_field", f"HELLO.incarnation: {2**64 - 1} is above {INT64_MAX}"),
    ("hello_summary_entry_arity", lambda: frame(HELLO, hello_body(summary=[["s", "n", 1]])),
     "invalid_field", "HELLO.summary[0]: expected 4 elements, got 3"),
    ("hello_summary_negative_version",
     lambda: frame(HELLO, hello_body(summary=[["s", "n", 1, -5]])), "invalid_field",
     "HELLO.summary[0].version: -5 is negative"),
    ("bye_reason_too_long", lambda: frame(MessageType.BYE, packb({"reason": "x" * 300})),
     "invalid_field", "BYE.reason: length 300 above 256"),
    ("bye_reason_as_bytes", lambda: frame(MessageType.BYE, packb({"reason": b"bye"})),
     "invalid_field", "BYE.reason: expected a string"),
]  # fmt: skip


# -- output -------------------------------------------------------------------


def build() -> dict[str, Any]:
    """Both files' contents, by file name."""
    limits = {
        "max_frame_bytes": LIMITS.max_frame_bytes,
        "max_records": LIMITS.max_records,
        "max_summary": LIMITS.max_summary,
        "max_str": LIMITS.max_str,
        "max_bin": LIMITS.max_bin,
        "max_array": LIMITS.max_array,
        "max_map": LIMITS.max_map,
    }
    messages = [
        {
            "name": name,
            "type": MESSAGE_TYPES[type(msg)].name,
            "hex": encode_message(msg, _version(name)).hex(),
            "decoded": message_json(msg, _version(name)),
            **({"version": 3} if name in V3 else {}),
        }
        for name, msg in VALID
    ]
    malformed = [
        {"name": name, "hex": make().hex(), "error_reason": reason, "error_contains": contains}
        for name, make, reason, contains in MALFORMED
    ]
    header = {"protocol_version": PROTOCOL_VERSION, "limits": limits}
    return {
        "messages.json": {
            "description": "Valid frames: decoding hex gives decoded; encoding decoded gives hex.",
            **header,
            "vectors": messages,
        },
        "malformed.json": {
            "description": "Frames a decoder with these limits must refuse, with these errors.",
            **header,
            "vectors": malformed,
        },
    }


def _version(name: str) -> int:
    return 3 if name in V3 else PROTOCOL_VERSION


def render(content: Any) -> str:
    """Deterministic JSON text (ASCII only, two-space indent, final newline)."""
    return json.dumps(content, indent=2, ensure_ascii=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check``, verify) the vector files."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the files are stale")
    parser.add_argument("--out", type=Path, default=HERE, help="output directory")
    args = parser.parse_args(argv)
    stale = []
    for name, content in build().items():
        path = args.out / name
        text = render(content)
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            path.write_text(text, encoding="utf-8")
    if stale:
        print(f"stale: {', '.join(stale)}; run proto/vectors/generate.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
