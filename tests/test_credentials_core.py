"""Credential gossip in the sans-IO core: links carry each node's newest credential to
every node, in any topology, before the records that need it (PROTOCOL.md 7.6).

The core treats credentials as opaque bytes; here a stand-in ``admit`` reads them as
msgpack ``[node, rank0, rank1]`` and refuses those marked revoked, as the daemon's
judge (certificates, signatures, revocation) does with real ones.
"""

from __future__ import annotations

import itertools

import msgpack

from convergenced.core.credentials import (
    MAX_CREDENTIALS_PER_MESSAGE,
    MAX_REPLACED,
    CredentialBook,
    Rank,
)
from convergenced.core.interval_set import IntervalSet
from convergenced.core.link import Link, LinkConfig, Role
from convergenced.core.node import NodeCore
from convergenced.core.records import Record
from convergenced.core.wire import CREDENTIALS_VERSION, PROTOCOL_VERSION, FrameDecoder

REVOKED = "revoked"


def blob(node: str, rank: Rank = (1, 1), pad: int = 0) -> bytes:
    return bytes(msgpack.packb([node, rank[0], rank[1], "x" * pad]))


def admit(data: bytes, via: str | None) -> tuple[str, Rank] | None:
    node, r0, r1, _ = msgpack.unpackb(data)
    if node.startswith(REVOKED):
        return None
    return node, (r0, r1)


class Net:
    """Nodes and links between them, pumped by hand until nothing moves."""

    def __init__(self, names: list[str]) -> None:
        self.nodes = {n: NodeCore(n, incarnation=1) for n in names}
        self.books = {n: CredentialBook(admit) for n in names}
        for n, book in self.books.items():
            book.put(n, (1, 1), blob(n))
        self.pairs: list[tuple[Link, Link]] = []

    def link(self, a: str, b: str, version: int = CREDENTIALS_VERSION) -> tuple[Link, Link]:
        def cfg(n: str) -> LinkConfig:
            return LinkConfig("c", wire_version=version, credentials=self.books[n])

        pair = (
            Link(self.nodes[a], Role.INITIATOR, cfg(a)),
            Link(self.nodes[b], Role.ACCEPTOR, cfg(b)),
        )
        for side in pair:
            side.start()
        self.pairs.append(pair)
        return pair

    def pump(self, rounds: int = 400) -> None:
        for _ in range(rounds):
            moved = False
            for x, y in self.pairs:
                for src, dst in ((x, y), (y, x)):
                    data = src.data_to_send()
                    if data:
                        moved = True
                        dst.receive_data(data)
                    while src.next_event() is not None:
                        pass
            if not moved:
                for x, y in self.pairs:
                    x.on_timer()
                    y.on_timer()
        for x, y in self.pairs:
            assert not x.closed and not y.closed

    def held(self, at: str) -> dict[str, Rank]:
        book = self.books[at]
        return {n: c.rank for n in book.nodes() if (c := book.get(n)) is not None}


def chain(names: list[str], version: int = CREDENTIALS_VERSION) -> Net:
    net = Net(names)
    for a, b in itertools.pairwise(names):
        net.link(a, b, version)
    return net


def test_every_node_learns_every_credential_over_a_chain() -> None:
    names = [f"n{i}" for i in range(6)]
    net = chain(names)
    net.pump()
    for n in names:
        assert net.held(n) == dict.fromkeys(names, (1, 1))


def test_a_higher_rank_replaces_the_credential_everywhere() -> None:
    names = ["a", "b", "c", "d"]
    net = chain(names)
    net.pump()
    net.books["a"].put("a", (2, 0), blob("a", (2, 0)))  # a rotated its certificate
    for link, _ in net.pairs:
        link.poll()
    net.pump()
    for n in names:
        assert net.held(n)["a"] == (2, 0)
    # An older one arriving late changes nothing.
    assert net.books["d"].offer([blob("a", (1, 9))], "c") == []
    assert net.held("d")["a"] == (2, 0)


def test_a_refused_credential_is_neither_held_nor_passed_on() -> None:
    net = chain(["a", "b", "c"])
    net.books["a"].put(REVOKED + "-x", (1, 1), blob(REVOKED + "-x"))
    net.pump()
    assert REVOKED + "-x" not in net.books["b"]
    assert REVOKED + "-x" not in net.books["c"]


def test_version_2_links_carry_no_credentials_and_still_exchange_records() -> None:
    net = Net(["a", "b"])
    net.link("a", "b", PROTOCOL_VERSION)
    record = Record("s", "z", 1, 1, bytes(32), IntervalSet.of(3))
    net.nodes["a"].receive([record])
    net.pump()
    assert net.held("b") == {"b": (1, 1)}
    assert net.nodes["b"].view.get(("s", "z")) == record


def test_many_credentials_cross_a_link_in_bounded_messages() -> None:
    net = Net(["a", "b"])
    many = MAX_CREDENTIALS_PER_MESSAGE * 2 + 5
    for i in range(many):
        net.books["a"].put(f"m{i}", (1, 1), blob(f"m{i}", pad=900))
    x, y = net.link("a", "b")
    sizes: list[int] = []
    for _ in range(50):
        data = x.data_to_send()
        if data:
            decoder = FrameDecoder()
            decoder.feed(data)
            while (frame := decoder.next_frame()) is not None:
                sizes.append(len(frame[1]))
            y.receive_data(data)
        back = y.data_to_send()
        if back:
            x.receive_data(back)
        x.on_timer()
        y.on_timer()
    assert len(net.books["b"]) == many + 2
    budget = x.config.limits.max_frame_bytes // 4
    assert max(sizes) < budget + 4096


