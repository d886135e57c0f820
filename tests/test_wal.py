"""The write-ahead log: what was synced survives, torn tails are cut and reported,
corruption before the end is refused, compaction is atomic."""

from __future__ import annotations

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
from convergenced.core.spec import Policy, StreamSpec
from convergenced.daemon.wal import (
    FILE_HEADER,
    Entry,
    Incarnation,
    WalCorruptError,
    WriteAheadLog,
    decode_entry,
    encode_entry,
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


def test_synced_entries_are_read_back_in_order(tmp_path: Path) -> None:
    wal, found, report = WriteAheadLog.open(tmp_path / "wal")
    assert found == [] and report.entries == 0
    for e in ENTRIES:
        wal.append(e)
    wal.sync()
    wal.close()
    _, again, report = WriteAheadLog.open(tmp_path / "wal")
    assert again == ENTRIES
    assert report.torn_tail_bytes == 0


def test_appends_without_sync_are_not_durable(tmp_path: Path) -> None:
    wal, _, _ = WriteAheadLog.open(tmp_path / "wal")
    wal.append(Incarnation(1))
    wal.sync()
    wal.append(Incarnation(2))  # never synced: the process dies here
    wal.close()
    _, found, _ = WriteAheadLog.open(tmp_path / "wal")
    assert found == [Incarnation(1)]


def test_one_sync_writes_a_whole_group(tmp_path: Path) -> None:
    wal, _, _ = WriteAheadLog.open(tmp_path / "wal")
    for e in ENTRIES:
        wal.append(e)
    assert wal.pending > 0
    wal.sync()
    assert wal.syncs == 1 and wal.pending == 0
    wal.sync()  # nothing pending: no fsync
    assert wal.syncs == 1


def _log_with(tmp_path: Path, entries: list[Entry]) -> bytes:
    wal, _, _ = WriteAheadLog.open(tmp_path / "wal")
    for e in entries:
        wal.append(e)
    wal.sync()
    wal.close()
    return (tmp_path / "wal").read_bytes()


def test_a_torn_last_entry_is_truncated_and_reported_at_every_cut(tmp_path: Path) -> None:
    full = _log_with(tmp_path, ENTRIES)
    (tmp_path / "prefix").mkdir()
    prefix = _log_with(tmp_path / "prefix", ENTRIES[:-1])
    for cut in range(len(prefix) + 1, len(full)):
        path = tmp_path / "wal"
        path.write_bytes(full[:cut])
        _, found, report = WriteAheadLog.open(path)
        assert found == ENTRIES[:-1]
        assert report.torn_tail_bytes == cut - len(prefix)
        assert "torn tail" in report.detail
        assert path.read_bytes() == prefix  # truncated on disk, not just ignored


def test_a_checksum_failure_in_the_last_entry_is_a_torn_tail(tmp_path: Path) -> None:
    full = bytearray(_log_with(tmp_path, ENTRIES))
    full[-1] ^= 0xFF
    (tmp_path / "wal").write_bytes(bytes(full))
    _, found, report = WriteAheadLog.open(tmp_path / "wal")
    assert found == ENTRIES[:-1]
    assert "checksum" in report.detail


def test_corruption_before_the_end_is_refused_not_dropped(tmp_path: Path) -> None:
    full = bytearray(_log_with(tmp_path, ENTRIES))
    full[len(FILE_HEADER) + 10] ^= 0xFF  # inside the first entry's payload
    (tmp_path / "wal").write_bytes(bytes(full))
    with pytest.raises(WalCorruptError, match="corrupt entry at offset"):
        WriteAheadLog.open(tmp_path / "wal")
    assert (tmp_path / "wal").read_bytes() == bytes(full)  # left for the operator


def test_an_implausible_length_is_corruption(tmp_path: Path) -> None:
    full = bytearray(_log_with(tmp_path, ENTRIES))
    full[len(FILE_HEADER) : len(FILE_HEADER) + 4] = b"\xff\xff\xff\xff"
    (tmp_path / "wal").write_bytes(bytes(full))
    with pytest.raises(WalCorruptError, match="claims"):
        WriteAheadLog.open(tmp_path / "wal")


def test_a_foreign_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "wal").write_bytes(b"hello world, not a log")
    with pytest.raises(WalCorruptError, match="not a convergenced write-ahead log"):
        WriteAheadLog.open(tmp_path / "wal")


def test_compaction_replaces_the_log_atomically(tmp_path: Path) -> None:
    wal, _, _ = WriteAheadLog.open(tmp_path / "wal")
    for e in ENTRIES:
        wal.append(e)
    wal.sync()
    wal.compact([Incarnation(7), Declare(SPEC)])
    wal.append(Commit("job", 2, "nvme", 1))
    wal.sync()
    wal.close()
    _, found, _ = WriteAheadLog.open(tmp_path / "wal")
    assert found == [Incarnation(7), Declare(SPEC), Commit("job", 2, "nvme", 1)]
    assert not (tmp_path / "wal.tmp").exists()


def test_replaying_the_log_rebuilds_the_same_node_state(tmp_path: Path) -> None:
    node = NodeCore("a", 1)
    wal, _, _ = WriteAheadLog.open(tmp_path / "wal")
    for fact in [Declare(SPEC), *(Commit("job", r, "nvme", e) for e in range(6) for r in (0, 1))]:
        node.apply(fact)
        wal.append(fact)
    wal.sync()
    wal.close()
    _, found, _ = WriteAheadLog.open(tmp_path / "wal")
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
@given(st.lists(entries, max_size=30), st.data())
def test_any_synced_prefix_survives_any_torn_tail(
    tmp_path: Path, batch: list[Entry], data: st.DataObject
) -> None:
    path = tmp_path / "prop.wal"
    path.unlink(missing_ok=True)
    wal, _, _ = WriteAheadLog.open(path)
    for e in batch:
        wal.append(e)
    wal.sync()
    durable = path.read_bytes()
    extra = data.draw(st.lists(entries, min_size=1, max_size=3))
    for e in extra:
        wal.append(e)
    wal.sync()
    wal.close()
    whole = path.read_bytes()
    cut = data.draw(st.integers(len(durable), len(whole)))
    path.write_bytes(whole[:cut])
    _, found, _ = WriteAheadLog.open(path)
    assert found[: len(batch)] == batch
    assert found == (batch + extra)[: len(found)]
