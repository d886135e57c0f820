"""A fleet of real daemons sharing one configuration, found through real DNS.

Every node runs the same fleet configuration: no node id (it comes from
``CONVERGENCED_NODE_ID``), no peer list, no trust list; ``trust_mode = "ca"`` and
``[discovery] srv`` pointing at a real DNS server (`dns_server.DnsServer`) whose SRV
records list the fleet, as a Kubernetes headless Service's do. Only the per-host paths
(state directory, socket, key files, ports) differ, because on loopback the nodes
share one host; on real hosts they would be the same lines too.

Used by tests/test_fleet_daemons.py (12 nodes) and benchmarks/bench_fleet.py (32).
"""

from __future__ import annotations

import datetime as dt
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from dns_server import DnsServer

from convergenced.client import Client, DaemonUnreachable
from convergenced.security import pki
from convergenced.tools.cluster import free_base_port, spawn_daemon, stop_daemons

SERVICE = "fleet.test"
SRV_NAME = f"_peer._tcp.{SERVICE}"

FAST_TIMER = """\
tick_ms = 20
idle_ticks = 4
dead_ticks = 40
"""
"""The tests' link timer: failures show within a second (the daemon's default is a
200 ms tick, a heartbeat every second and a link down after 2 s)."""

FLEET_CONFIG = """\
cluster = "fleet"
trust_mode = "ca"
{timer}{mesh}
[discovery]
{discovery}
refresh_s = 1

[revocation]
deny_file = "{deny_file}"
crl = "{crl_file}"
recheck_s = 1
"""
"""The part every node shares, word for word."""

HOST_PATHS = """\
listen = "127.0.0.1:{port}"
metrics_listen = "off"
state_dir = "{dir}/state"
socket_path = "{dir}/s.sock"
identity = "{dir}/identity.key"

[tls]
cert = "{dir}/node.crt"
key = "{dir}/node.key"
ca = "{ca}"
"""
"""What differs per host only because these hosts share one machine."""


