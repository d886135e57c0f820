"""Twelve real daemons from one shared configuration: no peer list, no trust list.

Node ids come from the environment, peers from DNS SRV records served by a real DNS
server, record keys from credentials the cluster CA vouches for (`tests.fleet_cluster`).
With a mesh limit of 8 the twelve link as a log-degree overlay, as a large fleet does.
The fleet links up and agrees on a restore point; two hosts are then replaced by
spares with new identities (new certificates, keys and empty disks, at the same
addresses), DNS is updated, and the fleet becomes whole (every overlay link up) and
agrees again with them as members. A node put on the deny list, and then one whose
certificate the CA's CRL revokes, is cut off at the next recheck. Smaller fleets check
the other sources: one seed address, and a contacts file an orchestrator rewrites.
"""

from __future__ import annotations

import shutil
import time
from typing import Any

from fleet_cluster import FleetCluster, wait_for

N = 12
MESH_LIMIT = 8


def names(*numbers: int) -> list[str]:
    return [f"fleet-{i:02d}" for i in numbers]


def spec(name: str, nodes: list[str]) -> dict[str, Any]:
    return {
        "name": name,
        "members": {node: [i] for i, node in enumerate(nodes)},
        "policy": {"mode": "all", "domains": ["nvme"]},
        "retention": 0,
    }


def members(fleet: FleetCluster, node: str) -> set[str]:
    """The nodes ``node`` counts as members of the fleet (none while it does not answer)."""
    status = fleet.status(node)
    return {p["id"] for p in status["peers"]} if status else set()


def agree(fleet: FleetCluster, stream: str, nodes: list[str], epoch: int) -> None:
    """Every member declares ``stream``, commits ``epoch`` for its rank, and waits
    until the restore point is ``epoch`` on every member."""
    for i, node in enumerate(nodes):
        c = fleet.client(node)
        c.declare(spec(stream, nodes))
        c.commit(stream, i, "nvme", epoch)
    for node in nodes:
        state = fleet.client(node).wait(stream, epoch, timeout=60)
        assert state["restore_point"] == epoch, (node, state)


def test_a_fleet_from_one_configuration_survives_replaced_hosts() -> None:
    with FleetCluster(mesh_limit=MESH_LIMIT) as fleet:
        first = names(*range(1, N + 1))
        for node in first:
            fleet.add(node)
        for node in first:
            fleet.start(node)
        took = fleet.wait_whole(first, 90, "every overlay link up")
        print(f"overlay of {N} from DNS in {took:.1f} s")
        agree(fleet, "job", first, 5)

        # Two hosts fail for good; spares with new identities take their addresses.
        gone, spares = names(11, 12), names(13, 14)
        for old, new in zip(gone, spares, strict=True):
            port = fleet.ports[old]
            fleet.remove(old)
            fleet.add(new, port)
            fleet.start(new)
        now = names(*range(1, 11), 13, 14)
        # Each spare took a dead host's address, which that host's credential still
        # advertises: the spare must not count it a member, or its overlay (a function
        # of the member list) would differ from everyone else's.
        took = fleet.wait_whole(now, 90, "the spares in the overlay")
        print(f"spares linked in {took:.1f} s")

        wait_for(
            lambda: all(members(fleet, n) == set(now) - {n} for n in now), 30, "dead hosts gone"
        )
        agree(fleet, "job2", now, 7)
        for node in now:
            status = fleet.status(node)
            assert status is not None
            counters = status["counters"]
            refused = {k: v for k, v in counters.items() if k.startswith("credentials_refused")}
            assert not any(refused.values()), (node, refused)

        # Revocation: fleet-13 goes on the deny list; within a few rechecks nobody
        # keeps a link to it, and it cannot link again.
        others = [n for n in now if n != "fleet-13"]
        assert any("fleet-13" in fleet.linked(n) for n in others)
        fleet.deny_file.write_text("fleet-13\n")
        wait_for(
            lambda: all("fleet-13" not in fleet.linked(n) for n in others),
            30,
            "fleet-13 cut off",
        )
        assert "credential no longer valid" in fleet.log("fleet-01")

        # The CA's CRL works the same way: it revokes fleet-14's certificate by serial.
        others = [n for n in others if n != "fleet-14"]
        assert any("fleet-14" in fleet.linked(n) for n in others)
        fleet.publish_crl(["fleet-14"])
        wait_for(
            lambda: all("fleet-14" not in fleet.linked(n) for n in others),
            30,
            "fleet-14 cut off by the CRL",
        )


