"""Discovery sources: the trio adapter that asks DNS and reads the contacts file.

`Discovery.lookup` asks every configured source at once and returns the union of
their contacts. The rules, each for a reason:

- **A failure keeps the last good answer.** NXDOMAIN, a timeout, SERVFAIL, an
  unreadable or invalid file: the source keeps what it said last time, and the
  failure is counted and its text kept for the status page. A flapping resolver or
  an orchestrator caught mid-write must not make members vanish from the directory
  (and reappear 15 s later), which would tear links down for nothing.
- **An authoritative empty answer replaces it.** A name that exists with no A, AAAA
  or SRV records (NOERROR, no data), or a valid file with no lines, is the source
  saying "nobody", and it is believed: otherwise a scaled-down fleet would be
  dialled forever.
- **A source answers as a whole.** If A succeeds and AAAA times out, the DNS source
  failed: a partial answer would drop the IPv6 half of the fleet.

DNS goes through dnspython, because getaddrinfo can neither ask for SRV records nor
ask a chosen nameserver. We run its *synchronous* resolver in worker threads rather
than ``dns.asyncresolver`` with its trio backend: that backend refuses to import
unless installed package metadata shows a trio version inside the range that
dnspython release was built for (``trio>=0.34`` for 2.9; 2.3 capped trio below
0.23), so an unrelated upgrade of either package, or a frozen install without
metadata, would turn DNS discovery off at run time. The synchronous resolver has no
such gate and is dnspython's most used path. Its costs are bounded: at most
`DNS_THREADS` threads per `Discovery`, off trio's shared thread pool so DNS cannot
starve the daemon's other blocking work; and a cancelled query abandons its thread,
which ends within the resolver's lifetime (`DNS_LIFETIME_S`).

The contacts file is stat'ed at every lookup and read only when its device, inode,
size, mtime or ctime changed. Orchestrators should replace it atomically (write a
temporary file, rename it over; a Kubernetes ConfigMap volume does): a reader then
sees the old file or the new one, never half of one. An in-place rewrite is caught
while it happens (the file's stat changes during the read: the read is discarded,
the last good contacts stand) except when it keeps the size and lands within one
tick of the file system's timestamps; `reload` covers that rare case.

Time: each query's lifetime is enforced by dnspython (retries across nameservers
included); each source's whole lookup is also bounded on trio's clock. The refresh
loop sleeps on trio's clock too, never the wall clock, so tests drive it with
``MockClock`` and a stepped system clock cannot stall it.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Final, Literal, Protocol, TypeVar

import dns.exception
import dns.name
import dns.nameserver
import dns.rdatatype
import dns.rdtypes.IN.A
import dns.rdtypes.IN.AAAA
import dns.rdtypes.IN.SRV
import dns.resolver
import dns.rrset
import trio

from convergenced.discovery.contacts import (
    MAX_CONTACTS,
    MAX_FILE_BYTES,
    SOURCE_KINDS,
    Contact,
    DiscoveryConfig,
    SourceKind,
    merge_contacts,
    parse_contacts_file,
)
from convergenced.errors import ConfigError

__all__ = [
    "DNS_LIFETIME_S",
    "OUTCOMES",
    "BlockingRunner",
    "Discovery",
    "DiscoveryStats",
    "Outcome",
]

DNS_LIFETIME_S: Final = 2.0
"""Longest one DNS query may take, retries included: a healthy cluster resolver
answers in milliseconds, and a lookup stuck longer only delays the next refresh."""
DNS_ATTEMPT_S: Final = 1.0
"""One try of one nameserver, so a second nameserver gets its turn within the lifetime."""
BUDGET_LIFETIMES: Final = 5
"""A DNS source's whole lookup (SRV, then its targets) may take this many lifetimes."""
DNS_THREADS: Final = 4
"""Worker threads one `Discovery` may use at once (DNS queries and file reads)."""
MAX_TARGET_QUERIES: Final = 256
"""SRV targets one lookup resolves by query when the answer's additional section
lacks their addresses; past it the lookup fails rather than sending thousands of
queries every refresh (CoreDNS does send the addresses, so this is a misconfigured
server)."""
MAX_ERROR_CHARS: Final = 300
"""Length kept of a source's last error: enough for dnspython's explanation, bounded
for the status page."""

Outcome = Literal["ok", "failed"]
"""The outcome of one source's lookup; a bounded metric label."""
OUTCOMES: Final[tuple[Outcome, ...]] = ("ok", "failed")

_T = TypeVar("_T")
_FileKey = tuple[int, int, int, int, int]
"""(device, inode, size, mtime ns, ctime ns): a change in any means "read it again".
ctime catches a rewrite that kept size and mtime (``cp -p``, ``rsync -t``)."""