class FleetCluster:
    """Daemons ``fleet-NN`` on loopback, discovered through DNS SRV records."""

    def __init__(
        self, discovery: str | None = None, *, fast: bool = True, mesh_limit: int | None = None
    ) -> None:
        """``discovery``: the ``[discovery]`` lines (default: the SRV records of the
        test DNS server); ``fast``: the tests' link timer, else the daemon's default;
        ``mesh_limit``: past it the fleet links as a log-degree overlay (default 16)."""
        self.discovery = discovery
        self.timer = FAST_TIMER if fast else ""
        self.mesh = f"mesh_limit = {mesh_limit}\n" if mesh_limit is not None else ""
        self.dir = Path(tempfile.mkdtemp(prefix="cvf-", dir="/tmp"))
        self.ca_dir = self.dir / "ca"
        pki.init_ca(self.ca_dir)
        self.deny_file = self.dir / "deny.txt"
        self.deny_file.write_text("# revoked node ids, serials or fingerprints\n")
        self.crl_file = self.dir / "ca.crl"
        self.publish_crl([])
        self.dns = DnsServer()
        self.dns.__enter__()
        self.ports: dict[str, int] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._clients: list[Client] = []

    def shared_config(self) -> str:
        """The configuration every node runs."""
        discovery = self.discovery or (
            f'srv = "{SRV_NAME}"\nnameservers = ["{self.dns.nameserver}"]'
        )
        return FLEET_CONFIG.format(
            timer=self.timer,
            mesh=self.mesh,
            discovery=discovery,
            deny_file=self.deny_file,
            crl_file=self.crl_file,
        )

    def add(self, node: str, port: int | None = None) -> None:
        """Give ``node`` a certificate, a directory and a port, and list it in DNS."""
        home = self.dir / node
        (home / "state").mkdir(parents=True)
        self.certify(node)
        self.ports[node] = port or free_base_port(1)
        text = HOST_PATHS.format(port=self.ports[node], dir=home, ca=self.ca_dir / pki.CA_CERT)
        top, tls = text.split("\n\n", 1)  # top-level keys go before any table
        (home / "convergenced.toml").write_text(f"{top}\n{self.shared_config()}\n{tls}")
        self._publish_dns()

    def certify(self, node: str) -> None:
        """Issue ``node`` a new certificate and key, renamed over the old ones (as
        cert-manager's renewal does)."""
        home = self.dir / node
        files = pki.issue(self.ca_dir, node, hosts=["127.0.0.1"], out_dir=home, overwrite=True)
        files.key.rename(home / "node.key")
        files.cert.rename(home / "node.crt")

    def publish_crl(self, nodes: list[str]) -> None:
        """Have the CA revoke the current certificates of ``nodes`` in a new CRL,
        renamed over the old one (as a CA's CRL distribution does)."""
        ca_cert, ca_key = pki.load_ca(self.ca_dir)
        now = dt.datetime.now(dt.UTC)
        builder = (
            x509.CertificateRevocationListBuilder()
            .issuer_name(ca_cert.subject)
            .last_update(now)
            .next_update(now + dt.timedelta(days=1))
        )
        for node in nodes:
            cert = pki.load_certificate(self.dir / node / "node.crt")
            entry = x509.RevokedCertificateBuilder().serial_number(cert.serial_number)
            builder = builder.add_revoked_certificate(entry.revocation_date(now).build())
        crl = builder.sign(ca_key, hashes.SHA256())
        tmp = self.crl_file.with_suffix(".tmp")
        tmp.write_bytes(crl.public_bytes(serialization.Encoding.PEM))
        tmp.rename(self.crl_file)

    def remove(self, node: str) -> None:
        """Stop ``node`` and take it out of DNS (a host gone for good)."""
        self.stop(node)
        del self.ports[node]
        self._publish_dns()

    def _publish_dns(self) -> None:
        srv = [f"0 0 {port} {node}.{SERVICE}." for node, port in sorted(self.ports.items())]
        self.dns.set(SRV_NAME, "SRV", *srv)
        for node in self.ports:
            self.dns.set(f"{node}.{SERVICE}", "A", "127.0.0.1")

    def start(self, node: str) -> None:
        """Start ``node``'s daemon (its id and address from the environment)."""
        home = self.dir / node
        env = {
            "CONVERGENCED_NODE_ID": node,
            "CONVERGENCED_ADVERTISE": f"127.0.0.1:{self.ports[node]}",
        }
        self.procs[node] = spawn_daemon(home / "convergenced.toml", home / "log", env)

    def stop(self, node: str) -> None:
        """Stop ``node``'s daemon, if it runs."""
        proc = self.procs.pop(node, None)
        if proc is not None:
            stop_daemons([proc])

    def socket(self, node: str) -> Path:
        """``node``'s local socket."""
        return self.dir / node / "s.sock"

    def client(self, node: str) -> Client:
        """A client of ``node`` (closed with the cluster)."""
        c = Client(self.socket(node), reconnect=0)
        self._clients.append(c)
        return c

    def status(self, node: str) -> dict[str, Any] | None:
        """``node``'s status, or None while it does not answer."""
        try:
            with Client(self.socket(node), timeout=2, reconnect=0) as c:
                return c.status()
        except (DaemonUnreachable, OSError):
            return None

    def linked(self, node: str) -> set[str]:
        """The peers ``node`` has an established link with."""
        status = self.status(node)
        if status is None:
            return set()
        return {x["peer"] for x in status["links"] if x["state"] not in ("start", "closed")}

    def whole(self, nodes: list[str]) -> bool:
        """Every node of ``nodes`` knows every other (holds its credential: a
        declaration may name it) and is linked to each of its overlay peers among them."""
        for node in nodes:
            status = self.status(node)
            if status is None:
                return False
            peers = {p["id"]: p for p in status["peers"]}
            if not set(nodes) - {node} <= set(peers) <= set(status["fleet"]["credentials"]):
                return False
            if any(p["overlay_link"] and not p["connected"] for p in peers.values()
                   if p["id"] in nodes):  # fmt: skip
                return False
        return True

    def diagnose(self, nodes: list[str]) -> str:
        """What each node lacks, for a fleet that did not become `whole`."""
        out = []
        for node in nodes:
            status = self.status(node)
            if status is None:
                out.append(f"{node}: no answer; its log ends:\n{self.log(node)[-1500:]}")
                continue
            peers = {p["id"]: p for p in status["peers"]}
            creds = set(status["fleet"]["credentials"])
            down = sorted(p for p, v in peers.items() if v["overlay_link"] and not v["connected"])
            out.append(
                f"{node}: knows {sorted(peers)}, overlay down {down}, "
                f"not known {sorted(set(nodes) - {node} - set(peers))}, "
                f"known without credential {sorted(set(peers) - creds)}"
            )
        return "\n".join(out)

    def wait_whole(self, nodes: list[str], timeout: float, what: str) -> float:
        """`wait_for` the fleet to be `whole`; on a timeout the `diagnose` is in the
        error."""
        try:
            return wait_for(lambda: self.whole(nodes), timeout, what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.diagnose(nodes)}") from None

    def log(self, node: str) -> str:
        """``node``'s log so far."""
        return (self.dir / node / "log").read_text(errors="replace")

    def close(self) -> None:
        """Stop everything and remove the directory."""
        for c in self._clients:
            c.close()
        stop_daemons(self.procs.values())
        self.dns.__exit__(None, None, None)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> FleetCluster:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def wait_for(predicate: Any, timeout: float, what: str) -> float:
    """Poll ``predicate`` until true; the seconds it took. Raises AssertionError."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.2)
    return time.monotonic() - start
