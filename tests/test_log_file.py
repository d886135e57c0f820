"""The write-ahead log file: what was synced survives, a torn last write is cut and
reported, damage anywhere else is refused with its offset (every byte of a log is
tried), an empty or headless file is refused, old-format logs still open, compaction
is atomic."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from convergenced.core.facts import (
    CloseGenerations,
    Commit,
    Declare,
    Freeze,
    HighWater,
    Retire,
    Retract,
)
from convergenced.core.interval_set import IntervalSet
from convergenced.core.node import NodeCore
from convergenced.core.packing import pack
from convergenced.core.spec import Policy, StreamSpec
from convergenced.daemon.durability.entries import Entry, Incarnation, decode_entry, encode_entry
from convergenced.daemon.durability.log_file import (
    FILE_HEADER,
    GROUP_HEADER_SIZE,
    FactLog,
    WalCorruptError,
    encode_group,
    frame_entry,
)

SPEC = StreamSpec.create("job", {"a": [0, 1], "b": [2]}, Policy.all_of("nvme"), retention=2)

ENTRIES: list[Entry] = [
    Incarnation(1),
    Declare(SPEC),
    Commit("job", 0, "nvme", 5, "sha256:ab", 1024),
    Commit("job", 1, "nvme", 5),
    Retract("job", 1, "nvme", 5),
    Retire("job", 0, "nvme", 4),
    Freeze("job", 3, IntervalSet([(1, 4), (7, 9)])),
    HighWater("job", 5, (("b", 2, 17),)),
    CloseGenerations("job", 3),
]


def test_every_entry_kind_round_trips_through_the_codec() -> None:
    for entry in ENTRIES:
        assert decode_entry(encode_entry(entry)) == entry


def test_appended_entries_are_framed_as_frame_entry_frames_them(tmp_path: Path) -> None:
    # append packs with a packer of its own; compaction (encode_log) with frame_entry.
    wal, _, _ = FactLog.open(tmp_path / "wal")
    for e in ENTRIES:
        wal.append(e)
    assert wal.take_pending() == encode_group([frame_entry(e) for e in ENTRIES], 1)
    wal.close()


def _sync(wal: FactLog) -> None:
    wal.write_durably(wal.take_pending())


def _open(path: Path) -> tuple[list[Entry], str, int]:
    wal, found, report = FactLog.open(path)
    wal.close()
    return found, report.detail, report.torn_tail_bytes


def _log_of(path: Path, groups: list[list[Entry]]) -> bytes:
    """A log written as one write (one group) per item of ``groups``."""
    path.unlink(missing_ok=True)
    wal, _, _ = FactLog.open(path)
    for group in groups:
        for e in group:
            wal.append(e)
        _sync(wal)
    wal.close()
    return path.read_bytes()


GROUPS = [ENTRIES[:3], ENTRIES[3:6], ENTRIES[6:]]


def _group_offsets(data: bytes) -> list[int]:
    """Where each group starts (from the headers' lengths)."""
    offsets, at = [], len(FILE_HEADER)
    while at < len(data):
        offsets.append(at)
        (length,) = struct.unpack_from(">I", data, at + 4)
        at += GROUP_HEADER_SIZE + length
    return offsets


def test_synced_entries_are_read_back_in_order(tmp_path: Path) -> None:
    wal, found, report = FactLog.open(tmp_path / "wal")
    assert found == [] and report.entries == 0
    for e in ENTRIES:
        wal.append(e)
    _sync(wal)
    wal.close()
    again, detail, torn = _open(tmp_path / "wal")
    assert again == ENTRIES and torn == 0 and detail == ""


def test_appends_never_written_are_not_durable(tmp_path: Path) -> None:
    wal, _, _ = FactLog.open(tmp_path / "wal")
    wal.append(Incarnation(1))
    _sync(wal)
    wal.append(Incarnation(2))  # never written: the process dies here
    wal.close()
    assert _open(tmp_path / "wal")[0] == [Incarnation(1)]


def test_one_write_is_one_group_and_numbers_run_across_groups(tmp_path: Path) -> None:
    data = _log_of(tmp_path / "wal", GROUPS)
    starts = _group_offsets(data)
    assert len(starts) == 3
    seqs = [struct.unpack_from(">QI", data, at + 8) for at in starts]
    assert seqs == [(1, 3), (4, 3), (7, 3)]
    wal, _, _ = FactLog.open(tmp_path / "wal")
    assert wal.take_pending() == b""  # nothing appended: nothing to write


def test_without_group_commit_every_entry_is_a_group_of_its_own(tmp_path: Path) -> None:
    wal, _, _ = FactLog.open(tmp_path / "wal")
    for e in ENTRIES[:4]:
        wal.append(e)
    for group in wal.take_pending_one_by_one():
        wal.write_durably(group)
    wal.close()
    data = (tmp_path / "wal").read_bytes()
    assert len(_group_offsets(data)) == 4
    assert _open(tmp_path / "wal")[0] == ENTRIES[:4]


def test_a_torn_last_write_is_truncated_and_reported_at_every_cut(tmp_path: Path) -> None:
    path = tmp_path / "wal"
    full = _log_of(path, GROUPS)
    last = _group_offsets(full)[-1]
    for cut in range(last, len(full)):
        path.write_bytes(full[:cut])
        found, detail, torn = _open(path)
        assert found == ENTRIES[:6], cut
        assert torn == cut - last
        assert path.read_bytes() == full[:last]  # truncated on disk, not just ignored
        if cut > last:
            assert f"torn tail at offset {last}" in detail


@pytest.mark.parametrize("data", [b"", FILE_HEADER[:1], FILE_HEADER[:7]], ids=len)
def test_an_empty_or_headless_log_is_refused_and_left_alone(tmp_path: Path, data: bytes) -> None:
    # The file is created whole (temporary file, fsync, rename), so this is damage;
    # it must not be taken for an empty log and then refused on the next start.
    path = tmp_path / "wal"
    path.write_bytes(data)
    with pytest.raises(WalCorruptError, match="created whole, so it was damaged"):
        FactLog.open(path)
    assert path.read_bytes() == data


def test_every_damaged_byte_is_refused_or_is_the_torn_last_write(tmp_path: Path) -> None:
    path = tmp_path / "wal"
    full = _log_of(path, GROUPS)
    last = _group_offsets(full)[-1]
    for at in range(len(full)):
        damaged = bytearray(full)
        damaged[at] ^= 0xFF
        path.write_bytes(bytes(damaged))
        if at >= last:
            # Indistinguishable from a torn last write (never acknowledged): cut.
            found, detail, _ = _open(path)
            assert found == ENTRIES[:6] and "torn tail" in detail, at
            continue
        with pytest.raises(WalCorruptError) as info:
            FactLog.open(path)
        if at >= len(FILE_HEADER):
            assert "offset" in str(info.value), at
        assert path.read_bytes() == bytes(damaged)  # left for the operator


def _with_length(data: bytes, at: int, length: int, *, fix_crc: bool) -> bytes:
    out = bytearray(data)
    struct.pack_into(">I", out, at + 4, length)
    if fix_crc:  # as if written so: only the length is wrong
        struct.pack_into(">I", out, at + 24, zlib.crc32(bytes(out[at : at + 24])))
    return bytes(out)


@pytest.mark.parametrize("fix_crc", [False, True])
def test_a_mid_log_length_pointing_past_the_end_is_corruption(
    tmp_path: Path, fix_crc: bool
) -> None:
    # Taking it for a torn tail would silently drop every acknowledged fact after it.
    path = tmp_path / "wal"
    full = _log_of(path, GROUPS)
    middle = _group_offsets(full)[1]
    path.write_bytes(_with_length(full, middle, len(full), fix_crc=fix_crc))
    with pytest.raises(WalCorruptError, match=f"damaged group at offset {middle}"):
        FactLog.open(path)


def test_a_group_removed_from_the_middle_is_corruption(tmp_path: Path) -> None:
    path = tmp_path / "wal"
    full = _log_of(path, GROUPS)
    _, second, third = _group_offsets(full)
    path.write_bytes(full[:second] + full[third:])
    with pytest.raises(WalCorruptError, match="starts at entry 7, expected 4"):
        FactLog.open(path)


def test_an_entry_removed_from_a_group_is_corruption(tmp_path: Path) -> None:
    path = tmp_path / "wal"
    full = _log_of(path, GROUPS)
    first, second, _ = _group_offsets(full)
    # Rebuild the first group without its second entry, checksums and all, so only
    # the numbering can tell: the next group starts at 4, not 3.
    shorter = encode_group([frame_entry(e) for e in (ENTRIES[0], ENTRIES[2])], 1)
    path.write_bytes(full[:first] + shorter + full[second:])
    with pytest.raises(WalCorruptError, match="expected 3"):
        FactLog.open(path)


def test_a_foreign_file_or_an_unknown_version_is_refused(tmp_path: Path) -> None:
    (tmp_path / "wal").write_bytes(b"hello world, not a log")
    with pytest.raises(WalCorruptError, match="not a convergenced write-ahead log"):
        FactLog.open(tmp_path / "wal")
    (tmp_path / "wal").write_bytes(b"CVWL\x09\x00\x00\x00")
    with pytest.raises(WalCorruptError, match="version 9 is not known"):
        FactLog.open(tmp_path / "wal")


def _v1_log(entries: list[Entry]) -> bytes:
    """A log as the first format wrote it: length and CRC per entry, no groups."""
    out = b"CVWL\x01\x00\x00\x00"
    for e in entries:
        payload = pack(encode_entry(e))
        out += struct.pack(">II", len(payload), zlib.crc32(payload)) + payload
    return out


def test_a_log_of_the_first_format_opens_and_is_rewritten_in_the_current_one(
    tmp_path: Path,
) -> None:
    path = tmp_path / "wal"
    old = _v1_log(ENTRIES)
    path.write_bytes(old + old[len(FILE_HEADER) : len(FILE_HEADER) + 5])  # and a torn tail
    wal, found, report = FactLog.open(path)
    assert found == ENTRIES and report.upgraded_from == 1 and report.torn_tail_bytes == 5
    wal.append(Commit("job", 2, "nvme", 9))
    _sync(wal)
    wal.close()
    assert path.read_bytes().startswith(FILE_HEADER)
    again, _, _ = _open(path)
    assert again == [*ENTRIES, Commit("job", 2, "nvme", 9)]


def test_compaction_replaces_the_log_atomically(tmp_path: Path) -> None:
    path = tmp_path / "wal"
    wal, _, _ = FactLog.open(path)
    for e in ENTRIES:
        wal.append(e)
    _sync(wal)
    wal.replace_durably([Incarnation(7), Declare(SPEC)])
    wal.append(Commit("job", 2, "nvme", 1))
    _sync(wal)
    wal.close()
    found, detail, _ = _open(path)
    assert found == [Incarnation(7), Declare(SPEC), Commit("job", 2, "nvme", 1)]
    assert detail == "" and not list(tmp_path.glob(".*.tmp"))


def test_a_compaction_that_crashed_before_its_rename_leaves_nothing_behind(
    tmp_path: Path,
) -> None:
    path = tmp_path / "wal"
    _log_of(path, GROUPS)
    stale = tmp_path / ".wal.999999.0badcafe.tmp"
    stale.write_bytes(b"half a compaction")
    assert _open(path)[0] == ENTRIES
    assert not stale.exists()


def test_replaying_the_log_rebuilds_the_same_node_state(tmp_path: Path) -> None:
    node = NodeCore("a", 1)
    wal, _, _ = FactLog.open(tmp_path / "wal")
    for fact in [Declare(SPEC), *(Commit("job", r, "nvme", e) for e in range(6) for r in (0, 1))]:
        node.apply(fact)
        wal.append(fact)
    _sync(wal)
    wal.close()
    found, _, _ = _open(tmp_path / "wal")
    again = NodeCore("a", 2)
    again.replay([f for f in found if not isinstance(f, Incarnation)])
    assert again.status("job").recoverable == node.status("job").recoverable


names = st.sampled_from(["job", "other"])
epochs = st.integers(0, 2**63 - 1)
entries = st.one_of(
    st.builds(Incarnation, st.integers(0, 2**63 - 1)),
    st.builds(
        Commit,
        names,
        st.integers(0, 3),
        st.sampled_from(["nvme", "s3"]),
        epochs,
        st.text(max_size=20),
        st.integers(0, 2**40),
    ),
    st.builds(Retract, names, st.integers(0, 3), st.just("nvme"), epochs),
    st.builds(Retire, names, st.integers(0, 3), st.just("nvme"), epochs),
    st.builds(CloseGenerations, names, st.integers(0, 100)),
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.lists(entries, min_size=1, max_size=8), max_size=5), st.data())
def test_any_synced_prefix_survives_any_torn_last_write(
    tmp_path: Path, groups: list[list[Entry]], data: st.DataObject
) -> None:
    path = tmp_path / "prop.wal"
    durable = _log_of(path, groups)
    extra = data.draw(st.lists(entries, min_size=1, max_size=3))
    whole = _log_of(path, [*groups, extra])
    cut = data.draw(st.integers(len(durable), len(whole)))
    path.write_bytes(whole[:cut])
    found, _, _ = _open(path)
    synced = [e for g in groups for e in g]
    assert found in (synced, synced + extra)
    assert found == synced + extra or cut < len(whole)