class BlockingRunner(Protocol):
    """Runs blocking work (a DNS query, a file read) without blocking trio."""

    def __call__(self, fn: Callable[[], _T], /) -> Awaitable[_T]: ...


@dataclass(slots=True)
class DiscoveryStats:
    """Counters of lookups per source kind and outcome, for metrics and status.

    Every (kind, outcome) pair exists from the start, so the metric labels are
    bounded and a counter at 0 is visible as 0, not as missing.
    """

    lookups: dict[tuple[SourceKind, Outcome], int] = field(
        default_factory=lambda: {(k, o): 0 for k in SOURCE_KINDS for o in OUTCOMES}
    )
    last_error: dict[SourceKind, str | None] = field(
        default_factory=lambda: {k: None for k in SOURCE_KINDS}
    )
    """The failure of each source's latest lookup; None once it succeeds again (its
    flaps remain in `lookups`)."""
    contacts: dict[SourceKind, int] = field(default_factory=lambda: dict.fromkeys(SOURCE_KINDS, 0))
    """How many contacts each source holds now (its last good answer)."""
    changes: int = 0
    """How many times `Discovery.run` reported a new set (the first one included)."""


class _SourceFailed(Exception):
    """A source could not answer this time; its last good answer stands.

    ``key`` is set when the failure is a property of the file's content (invalid
    lines): the same file need not be read again to fail again.
    """

    def __init__(self, problem: str, key: _FileKey | None = None) -> None:
        super().__init__(problem)
        self.key = key


