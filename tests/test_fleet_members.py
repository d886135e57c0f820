"""Who a node counts as a member, and which overlay links it dials (`peers.fleet`).

The daemon-level behaviour is in tests/test_fleet_daemons.py (real daemons, real DNS,
a fleet past the mesh limit with replaced hosts); these tests pin the two rules that
keep a replaced host from splitting the overlay, on one `Fleet` object, with trio's
`MockClock` for the time an overlay peer is waited for.
"""

from __future__ import annotations

import itertools

import pytest
import trio
import trio.testing

from convergenced.core.overlay import dial_targets
from convergenced.daemon.config import Config, parse
from convergenced.daemon.peers.fleet import OVERDUE_S, Fleet
from convergenced.daemon.peers.manager import dial_plan, overlay_peers
from convergenced.daemon.peers.security import PeerSecurity
from convergenced.daemon.peers.transport import PeerTransport
from convergenced.daemon.telemetry import Telemetry
from convergenced.discovery.contacts import Contact


def config(node: str, peers: dict[str, int], *, port: int = 7000, mesh_limit: int = 4) -> Config:
    raw = {
        "node_id": node,
        "insecure": True,
        "listen": f"127.0.0.1:{port}",
        "mesh_limit": mesh_limit,
        "peers": [{"id": p, "address": f"127.0.0.1:{port}"} for p, port in peers.items()],
    }
    return parse(raw)


def fleet_of(cfg: Config) -> Fleet:
    return Fleet(cfg, PeerSecurity(PeerTransport(cfg)), Telemetry())


def test_a_member_claiming_this_nodes_own_address_is_not_kept() -> None:
    # A dead host's identity still names the address its spare (this node) took.
    fleet = fleet_of(config("spare", {}, port=7000))
    fleet._contacts_changed(
        frozenset({Contact("127.0.0.1", 7000, "dead"), Contact("127.0.0.1", 7001, "other")})
    )
    assert [p.node_id for p in fleet.members()] == ["other"]


def test_a_linked_node_answers_for_its_address_over_a_stale_claim() -> None:
    fleet = fleet_of(config("me", {}, port=7000))
    fleet._contacts_changed(
        frozenset({Contact("127.0.0.1", 7001, "dead"), Contact("127.0.0.1", 7001, "spare")})
    )
    assert {p.node_id for p in fleet.members()} == {"dead", "spare"}  # nobody to tell
    fleet.linked = lambda: frozenset({"spare"})
    assert [p.node_id for p in fleet.members()] == ["spare"]


def awaited_setup() -> tuple[Fleet, Config, frozenset[str]]:
    """A node of eight past a mesh limit of four, and the overlay peers that should
    dial it."""
    ids = [f"n{i}" for i in range(8)]
    cfg = config("n0", {n: 7001 + i for i, n in enumerate(ids[1:])})
    awaited = overlay_peers(cfg) - {p.node_id for p in dial_plan(cfg)}
    assert awaited and all("n0" in dial_targets(ids, n, 4) for n in awaited)
    return fleet_of(cfg), cfg, awaited


@pytest.mark.trio
async def test_an_overlay_peer_that_never_dials_is_dialled_after_a_while(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fleet, cfg, awaited = awaited_setup()
    one, *others = sorted(awaited)
    fleet.linked = lambda: frozenset({one})  # it dialled; the others did not
    fleet._choose_overdue(cfg)
    assert fleet.extra_dials() == frozenset()
    await trio.sleep(OVERDUE_S - 1)
    fleet._choose_overdue(cfg)
    assert fleet.extra_dials() == frozenset()
    await trio.sleep(1)
    fleet._choose_overdue(cfg)
    assert fleet.extra_dials() == frozenset(others)
    # One of them dials after all: ours is dropped (one link per pair), and the
    # peers the overlay has this node dial anyway are never counted as awaited.
    fleet.dialled_by = lambda: frozenset(others[:1])
    fleet.linked = lambda: frozenset({one, *others})
    fleet._choose_overdue(cfg)
    assert fleet.extra_dials() == frozenset(others[1:])
    assert not fleet.extra_dials() & {p.node_id for p in dial_plan(cfg)}


@pytest.mark.trio
async def test_a_peer_that_leaves_the_overlay_is_no_longer_dialled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fleet, cfg, awaited = awaited_setup()
    fleet._choose_overdue(cfg)
    await trio.sleep(OVERDUE_S)
    fleet._choose_overdue(cfg)
    assert fleet.extra_dials() == awaited
    smaller = config("n0", {p.node_id: p.port for p in cfg.peers[:2]})  # a full mesh now
    fleet._choose_overdue(smaller)
    assert fleet.extra_dials() == frozenset()


def test_only_addresses_in_doubt_are_probed() -> None:
    # Probing every address not linked would cost each node a TLS handshake per member
    # and recheck period; only an address no credential claims, or several do (a host
    # replaced by a spare at the same address), says nothing of who is there.
    fleet = fleet_of(config("me", {}, port=7000))
    fleet._contacts_changed(frozenset(Contact("127.0.0.1", p) for p in range(7000, 7005)))
    claims = {"a": 7001, "b": 7002, "dead": 7003, "spare": 7003}
    fleet._advertised = lambda: {n: ("127.0.0.1", p) for n, p in claims.items()}  # type: ignore[method-assign]
    assert fleet._worth_probing() == {("127.0.0.1", 7003), ("127.0.0.1", 7004)}
    fleet.linked = lambda: frozenset({"spare"})  # a link says who answers at 7003
    assert fleet._worth_probing() == {("127.0.0.1", 7004)}


@pytest.mark.trio
async def test_a_dead_address_is_probed_less_and_less_often(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A dead host left in DNS or a contacts file would otherwise cost every node a
    # connection attempt per recheck period, forever.
    fleet = fleet_of(config("me", {}, port=7000))
    fleet._contacts_changed(frozenset({Contact("127.0.0.1", 7009)}))
    probes: list[float] = []

    async def nobody_answers(host: str, port: int) -> str:
        probes.append(trio.current_time())
        raise OSError(111, "Connection refused")

    fleet.security.transport.probe = nobody_answers  # type: ignore[method-assign]
    period = fleet._recheck_s()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fleet.run, nursery)
        await trio.sleep(70 * period)
        gaps = [round((b - a) / period) for a, b in itertools.pairwise(probes)]
        assert gaps[:7] == [1, 2, 4, 8, 16, 16, 16]
        # A spare announces itself at that address beside the dead host's claim: who
        # answers there is in doubt anew, and it is probed at once.
        fleet._advertised = lambda: {  # type: ignore[method-assign]
            "dead": ("127.0.0.1", 7009),
            "spare": ("127.0.0.1", 7009),
        }
        fleet._changed.set()
        before = len(probes)
        await trio.sleep(2.0)
        assert len(probes) == before + 1
        nursery.cancel_scope.cancel()
