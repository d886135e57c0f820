"""Credentials: what each node says about itself, gossiped beside the records.

With CA-bound trust (PROTOCOL.md 7.6) no node holds a list of the others' keys.
Instead each node publishes a *credential*: its certificate from the cluster CA, and
the record-signing key and address it vouches for, signed with the certificate's own
key. A node that receives a relayed record of an origin it never linked to needs that
origin's credential to check the record's signature, so the links carry credentials
the way they carry records: each one once per link, the newest of each node only,
before any record of the same message.

To the core a credential is opaque bytes. Whether it is valid (the certificate chains
to the CA, names the node, is not revoked; the signature holds) is cryptography, and
the core stays free of it: the adapter's ``admit`` function judges each credential
and says which node it speaks for and its *rank*. Of two credentials of one node the
higher rank wins (a newer certificate, or the same one re-signed by a later life of
the node), so every node ends up holding the same newest credential of each node, in
any order of delivery, like a record merge.

`CredentialBook` is that store. It is shared by every link of a node (through
`link.LinkConfig`); each link remembers which ranks its peer holds and sends the rest
(`pending_for`). A book without ``admit`` (trust lists, insecure mode, the simulator)
takes nothing in and sends only what was put in it by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

Rank = tuple[int, int]
"""Orders the credentials of one node: the higher wins."""

Admit = Callable[[bytes, "str | None"], "tuple[str, Rank] | None"]
"""``admit(blob, via)``: the node ``blob`` speaks for and its rank, or None when it must
not be taken (invalid, revoked, another cluster's). ``via`` is the peer it came from,
as the link authenticated it. The function counts its own refusals."""

MAX_CREDENTIAL_BYTES = 4096
"""Largest credential on the wire (an RSA-4096 certificate fits with room to spare)."""
MAX_REPLACED = 2
"""Replaced credentials kept per node (`CredentialBook.replaced`): those of its last
two lives, for a node that lost its key twice before it linked to us again."""
MAX_SERIAL = (1 << 63) - 2
"""Highest serial a node signs its credential at (a msgpack int stays below 2^63)."""
MAX_CREDENTIALS_PER_MESSAGE = 64
"""Credentials in one HELLO, TICK or TOCK: 64 of about 1 KiB stay well inside the
frame budget, and a new link still learns 1,024 nodes in 16 exchanges."""


def serial_to_outrank(own: Rank | None, seen: Rank) -> int | None:
    """The serial to sign this node's credential at again, after a peer sent back
    ``seen``, a credential of this node that it holds (from an earlier life, whose
    record key its peers would otherwise keep checking our records against).

    None when there is nothing to do: ours ranks above already, or ``seen`` is of a
    newer certificate (only a newer certificate of ours could outrank it, and one we
    do not hold means someone else has this node's certificate key: the adapter says
    so). Otherwise one above ``seen``'s serial, at most `MAX_SERIAL`.
    """
    if own is None or seen < own or seen[0] > own[0]:
        return None
    return min(seen[1] + 1, MAX_SERIAL)


@dataclass(frozen=True, slots=True)
class Credential:
    """One node's newest credential as this node holds it."""

    node: str
    rank: Rank
    blob: bytes
    seq: int
    """The book's change counter when it was taken: what a link has sent up to."""


class CredentialBook:
    """The newest admitted credential of every node; see the module docstring."""

    __slots__ = ("_admit", "_blob_node", "_by_node", "_replaced", "generation", "on_change",
                 "on_own", "own", "seq")  # fmt: skip

    def __init__(
        self,
        admit: Admit | None = None,
        on_change: Callable[[str, Credential | None], None] | None = None,
        *,
        own: str | None = None,
        on_own: Callable[[bytes, Rank], None] | None = None,
    ) -> None:
        """Args:
        admit: judges what peers send (None: nothing is taken from peers).
        on_change: told of each node whose credential changed (None: removed), so
            the adapter can trust its new key.
        own: this node's id. A credential of ours that a peer sends is never taken
            (only this node says what its key is) but told to ``on_own``: one that
            ranks above ours is from an earlier life (or a stolen key), and ours must
            be signed again above it.
        """
        self._admit = admit
        self.on_change = on_change
        self.own = own
        self.on_own = on_own
        self.generation = 0
        """Bumped by `resend`: every link then forgets what its peer holds."""
        self._by_node: dict[str, Credential] = {}
        self._replaced: dict[str, list[bytes]] = {}
        """node -> the credentials of it this book held before its current one, newest
        last (at most `MAX_REPLACED`): told to that node itself (`replaced`)."""
        self._blob_node: dict[bytes, str] = {}
        """The bytes of every credential held: the same bytes cross a node once per
        link, and this test costs no cryptography."""
        self.seq = 0
        """Bumped at every change; links compare it with what they sent up to."""

    def __len__(self) -> int:
        return len(self._by_node)

    def __contains__(self, node: object) -> bool:
        return node in self._by_node

    def get(self, node: str) -> Credential | None:
        """The credential held for ``node``."""
        return self._by_node.get(node)

    def nodes(self) -> list[str]:
        """Every node a credential is held for, sorted."""
        return sorted(self._by_node)

    def put(self, node: str, rank: Rank, blob: bytes) -> bool:
        """Hold ``blob`` for ``node`` unless a credential of equal or higher rank is held
        (our own credential, or one the adapter judged itself). True when it changed."""
        if len(blob) > MAX_CREDENTIAL_BYTES:
            raise ValueError(f"credential of {len(blob)} bytes exceeds {MAX_CREDENTIAL_BYTES}")
        held = self._by_node.get(node)
        if held is not None and held.rank >= rank:
            return False
        if held is not None:
            del self._blob_node[held.blob]
            if node != self.own:
                replaced = self._replaced.setdefault(node, [])
                replaced.append(held.blob)
                del replaced[:-MAX_REPLACED]
        self.seq += 1
        cred = self._by_node[node] = Credential(node, rank, blob, self.seq)
        self._blob_node[blob] = node
        if self.on_change is not None:
            self.on_change(node, cred)
        return True

    def remove(self, node: str) -> bool:
        """Forget ``node``'s credential (revoked, expired, retired). True when one was
        held. Links do not tell their peers: each peer judges the same certificate."""
        held = self._by_node.pop(node, None)
        if held is None:
            return False
        del self._blob_node[held.blob]
        self._replaced.pop(node, None)
        self.resend()  # should it come back at the same rank, peers must hear of it
        if self.on_change is not None:
            self.on_change(node, None)
        return True

    def replaced(self, node: str) -> tuple[bytes, ...]:
        """The credentials of ``node`` this book held before its current one, oldest
        first. A node that lost its record key (and its state) learns from them the
        keys of its earlier lives, which signed the records of its that peers hold."""
        return tuple(self._replaced.get(node, ()))

    def resend(self) -> None:
        """Make every link send every credential again. A peer may have refused one
        (its clock, its CA file, its revocations were wrong then), and the links
        remember only what they sent: the adapter calls this when something the
        judging depends on changed, and now and then."""
        self.generation += 1
        self.seq += 1

    def offer(self, blobs: Iterable[bytes], via: str | None) -> list[Credential]:
        """Admit what a peer sent; returns the credentials that were new to us.

        Bytes the book holds already are not judged again.
        """
        if self._admit is None:
            return []
        taken: list[Credential] = []
        for blob in blobs:
            if blob in self._blob_node:
                continue
            verdict = self._admit(blob, via)
            if verdict is None:
                continue
            node, rank = verdict
            if node == self.own:
                if self.on_own is not None:
                    self.on_own(blob, rank)
                continue
            if self.put(node, rank, blob):
                taken.append(self._by_node[node])
        return taken

    def holding(self, blob: bytes) -> Credential | None:
        """The credential held whose bytes are ``blob``, if any."""
        node = self._blob_node.get(blob)
        return None if node is None else self._by_node[node]

    def pending_for(self, known: dict[str, Rank], since: int) -> list[Credential]:
        """Credentials changed after ``since`` that the peer (whose ranks are
        ``known``) does not hold, oldest change first."""
        if since >= self.seq:
            return []
        out = [
            c
            for c in self._by_node.values()
            if c.seq > since and known.get(c.node, (-1, -1)) < c.rank
        ]
        out.sort(key=lambda c: c.seq)
        return out


class CredentialExchange:
    """One link's share of the gossip: which credentials its peer holds, and what to
    send it next. Inert (sends and takes nothing) without a book or below version 3."""

    __slots__ = ("_book", "_generation", "_known", "_sent_seq", "_theirs")

    def __init__(self, book: CredentialBook | None, enabled: bool) -> None:
        self._book = book if enabled else None
        self._theirs: tuple[bytes, ...] = ()
        """The peer's own replaced credentials, still to be sent to it (`peer_is`)."""
        self._known: dict[str, Rank] = {}
        """node -> the rank the peer holds: sent by us, or received from it."""
        self._sent_seq = 0
        """Every change of the book up to this one is sent or known to the peer."""
        self._generation = book.generation if book is not None else 0

    def _fresh(self, book: CredentialBook) -> None:
        if book.generation != self._generation:  # `CredentialBook.resend`
            self._generation = book.generation
            self._known.clear()
            self._sent_seq = 0

    def owed(self, origin: str, peer: str | None) -> bool:
        """True while we hold ``origin``'s credential and the peer does not: its
        records wait, since the peer could not check them (the peer's own records
        rest on the link, and need none)."""
        book = self._book
        if book is None or origin == peer:
            return False
        self._fresh(book)
        cred = book.get(origin)
        return cred is not None and self._known.get(origin, (-1, -1)) < cred.rank

    def own(self, node: str) -> tuple[bytes, ...]:
        """For our HELLO: our own credential, if we have one."""
        cred = self._book.get(node) if self._book is not None else None
        if cred is None:
            return ()
        self._known[node] = cred.rank
        return (cred.blob,)

    def peer_is(self, peer: str) -> None:
        """The HELLO named the peer: the credentials of it we held before its current
        one go to it first, once (it keeps accepting the keys they name for its own
        records of then)."""
        if self._book is not None:
            self._theirs = self._book.replaced(peer)

    def take(self, blobs: tuple[bytes, ...], via: str | None) -> None:
        """Admit what the peer sent (before the records of the same message), and note
        that it holds them."""
        book = self._book
        if book is None or not blobs:
            return
        book.offer(blobs, via)
        for blob in blobs:
            cred = book.holding(blob)
            if cred is not None and self._known.get(cred.node, (-1, -1)) < cred.rank:
                self._known[cred.node] = cred.rank

    def pending(self) -> bool:
        """True when the peer lacks a credential we hold; changes what `deltas` sends
        only by skipping changes the peer already knows."""
        book = self._book
        if book is None:
            return False
        if self._theirs:
            return True
        self._fresh(book)
        if book.seq <= self._sent_seq:
            return False
        if book.pending_for(self._known, self._sent_seq):
            return True
        self._sent_seq = book.seq
        return False

    def deltas(self, budget: int) -> tuple[bytes, ...]:
        """The credentials to send in the next TICK or TOCK: at most
        `MAX_CREDENTIALS_PER_MESSAGE`, within ``budget`` bytes; the rest go next time."""
        book = self._book
        if book is None:
            return ()
        theirs: list[bytes] = []
        for blob in self._theirs:  # a few (`MAX_REPLACED`), each within the limits
            if len(blob) <= budget:
                budget -= len(blob)
                theirs.append(blob)
        self._theirs = ()
        self._fresh(book)
        if book.seq <= self._sent_seq:
            return tuple(theirs)
        pending = book.pending_for(self._known, self._sent_seq)
        out: list[Credential] = []
        for cred in pending:
            full = len(theirs) + len(out) >= MAX_CREDENTIALS_PER_MESSAGE
            if full or len(cred.blob) > budget:
                break
            budget -= len(cred.blob)
            out.append(cred)
        if not out:
            return tuple(theirs)  # none fits this frame limit: nothing to do but wait
        self._sent_seq = out[-1].seq if len(out) < len(pending) else book.seq
        for cred in out:
            self._known[cred.node] = cred.rank
        return (*theirs, *(c.blob for c in out))