def test_credentials_come_before_the_records_of_the_same_message() -> None:
    # A relayed record is verified against its origin's credential: the receiver
    # must have admitted the credential first. Node c records the order it saw.
    order: list[str] = []

    def admit_and_note(data: bytes, via: str | None) -> tuple[str, Rank] | None:
        verdict = admit(data, via)
        if verdict is not None:
            order.append(f"credential {verdict[0]}")
        return verdict

    def verify(record: Record, via: str | None) -> str | None:
        order.append(f"record {record.origin}")
        return None

    net = Net(["a", "b", "c"])
    net.nodes["c"] = NodeCore("c", incarnation=1, verify=verify)
    net.books["c"] = CredentialBook(admit_and_note)
    net.books["c"].put("c", (1, 1), blob("c"))
    net.nodes["a"].receive([Record("s", "z", 1, 1, bytes(32), IntervalSet.of(1))])
    net.books["a"].put("z", (1, 1), blob("z"))
    net.link("a", "b")
    net.pump()
    net.link("b", "c")
    net.pump()
    assert "record z" in order
    assert order.index("credential z") < order.index("record z")


def test_records_wait_for_their_origins_credential() -> None:
    # More origins than one message carries credentials for: a receiver that checks
    # each relayed record against its origin's credential must still get them all.
    net = Net(["a", "b"])
    held = net.books["b"]

    def verify(record: Record, via: str | None) -> str | None:
        return None if record.origin == via or record.origin in held else "unknown_origin"

    net.nodes["b"] = NodeCore("b", incarnation=1, verify=verify)
    origins = [f"o{i:03d}" for i in range(MAX_CREDENTIALS_PER_MESSAGE * 2 + 22)]
    for o in origins:
        net.books["a"].put(o, (1, 1), blob(o))
    net.nodes["a"].receive([Record("s", o, 1, 1, bytes(32), IntervalSet.of(1)) for o in origins])
    net.link("a", "b")
    net.pump()
    assert all(net.nodes["b"].view.get(("s", o)) is not None for o in origins)
    assert net.nodes["b"].view.digest == net.nodes["a"].view.digest


def test_a_refused_credential_comes_again_after_a_resend() -> None:
    refuse = {"x"}

    def picky(data: bytes, via: str | None) -> tuple[str, Rank] | None:
        verdict = admit(data, via)
        return None if verdict is not None and verdict[0] in refuse else verdict

    net = Net(["a", "b"])
    net.books["b"] = CredentialBook(picky)
    net.books["b"].put("b", (1, 1), blob("b"))
    net.books["a"].put("x", (1, 1), blob("x"))
    x, _ = net.link("a", "b")
    net.pump()
    assert "x" not in net.books["b"]  # refused (its clock was wrong, say)
    refuse.clear()
    net.books["a"].resend()
    x.poll()
    net.pump()
    assert "x" in net.books["b"]


def test_a_node_never_takes_its_own_credential_from_a_peer() -> None:
    seen: list[Rank] = []
    book = CredentialBook(admit, own="a", on_own=lambda data, rank: seen.append(rank))
    book.put("a", (1, 1), blob("a"))
    assert book.offer([blob("a", (1, 9))], "b") == []
    assert book.get("a") is not None and book.get("a").rank == (1, 1)  # type: ignore[union-attr]
    assert seen == [(1, 9)]


def test_a_node_hears_back_the_credentials_its_new_one_replaced() -> None:
    # A node that lost its record key comes back with a credential that outranks its
    # old one (a new certificate): its peer replaces the old one, and sends it back
    # once on the new link, since it names the key its records of then are signed with.
    def own_book(seen: list[Rank]) -> CredentialBook:
        return CredentialBook(admit, own="a", on_own=lambda data, rank: seen.append(rank))

    first: list[Rank] = []
    net = Net(["a", "b"])
    net.books["a"] = own_book(first)
    net.books["a"].put("a", (1, 1), blob("a"))
    net.link("a", "b")
    net.pump()
    assert first == [] and net.books["b"].replaced("a") == ()

    again: list[Rank] = []  # a new life: no memory, a new certificate, a new link
    net.pairs.clear()
    net.nodes["a"] = NodeCore("a", incarnation=2)
    net.books["a"] = own_book(again)
    net.books["a"].put("a", (2, 1), blob("a", (2, 1)))
    net.link("a", "b")
    net.pump()
    assert net.held("b")["a"] == (2, 1)
    assert net.books["b"].replaced("a") == (blob("a"),)
    assert again == [(1, 1)]  # once, though the link kept exchanging
    # Only the last few are kept (each lists the keys of the lives before it).
    for serial in range(2, 2 + MAX_REPLACED + 3):
        net.books["b"].put("a", (3, serial), blob("a", (3, serial)))
    assert len(net.books["b"].replaced("a")) == MAX_REPLACED