class Discovery:
    """The contacts every configured source gives, refreshed periodically.

    Args:
        config: the ``[discovery]`` table.
        dns_lifetime_s: the longest one DNS query may take (tests shorten it).
        run_blocking: how blocking work runs; default a worker thread. Tests pass an
            inline runner so that trio's ``MockClock`` autojump does not fire while a
            thread works (it would count the wait as idle time).
    """

    def __init__(
        self,
        config: DiscoveryConfig,
        *,
        dns_lifetime_s: float = DNS_LIFETIME_S,
        run_blocking: BlockingRunner | None = None,
    ) -> None:
        self.config = config
        self.stats = DiscoveryStats()
        self._lifetime = dns_lifetime_s
        self._budget_s = BUDGET_LIFETIMES * dns_lifetime_s
        self._limiter = trio.CapacityLimiter(DNS_THREADS)
        self._run_blocking: BlockingRunner = run_blocking or self._in_thread
        self._results: dict[SourceKind, frozenset[Contact]] = {
            kind: frozenset() for kind in config.kinds
        }
        # The system resolver applies resolv.conf's search list, as getaddrinfo does
        # (a short service name works in Kubernetes); names sent to chosen
        # nameservers are taken as absolute.
        self._search = not config.nameservers
        self._file_key: _FileKey | None = None
        self._file_error: str | None = None
        self._file_forced = False
        self._wake = trio.Event()
        self._lock = trio.Lock()
        self._fetchers: dict[SourceKind, Callable[[], Awaitable[frozenset[Contact]]]] = {
            "seeds": self._fetch_seeds,
            "dns": self._fetch_dns,
            "srv": self._fetch_srv,
            "file": self._fetch_file,
        }

    @property
    def contacts(self) -> frozenset[Contact]:
        """The union of every source's last good answer, without asking again."""
        return merge_contacts(c for result in self._results.values() for c in result)

    async def lookup(self) -> frozenset[Contact]:
        """Ask every configured source (concurrently) and return the union.

        A source that fails keeps its previous answer; see the module docstring.
        Concurrent calls take turns, so the statistics count each lookup once.
        """
        async with self._lock:
            async with trio.open_nursery() as nursery:
                for kind in self.config.kinds:
                    nursery.start_soon(self._refresh, kind)
            return self.contacts

    def reload(self) -> None:
        """Re-read the contacts file even if it looks unchanged, and look up now.

        For SIGHUP: an operator who just fixed the file should not wait for the
        next refresh, nor depend on its timestamps (a network file system may
        cache them).
        """
        self._file_forced = True
        self._wake.set()

    async def run(
        self,
        on_change: Callable[[frozenset[Contact]], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Look up every ``refresh_s`` seconds and report each new set of contacts.

        ``on_change`` gets the first set (so the caller starts from a known state),
        then only sets that differ from the previous one. ``task_status.started()``
        comes after that first report, so ``await nursery.start(discovery.run, cb)``
        returns with the first contacts delivered. `reload` starts the next lookup
        at once. Runs until cancelled.
        """
        self._wake = trio.Event()
        current = await self.lookup()
        self.stats.changes += 1
        on_change(current)
        task_status.started()
        while True:
            with trio.move_on_at(trio.current_time() + self.config.refresh_s):
                await self._wake.wait()
            # A fresh event before the lookup: a reload() during it wakes the next wait.
            self._wake = trio.Event()
            contacts = await self.lookup()
            if contacts != current:
                current = contacts
                self.stats.changes += 1
                on_change(current)

    async def _in_thread(self, fn: Callable[[], _T]) -> _T:
        return await trio.to_thread.run_sync(fn, limiter=self._limiter, abandon_on_cancel=True)

    async def _refresh(self, kind: SourceKind) -> None:
        try:
            if kind in ("dns", "srv"):
                with trio.fail_after(self._budget_s):
                    result = await self._fetchers[kind]()
            else:
                result = await self._fetchers[kind]()
        except trio.TooSlowError:
            self._failed(kind, f"no complete answer within {self._budget_s:g} s")
        except _SourceFailed as exc:
            self._failed(kind, str(exc))
        else:
            self._results[kind] = result
            self.stats.lookups[(kind, "ok")] += 1
            self.stats.last_error[kind] = None
            self.stats.contacts[kind] = len(result)

    def _failed(self, kind: SourceKind, problem: str) -> None:
        self.stats.lookups[(kind, "failed")] += 1
        if len(problem) > MAX_ERROR_CHARS:
            problem = problem[: MAX_ERROR_CHARS - 3] + "..."
        self.stats.last_error[kind] = problem

    async def _fetch_seeds(self) -> frozenset[Contact]:
        return frozenset(self.config.seeds)

    # -- DNS ----------------------------------------------------------------------

    async def _fetch_dns(self) -> frozenset[Contact]:
        name = self.config.dns
        assert name is not None
        port = self.config.dns_port or self.config.default_port
        resolver = await self._blocking_dns("resolver configuration", self._make_resolver)
        addresses = await self._addresses(resolver, name, absent_ok=False)
        return frozenset(Contact(address, port) for address in addresses)

    async def _fetch_srv(self) -> frozenset[Contact]:
        name = self.config.srv
        assert name is not None
        resolver = await self._blocking_dns("resolver configuration", self._make_resolver)
        query = partial(_ask, resolver, name, "SRV", search=self._search, absent_ok=False)
        answer = await self._blocking_dns(f"{name} SRV", query)
        assert answer is not None  # absent_ok=False: NXDOMAIN raised
        records: list[tuple[dns.name.Name, int]] = []
        for rd in answer.rrset or ():
            # A target of "." means "no service here" (RFC 2782); port 0 cannot be dialled.
            if isinstance(rd, dns.rdtypes.IN.SRV.SRV) and rd.target != dns.name.root and rd.port:
                records.append((rd.target, rd.port))
        if len(records) > MAX_CONTACTS:
            raise _SourceFailed(f"{name} SRV: {len(records)} records, above {MAX_CONTACTS}")
        known: dict[dns.name.Name, set[str]] = {}
        for rrset in answer.response.additional:
            if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
                known.setdefault(rrset.name, set()).update(_addresses_of(rrset))
        missing = sorted({target for target, _ in records if target not in known})
        if len(missing) > MAX_TARGET_QUERIES:
            raise _SourceFailed(
                f"{name} SRV: {len(missing)} targets lack addresses in the additional "
                f"section; at most {MAX_TARGET_QUERIES} are looked up one by one"
            )

        async def resolve(target: dns.name.Name) -> None:
            # A target gone since the SRV answer (NXDOMAIN) simply has no address.
            known[target] = await self._addresses(resolver, target, absent_ok=True)

        await self._all([partial(resolve, target) for target in missing])
        contacts = frozenset(
            Contact(address, port) for target, port in records for address in known[target]
        )
        if len(contacts) > MAX_CONTACTS:
            raise _SourceFailed(f"{name} SRV: {len(contacts)} addresses, above {MAX_CONTACTS}")
        return contacts

    async def _addresses(
        self, resolver: dns.resolver.Resolver, name: dns.name.Name | str, *, absent_ok: bool
    ) -> set[str]:
        """The A and AAAA addresses of ``name``, asked concurrently."""
        found: set[str] = set()

        async def ask(rdtype: str) -> None:
            query = partial(_ask, resolver, name, rdtype, search=self._search, absent_ok=absent_ok)
            answer = await self._blocking_dns(f"{name} {rdtype}", query)
            if answer is not None and answer.rrset is not None:
                found.update(_addresses_of(answer.rrset))

        await self._all([partial(ask, "A"), partial(ask, "AAAA")])
        return found

    async def _all(self, jobs: list[Callable[[], Awaitable[None]]]) -> None:
        """Run ``jobs`` concurrently; the first failure cancels the rest and is raised.

        Failures are caught inside each task so that the caller gets one
        `_SourceFailed`, not an exception group to unpick.
        """
        errors: list[str] = []
        async with trio.open_nursery() as nursery:

            async def one(job: Callable[[], Awaitable[None]]) -> None:
                try:
                    await job()
                except _SourceFailed as exc:
                    errors.append(str(exc))
                    nursery.cancel_scope.cancel()

            for job in jobs:
                nursery.start_soon(one, job)
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise _SourceFailed(errors[0] + more)

    async def _blocking_dns(self, what: str, fn: Callable[[], _T]) -> _T:
        try:
            return await self._run_blocking(fn)
        except dns.exception.DNSException as exc:
            raise _SourceFailed(f"{what}: {str(exc) or type(exc).__name__}") from None
        except OSError as exc:
            raise _SourceFailed(f"{what}: {exc}") from None

    def _make_resolver(self) -> dns.resolver.Resolver:
        """A resolver for one lookup (blocking: it may read /etc/resolv.conf).

        Made anew for each lookup so that edits of resolv.conf are followed, as
        getaddrinfo follows them; that is one small file read per refresh.
        """
        if self.config.nameservers:
            resolver = dns.resolver.Resolver(configure=False)
            resolver.nameservers = [
                dns.nameserver.Do53Nameserver(host, port) for host, port in self.config.nameservers
            ]
        else:
            resolver = dns.resolver.Resolver()
        resolver.lifetime = self._lifetime
        resolver.timeout = min(DNS_ATTEMPT_S, self._lifetime)
        resolver.cache = None  # every refresh asks: a stale cache would hide a change
        return resolver

    # -- the contacts file --------------------------------------------------------

    async def _fetch_file(self) -> frozenset[Contact]:
        path = self.config.file
        assert path is not None
        forced, self._file_forced = self._file_forced, False
        known = None if forced else self._file_key
        read = partial(_read_contacts_file, path, known, self.config.default_port)
        try:
            key, contacts = await self._run_blocking(read)
        except _SourceFailed as exc:
            if exc.key is not None:  # the content is bad: remember, so it is not re-read
                self._file_key, self._file_error = exc.key, str(exc)
            else:  # transient: a forced re-read still owed
                self._file_forced |= forced
            raise
        except OSError as exc:
            self._file_forced |= forced
            raise _SourceFailed(str(exc)) from None
        if contacts is None:  # unchanged since the last read
            if self._file_error is not None:
                raise _SourceFailed(self._file_error)
            return self._results["file"]
        self._file_key, self._file_error = key, None
        return frozenset(contacts)


def _ask(
    resolver: dns.resolver.Resolver,
    name: dns.name.Name | str,
    rdtype: str,
    *,
    search: bool,
    absent_ok: bool,
) -> dns.resolver.Answer | None:
    """One blocking query. NODATA is an answer with no rrset (the authoritative
    "none"); NXDOMAIN raises, unless ``absent_ok`` (then None)."""
    try:
        return resolver.resolve(name, rdtype, search=search, raise_on_no_answer=False)
    except dns.resolver.NXDOMAIN:
        if absent_ok:
            return None
        raise


def _addresses_of(rrset: dns.rrset.RRset) -> set[str]:
    """The addresses of an A or AAAA rrset, in canonical text (as contacts store them)."""
    return {
        str(ipaddress.ip_address(rd.address))
        for rd in rrset
        if isinstance(rd, dns.rdtypes.IN.A.A | dns.rdtypes.IN.AAAA.AAAA)
    }


def _stat_key(st: os.stat_result) -> _FileKey:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _read_contacts_file(
    path: Path, known: _FileKey | None, default_port: int
) -> tuple[_FileKey, tuple[Contact, ...] | None]:
    """Stat the file; if it changed since ``known``, read and parse it (blocking).

    Returns:
        Its key and its contacts, or None as contacts when it is unchanged.

    Raises:
        OSError: it cannot be stat'ed, opened or read.
        _SourceFailed: too large, not UTF-8, invalid, or written to while read.
    """
    current = _stat_key(os.stat(path))
    if current == known:
        return current, None
    with open(path, "rb") as f:
        before = _stat_key(os.fstat(f.fileno()))
        data = f.read(MAX_FILE_BYTES + 1)
        after = _stat_key(os.fstat(f.fileno()))
    if before != after:
        # Written in place while we read (not replaced by a rename, which is atomic):
        # what we hold may be half of it. Keep the last good contacts, try again later.
        raise _SourceFailed(f"{path}: changed while being read; read again at the next lookup")
    if len(data) > MAX_FILE_BYTES:
        raise _SourceFailed(f"{path}: above the limit of {MAX_FILE_BYTES} bytes", before)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _SourceFailed(f"{path}: not UTF-8 ({exc})", before) from None
    try:
        return before, parse_contacts_file(text, str(path), default_port)
    except ConfigError as exc:
        raise _SourceFailed(str(exc), before) from None
