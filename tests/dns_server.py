"""A tiny real DNS server for tests: UDP on 127.0.0.1, answering from a dict.

Real on purpose: the resolver under test sends real queries over a real socket and
parses real responses (built with dnspython's own ``make_response``), so what is
tested is what runs in production, down to rcodes and the additional section. Only
the zone is fake: a dict the test edits while the server runs.

- A name absent from `records` answers NXDOMAIN.
- A name present without the asked type answers NOERROR with no records (NODATA,
  the authoritative "nothing here").
- A name in `silent` gets no answer at all, so the client times out.
- An SRV answer carries the A and AAAA records of its targets in the additional
  section while `additional` is true, as Kubernetes' CoreDNS does.

It serves from a thread, so a blocking client (a resolver in a worker thread) and a
trio test can both use it. No TCP: answers here stay far below the UDP size limit.
"""

from __future__ import annotations

import socket
import threading
from types import TracebackType

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype
import dns.rdtypes.IN.SRV
import dns.rrset

TTL = 5


def _key(name: str) -> str:
    """Names compare in lower case and absolute form (``peers.test.``)."""
    return name.lower().rstrip(".") + "."


class DnsServer:
    """Answers DNS queries on ``127.0.0.1:port`` from `records` until stopped.

    Use as a context manager; `nameserver` is the ``ip:port`` text to configure.
    """

    def __init__(self) -> None:
        self.records: dict[str, dict[str, list[str]]] = {}
        """name -> record type ("A", "AAAA", "SRV") -> record texts."""
        self.additional = True
        self.silent: set[str] = set()
        self.queries: list[tuple[str, str]] = []
        """(name, type) of every query received, in order."""
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self._stopping = False
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="dns-server", daemon=True)

    @property
    def nameserver(self) -> str:
        """This server as a ``discovery.nameservers`` entry."""
        return f"127.0.0.1:{self.port}"

    def set(self, name: str, rdtype: str, *texts: str) -> None:
        """Replace the ``rdtype`` records of ``name`` (no texts: the type is empty)."""
        with self._lock:
            self.records.setdefault(_key(name), {})[rdtype] = list(texts)

    def remove(self, name: str) -> None:
        """Forget ``name``: it answers NXDOMAIN from now on."""
        with self._lock:
            self.records.pop(_key(name), None)

    def mute(self, name: str, silent: bool = True) -> None:
        """Stop (or resume) answering queries for ``name``."""
        with self._lock:
            (self.silent.add if silent else self.silent.discard)(_key(name))

    def __enter__(self) -> DnsServer:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stopping = True
        self._sock.sendto(b"", ("127.0.0.1", self.port))  # wake the blocked recvfrom
        self._thread.join(timeout=5)
        self._sock.close()
        if self._failure is not None and exc is None:
            raise AssertionError("the test DNS server failed") from self._failure

    def _serve(self) -> None:
        while True:
            data, peer = self._sock.recvfrom(65535)
            if self._stopping:
                return
            try:
                reply = self._answer(data)
            except BaseException as exc:  # reported by __exit__, not lost in the thread
                self._failure = exc
                return
            if reply is not None:
                self._sock.sendto(reply, peer)

    def _answer(self, wire: bytes) -> bytes | None:
        try:
            query = dns.message.from_wire(wire)
        except dns.exception.DNSException:
            return None
        question = query.question[0]
        name, rdtype = question.name.to_text().lower(), dns.rdatatype.to_text(question.rdtype)
        with self._lock:
            self.queries.append((name, rdtype))
            if name in self.silent:
                return None
            zone = {t: list(v) for t, v in self.records.get(name, {}).items()}
            known = name in self.records
            snapshot = {n: dict(z) for n, z in self.records.items()}
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        if not known:
            response.set_rcode(dns.rcode.NXDOMAIN)
            return response.to_wire()
        if zone.get(rdtype):
            rrset = dns.rrset.from_text_list(question.name, TTL, "IN", rdtype, zone[rdtype])
            response.answer.append(rrset)
            if rdtype == "SRV" and self.additional:
                for rd in rrset:
                    assert isinstance(rd, dns.rdtypes.IN.SRV.SRV)
                    target = rd.target.to_text().lower()
                    for glue in ("A", "AAAA"):
                        texts = snapshot.get(target, {}).get(glue)
                        if texts:
                            response.additional.append(
                                dns.rrset.from_text_list(rd.target, TTL, "IN", glue, texts)
                            )
        return response.to_wire()
