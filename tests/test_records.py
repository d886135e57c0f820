"""Records and the view merge: a join on a semilattice, so order and duplicates never matter."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from convergenced.core import records as records_module
from convergenced.core.errors import RemoteProtocolError
from convergenced.core.interval_set import IntervalSet
from convergenced.core.records import DIGEST_LEN, Record, RecordKey, View

PROPERTY = settings(max_examples=100, deadline=None)
SPEC_A = b"A" * 32
SPEC_B = b"B" * 32
EMPTY = IntervalSet()


def rec(
    origin: str = "a",
    incarnation: int = 1,
    version: int = 1,
    *,
    stream: str = "job",
    recoverable: IntervalSet = EMPTY,
    **fields: Any,
) -> Record:
    fields.setdefault("spec_digest", SPEC_A)
    return Record(
        stream=stream,
        origin=origin,
        incarnation=incarnation,
        version=version,
        recoverable=recoverable,
        **fields,
    )


# -- strategies ---------------------------------------------------------------

small_sets = st.lists(st.tuples(st.integers(0, 30), st.integers(0, 5)), max_size=3).map(
    lambda pairs: IntervalSet((lo, lo + n) for lo, n in pairs)
)
opt_epoch = st.none() | st.integers(0, 40)


@st.composite
def records(draw: st.DrawFn) -> Record:
    """A record with every field drawn independently (for wire round trips)."""
    big = st.integers(0, 2**63 - 1)
    domains = draw(st.lists(st.sampled_from(["gpu", "nvme", "s3"]), unique=True, max_size=3))
    gens = draw(st.lists(st.integers(0, 2**63 - 1), unique=True, max_size=3))
    return Record(
        stream=draw(st.sampled_from(["job", "other", "llm/pretrain-7"])),
        origin=draw(st.sampled_from(["a", "b", "node.3"])),
        incarnation=draw(big),
        version=draw(big),
        spec_digest=draw(st.binary(min_size=32, max_size=32)),
        recoverable=draw(small_sets),
        newest=tuple((d, draw(big)) for d in sorted(domains)),
        proposal=draw(st.none() | big),
        restore_point=draw(opt_epoch),
        high_water=draw(opt_epoch),
        generations=tuple((g, draw(small_sets)) for g in sorted(gens)),
        signature=draw(st.sampled_from([b"", b"\x01" * 64, bytes(range(64))])),
    )


def _content(r: Record) -> tuple[Any, ...]:
    """Everything but the key and the stamp, in constructor order."""
    return (
        r.spec_digest,
        r.recoverable,
        r.newest,
        r.proposal,
        r.restore_point,
        r.high_water,
        r.generations,
        r.signature,
    )


_CONTENTS: list[tuple[Any, ...]] = [
    (SPEC_A, IntervalSet(), (), None, None, None, (), b""),
    (SPEC_A, IntervalSet.span(0, 9), (("nvme", 9),), 9, 7, 7, (), b""),
    (SPEC_A, IntervalSet.span(0, 9), (("nvme", 9),), 9, 7, 7, (), b"\x01" * 64),
    (SPEC_A, IntervalSet.span(0, 9), (("nvme", 9),), 9, 7, 7, (), b"\x02" * 64),
    (SPEC_A, IntervalSet.of(3, 5), (("gpu", 6), ("nvme", 5)), 5, 5, 8, (), b""),
    (SPEC_A, IntervalSet.of(3, 5), (), 5, None, 8, ((1, IntervalSet.of(3)),), b""),
    (SPEC_B, IntervalSet.of(3, 5), (), 3, 3, 3, ((1, IntervalSet.of(3)), (4, IntervalSet())), b""),
    (SPEC_B, IntervalSet.span(2, 20), (("s3", 20),), None, None, None, (), b"\x01" * 64),
]
"""A pool of record contents, so that equal stamps with equal or different bodies,
and equal bodies with different signatures, are all common."""


@st.composite
def pooled_records(draw: st.DrawFn) -> Record:
    """Records over few keys, stamps and contents: collisions and ties are common."""
    return Record(
        draw(st.sampled_from(["job", "other"])),
        draw(st.sampled_from(["a", "b", "c"])),
        draw(st.integers(0, 2)),
        draw(st.integers(0, 3)),
        *draw(st.sampled_from(_CONTENTS)),
    )


def view_of(items: list[Record]) -> View:
    view = View()
    for r in items:
        view.merge(r)
    return view


def contents(view: View) -> dict[RecordKey, Record]:
    return {r.key: r for r in view}


def expected_winners(items: list[Record]) -> dict[RecordKey, Record]:
    """The model: per key, the record with the greatest (stamp, fingerprint, signature)."""
    out: dict[RecordKey, Record] = {}
    for r in items:
        old = out.get(r.key)
        if old is None or (r.stamp, r.fingerprint, r.signature) > (
            old.stamp,
            old.fingerprint,
            old.signature,
        ):
            out[r.key] = r
    return out


record_lists = st.lists(pooled_records(), max_size=12)


# -- the semilattice ------------------------------------------------------------


@PROPERTY
@given(record_lists)
def test_view_keeps_the_greatest_record_per_key(items: list[Record]) -> None:
    assert contents(view_of(items)) == expected_winners(items)


@PROPERTY
@given(record_lists, st.randoms(use_true_random=False))
def test_merge_is_commutative(items: list[Record], rnd: Any) -> None:
    shuffled = list(items)
    rnd.shuffle(shuffled)
    a, b = view_of(items), view_of(shuffled)
    assert contents(a) == contents(b)
    assert a.digest == b.digest


@PROPERTY
@given(record_lists, record_lists, record_lists)
def test_merge_is_associative(xs: list[Record], ys: list[Record], zs: list[Record]) -> None:
    left = view_of(xs)
    left.merge_all(list(view_of(ys)))  # (x ⊔ y)
    left.merge_all(list(view_of(zs)))  # (x ⊔ y) ⊔ z
    right_inner = view_of(ys)
    right_inner.merge_all(list(view_of(zs)))  # (y ⊔ z)
    right = view_of(xs)
    right.merge_all(list(right_inner))  # x ⊔ (y ⊔ z)
    assert contents(left) == contents(right)
    assert left.digest == right.digest
    assert contents(left) == expected_winners(xs + ys + zs)


@PROPERTY
@given(record_lists, st.randoms(use_true_random=False))
def test_merge_is_idempotent_under_duplication(items: list[Record], rnd: Any) -> None:
    duplicated = items + [rnd.choice(items) for _ in items] if items else []
    rnd.shuffle(duplicated)
    once, many = view_of(items), view_of(duplicated)
    assert contents(once) == contents(many)
    assert once.digest == many.digest


@PROPERTY
@given(record_lists)
def test_merging_a_view_into_itself_changes_nothing(items: list[Record]) -> None:
    view = view_of(items)
    digest, seq = view.digest, view.seq
    assert view.merge_all(list(view)) == []
    assert view.digest == digest
    assert view.seq == seq


# -- stale, replayed and equivocating records -------------------------------------


def test_a_stale_record_never_overwrites_a_newer_one() -> None:
    view = View()
    newer = rec(version=5, recoverable=IntervalSet.of(5))
    assert view.merge(newer)
    seq, digest = view.seq, view.digest
    for stale in (rec(version=4), rec(version=1), rec(incarnation=0, version=99)):
        assert view.merge(stale) is False
    assert view.get(("job", "a")) == newer
    assert (view.seq, view.digest) == (seq, digest)


def test_a_new_incarnation_beats_any_version_of_the_old_one() -> None:
    view = view_of([rec(incarnation=1, version=1000)])
    restarted = rec(incarnation=2, version=1)
    assert view.merge(restarted)
    assert view.get(("job", "a")) == restarted


def test_a_replayed_record_is_refused_and_leaves_the_view_unchanged() -> None:
    r = rec(version=3, proposal=7)
    view = view_of([r])
    seq, digest = view.seq, view.digest
    assert view.merge(Record.from_wire(r.to_wire(), "replay")) is False
    assert (view.seq, view.digest) == (seq, digest)


@PROPERTY
@given(pooled_records(), pooled_records())
def test_equal_stamps_with_different_content_resolve_the_same_in_either_order(
    x: Record, y: Record
) -> None:
    y = Record(x.stream, x.origin, x.incarnation, x.version, *_content(y))
    first, second = view_of([x, y]), view_of([y, x])
    assert contents(first) == contents(second)
    assert first.digest == second.digest
    winner = first.get(x.key)
    assert winner is not None
    assert winner.fingerprint == max(x.fingerprint, y.fingerprint)


def test_records_differing_only_in_signature_resolve_the_same_in_either_order() -> None:
    unsigned = rec(version=2)
    signed = rec(version=2, signature=b"\x07" * 64)
    assert unsigned.fingerprint == signed.fingerprint
    first, second = view_of([unsigned, signed]), view_of([signed, unsigned])
    assert first.get(("job", "a")) == second.get(("job", "a")) == signed


def test_records_of_different_streams_or_origins_never_compete() -> None:
    items = [rec("a"), rec("b"), rec("a", stream="other")]
    view = view_of(items)
    assert len(view) == 3
    assert view.streams() == ["job", "other"]
    assert set(view.stream("job")) == {"a", "b"}
    assert view.stream("missing") == {}


# -- digest -------------------------------------------------------------------------


def test_an_empty_view_has_the_zero_digest() -> None:
    assert View().digest == bytes(DIGEST_LEN)


@PROPERTY
@given(record_lists, record_lists)
def test_view_digests_are_equal_iff_views_hold_the_same_records(
    xs: list[Record], ys: list[Record]
) -> None:
    # "The same records" means the same signed bodies: the signature is not covered.
    a, b = view_of(xs), view_of(ys)
    bodies_a = {k: r.body_bytes() for k, r in contents(a).items()}
    bodies_b = {k: r.body_bytes() for k, r in contents(b).items()}
    assert (a.digest == b.digest) == (bodies_a == bodies_b)


def test_digest_changes_when_a_record_is_superseded_and_tracks_the_winner() -> None:
    view = view_of([rec(version=1), rec("b")])
    before = view.digest
    view.merge(rec(version=2, proposal=3))
    assert view.digest != before
    assert view.digest == view_of([rec("b"), rec(version=2, proposal=3)]).digest


def test_fingerprint_covers_the_body_but_not_the_signature() -> None:
    base = rec(proposal=3)
    assert base.fingerprint != rec(proposal=4).fingerprint
    assert base.fingerprint != rec(spec_digest=SPEC_B, proposal=3).fingerprint
    assert base.fingerprint == rec(proposal=3, signature=b"\x09" * 64).fingerprint
    assert len(base.fingerprint) == DIGEST_LEN


# -- wire form --------------------------------------------------------------------------


@PROPERTY
@given(records())
def test_record_wire_form_round_trips_through_msgpack(r: Record) -> None:
    wire = msgpack.unpackb(msgpack.packb(r.to_wire(), use_bin_type=True), raw=False)
    back = Record.from_wire(wire, "rec")
    assert back == r
    assert back.fingerprint == r.fingerprint
    assert back.body_bytes() == r.body_bytes()


def test_packed_is_the_msgpack_of_the_wire_form() -> None:
    r = rec(proposal=4, signature=b"\x05" * 64)
    assert r.packed() == msgpack.packb(r.to_wire(), use_bin_type=True)


_NASTY: list[Any] = [
    None, -1, 0, 2**63 - 1, 2**63, True, 1.5, "", "x", "bad name", b"", b"A" * 32,
    b"\x00" * 64, [], [0], [1, 0], [0, 1, 3, 4], [0, 1, 2, 3], [["nvme", 1]], [[1, []]],
    [[2, [0, 1]], [1, []]], [["s3", 1], ["nvme", 2]], [["nvme", -1]], [[0, [5]]], {},
    "a\n", "x" * 129, "é",
]  # fmt: skip


@st.composite
def damaged_wire(draw: st.DrawFn) -> Any:
    """A record's wire form with a few fields (or elements inside them) replaced."""
    wire: list[Any] = draw(records()).to_wire()
    for _ in range(draw(st.integers(0, 3))):
        i = draw(st.integers(0, len(wire) - 1))
        if isinstance(wire[i], list) and wire[i] and draw(st.booleans()):
            inner = list(wire[i])
            inner[draw(st.integers(0, len(inner) - 1))] = draw(st.sampled_from(_NASTY))
            wire[i] = inner
        else:
            wire[i] = draw(st.sampled_from(_NASTY))
    return draw(st.sampled_from([wire, wire[:-1], [*wire, None], wire]))


