"""Who is in the cluster, as this node learns it: discovery, credentials, revocations.

With ``[[peers]]`` and ``[trust]`` the cluster is written down in every file. A fleet
sharing one configuration learns it instead:

- *discovery* (`convergenced.discovery`) yields addresses, some with node ids; an
  address without one is probed (a TLS handshake tells whose certificate answers);
- with CA-bound trust every node's *credential* (`security.node_credentials`), gossiped
  by the links (`core.credentials`), gives its record key and its advertised address;
- the *revocations* (deny list, CRL) and the certificate files are looked at again
  every ``recheck_s`` and on SIGHUP: a revoked credential is dropped, its key trusted
  no more, its links closed; a rotated certificate is loaded and our credential
  signed again.

From all of it `Fleet.effective` makes the configuration the rest of the daemon
already knows how to apply (`main.Daemon.apply_members`): the peers to dial, the
nodes a declaration may name. Members come and go with hysteresis: a discovered
member leaves only after missing from discovery for three refresh periods, so a
flapping resolver moves nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from contextlib import suppress
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import structlog
import trio
from cryptography import x509

from convergenced.core.credentials import Credential, CredentialBook, Rank, serial_to_outrank
from convergenced.daemon.config import Config, Peer
from convergenced.daemon.fleet_config import load_revocations
from convergenced.daemon.peers.manager import dial_plan, overlay_peers
from convergenced.daemon.peers.security import PeerSecurity
from convergenced.daemon.telemetry import Telemetry
from convergenced.discovery.contacts import Contact, SourceKind, parse_address
from convergenced.discovery.sources import Discovery
from convergenced.errors import ConvergencedError
from convergenced.security import pki
from convergenced.security.node_credentials import (
    CredentialJudge,
    Refusal,
    make_credential,
)

log = structlog.get_logger("convergenced.daemon")

BOOTSTRAP_LINKS = 2
MAX_PROBED = 65536
PROBE_BACKOFF_MAX = 16
"""An address in doubt that never answers (a dead host still in DNS or a contacts
file) is probed again after 1, 2, 4 ... and at most this many recheck periods; an
answer, or a change in which credentials claim the address, starts over at one."""
RESEND_S = 3600.0
"""How often every link sends every credential again (`CredentialBook.resend`)."""
GRACE_REFRESHES = 3
"""A discovered member missing from this many lookups in a row is gone."""
OVERDUE_S = 10.0
"""An overlay peer that should dial this node and has not linked for this long is
dialled from here too (`Fleet.overdue`)."""


class _ProbeSchedule(NamedTuple):
    """When an address in doubt may be probed again (`Fleet._note_probe`)."""

    not_before: float
    """`trio.current_time` from which it may."""
    failures: int
    """Probes in a row that found nobody there."""
    claimants: frozenset[str]
    """The nodes whose credentials claimed the address then."""


class Fleet:
    """This node's knowledge of its fleet; see the module docstring."""

    def __init__(self, cfg: Config, security: PeerSecurity, telemetry: Telemetry) -> None:
        self.config = cfg
        self.security = security
        self.telemetry = telemetry
        self.dynamic = cfg.fleet.ca_trust or cfg.discovery is not None
        """Members are learned, not only configured."""
        self.judge: CredentialJudge | None = None
        self.book = CredentialBook()
        self.discovery = Discovery(cfg.discovery) if cfg.discovery is not None else None
        self._applied: tuple[tuple[Peer, ...], frozenset[str]] | None = None
        self._last_present: dict[str, float] = {}
        """`trio.current_time` when discovery last showed each learned member (or a link
        to it was up): members are derived afresh from the credentials, the contacts
        and the probes each time, and only this is remembered."""
        self.bootstrap: set[str] = set()
        """Members this node dials although the overlay says they dial it: chosen
        while it holds no link at all (they may not know of it yet), and kept."""
        self.overdue: set[str] = set()
        """Overlay peers this node dials because they should have dialled it and did
        not for `OVERDUE_S` (`_choose_overdue`); kept while they are overlay peers."""
        self._awaited_since: dict[str, float] = {}
        self._contacts: frozenset[Contact] = frozenset()
        self._probed: dict[tuple[str, int], str] = {}
        self._probe_after: dict[tuple[str, int], _ProbeSchedule] = {}
        """Per address probed: when it may be probed again (`_note_probe`)."""
        self._changed = trio.Event()
        self._stamps: dict[Path, tuple[float, int] | None] = {}
        self.on_members: Callable[[Config], None] | None = None
        """Called with the effective configuration when the members changed."""
        self.on_credentials: Callable[[], None] | None = None
        """Called as soon as the set of nodes with a valid credential changed: a
        declaration may name them at once (`on_members` follows within a second)."""
        self.linked: Callable[[], frozenset[str]] = frozenset
        """The peers with an established link now (the daemon sets it)."""
        self.dialled_by: Callable[[], frozenset[str]] = frozenset
        """The peers with an established link that they dialled (the daemon sets it)."""
        self.on_recheck: Callable[[], None] | None = None
        """Called after each recheck: the daemon closes the links whose certificate no
        longer holds (revoked, or its CA removed)."""
        self._resent_at = 0.0
        if cfg.fleet.ca_trust and security.trust is not None and cfg.tls is not None:
            self.judge = CredentialJudge(
                cfg.cluster,
                pki.load_ca_certificates(cfg.tls.ca),
                load_revocations(cfg.fleet.revocation),
                on_refused=self._refused,
            )
            self.book = CredentialBook(
                self.judge.admit,
                on_change=self._credential_changed,
                own=cfg.node_id,
                on_own=self._own_seen,
            )
            security.transport.revoked = self._revoked
            security.revoke_nodes(self.judge.revocations.node_ids)
            for path in self._watched():
                self._stamps[path] = _stamp(path)

    # -- credentials --------------------------------------------------------------

    def publish_own(self, incarnation: int) -> None:
        """Sign our credential with the current certificate and put it in the book.

        Raises:
            ConvergencedError, ValueError: the certificate or key cannot be read.
        """
        cfg, identity = self.config, self.security.identity
        if self.judge is None or identity is None or cfg.tls is None:
            return
        cert = pki.load_certificate(cfg.tls.cert)
        key = pki.load_private_key(cfg.tls.key)
        host, port = cfg.advertise
        blob = make_credential(
            cluster=cfg.cluster,
            node=cfg.node_id,
            record_key=identity.public_key_bytes(),
            address=f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
            serial=incarnation,
            certificate=cert,
            tls_key=key,
        )
        info = self.judge.check(blob)
        if isinstance(info, tuple):
            raise ValueError(f"our own credential does not hold: {info[1]}")
        self.judge.admit(blob, None)
        self.book.put(cfg.node_id, info.rank, blob)

    def _own_seen(self, blob: bytes, rank: Rank) -> None:
        """A peer holds, or held, a credential of ours: from an earlier life (whose
        record key still verifies our records of then: peers send back the ones they
        replaced), or a stolen certificate key's. Unless it is of a newer certificate
        than ours (then not ours), its record key is accepted for our own records; one
        that ranks at or above ours is outranked by signing ours again."""
        judge, security = self.judge, self.security
        info = judge.info(blob) if judge is not None else None
        trust = security.trust
        own = self.book.get(self.config.node_id)
        newer_certificate = own is not None and rank[0] > own.rank[0]
        if (
            info is not None
            and trust is not None
            and not newer_certificate
            and info.record_key != security.own_public_key
        ):
            trust.add_past_key(self.config.node_id, info.record_key)
        serial = serial_to_outrank(own.rank if own else None, rank)
        if serial is None:
            if own is not None and newer_certificate:
                log.error("a credential of this node with a newer certificate is in the "
                          "fleet: revoke that certificate if it is not this node's",
                          their_rank=list(rank), ours=list(own.rank))  # fmt: skip
            return
        try:
            self.publish_own(serial)
        except (ConvergencedError, ValueError) as exc:
            log.error("could not sign this node's credential again", error=str(exc))

    def _credential_changed(self, node: str, cred: Credential | None) -> None:
        if node == self.config.node_id:
            return
        judge = self.judge
        if judge is not None and judge.remembered > 2 * len(self.book) + 1024:
            judge.keep_only({c.blob for n in self.book.nodes() if (c := self.book.get(n))})
        info = self.judge.info(cred.blob) if cred is not None and self.judge else None
        self.security.set_credential_key(node, info.record_key if info else None)
        if self.on_credentials is not None:
            self.on_credentials()
        self._changed.set()

    def _refused(self, reason: Refusal, detail: str, via: str | None) -> None:
        self.telemetry.credential_refused(reason.value, detail, via)

    def _revoked(self, node: str, cert: x509.Certificate) -> str | None:
        return self.judge.revocations.why(node, cert) if self.judge is not None else None

    # -- members ------------------------------------------------------------------

    def members(self) -> list[Peer]:
        """Every node to consider for the overlay, with the address to dial: the
        configured peers, and the learned ones that are present (`_present`)."""
        out = {p.node_id: p for p in self.config.peers}
        for node, (host, port) in self._present(self._learned()).items():
            out.setdefault(node, Peer(node, host, port))
        return sorted(out.values(), key=lambda p: p.node_id)

    def _learned(self) -> dict[str, tuple[str, int]]:
        """node -> address, from the credentials held (the address each advertises),
        the contacts discovery gives with a node id, and the probes of the others. An
        address a probe found another node answering at is no longer the old node's
        (a host replaced by a spare with a new identity)."""
        out = self._advertised()
        for c in self._contacts:
            named = c.node_id or self._probed.get((c.host, c.port))
            if named is not None:
                out[named] = (c.host, c.port)
        # Whoever answers at an address now is who is there: a probe's answer, a
        # linked node advertising it, or this node itself. A dead host's credential
        # still advertises the address its spare took; kept, it would skew this node's
        # overlay (a log-degree overlay is a function of the member list).
        me = self.config.node_id
        linked = self.linked()
        held = {a: n for n, a in out.items() if n in linked}
        held[self.config.advertise] = me
        for node, address in list(out.items()):
            answering = held.get(address) or self._probed.get(address)
            if answering is not None and answering != node:
                del out[node]
        out.pop(me, None)
        return out

    def _advertised(self) -> dict[str, tuple[str, int]]:
        """node -> the address its credential advertises, for the credentials held."""
        out: dict[str, tuple[str, int]] = {}
        judge = self.judge
        for node in self.book.nodes():
            cred = self.book.get(node)
            info = judge.info(cred.blob) if judge is not None and cred is not None else None
            if info is not None and info.address:
                with suppress(ValueError):  # checked when admitted; never expected
                    out[node] = parse_address(info.address, None)
        return out

    def _worth_probing(
        self, claims: dict[tuple[str, int], frozenset[str]] | None = None
    ) -> set[tuple[str, int]]:
        """The discovered addresses whose node is in doubt: claimed by no credential
        held (a host not heard of yet) or by several (a host replaced by a spare at the
        same address, until a probe says which answers there), and held by no link.

        An address exactly one credential claims is not probed: that node is there as
        far as anyone has said, and a spare that took it over announces itself (its
        bootstrap links spread its credential), which makes two claims. Probing every
        address not linked would cost every node a TLS handshake per member and
        recheck period, N^2 across the fleet, while the overlay links only log N.
        ``claims``: `_claims`, when the caller has it already."""
        claims = self._claims() if claims is None else claims
        linked = self.linked()
        held = {a for node, a in self._learned().items() if node in linked}
        held.add(self.config.advertise)
        return {
            (c.host, c.port)
            for c in self._contacts
            if c.node_id is None
            and (c.host, c.port) not in held
            and len(claims.get((c.host, c.port), ())) != 1
        }

    def _claims(self) -> dict[tuple[str, int], frozenset[str]]:
        """address -> the nodes whose credential advertises it."""
        out: dict[tuple[str, int], set[str]] = {}
        for node, address in self._advertised().items():
            out.setdefault(address, set()).add(node)
        return {address: frozenset(nodes) for address, nodes in out.items()}

    def _probe_due(self, address: tuple[str, int], claimants: frozenset[str], now: float) -> bool:
        after = self._probe_after.get(address)
        return after is None or now >= after.not_before or claimants != after.claimants

    def _note_probe(
        self, address: tuple[str, int], answered: bool, claimants: frozenset[str], now: float
    ) -> None:
        """Schedule the next probe of ``address``: one recheck period after an answer,
        twice as long after each probe in a row that found nobody (up to
        `PROBE_BACKOFF_MAX` periods), while the same credentials claim it."""
        before = self._probe_after.get(address)
        failures = 0
        if not answered:
            if before is not None and before.claimants == claimants:
                failures = before.failures
            failures += 1
        periods = min(2 ** (failures - 1), PROBE_BACKOFF_MAX) if failures else 1
        if len(self._probe_after) >= MAX_PROBED:
            self._probe_after.clear()  # bounded; at worst a dead address is probed sooner
        not_before = now + periods * self._recheck_s()
        self._probe_after[address] = _ProbeSchedule(not_before, failures, claimants)

    def _present(self, learned: dict[str, tuple[str, int]]) -> dict[str, tuple[str, int]]:
        """The learned members still present. DNS, SRV and the file list the whole
        fleet, so their silence about a member (for `GRACE_REFRESHES` lookups, while
        no link to it is up) means it left; a seed list lists few, so there every
        member stays."""
        discovery = self.discovery
        if discovery is None:
            return learned
        cfg, stats = discovery.config, discovery.stats
        whole: list[SourceKind] = [k for k in ("dns", "srv", "file") if getattr(cfg, k)]
        # Silence means something only from a source that answers now; one that fails
        # (or never answered) says nothing about who left.
        if (
            not whole
            or any(stats.last_error.get(k) for k in whole)
            or not all(stats.lookups.get((k, "ok")) for k in whole)
        ):
            return learned
        grace = GRACE_REFRESHES * cfg.refresh_s
        now = trio.current_time()
        shown = {(c.host, c.port) for c in self._contacts}
        linked = self.linked()
        out = {}
        for node, address in learned.items():
            if address in shown or node in linked:
                self._last_present[node] = now
            if now - self._last_present.setdefault(node, now) <= grace:
                out[node] = address
        return out

    def effective(self, cfg: Config | None = None) -> Config:
        """``cfg`` (default ours) with the learned members among its peers."""
        if cfg is not None:
            self.config = cfg
        return replace(self.config, peers=tuple(self.members()))

    def known_nodes(self) -> frozenset[str]:
        """Nodes with a valid credential (CA-bound trust's meaning of "in the cluster")."""
        return frozenset(self.book.nodes())

    def _contacts_changed(self, contacts: frozenset[Contact]) -> None:
        self._contacts = contacts
        addresses = {(c.host, c.port) for c in contacts}
        self._probe_after = {a: v for a, v in self._probe_after.items() if a in addresses}
        self._changed.set()

    async def _probe(self, contact: Contact) -> bool:
        """Ask who answers at ``contact``; False when nobody did."""
        try:
            node = await self.security.transport.probe(contact.host, contact.port)
        except (OSError, trio.TooSlowError, ConvergencedError) as exc:
            log.debug("probe failed", address=contact.address, error=str(exc))
            return False
        if len(self._probed) >= MAX_PROBED:
            self._probed.clear()  # bounded; what is still there is probed again
        self._probed[(contact.host, contact.port)] = node
        self._changed.set()
        return True

    # -- the tasks ----------------------------------------------------------------

    async def run(self, nursery: trio.Nursery) -> None:
        """Discovery, probes, rechecks, and telling `on_members` of changes (at most
        once a second) until cancelled."""
        if self.discovery is not None:
            nursery.start_soon(self.discovery.run, self._contacts_changed)
        nursery.start_soon(self._recheck_loop)
        probing: set[tuple[str, int]] = set()
        while True:
            with trio.move_on_after(OVERDUE_S / 2):  # overdue links show without a change
                await self._changed.wait()
            self._changed = trio.Event()
            # Addresses in doubt are probed (each at most once per recheck period, and
            # less often while nobody answers): whoever answers there now is who is there.
            now, claims = trio.current_time(), self._claims()
            doubtful = {
                address
                for address in self._worth_probing(claims) - probing
                if self._probe_due(address, claims.get(address, frozenset()), now)
            }
            for c in self._contacts:
                address = (c.host, c.port)
                if address in doubtful:
                    doubtful.discard(address)
                    probing.add(address)
                    nursery.start_soon(
                        self._probe_once, c, probing, claims.get(address, frozenset())
                    )
            effective = self.effective()
            self._choose_bootstrap(effective)
            self._choose_overdue(effective)
            # Applying wakes every link and redoes the dial plan: only on a change.
            applied = (effective.peers, self.extra_dials())
            if self.on_members is not None and applied != self._applied:
                self._applied = applied
                self.on_members(effective)
            await trio.sleep(1.0)

    def _choose_bootstrap(self, effective: Config) -> None:
        """A node learned from a seed sorts after it, so by the overlay the seed would
        dial it, and the seed has never heard of it: while it holds no link, the node
        dials up to `BOOTSTRAP_LINKS` members itself. Once linked, its credential
        spreads and the overlay takes over; the bootstrap links stay (no flapping)."""
        ids = {p.node_id for p in effective.peers}
        self.bootstrap &= ids
        if self.linked() or len(self.bootstrap) >= BOOTSTRAP_LINKS:
            return
        planned = {p.node_id for p in dial_plan(effective)}
        me = self.config.node_id.encode()
        # In an order of this node's own (a hash), so the fleet's bootstrap links
        # spread over the members instead of all landing on the first ids.
        for node in sorted(
            ids - planned - self.bootstrap,
            key=lambda n: hashlib.blake2b(me + b"\0" + n.encode(), digest_size=8).digest(),
        ):
            self.bootstrap.add(node)
            if len(self.bootstrap) >= BOOTSTRAP_LINKS:
                break

    def extra_dials(self) -> frozenset[str]:
        """The members this node dials beyond its dial plan: `bootstrap`, `overdue`."""
        return frozenset(self.bootstrap | self.overdue)

    def _choose_overdue(self, effective: Config) -> None:
        """Dial the overlay peers that should dial this node and have not linked for
        `OVERDUE_S`. The overlay is a function of the member list, and two nodes'
        lists can differ for a while (one has not yet dropped a dead host, or learned
        a new one): an edge that each side thinks the other dials would never be
        dialled. Once the peer dials this node after all, ours is dropped: one link
        per pair. (Two for a while cost only traffic: records are idempotent, and
        links are counted per peer, `NodeCore.link_up`.)"""
        overlay = overlay_peers(effective)
        self.overdue &= overlay
        self.overdue -= self.dialled_by()
        awaited = overlay - {p.node_id for p in dial_plan(effective)} - self.extra_dials()
        waiting = awaited - self.linked() - self.dialled_by()
        now = trio.current_time()
        self._awaited_since = {n: self._awaited_since.get(n, now) for n in waiting}
        for node, since in list(self._awaited_since.items()):
            if now - since >= OVERDUE_S:
                log.info("dialling an overlay peer that has not dialled us", peer=node)
                self.overdue.add(node)
                del self._awaited_since[node]

    async def _probe_once(
        self, contact: Contact, probing: set[tuple[str, int]], claimants: frozenset[str]
    ) -> None:
        address = (contact.host, contact.port)
        try:
            answered = await self._probe(contact)
        finally:
            probing.discard(address)
        self._note_probe(address, answered, claimants, trio.current_time())

    def _recheck_s(self) -> float:
        return self.config.fleet.revocation.recheck_s

    async def _recheck_loop(self) -> None:
        while True:
            await trio.sleep(self._recheck_s())
            self.recheck()
            now = trio.current_time()
            if now - self._resent_at >= RESEND_S:
                # A peer may have refused a credential when its clock or CA file was
                # wrong; links only remember what they sent, so now and then resend.
                self._resent_at = now
                self.book.resend()
            self._changed.set()

    def recheck(self, *, force: bool = False) -> None:
        """Look at the revocations and the certificate files again (every
        ``recheck_s``; at once on SIGHUP with ``force``) and at every held credential."""
        judge = self.judge
        if judge is None:
            return
        # A file's new stamp is kept only once it was read successfully, so a half-done
        # rotation (a new key beside the old certificate) is tried again next time.
        stamps = {p: _stamp(p) for p in self._watched()}
        changed = {p for p, st in stamps.items() if force or st != self._stamps.get(p)}
        cfg = self.config
        rev = [p for p in (cfg.fleet.revocation.deny_file, cfg.fleet.revocation.crl) if p]
        if force or changed & set(rev):
            try:
                judge.revocations = load_revocations(cfg.fleet.revocation)
                self._stamps.update({p: stamps[p] for p in rev})
                log.info("revocations loaded", entries=len(judge.revocations))
                self.security.revoke_nodes(judge.revocations.node_ids)
                self.book.resend()  # what a peer refused as revoked may be good again
            except ValueError as exc:
                log.error("revocations not reloaded; keeping the previous ones", error=str(exc))
        tls = [cfg.tls.cert, cfg.tls.key, cfg.tls.ca] if cfg.tls is not None else []
        if changed & set(tls):
            try:
                self.security.transport.reload(cfg)
                judge.ca_certs = tuple(pki.load_ca_certificates(tls[2]))
                own = self.book.get(cfg.node_id)
                self.publish_own(own.rank[1] + 1 if own else 0)  # ranks above the old
                self._stamps.update({p: stamps[p] for p in tls})
                self.book.resend()
                log.info("certificates reloaded", cert=str(tls[0]))
            except (ConvergencedError, ValueError, OSError) as exc:
                log.error("certificates not reloaded; keeping the previous ones", error=str(exc))
        for node in self.book.nodes():
            cred = self.book.get(node)
            info = judge.info(cred.blob) if cred is not None else None
            if cred is None or info is None:
                continue
            problem = judge.still_valid(info)
            if problem is not None and node != cfg.node_id:
                log.warning("credential no longer valid", node=node, reason=problem[0].value,
                            detail=problem[1])  # fmt: skip
                self.book.remove(node)
                judge.forget(cred.blob)
        if self.on_recheck is not None:
            self.on_recheck()

    def describe(self) -> dict[str, Any]:
        """For ``status``: the trust mode, the members, and the credentials held."""
        judge = self.judge
        creds: dict[str, Any] = {}
        for node in self.book.nodes():
            cred = self.book.get(node)
            info = judge.info(cred.blob) if judge is not None and cred is not None else None
            if cred is not None and info is not None:
                creds[node] = {
                    "address": info.address,
                    "serial": info.serial,
                    "certificate_serial": f"{info.certificate.serial_number:#x}",
                    "not_after": info.not_after.isoformat(),
                }
        return {
            "trust_mode": self.config.fleet.trust_mode,
            "members": len(self.members()),
            "discovered": len(self._contacts),
            "discovery_errors": {
                kind: error
                for kind, error in (
                    self.discovery.stats.last_error.items() if self.discovery else ()
                )
                if error
            },
            "revocations": len(judge.revocations) if judge is not None else 0,
            "credentials": creds,
        }

    def _watched(self) -> list[Path]:
        cfg = self.config
        rev = cfg.fleet.revocation
        paths = [p for p in (rev.deny_file, rev.crl) if p is not None]
        if cfg.tls is not None:
            paths += [cfg.tls.cert, cfg.tls.key, cfg.tls.ca]
        return paths


def _stamp(path: Path) -> tuple[float, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime, st.st_size
