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

It serves from threads, so a blocking client (a resolver in a worker thread) and a
trio test can both use it. Like a real server it truncates a UDP answer that does not
fit (512 bytes, or the client's EDNS size) and answers the same question in full over
TCP on the same port, which resolvers then ask: the SRV records of a fleet of 32 do
not fit in one datagram.
"""

from __future__ import annotations

import socket
import threading
from contextlib import suppress
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
        self._version = 0
        """Bumped by every change of the zone: rendered replies of older ones are stale."""
        self._rendered: dict[
            tuple[int, bool, bool, bytes], tuple[bytes | None, tuple[str, str]]
        ] = {}
        for _ in range(100):  # a port free for both UDP and TCP
            self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self._sock.bind(("127.0.0.1", 0))
            self.port: int = self._sock.getsockname()[1]
            self._tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                self._tcp.bind(("127.0.0.1", self.port))
                break
            except OSError:
                self._sock.close()
                self._tcp.close()
        self._tcp.listen(64)
        self._stopping = False
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="dns-server", daemon=True)
        self._tcp_thread = threading.Thread(target=self._serve_tcp, name="dns-tcp", daemon=True)

    @property
    def nameserver(self) -> str:
        """This server as a ``discovery.nameservers`` entry."""
        return f"127.0.0.1:{self.port}"

    def set(self, name: str, rdtype: str, *texts: str) -> None:
        """Replace the ``rdtype`` records of ``name`` (no texts: the type is empty)."""
        with self._lock:
            self.records.setdefault(_key(name), {})[rdtype] = list(texts)
            self._version += 1

    def remove(self, name: str) -> None:
        """Forget ``name``: it answers NXDOMAIN from now on."""
        with self._lock:
            self.records.pop(_key(name), None)
            self._version += 1

    def mute(self, name: str, silent: bool = True) -> None:
        """Stop (or resume) answering queries for ``name``."""
        with self._lock:
            (self.silent.add if silent else self.silent.discard)(_key(name))
            self._version += 1

    def __enter__(self) -> DnsServer:
        self._thread.start()
        self._tcp_thread.start()
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
        with suppress(OSError):
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        self._tcp_thread.join(timeout=5)
        self._tcp.close()
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

    def _serve_tcp(self) -> None:
        while True:
            conn, _ = self._tcp.accept()
            if self._stopping:
                conn.close()
                return
            # A thread each: many resolvers fall back to TCP at once.
            threading.Thread(target=self._answer_tcp, args=(conn,), daemon=True).start()

    def _answer_tcp(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            try:
                while True:  # a resolver may ask again on the same connection
                    head = _read_exactly(conn, 2)
                    query = _read_exactly(conn, int.from_bytes(head, "big"))
                    reply = self._answer(query, tcp=True)
                    if reply is not None:
                        conn.sendall(len(reply).to_bytes(2, "big") + reply)
            except (OSError, ValueError):
                return
            except BaseException as exc:  # reported by __exit__
                self._failure = exc

    def _answer(self, wire: bytes, *, tcp: bool = False) -> bytes | None:
        """The reply to ``wire`` (None: none). Rendered once per zone version and
        query, then only its 2-byte id changes: a fleet of resolvers asks the same
        question over and over, and rendering 64 records takes milliseconds (a server
        that slow times out a fleet's lookups on a loaded machine)."""
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
            key = (self._version, self.additional, tcp, wire[2:])
            cached = self._rendered.get(key)
            zone = {t: list(v) for t, v in self.records.get(name, {}).items()}
            known = name in self.records
            snapshot = {n: dict(z) for n, z in self.records.items()}
        if cached is None:
            cached = self._render(query, question, rdtype, zone, known, snapshot, tcp=tcp)
            with self._lock:
                if len(self._rendered) > 4096:
                    self._rendered.clear()
                self._rendered[key] = cached
        return wire[:2] + cached[2:]

    def _render(  # noqa: PLR0917 - the parts of one answer, read under the lock
        self,
        query: dns.message.Message,
        question: dns.rrset.RRset,
        rdtype: str,
        zone: dict[str, list[str]],
        known: bool,
        snapshot: dict[str, dict[str, list[str]]],
        *,
        tcp: bool,
    ) -> bytes:
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
        if tcp:  # up to the 64 KiB a TCP message can hold, whatever the EDNS size
            return response.to_wire(max_size=65535)
        limit = max(512, query.payload) if query.edns >= 0 else 512
        try:
            return response.to_wire(max_size=limit)
        except dns.exception.TooBig:
            response.answer.clear()
            response.additional.clear()
            response.flags |= dns.flags.TC
            return response.to_wire()


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ValueError("connection closed")
        data += chunk
    return data