def _decode(obj: Any, *, strict_only: bool = False) -> Record | RemoteProtocolError:
    with pytest.MonkeyPatch.context() as mp:
        if strict_only:
            mp.setattr(records_module, "_from_wire_fast", lambda _obj: None)
        try:
            return Record.from_wire(obj, "r")
        except RemoteProtocolError as err:
            return err


@PROPERTY
@given(damaged_wire())
def test_fast_decoding_accepts_exactly_what_strict_decoding_accepts(wire: Any) -> None:
    # The fast path is an optimisation: it must never accept what the strict path
    # refuses, nor return a different record.
    strict, decoded = _decode(wire, strict_only=True), _decode(wire)
    event("accepted" if isinstance(strict, Record) else "refused")
    if isinstance(strict, Record):
        assert decoded == strict
    else:
        assert isinstance(decoded, RemoteProtocolError)
        assert str(decoded) == str(strict)


def test_wire_form_is_the_body_then_the_signature() -> None:
    r = rec(signature=b"\x05" * 64)
    assert r.to_wire() == [*r.body(), b"\x05" * 64]


def _wire_with(index: int, value: Any) -> list[Any]:
    wire = rec(newest=(("nvme", 1),), generations=((1, IntervalSet.of(2)),)).to_wire()
    wire[index] = value
    return wire


