"""A commit of an epoch this node may already hold: new, sent again, or a conflict.

Clients retry: a training process that reconnects after its daemon restarted sends
again every commit it got no answer for, and some of those the daemon had already
made durable. Such a commit must be acknowledged (the rank is waiting for it) and
must change nothing: no second fact in the log, no second count in the metrics.
And a commit that says other bytes for an epoch held is not the same checkpoint:
taking it silently would let two ranks restore different bytes under one epoch.
`judge` tells them apart from the epoch's `Content` (the digest and size its commit
stated, kept while the epoch is held and through log compaction):

* not held (never committed, or lost or retired since): **new**, applied and logged;
* held, and the commit states the same digest and size, or none at all: a
  **repeat**, acknowledged once what the node holds is durable (its reply goes
  through the output gate like every reply, so it never leaves before the first
  commit's fsync), and applied nowhere;
* held without a digest or size, and the commit states some: applied and logged,
  the epoch takes them (**content**);
* held with another digest or size: a **conflict**, refused (``digest_conflict``),
  unless the commit comes from a later launch of the job (`relaunched`): then it
  **supersedes** the held content, applied and logged.

`relaunched` is the one place that says when a save belongs to a new launch. Today
that is: a recovery generation was frozen at this node after the held content was
committed (``Content.after`` is the newest generation frozen then), the newest such
generation is g, and the epoch is above g's restore point (above the newest epoch of
our frozen set for g while g is unresolved: the restore point is never above it).
A relaunched job restores g's restore point and saves the epochs after it again,
which need not be bitwise the same; the restore point itself and the epochs below
it are what the job restored from, and keep their content.

A digest is ``ALGO:hex``, lowercase, of the algorithm's length (`DIGEST_HEX`;
the files integration commits ``sha256:<hex>``); `check_digest` says what is wrong
with one that is not.

Sans-IO, and shared: `Admission` asks it for the daemon's local API and the
simulator's ranks alike.
"""

from __future__ import annotations

from enum import Enum

from convergenced.core.facts import Commit, Content, StreamFacts

DIGEST_HEX: dict[str, int] = {
    "md5": 32,
    "sha1": 40,
    "sha224": 56,
    "sha256": 64,
    "sha384": 96,
    "sha512": 128,
    "sha3-224": 56,
    "sha3-256": 64,
    "sha3-384": 96,
    "sha3-512": 128,
    "blake2b": 128,
    "blake2s": 64,
    "blake3": 64,
    "xxh64": 16,
    "xxh3": 16,
    "xxh128": 32,
    "crc32c": 8,
}
"""The digest algorithms a commit may name, with the hex digits of each digest."""
_HEX = frozenset("0123456789abcdef")


class Verdict(Enum):
    """What a commit is to the node that judges it."""

    NEW = "new"
    """Not held here: apply and log it."""
    REPEAT = "repeat"
    """Held already, and the commit says nothing else: acknowledge it, apply nothing."""
    CONTENT = "content"
    """Held without a digest or size, or held from an earlier launch (`relaunched`):
    apply and log it; its content replaces the held one."""
    CONFLICT = "conflict"
    """Held already with another digest or size: refuse it."""


def check_digest(digest: str) -> str | None:
    """What is wrong with ``digest`` as a commit's digest (None: nothing; an empty
    digest states none)."""
    if not digest:
        return None
    algo, sep, hexdigits = digest.partition(":")
    want = DIGEST_HEX.get(algo)
    if not sep or want is None:
        known = ", ".join(DIGEST_HEX)
        return f"digest {digest[:80]!r} is not ALGO:hex with ALGO one of {known}"
    if len(hexdigits) != want or not _HEX.issuperset(hexdigits):
        return f"digest {digest[:80]!r}: {algo} takes {want} lowercase hex digits"
    return None


def relaunched(facts: StreamFacts, held: Content, epoch: int) -> bool:
    """Whether a commit of ``epoch`` made now comes from a later launch of the job
    than the one that committed ``held`` (see the module docstring)."""
    gens = facts.generations
    g = gens.newest_frozen()
    if g is None or (held.after is not None and g <= held.after):
        return False  # no generation frozen here since the held content came
    restore_point = gens.answers[g] if g in gens.answers else gens.frozen[g].max()
    return restore_point is None or epoch > restore_point


def judge(facts: StreamFacts, commit: Commit) -> Verdict:
    """Whether ``commit`` (already checked against ``facts``) is new, a repeat,
    content for an epoch held, or a conflict (see the module docstring)."""
    if not facts.holds(commit.rank, commit.domain, commit.epoch):
        return Verdict.NEW
    if not (commit.digest or commit.size):
        return Verdict.REPEAT  # it states nothing the held epoch could contradict
    held = facts.content(commit.rank, commit.domain, commit.epoch)
    if held is None or not (held.digest or held.size):  # held with a location at most
        return Verdict.CONTENT
    if held.same(commit.digest, commit.size):
        return Verdict.REPEAT
    if relaunched(facts, held, commit.epoch):
        return Verdict.CONTENT
    return Verdict.CONFLICT