def test_a_seed_list_is_enough_and_certificates_rotate_without_a_restart() -> None:
    # Only fleet-01 is listed; the others learn each other from the credentials that
    # the links pass on (each carries its node's advertised address).
    with FleetCluster() as fleet:
        nodes = names(1, 2, 3, 4)
        for node in nodes:
            fleet.add(node)
        fleet.discovery = f'seeds = ["127.0.0.1:{fleet.ports["fleet-01"]}"]'
        for node in nodes:  # rewrite every file with the seed list
            home = fleet.dir / node
            text = (home / "convergenced.toml").read_text()
            head, _, rest = text.partition("[discovery]\n")
            rest = rest.split("refresh_s", 1)[1]
            (home / "convergenced.toml").write_text(
                f"{head}[discovery]\n{fleet.discovery}\nrefresh_s{rest}"
            )
            fleet.start(node)
        wait_for(
            lambda: all(fleet.linked(n) == set(nodes) - {n} for n in nodes),
            60,
            "a full mesh from one seed",
        )
        agree(fleet, "job", nodes, 3)

        def serial_seen(at: str, of: str) -> str | None:
            status = fleet.status(at)
            cred = status["fleet"]["credentials"].get(of) if status else None
            return cred["certificate_serial"] if cred else None

        before = serial_seen("fleet-04", "fleet-02")
        assert before is not None
        fleet.certify("fleet-02")  # renewed on disk, as cert-manager does
        wait_for(
            lambda: "certificates reloaded" in fleet.log("fleet-02"),
            30,
            "fleet-02 loads its new certificate",
        )
        wait_for(
            lambda: serial_seen("fleet-04", "fleet-02") not in (None, before),
            30,
            "fleet-04 holds fleet-02's new credential",
        )
        # New connections use the new certificate: restart a peer, it links again.
        fleet.stop("fleet-03")
        fleet.start("fleet-03")
        wait_for(lambda: "fleet-02" in fleet.linked("fleet-03"), 60, "fleet-03 back")
        agree(fleet, "job2", nodes, 4)


def test_a_contacts_file_an_orchestrator_rewrites_is_followed() -> None:
    # The fleet comes from a file of host:port lines (no node ids: each is asked with a
    # TLS handshake) that the orchestrator replaces by renaming over it.
    with FleetCluster() as fleet:
        contacts = fleet.dir / "contacts.txt"
        fleet.discovery = f'file = "{contacts}"'

        def publish(nodes: list[str]) -> None:
            tmp = contacts.with_suffix(".tmp")
            tmp.write_text("".join(f"127.0.0.1:{fleet.ports[n]}\n" for n in nodes))
            tmp.rename(contacts)

        first = names(1, 2, 3)
        for node in first:
            fleet.add(node)
        publish(first)
        for node in first:
            fleet.start(node)
        fleet.wait_whole(first, 60, "three nodes from the file")
        agree(fleet, "job", first, 2)

        grown = names(1, 2, 3, 4)
        fleet.add("fleet-04")  # every node's configuration names the same file
        publish(grown)
        fleet.start("fleet-04")
        fleet.wait_whole(grown, 60, "fleet-04 found through the rewritten file")
        agree(fleet, "job2", grown, 3)

        # fleet-03's host goes away and out of the file: after a few refreshes without
        # it, the others stop counting it a member.
        fleet.stop("fleet-03")
        rest = names(1, 2, 4)
        publish(rest)

        wait_for(
            lambda: all(members(fleet, n) == set(rest) - {n} for n in rest), 30, "fleet-03 gone"
        )


def test_a_node_that_lost_its_identity_key_and_disk_is_trusted_again() -> None:
    # A pod rescheduled with its identity key and state on emptyDir volumes: a new
    # record key, and no memory of its incarnations, so it must learn its earlier life
    # from the records of its own that its peers hold, and rise above it. Those are
    # signed with its old key, which only its old credential names.
    # First with the same certificate: the new credential ranks below the old one (a
    # lower serial); peers send the old one back, and it signs its own again above it,
    # naming its old key. Then again with a new certificate (a host re-imaged): its new
    # credential ranks above at once, and only the credential the peers replaced, sent
    # back to it, names the key of its earlier life.
    with FleetCluster() as fleet:
        nodes = names(1, 2, 3)
        for node in nodes:
            fleet.add(node)
        for node in nodes:
            fleet.start(node)
        fleet.wait_whole(nodes, 60, "the fleet whole")
        agree(fleet, "job", nodes, 3)
        for _ in range(2):  # a few lives, so the old credential's serial is above 1
            fleet.stop("fleet-02")
            fleet.start("fleet-02")
            fleet.wait_whole(nodes, 60, "fleet-02 back")
        others = [n for n in nodes if n != "fleet-02"]

        def held(at: str) -> dict[str, Any]:
            status = fleet.status(at)
            cred = status["fleet"]["credentials"].get("fleet-02") if status else None
            return cred or {"serial": -1, "certificate_serial": None}

        def lose_everything(new_certificate: bool) -> None:
            fleet.stop("fleet-02")
            home = fleet.dir / "fleet-02"
            for key_file in home.glob("identity*"):  # the key and the floor beside it
                key_file.unlink()
            shutil.rmtree(home / "state")
            (home / "state").mkdir()
            if new_certificate:
                time.sleep(1.1)  # a later notBefore, so a higher rank
                fleet.certify("fleet-02")
            fleet.start("fleet-02")
            fleet.wait_whole(nodes, 60, "fleet-02 linked with a new key")

        old = held("fleet-01")
        assert old["serial"] >= 3
        lose_everything(new_certificate=False)
        agree(fleet, "job", nodes, 4)
        wait_for(
            lambda: all(held(n)["serial"] > old["serial"] for n in others),
            30,
            "fleet-02 signed again above its old credential",
        )
        lose_everything(new_certificate=True)
        agree(fleet, "job", nodes, 5)
        assert all(held(n)["certificate_serial"] != old["certificate_serial"] for n in others)