@pytest.mark.parametrize(
    ("wire", "path"),
    [
        (rec().to_wire()[:-1], "r"),
        (_wire_with(0, "bad stream"), "r.stream"),
        (_wire_with(2, -1), "r.incarnation"),
        (_wire_with(3, True), "r.version"),
        (_wire_with(4, b"short"), "r.spec_digest"),
        (_wire_with(5, [3, 1]), "r.recoverable"),
        (_wire_with(5, [0, 1, 2, 3]), "r.recoverable"),
        (_wire_with(6, [["s3", 1], ["nvme", 2]]), "r.newest"),
        (_wire_with(6, [["nvme", 1], ["nvme", 2]]), "r.newest"),
        (_wire_with(7, -2), "r.proposal"),
        (_wire_with(10, [[2, []], [1, []]]), "r.generations"),
        (_wire_with(11, -1), "r.membership"),
        (_wire_with(12, b"\x00" * 10), "r.signature"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_from_wire_rejects_malformed_records_naming_the_field(wire: Any, path: str) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        Record.from_wire(wire, "r")
    assert str(info.value).startswith(path + ":") or str(info.value).startswith(path + "[")


# -- change tracking ---------------------------------------------------------------------


@PROPERTY
@given(st.lists(pooled_records(), max_size=150), st.data())
def test_changed_since_returns_the_current_records_of_keys_changed_after_seq(
    items: list[Record], data: st.DataObject
) -> None:
    view = View()
    accepted: list[tuple[int, RecordKey]] = []
    for r in items:
        if view.merge(r):
            accepted.append((view.seq, r.key))
    assert view.seq == len(accepted)
    since = data.draw(st.integers(0, view.seq))
    changed = view.changed_since(since)
    expected_keys = {k for s, k in accepted if s > since}
    assert [r.key for r in changed] == list(dict.fromkeys(r.key for r in changed))
    assert {r.key for r in changed} == expected_keys
    assert all(view.get(r.key) is r for r in changed)


def test_changed_since_the_latest_seq_is_empty() -> None:
    view = view_of([rec("a"), rec("b")])
    assert view.changed_since(view.seq) == []
    assert {r.origin for r in view.changed_since(0)} == {"a", "b"}


def test_changed_since_survives_many_updates_of_one_key() -> None:
    view = View()
    for v in range(1, 500):
        view.merge(rec(version=v))
    view.merge(rec("b"))
    assert view.changed_since(0) == [view.get(("job", "a")), view.get(("job", "b"))]
    assert view.changed_since(498) == [view.get(("job", "a")), view.get(("job", "b"))]
    assert view.changed_since(499) == [view.get(("job", "b"))]


def test_summary_and_newer_than_compute_what_a_peer_lacks() -> None:
    view = view_of([rec("a", version=3), rec("b", version=1), rec("c")])
    assert view.summary()[("job", "a")] == (1, 3)
    peer_knows = {("job", "a"): (1, 3), ("job", "b"): (1, 0)}
    assert {r.origin for r in view.newer_than(peer_knows)} == {"b", "c"}
