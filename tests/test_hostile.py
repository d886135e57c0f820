"""Hostile input through the real adapters: the Unix socket and the TLS peer port.

Why: the security issue's promise is that no input, however malformed, may crash a
daemon, hang it or alter its state, and that each one gets a clean typed error, a
counter by reason and, where needed, a closed connection, while the daemon keeps
serving every other client and peer. Unit tests of the decoders cannot show that: the
adapters (framing across reads, bytes trickled one at a time, TLS, the handshake
deadline, the reply queue, the signature check on merge) are where it is kept or lost.

The target is one cluster of two real ``convergenced run`` processes with mutual TLS
1.3 and signed records, whose stream ``job`` is agreed at epoch 3. Before anything
hostile happens the suite records, per node, the stream's state, the view digest and
record stamps the node announces in its HELLO, and the counters. A bystander thread
then polls both daemons' state for the whole module. Then:

- **Unix socket** (hypothesis, 1,600 cases): request maps with fields of the wrong type,
  negative, huge, NaN and infinite numbers, unknown ops and arguments, malformed and
  conflicting specs; hand-built msgpack with duplicate keys, deep nesting, ext types,
  float32 NaN, invalid UTF-8, non-string keys, trailing objects, huge container headers;
  length prefixes that are short, long, zero or oversized; truncated frames; garbage;
  several frames in one connection; bytes trickled one at a time.
- **Peer port** (hypothesis, 700 cases), over TLS with a valid cluster certificate:
  garbage, truncated and oversized frames, bad magic, version 0/2/255, unknown type
  bytes, non-zero flags, messages out of handshake order, repeated HELLO, wrong cluster,
  HELLO naming ourselves, another node than the certificate or a node outside the
  cluster; then, after a proper HELLO, TICKs with mutated fields and forged records
  (unsigned, signed by a stranger's key, carrying a real signature of another body, of
  unknown origins, the receiver's own) and stale ones, followed by NUDGEs, repeated
  HELLOs or garbage.
- **Explicit cases**: certificates of another CA, none, expired, TLS 1.2, plaintext, a
  certificate naming no node; slowloris at the TLS and at the HELLO stage, and more
  idle connections than ``max_connections`` at once; replays of real records captured
  earlier (stale, the receiver's own, tampered); a flood of forged signatures in one
  TICK; oversized Unix frames; a conflicting declare.

Oracles: the expected outcome of every input is computed with the sans-IO codecs
(`codec.FrameReader` and `parse_request`, `wire.FrameDecoder` and `decode_message`) and
the link rules of PROTOCOL.md section 9. Over the real sockets the daemon must agree:
every Unix reply is a well-formed map with a known error kind and the predicted reason,
the connection ends by itself, and the ``api_errors_<reason>`` counters move by exactly
the replies received; every peer violation ends with a BYE naming the predicted reason
and a close, and ``peer_rejected_<reason>`` / ``records_rejected_<reason>`` move by
exactly what was predicted. After every test: both daemons alive, the real link up with
no reconnect, the stream state and view digest unchanged, and the bystander never saw a
change, an error or an answer slower than two seconds. The last test checks that the
warnings about all this were rate-limited.

Three bugs this suite found were fixed: requests before a fatal frame in the same read
went unanswered (codec.FrameReader), peers silent after TLS were not counted at the HELLO
deadline (PeerSession), and connections still in their TLS handshake did not count
against max_connections (Daemon._accept_peer). Their tests stay.

Nothing here may legitimately change state: requests name streams that are not
declared (a generated request that could change state is discarded with `assume`), the
declared stream is only re-declared with a conflicting spec, and every record is
forged, stale, of an unknown origin or the receiver's own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import math
import os
import socket
import ssl
import struct
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from daemons import LocalCluster, until
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from convergenced.client import Client
from convergenced.core import local_api_codec as codec
from convergenced.core import wire
from convergenced.core.errors import RemoteProtocolError
from convergenced.core.interval_set import IntervalSet
from convergenced.core.local_api_codec import ApiError, ErrorKind
from convergenced.core.messages import Bye, Hello, Message, MessageType, Nudge, Tick, Tock
from convergenced.core.records import Record
from convergenced.daemon.config import Limits
from convergenced.security import pki
from convergenced.security.keys import NodeIdentity

CLUSTER = "local"
STREAM = "job"
SPEC: dict[str, Any] = {
    "name": STREAM,
    "members": {"node-1": [0], "node-2": [1]},
    "policy": {"mode": "all", "domains": ["nvme"]},
    "retention": 0,
}
EPOCHS = 3
HANDSHAKE_S = 1.5
"""``limits.handshake_timeout_s`` of the target (the default 5 s would slow the suite)."""
MAX_CONNECTIONS = 32
"""``limits.max_connections`` of the target (small, so exceeding it is cheap)."""
IO_TIMEOUT = 5.0
"""Longest a daemon may take to answer and close one hostile connection."""
MAX_FRAME = Limits().max_frame_bytes
WIRE_LIMITS = wire.WireLimits()
READ_LIMITS = wire.WireLimits(max_frame_bytes=1 << 24, max_str=1 << 16, max_bin=1 << 16)
"""For decoding what the daemons send us (their BYE reasons, records)."""
SLOW_ANSWER_S = 2.0

SETTINGS = settings(
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)

# -- the target -----------------------------------------------------------------------

Stamps = dict[tuple[str, str], tuple[int, int]]


@dataclass
class Snapshot:
    """What must not change: per node, the stream's state and the HELLO's view."""

    states: list[dict[str, Any]]
    views: list[tuple[bytes, tuple[tuple[str, str, int, int], ...]]]


class Bystander(threading.Thread):
    """A well-behaved client of both daemons, polling the stream's state throughout."""

    def __init__(self, paths: list[Path], expected: list[dict[str, Any]]) -> None:
        super().__init__(daemon=True, name="bystander")
        self.paths = paths
        self.expected = expected
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.slowest = 0.0
        self.polls = 0

    def run(self) -> None:
        try:
            clients = [Client(p) for p in self.paths]
        except Exception as exc:
            self.errors.append(f"cannot connect: {exc!r}")
            return
        try:
            while not self.stop.wait(0.02):
                for c, want in zip(clients, self.expected, strict=True):
                    t0 = time.monotonic()
                    got = c.state(STREAM)
                    self.slowest = max(self.slowest, time.monotonic() - t0)
                    self.polls += 1
                    if got != want:
                        self.errors.append(f"state changed: {got} != {want}")
        except Exception as exc:
            self.errors.append(f"bystander failed: {exc!r}")
        finally:
            for c in clients:
                c.close()


@dataclass
class Target:
    """The cluster under attack and everything known about it before the attack."""

    cluster: LocalCluster
    admins: list[Client]
    contexts: dict[str, ssl.SSLContext]
    """TLS client contexts by certificate: the two members and node-9, a non-member."""
    incarnation: dict[str, int]
    old_records: dict[str, Record] = field(default_factory=dict)
    """A signed record of each node, captured at epoch 1 (for replays)."""
    snapshot: Snapshot = field(default_factory=lambda: Snapshot([], []))
    reconnects: int = 0
    bystander: Bystander = field(default_factory=lambda: Bystander([], []))
    started: float = field(default_factory=time.monotonic)
    notes: dict[str, Any] = field(default_factory=dict)
    """Measurements one test leaves for another (and for the report)."""

    def port(self, i: int) -> int:
        return self.cluster.base_port + i - 1

    def counters(self, i: int) -> dict[str, int]:
        return dict(self.admins[i - 1].status()["counters"])

    def held(self, i: int) -> Stamps:
        """(stream, origin) -> (incarnation, version) of the records node ``i`` holds."""
        return {(s, o): (inc, v) for s, o, inc, v in self.snapshot.views[i - 1][1]}


def client_context(cert: Path, key: Path, ca: Path, *, tls12: bool = False) -> ssl.SSLContext:
    """A TLS client presenting ``cert`` and trusting ``ca`` (no file consistency checks,
    so a certificate of another CA can be presented)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cafile=str(ca))
    if tls12:
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    else:
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(str(cert), str(key))
    return ctx


def counter_delta(before: dict[str, int], after: dict[str, int], prefix: str) -> Counter[str]:
    out: Counter[str] = Counter()
    for k, v in after.items():
        if k.startswith(prefix) and v != before.get(k, 0):
            out[k[len(prefix) :]] = v - before.get(k, 0)
    return out


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    with LocalCluster(2, tick_ms=50) as cluster:
        for path in cluster.configs:
            with path.open("a") as f:
                f.write(
                    f"\n[limits]\nhandshake_timeout_s = {HANDSHAKE_S}\n"
                    f"max_connections = {MAX_CONNECTIONS}\n"
                )
        cluster.start_all()
        admins = [cluster.client(1), cluster.client(2)]
        ca = cluster.dir / "ca" / "ca.crt"
        contexts: dict[str, ssl.SSLContext] = {}
        for i in (1, 2):
            files = pki.node_files(cluster.dir / f"node-{i}" / "tls", f"node-{i}")
            contexts[f"node-{i}"] = client_context(files.cert, files.key, ca)
        stranger = pki.issue(cluster.dir / "ca", "node-9", out_dir=cluster.dir / "node-9")
        contexts["node-9"] = client_context(stranger.cert, stranger.key, ca)

        for c in admins:
            c.declare(SPEC)
        for rank, c in enumerate(admins):
            c.commit(STREAM, rank, "nvme", 1)
        for c in admins:
            c.wait(STREAM, 1, timeout=20)
        incarnation = {f"node-{i}": int(admins[i - 1].status()["incarnation"]) for i in (1, 2)}
        t = Target(cluster, admins, contexts, incarnation)
        t.old_records = {
            "node-1": own_record(t, at=1, identity="node-2"),
            "node-2": own_record(t, at=2, identity="node-1"),
        }
        for e in range(2, EPOCHS + 1):
            for rank, c in enumerate(admins):
                c.commit(STREAM, rank, "nvme", e)
        for c in admins:
            assert c.wait(STREAM, EPOCHS, timeout=20)["restore_point"] == EPOCHS
        until(
            lambda: all(c.state(STREAM)["knowledge"] == "published" for c in admins),
            what="both nodes to know every proposal",
        )

        def settled() -> Snapshot | None:
            first = Snapshot([c.state(STREAM) for c in admins], [view(t, 1), view(t, 2)])
            time.sleep(0.3)
            again = Snapshot([c.state(STREAM) for c in admins], [view(t, 1), view(t, 2)])
            if first != again or first.views[0][0] != first.views[1][0]:
                return None
            return first

        snapshot = None
        deadline = time.monotonic() + 20
        while snapshot is None:
            assert time.monotonic() < deadline, "the cluster did not settle"
            snapshot = settled()
        t.snapshot = snapshot
        t.reconnects = admins[0].status()["counters"].get("peer_reconnects", 0)
        t.bystander = bystander = Bystander(
            [cluster.socket_path(1), cluster.socket_path(2)], snapshot.states
        )
        bystander.start()
        try:
            yield t
        finally:
            bystander.stop.set()
            bystander.join(timeout=10)


def undisturbed(t: Target) -> None:
    """Both daemons alive and answering, the real link up and in sync with no reconnect,
    state and views as before, and the bystander content."""
    for i in (1, 2):
        proc = t.cluster.procs[i]
        assert proc.poll() is None, f"node-{i} died:\n{t.cluster.log(i)[-3000:]}"
    states = [c.state(STREAM) for c in t.admins]
    assert states == t.snapshot.states

    def link_up() -> bool:
        one = t.admins[0].status()["links"]
        two = t.admins[1].status()["links"]
        return any(
            ln["peer"] == "node-2" and ln["role"] == "initiator" and ln["in_sync"] for ln in one
        ) and any(
            ln["peer"] == "node-1" and ln["role"] == "acceptor" and ln["in_sync"] for ln in two
        )

    until(link_up, timeout=5, what="the real link to be up and in sync")
    assert [view(t, 1), view(t, 2)] == t.snapshot.views
    assert t.counters(1).get("peer_reconnects", 0) == t.reconnects
    assert t.bystander.is_alive()
    assert t.bystander.errors == []
    assert t.bystander.slowest < SLOW_ANSWER_S, f"bystander waited {t.bystander.slowest:.2f} s"


# -- peer connections ----------------------------------------------------------------------


class PeerConn:
    """A TLS client connection to a daemon's peer port (blocking, with timeouts)."""

    def __init__(self, t: Target, node: int, identity: str) -> None:
        raw = socket.create_connection(("127.0.0.1", t.port(node)), timeout=IO_TIMEOUT)
        try:
            self.sock = t.contexts[identity].wrap_socket(raw)
        except BaseException:
            raw.close()
            raise
        self.received = bytearray()
        self.eof = False

    def send(self, data: bytes, *, trickle: bool = False) -> bool:
        """Send ``data``; False when the daemon had closed the connection already."""
        try:
            if trickle:
                for i in range(len(data)):
                    self.sock.sendall(data[i : i + 1])
            else:
                self.sock.sendall(data)
        except (OSError, ssl.SSLError):
            return False
        return True

    def read_until_eof(self, timeout: float = IO_TIMEOUT) -> bytes:
        deadline = time.monotonic() + timeout
        while not self.eof:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"the daemon kept the connection open for {timeout} s")
            self.sock.settimeout(left)
            self._recv()
        return bytes(self.received)

    def read_frames(self, count: int, timeout: float = IO_TIMEOUT) -> list[Message]:
        """The first ``count`` messages the daemon sent (fewer if it closed)."""
        deadline = time.monotonic() + timeout
        while not self.eof:
            msgs = peer_messages(bytes(self.received), partial=True)
            if len(msgs) >= count:
                return msgs[:count]
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {count} messages within {timeout} s")
            self.sock.settimeout(left)
            self._recv()
        return peer_messages(bytes(self.received), partial=True)[:count]

    def _recv(self) -> None:
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            raise AssertionError(
                f"the daemon neither answered nor closed: {bytes(self.received)!r}"
            ) from None
        except (OSError, ssl.SSLError):
            data = b""  # a reset or an alert: closed all the same
        if data:
            self.received += data
        else:
            self.eof = True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def __enter__(self) -> PeerConn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def peer_messages(data: bytes, *, partial: bool = False) -> list[Message]:
    """Decode what a daemon sent us; with ``partial``, ignore an incomplete last frame."""
    dec = wire.FrameDecoder(READ_LIMITS)
    dec.feed(data)
    out: list[Message] = []
    while (frame := dec.next_frame()) is not None:
        out.append(wire.decode_message(frame[0], frame[1], READ_LIMITS))
    assert partial or dec.buffered == 0, f"daemon sent a truncated frame: {data[-40:]!r}"
    return out


def frame(
    mtype: int,
    body: bytes,
    *,
    version: int = wire.PROTOCOL_VERSION,
    flags: int = 0,
    length: int | None = None,
    magic: bytes = wire.MAGIC,
) -> bytes:
    """A peer frame, any header field overridable."""
    n = len(body) if length is None else length
    return struct.pack(">4sBBHI", magic, version, mtype, flags, n) + body


def hello_frame(node: str = "node-2", cluster: str = CLUSTER, **changes: Any) -> bytes:
    body = {
        "cluster": cluster,
        "node": node,
        "incarnation": 1,
        "digest": bytes(16),
        "summary": [],
    } | changes
    return frame(MessageType.HELLO, wire.pack(body))


def tick_frame(records: list[Any], *, seq: int = 1, links: list[str] | None = None) -> bytes:
    body = {
        "seq": seq,
        "digest": bytes(16),
        "match": False,
        "records": records,
        "links": links or [],
    }
    return frame(MessageType.TICK, wire.pack(body))


SENTINEL = b"XXXX" + bytes(8)
"""Bad magic: ends a connection whose input was fine with one predictable violation, so
the test knows the daemon read everything before it."""


def view(t: Target, node: int) -> tuple[bytes, tuple[tuple[str, str, int, int], ...]]:
    """The view digest and record stamps ``node`` announces in its HELLO."""
    identity = "node-2" if node == 1 else "node-1"
    with PeerConn(t, node, identity) as conn:
        (hello,) = conn.read_frames(1)
    assert isinstance(hello, Hello)
    return hello.digest, tuple(sorted(hello.summary))


def own_record(t: Target, at: int, identity: str) -> Record:
    """The signed ``job`` record of node ``at``, as it sends it to a peer."""
    with PeerConn(t, at, identity) as conn:
        conn.send(hello_frame(identity) + tick_frame([]))
        msgs = conn.read_frames(2)
    tock = msgs[1]
    assert isinstance(tock, Tock), msgs
    (rec,) = [r for r in tock.records if r.stream == STREAM and r.origin == f"node-{at}"]
    assert rec.signature, "records are signed by their origin"
    return rec


# -- the peer oracle ----------------------------------------------------------------------


@dataclass
class PeerOutcome:
    """What a daemon must do with some bytes on a fresh link (PROTOCOL.md 9 and 16)."""

    violation: str | None = None
    """The reason of the BYE and of the ``peer_rejected_`` counter, if any."""
    said_bye: bool = False
    """The input said BYE first: the daemon closes without a word."""
    complete: bool = True
    """The input ends on a frame boundary."""
    records: Counter[str] = field(default_factory=Counter)
    """``records_rejected_`` reasons the TICK's records must be counted under."""
    dangerous: bool = False
    """A record the daemon would rightly accept (the test must not send it)."""


def peer_oracle(
    data: bytes, *, identity: str, receiver: str, incarnation: int, held: Stamps
) -> PeerOutcome:
    """Run ``data`` through the sans-IO decoder and the link rules, as the acceptor
    ``receiver`` (holding records of stamps ``held``) whose peer presented
    ``identity``'s certificate."""
    out = PeerOutcome()
    dec = wire.FrameDecoder(WIRE_LIMITS)
    dec.feed(data)
    state, nudged = "HELLO_SENT", False
    members = {"node-1", "node-2"}
    while True:
        try:
            fr = dec.next_frame()
            if fr is None:
                break
            msg = wire.decode_message(fr[0], fr[1], WIRE_LIMITS)
        except RemoteProtocolError as err:
            out.violation = err.reason
            return out
        if isinstance(msg, Bye):
            out.said_bye = True
            return out
        if state == "HELLO_SENT":
            if not isinstance(msg, Hello):
                out.violation = "out_of_order"
            elif msg.cluster != CLUSTER:
                out.violation = "wrong_cluster"
            elif msg.node == receiver:
                out.violation = "self_connection"
            elif msg.node != identity:
                out.violation = "unexpected_peer"
            elif msg.node not in members:
                out.violation = "unknown_node"
            state = "WAITING"
        elif state == "WAITING":
            if not isinstance(msg, Tick) or msg.seq != 1:
                out.violation = "out_of_order"
            else:
                for rec in msg.records:
                    mine = held.get(rec.key)
                    this_life = rec.incarnation == incarnation and mine is not None
                    if rec.origin == receiver and this_life and rec.stamp <= mine:
                        continue  # "ourselves, this life": ignored, not counted
                    # Any other record of the receiver's origin is checked like all
                    # (a genuine one of a life it lost would lift it above that life).
                    if rec.origin not in members:
                        out.records["unknown_origin"] += 1
                    elif rec.origin == identity:
                        # Rests on the link's authentication: harmless only if stale.
                        if rec.stamp >= held.get(rec.key, (-1, -1)):
                            out.dangerous = True
                    else:
                        out.records["bad_signature" if rec.signature else "unsigned"] += 1
                state = "HOLDING_OR_TICK_SENT"
        elif isinstance(msg, Nudge) and not nudged:
            nudged = True
        elif isinstance(msg, Tock) and msg.seq == 2:
            out.dangerous = True  # legal only if the daemon's idle TICK came first: a race
        else:
            out.violation = "out_of_order"
        if out.violation:
            return out
    out.complete = dec.buffered == 0
    return out


def run_peer_case(
    t: Target,
    data: bytes,
    *,
    identity: str = "node-2",
    node: int = 1,
    trickle: bool = False,
    expected: Counter[str] | None = None,
) -> PeerOutcome:
    """Send ``data`` on a fresh link and check the daemon's answer against the oracle;
    add the counters it must have moved to ``expected``."""
    receiver = f"node-{node}"
    out = peer_oracle(
        data,
        identity=identity,
        receiver=receiver,
        incarnation=t.incarnation[receiver],
        held=t.held(node),
    )
    safe(not out.dangerous)
    probe = out.violation is None and not out.said_bye and out.complete
    with PeerConn(t, node, identity) as conn:
        conn.send(data + (SENTINEL if probe else b""), trickle=trickle)
        if out.violation is None and not out.said_bye and not out.complete:
            return out  # a truncated frame: nothing to say, we just hang up
        msgs = peer_messages(conn.read_until_eof())
    assert msgs and isinstance(msgs[0], Hello), msgs
    reason = "bad_magic" if probe else out.violation
    byes = [m for m in msgs if isinstance(m, Bye)]
    if reason is None:
        assert byes == [], msgs  # the peer said BYE: the daemon just closes
    else:
        assert len(byes) == 1 and msgs[-1] is byes[0], msgs
        assert byes[0].reason.startswith(f"{reason}: "), (byes[0].reason, reason)
        if expected is not None:
            expected[f"peer_rejected_{reason}"] += 1
    if expected is not None:
        for r, n in out.records.items():
            expected[f"records_rejected_{r}"] += n
    return out


def check_counters(t: Target, node: int, before: dict[str, int], expected: Counter[str]) -> None:
    """The daemon's peer and record rejection counters moved by exactly ``expected``."""
    after = t.counters(node)
    moved = Counter(
        {
            k: after.get(k, 0) - before.get(k, 0)
            for k in set(after) | set(before)
            if k.startswith(("peer_rejected_", "peer_refused_", "records_rejected_"))
            and after.get(k, 0) != before.get(k, 0)
        }
    )
    assert moved == +expected, f"counters moved {dict(moved)}, expected {dict(+expected)}"


# -- strategies: values ---------------------------------------------------------------------

NAMES = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._/-]{0,15}\Z")
BAD_NAMES = st.sampled_from(
    ["", " ", "a b", "x\n", "-x", ".x", "/", "é", "a" * 129, "\x00", "job\n", "JOB "]
)
HUGE_INTS = st.sampled_from([-1, -(2**63), 2**63 - 1, 2**63, 2**64 - 1, 2**32, -(2**31)])
INTS = st.one_of(st.integers(0, 8), HUGE_INTS, st.integers(-(2**63), 2**64 - 1))
FLOATS = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.5, 1e308, 5e-324, -1.0]),
    st.floats(),
)
SCALARS = st.one_of(
    st.none(), st.booleans(), INTS, FLOATS, st.text(max_size=12), st.binary(max_size=12)
)
VALUES = st.recursive(
    SCALARS,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=6), st.integers(-3, 3)), kids, max_size=4),
    ),
    max_leaves=10,
)
"""Anything msgpack can carry, of any type, in any place."""


def safe(ok: bool) -> None:
    """Discard an input that could legitimately change state (an explicit one is a bug
    of the test)."""
    if currently_in_test_context():
        assume(ok)
    assert ok, "this input could change state"


def either(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a well-typed value, often a hostile one."""
    return st.one_of(good, good, INTS, FLOATS, VALUES)


# -- strategies: local API -------------------------------------------------------------------

OP_ARGS: dict[str, tuple[str, ...]] = {
    "status": (),
    "streams": (),
    "declare": ("spec", "allow_unknown_members"),
    "undeclare": ("stream",),
    "commit": ("stream", "rank", "domain", "epoch", "digest", "size"),
    "retract": ("stream", "rank", "domain", "epoch"),
    "retire": ("stream", "rank", "domain", "epoch"),
    "state": ("stream",),
    "wait": ("stream", "epoch", "timeout"),
    "restore_point": ("stream", "generation", "timeout"),
    "next_generation": ("stream", "timeout"),
    "watch": ("stream",),
    "drain": ("node", "streams", "checkpoint", "timeout", "versions"),
    "drill": ("stream", "epoch", "domain"),
    "report_version": ("component", "running", "accepts"),
    "versions": ("stream",),
    "note_rollout": ("text",),
    "report_save": ("stream", "rank", "blocking_s", "interval_s"),
    "cancel": ("target",),
}
assert set(OP_ARGS) == set(codec.OPS)


@st.composite
def specs(draw: st.DrawFn) -> Any:
    """The declared spec with one part broken or changed (or anything at all)."""
    spec = json.loads(json.dumps(SPEC))
    part = draw(
        st.sampled_from(
            [
                "name",
                "members",
                "policy",
                "retention",
                "extra",
                "drop",
                "domains",
                "mode",
                "ranks",
                "whole",
            ]
        )
    )
    if part == "whole":
        return draw(VALUES)
    if part == "extra":
        spec[draw(st.text(max_size=6))] = draw(VALUES)
    elif part == "drop":
        spec.pop(draw(st.sampled_from(sorted(spec))))
    elif part == "domains":
        spec["policy"]["domains"] = draw(either(st.lists(st.one_of(NAMES, BAD_NAMES), max_size=20)))
    elif part == "mode":
        spec["policy"]["mode"] = draw(either(st.sampled_from(["all", "any", "ALL", "none"])))
    elif part == "ranks":
        spec["members"]["node-2"] = draw(either(st.lists(INTS, max_size=4)))
    elif part == "name":
        spec["name"] = draw(st.one_of(BAD_NAMES, VALUES, st.just(STREAM)))
    elif part == "members":
        spec["members"] = draw(
            either(
                st.dictionaries(st.one_of(NAMES, BAD_NAMES), st.lists(INTS, max_size=3), max_size=3)
            )
        )
    else:
        spec[part] = draw(VALUES)
    return spec


GOOD_ARGS: dict[str, st.SearchStrategy[Any]] = {
    "stream": NAMES,
    "domain": NAMES,
    "rank": st.integers(0, 4),
    "epoch": st.integers(0, 10),
    "generation": st.integers(0, 4),
    "size": st.integers(0, 2**40),
    "digest": st.text(max_size=300),
    "allow_unknown_members": st.booleans(),
    "timeout": st.one_of(st.none(), st.floats(0, 0.2), st.just(604801)),
    "target": st.integers(0, 8),
    "spec": specs(),
    "node": st.one_of(st.just("node-1"), NAMES),
    "streams": st.lists(NAMES, max_size=3),
    "checkpoint": st.booleans(),
    "versions": st.dictionaries(NAMES, st.text(max_size=10), max_size=3),
    "component": st.one_of(st.just("driver"), NAMES),
    "running": st.text(max_size=10),
    "accepts": st.lists(st.text(max_size=10), max_size=3),
    "text": st.text(max_size=20),
    "blocking_s": st.floats(0, 1e7),
    "interval_s": st.one_of(st.none(), st.floats(0, 1e7)),
}
BAD_VALUES = st.one_of(BAD_NAMES, INTS, FLOATS, VALUES)


@st.composite
def request_objs(draw: st.DrawFn, rid: int | None = None) -> Any:
    """A request map: a valid one with zero, one or two fields spoilt, or worse."""
    op = draw(st.sampled_from(codec.OPS)) if draw(st.integers(0, 7)) < 7 else draw(VALUES)
    names = OP_ARGS.get(op, ()) if isinstance(op, str) else ()
    args: dict[Any, Any] = {n: draw(GOOD_ARGS[n]) for n in names if draw(st.integers(0, 5)) < 5}
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2]))):
        key = draw(st.sampled_from(sorted(args))) if args and draw(st.booleans()) else None
        args[key if key is not None else draw(st.text(max_size=8))] = draw(BAD_VALUES)
    good_id = st.integers(0, 99) if rid is None else st.just(rid)
    obj: dict[Any, Any] = {
        "id": draw(good_id) if draw(st.integers(0, 5)) < 5 else draw(BAD_VALUES),
        "op": op,
        "args": args,
    }
    roll = draw(st.integers(0, 19))  # hypothesis favours 0: that is the common case
    if roll == 16:
        obj.pop(draw(st.sampled_from(["id", "op", "args"])))
    elif roll == 17:
        obj[draw(st.one_of(st.text(max_size=6), st.integers(0, 3)))] = draw(VALUES)
    elif roll == 18:
        obj["args"] = draw(VALUES)
    elif roll == 19:
        return draw(VALUES)
    return obj


def pk(obj: Any) -> bytes:
    return bytes(msgpack.packb(obj, use_bin_type=True))


def map_header(n: int) -> bytes:
    return bytes([0x80 | n]) if n < 16 else b"\xde" + struct.pack(">H", n)


RAW_TOKENS = [
    b"\xca" + struct.pack(">f", math.nan),  # float32 NaN
    b"\xca" + struct.pack(">f", math.inf),
    b"\xcb" + struct.pack(">d", -math.inf),
    b"\xcf" + b"\xff" * 8,  # uint64 max
    b"\xd3\x80" + bytes(7),  # int64 min
    b"\xd0\xff",  # int8 -1
    b"\xd4\x01\x00",  # fixext 1
    b"\xc7\x00\x05",  # ext 8, empty
    b"\xc1",  # never used
    b"\xa2\xff\xfe",  # invalid UTF-8
    b"\xc4\x03job",  # bin, not str
    b"\xdf\xff\xff\xff\xff",  # map 32 claiming 4G entries
    b"\xdd\xff\xff\xff\xff",  # array 32 claiming 4G items
    b"\xdb\xff\xff\xff\xff",  # str 32 claiming 4 GB
    b"\xc6\xff\xff\xff\xff",  # bin 32 claiming 4 GB
    b"\x81\x01\x02",  # integer map key
    b"\x81\xc0\x00",  # nil map key
    b"\x81\x91\x00\x00",  # array map key
    b"\xc0",
    b"\xc3",
]


@st.composite
def hand_built_bodies(draw: st.DrawFn) -> bytes:
    """msgpack no library would write: duplicate keys, deep nesting, raw oddities."""
    rid = pk(draw(st.integers(1000, 1010)))
    kind = draw(st.sampled_from(["dup_top", "dup_args", "deep", "raw", "trailing", "scalar"]))
    if kind == "dup_top":
        entries = [(pk("id"), rid), (pk("op"), pk("status")), (pk("args"), pk({}))]
        key, _ = draw(st.sampled_from(entries))
        entries.insert(draw(st.integers(0, 3)), (key, pk(draw(VALUES))))
        return map_header(len(entries)) + b"".join(k + v for k, v in entries)
    if kind == "dup_args":
        args = map_header(2) + pk("stream") + pk("a") + pk("stream") + pk("b")
        return map_header(3) + pk("id") + rid + pk("op") + pk("state") + pk("args") + args
    if kind == "deep":
        depth = draw(st.integers(1, 5000))
        opener = draw(st.sampled_from([b"\x91", b"\x81\xa1k", b"\xdc\x00\x01"]))
        nested = opener * depth + b"\xc0"
        where = draw(st.sampled_from(["stream", "args", "id"]))
        if where == "args":
            return map_header(3) + pk("id") + rid + pk("op") + pk("state") + pk("args") + nested
        if where == "id":
            return map_header(2) + pk("id") + nested + pk("op") + pk("status")
        args = map_header(1) + pk("stream") + nested
        return map_header(3) + pk("id") + rid + pk("op") + pk("state") + pk("args") + args
    if kind == "raw":
        token = draw(st.sampled_from(RAW_TOKENS))
        where = draw(st.sampled_from(["id", "op", "args", "stream", "epoch", "timeout", "key"]))
        fields = {
            "id": rid,
            "op": pk("wait"),
            "args": map_header(3)
            + pk("stream")
            + pk("nope")
            + pk("epoch")
            + pk(1)
            + pk("timeout")
            + pk(0),
        }
        if where in fields:
            fields[where] = token
        elif where == "key":
            return map_header(2) + pk("id") + rid + token
        else:
            args = {"stream": pk("nope"), "epoch": pk(1), "timeout": pk(0)}
            args[where] = token
            fields["args"] = map_header(3) + b"".join(pk(k) + v for k, v in args.items())
        return map_header(3) + b"".join(pk(k) + v for k, v in fields.items())
    if kind == "trailing":
        req = pk({"id": 1001, "op": "status"})
        return req + draw(st.sampled_from([b"\xc0", req, b"\x00", b"\xa1"]))
    return pk(draw(SCALARS))


LEN = struct.Struct(">I")


@st.composite
def unix_frames(draw: st.DrawFn, body: bytes) -> bytes:
    """``body`` framed, mostly right, sometimes with a lying or oversized length."""
    how = draw(st.sampled_from(["exact"] * 8 + ["short", "long", "huge", "zero", "cut"]))
    if how == "exact":
        return LEN.pack(len(body)) + body
    if how == "short" and body:
        return LEN.pack(draw(st.integers(0, len(body) - 1))) + body
    if how == "long":
        return LEN.pack(len(body) + draw(st.integers(1, 64))) + body
    if how == "huge":
        return (
            LEN.pack(draw(st.one_of(st.just(MAX_FRAME + 1), st.integers(MAX_FRAME + 1, 2**32 - 1))))
            + body
        )
    if how == "zero":
        return LEN.pack(0) + body
    whole = LEN.pack(len(body)) + body
    return whole[: draw(st.integers(0, len(whole) - 1))]


@st.composite
def unix_cases(draw: st.DrawFn, *, many: bool) -> tuple[bytes, bool]:
    """(bytes for one connection, send them one byte at a time)."""
    count = draw(st.integers(2, 5)) if many else 1
    parts = []
    for i in range(count):
        requests = request_objs(rid=i + 1 if many else None).map(pk)
        body = draw(
            st.one_of(requests, requests, requests, hand_built_bodies(), st.binary(max_size=40))
        )
        parts.append(
            draw(unix_frames(body)) if not many or i == count - 1 else LEN.pack(len(body)) + body
        )
    if draw(st.integers(0, 9)) == 9:
        parts.append(draw(st.binary(min_size=1, max_size=16)))
    data = b"".join(parts)
    trickle = len(data) <= 300 and draw(st.integers(0, 7)) == 7
    return data, trickle


# -- the local API oracle --------------------------------------------------------------------

TASK_OPS = {"status", "streams", "state", "versions", "wait", "restore_point", "next_generation",
            "watch", "drain", "drill"}  # fmt: skip


@dataclass
class Expect:
    """One reply the daemon owes: its id and the outcomes allowed (``ok`` or
    ``kind/reason``; ``kind/*`` for any reason)."""

    id: int | None
    outcomes: set[str]
    optional: bool = False
    task: bool = False
    """A request served by a task of its own (its id stays in flight a while)."""


def request_expectation(obj: Any, earlier_tasks: set[int], cancels: bool) -> Expect | None:
    """What one decoded request must get; None when it could change state."""
    try:
        req = codec.parse_request(obj)
    except ApiError as err:
        return Expect(err.request_id, {f"{err.kind.value}/{err.reason}"})
    stream = req.args.get("stream")
    if req.op in ("status", "streams", "cancel"):
        outcomes = {"ok"}
    elif req.op == "state" or (req.op == "versions" and stream is not None):
        outcomes = {"ok"} if stream == STREAM else {"rejected/unknown_stream"}
    elif req.op == "versions":
        outcomes = {"ok"}
    elif req.op == "report_version":
        outcomes = {"rejected/*"}  # the target has no catalogue: nothing to report
    elif req.op == "note_rollout":
        return None  # a note is kept: it changes what versions answers
    elif req.op == "report_save" and stream == STREAM:
        return None  # a save is kept: it changes the stream's state
    elif req.op == "drain":
        if req.args["node"] != "node-1":
            outcomes = {"rejected/wrong_node"}
        elif any(s != STREAM for s in req.args["streams"]):
            outcomes = {"rejected/unknown_stream"}
        else:
            return None  # a drain of the target's own stream: it may wait
    elif req.op == "next_generation" and stream != STREAM:
        outcomes = {"ok"}  # a spare asks before it declares: answered from the records
    elif req.op == "declare":
        spec = req.args["fact"].spec
        if spec.name != STREAM:
            return None  # would declare a new stream
        same = spec.to_wire() == SPEC
        outcomes = {"ok"} if same else {"rejected/*"}
    else:
        fact = req.args.get("fact")
        if (fact.stream if fact is not None else stream) == STREAM:
            return None  # a commit, a wait or a freeze on the real stream
        outcomes = {"rejected/unknown_stream"}
    if req.id in earlier_tasks:
        outcomes.add("bad_request/duplicate_id")
    if cancels and req.op in TASK_OPS:
        outcomes.add("unavailable/cancelled")
    return Expect(req.id, outcomes, task=req.op in TASK_OPS)


def unix_oracle(data: bytes) -> list[Expect] | None:
    """Every reply ``data`` must get before the daemon closes (None: unsafe input)."""
    objs: list[Any] = []
    fatal: str | None = None
    pos = 0
    while len(data) - pos >= LEN.size:
        (n,) = LEN.unpack_from(data, pos)
        if n > MAX_FRAME:
            fatal = "frame_too_large"
            break
        if len(data) - pos - LEN.size < n:
            break  # truncated: the daemon waits for the rest, then sees the end
        one = data[pos : pos + LEN.size + n]
        pos += LEN.size + n
        try:
            objs.extend(codec.FrameReader(MAX_FRAME).feed(one))
        except ApiError as err:
            fatal = err.reason
            break
    cancels = any(isinstance(o, dict) and o.get("op") == "cancel" for o in objs)
    out: list[Expect] = []
    tasks: set[int] = set()
    for obj in objs:
        e = request_expectation(obj, tasks, cancels)
        if e is None:
            return None
        if e.task and e.id is not None:
            tasks.add(e.id)
        out.append(e)
    if fatal is not None:
        # Frames read together with the fatal one may be dropped unanswered (see
        # test_requests_before_a_fatal_frame_in_the_same_read_are_answered).
        for e in out:
            e.optional = True
        out.append(Expect(None, {f"bad_request/{fatal}"}))
    return out


def unix_exchange(path: Path, data: bytes, trickle: bool) -> list[Any]:
    """Send ``data`` on a fresh connection, half-close, read every reply until the
    daemon closes (within IO_TIMEOUT)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(IO_TIMEOUT)
    try:
        s.connect(str(path))
        try:
            if trickle:
                for i in range(len(data)):
                    s.sendall(data[i : i + 1])
            else:
                s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon hung up on a fatal frame while we were still sending
        buf = bytearray()
        deadline = time.monotonic() + IO_TIMEOUT
        while True:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            except TimeoutError:
                raise AssertionError(
                    f"the daemon kept the connection open for {IO_TIMEOUT} s"
                ) from None
            if not chunk:
                break
            buf += chunk
    finally:
        s.close()
    reader = codec.FrameReader(64 << 20)
    replies = reader.feed(bytes(buf))
    assert reader.buffered == 0, f"a truncated reply: {bytes(buf[-60:])!r}"
    return replies


KINDS = {k.value for k in ErrorKind}


def outcome_of(reply: Any) -> tuple[Any, str]:
    """(id, ``ok`` or ``kind/reason``) of a reply, checking its shape."""
    assert isinstance(reply, dict), reply
    rid = reply.get("id")
    assert rid is None or type(rid) is int, reply
    if "ok" in reply:
        assert set(reply) == {"id", "ok"}, reply
        return rid, "ok"
    assert set(reply) == {"id", "error"}, reply
    err = reply["error"]
    assert isinstance(err, dict) and set(err) == {"kind", "reason", "message"}, reply
    assert err["kind"] in KINDS, reply
    assert isinstance(err["reason"], str) and err["reason"], reply
    assert isinstance(err["message"], str) and err["message"], reply
    return rid, f"{err['kind']}/{err['reason']}"


def matches(outcome: str, allowed: set[str]) -> bool:
    return outcome in allowed or f"{outcome.split('/', 1)[0]}/*" in allowed


def run_unix_case(t: Target, data: bytes, trickle: bool, seen: Counter[str]) -> None:
    """One connection; every reply predicted, typed, and tallied into ``seen``."""
    expects = unix_oracle(data)
    safe(expects is not None)
    assert expects is not None
    replies = unix_exchange(t.cluster.socket_path(1), data, trickle)
    owed = list(expects)
    for reply in replies:
        rid, outcome = outcome_of(reply)
        for e in owed:
            if e.id == rid and type(e.id) is type(rid) and matches(outcome, e.outcomes):
                owed.remove(e)
                break
        else:
            raise AssertionError(f"unexpected reply {reply}; owed {owed}")
        if outcome != "ok":
            seen[outcome.split("/", 1)[1]] += 1
    missing = [e for e in owed if not e.optional]
    assert not missing, f"no reply for {missing}; got {replies}"


def api_errors(before: dict[str, int], after: dict[str, int]) -> Counter[str]:
    return counter_delta(before, after, "api_errors_")


# -- the local socket ------------------------------------------------------------------------


def test_unix_single_requests_get_typed_errors_and_are_counted(target: Target) -> None:
    before = target.counters(1)
    seen: Counter[str] = Counter()

    @settings(SETTINGS, max_examples=700)
    @given(case=unix_cases(many=False))
    def one(case: tuple[bytes, bool]) -> None:
        run_unix_case(target, case[0], case[1], seen)

    one()
    assert api_errors(before, target.counters(1)) == seen
    assert seen["bad_request"] and seen["undecodable"] and seen["frame_too_large"]
    undisturbed(target)


def test_unix_pipelined_frames_are_each_answered(target: Target) -> None:
    before = target.counters(1)
    seen: Counter[str] = Counter()

    @settings(SETTINGS, max_examples=400)
    @given(case=unix_cases(many=True))
    def one(case: tuple[bytes, bool]) -> None:
        run_unix_case(target, case[0], case[1], seen)

    one()
    assert api_errors(before, target.counters(1)) == seen
    undisturbed(target)


@st.composite
def hand_built_cases(draw: st.DrawFn) -> tuple[bytes, bool]:
    data = draw(unix_frames(draw(hand_built_bodies())))
    return data, len(data) <= 300 and draw(st.integers(0, 7)) == 7


def test_unix_hand_built_msgpack_is_refused_cleanly(target: Target) -> None:
    before = target.counters(1)
    seen: Counter[str] = Counter()

    @settings(SETTINGS, max_examples=500)
    @given(case=hand_built_cases())
    def one(case: tuple[bytes, bool]) -> None:
        run_unix_case(target, case[0], case[1], seen)

    one()
    assert api_errors(before, target.counters(1)) == seen
    assert seen["undecodable"]
    undisturbed(target)


def test_unix_oversized_frames_are_refused_before_their_body(target: Target) -> None:
    before = target.counters(1)
    seen: Counter[str] = Counter()
    nils = b"\xdd" + LEN.pack(MAX_FRAME - 5) + b"\xc0" * (MAX_FRAME - 5)  # 1 MiB of nils
    for data in (
        LEN.pack(2**32 - 1),  # the header alone: refused at once
        LEN.pack(MAX_FRAME + 1) + b"\x80" * 100,
        LEN.pack(len(nils)) + nils,  # exactly the limit: read, then refused by msgpack
    ):
        run_unix_case(target, data, False, seen)
    assert seen == Counter({"frame_too_large": 2, "undecodable": 1})
    assert api_errors(before, target.counters(1)) == seen
    undisturbed(target)


def test_conflicting_declare_is_rejected_and_changes_nothing(target: Target) -> None:
    before = target.counters(1)
    other = json.loads(json.dumps(SPEC)) | {"retention": 5}
    seen: Counter[str] = Counter()
    for spec in (other, {**SPEC, "members": {"node-1": [0, 1]}}):
        data = LEN.pack(len(pk({"id": 1, "op": "declare", "args": {"spec": spec}})))
        data += pk({"id": 1, "op": "declare", "args": {"spec": spec}})
        run_unix_case(target, data, False, seen)
    assert seen == Counter({"spec_conflict": 2})
    assert api_errors(before, target.counters(1)) == seen
    undisturbed(target)


def test_requests_before_a_fatal_frame_in_the_same_read_are_answered(target: Target) -> None:
    good = pk({"id": 7, "op": "state", "args": {"stream": "nope"}})
    data = LEN.pack(len(good)) + good + LEN.pack(MAX_FRAME + 1)
    replies = unix_exchange(target.cluster.socket_path(1), data, False)
    assert Counter(outcome_of(r) for r in replies) == Counter(
        [(None, "bad_request/frame_too_large"), (7, "rejected/unknown_stream")]
    )


# -- strategies: peer port -------------------------------------------------------------------

STRANGERS: dict[str, NodeIdentity] = {}
"""Fresh keys that sign records in other nodes' names: not the keys the trust list holds."""


def stranger(origin: str) -> NodeIdentity:
    if origin not in STRANGERS:
        STRANGERS[origin] = NodeIdentity.generate(origin)
    return STRANGERS[origin]


ORIGINS = ["node-1", "node-2", "node-9", "mallory", "node-1x"]
SPEC_DIGESTS = [bytes(32), bytes(range(32)), b"\xff" * 32]


@st.composite
def interval_sets(draw: st.DrawFn) -> IntervalSet:
    return IntervalSet(
        (lo, lo + n)
        for lo, n in draw(st.lists(st.tuples(st.integers(0, 100), st.integers(0, 5)), max_size=3))
    )


@st.composite
def forged_records(draw: st.DrawFn, t: Target, receiver: str, identity: str) -> list[Any]:
    """The wire form of a record ``receiver`` must not take: forged, of an unknown origin,
    stale (from the link's own node, which the link vouches for), or the receiver's own;
    sometimes with one field spoilt."""
    origin = draw(st.sampled_from(ORIGINS))
    stream = draw(st.sampled_from([STREAM, "other"]))
    incarnation = draw(st.integers(0, 2**63 - 1))
    if origin == identity:
        stream, incarnation = STREAM, 0  # stale: the real one is at incarnation >= 1
    elif origin == receiver:
        incarnation = draw(st.sampled_from([0, 0, t.incarnation[receiver], 2**63 - 1]))
    rec = Record(
        stream,
        origin,
        incarnation,
        draw(st.integers(0, 2**63 - 1)),
        draw(st.sampled_from(SPEC_DIGESTS)),
        draw(interval_sets()),
        tuple(
            (d, draw(st.integers(0, 100)))
            for d in draw(st.lists(st.sampled_from(["gpu", "nvme", "s3"]), unique=True).map(sorted))
        ),
        draw(st.one_of(st.none(), st.integers(0, 100))),
        draw(st.one_of(st.none(), st.integers(0, 100))),
        draw(st.one_of(st.none(), st.integers(0, 100))),
        tuple(
            (g, draw(interval_sets()))
            for g in draw(st.lists(st.integers(0, 5), unique=True, max_size=2).map(sorted))
        ),
    )
    how = draw(st.sampled_from(["unsigned", "stranger", "random", "borrowed"]))
    if how == "stranger" and origin in ORIGINS[:4]:
        rec = stranger(origin).sign_record(rec)
    elif how == "random":
        rec = Record(
            *[getattr(rec, f) for f in Record.__slots__[:11]],
            signature=draw(st.binary(min_size=64, max_size=64)),
        )
    elif how == "borrowed":  # a real signature, of another body
        sig = t.old_records[draw(st.sampled_from(["node-1", "node-2"]))].signature
        rec = Record(*[getattr(rec, f) for f in Record.__slots__[:11]], signature=sig)
    out = rec.to_wire()
    if draw(st.integers(0, 9)) == 9:
        out[draw(st.integers(0, 11))] = draw(BAD_VALUES)
    return out


@st.composite
def tick_bodies(draw: st.DrawFn, t: Target, receiver: str, identity: str) -> bytes:
    """A TICK body: mostly well-formed around forged records, sometimes spoilt."""
    body: dict[Any, Any] = {
        "seq": 1,
        "digest": draw(st.binary(min_size=16, max_size=16)),
        "match": draw(st.booleans()),
        "records": draw(st.lists(forged_records(t, receiver, identity), min_size=1, max_size=5)),
        "links": draw(st.lists(st.sampled_from(ORIGINS), max_size=3)),
    }
    roll = draw(st.integers(0, 9))
    if roll >= 8:
        key = draw(st.sampled_from(sorted(body)))
        body[key] = draw(st.one_of(BAD_VALUES, st.integers(0, 3)))
    elif roll == 7:
        if draw(st.booleans()):
            body.pop(draw(st.sampled_from(sorted(body))))
        else:
            body[draw(st.text(max_size=6))] = draw(VALUES)
    return pk(body)


@st.composite
def good_hellos(draw: st.DrawFn, node: str) -> bytes:
    summary = draw(
        st.lists(
            st.tuples(
                st.sampled_from([STREAM, "other"]),
                st.sampled_from(ORIGINS),
                st.integers(0, 5),
                st.integers(0, 10**6),
            ).map(list),
            max_size=3,
        )
    )
    return hello_frame(
        node,
        incarnation=draw(st.integers(0, 2**63 - 1)),
        summary=summary,
        digest=draw(st.binary(min_size=16, max_size=16)),
    )


@st.composite
def peer_frames(draw: st.DrawFn, identity: str) -> bytes:
    """One frame of any kind, right or wrong, or bytes that are no frame at all."""
    kind = draw(
        st.sampled_from(
            ["hello", "hello", "hello_body", "header", "other_type", "hand_built", "garbage"]
        )
    )
    if kind == "hello":
        node = draw(st.sampled_from([identity, identity, "node-1", "node-2", "node-3", "node-9"]))
        cluster = draw(st.sampled_from([CLUSTER, CLUSTER, "other", "LOCAL"]))
        return hello_frame(node, cluster)
    if kind == "hello_body":
        body: dict[Any, Any] = {
            "cluster": CLUSTER,
            "node": identity,
            "incarnation": 1,
            "digest": bytes(16),
            "summary": [],
        }
        key = draw(st.one_of(st.sampled_from(sorted(body)), st.text(max_size=5)))
        if draw(st.booleans()) and key in body:
            body.pop(key)
        else:
            body[key] = draw(BAD_VALUES)
        return frame(MessageType.HELLO, pk(body))
    if kind == "header":  # one header field wrong
        body = hello_frame(identity)[wire.HEADER_SIZE :]
        spoil = draw(st.sampled_from(["type", "version", "flags", "length", "magic"]))
        header: dict[str, Any] = {
            "type": draw(st.sampled_from([0, 6, 255])) if spoil == "type" else 1,
            "version": draw(st.sampled_from([0, 1, 4, 255]))
            if spoil == "version"
            else wire.PROTOCOL_VERSION,
            "flags": draw(st.sampled_from([1, 0x8000])) if spoil == "flags" else 0,
            "magic": draw(st.sampled_from([b"CVGE", b"HTTP", bytes(4), b"cvgd"]))
            if spoil == "magic"
            else wire.MAGIC,
        }
        length = None
        if spoil == "length":
            length = draw(
                st.one_of(
                    st.integers(0, 2**32 - 1),
                    st.just(wire.DEFAULT_MAX_FRAME + 1),
                    st.integers(0, len(body) + 8),
                )
            )
        return frame(
            header["type"],
            body,
            version=header["version"],
            flags=header["flags"],
            length=length,
            magic=header["magic"],
        )
    if kind == "other_type":
        msg = draw(
            st.sampled_from(
                [
                    Tick(1, bytes(16), False, ()),
                    Tock(1, bytes(16), False, ()),
                    Nudge(),
                    Tick(7, bytes(16), True, (), ("node-1",)),
                    Bye("bye"),
                ]
            )
        )
        return wire.encode_message(msg)
    if kind == "hand_built":
        body_bytes = draw(hand_built_bodies())
        return frame(draw(st.sampled_from([1, 2, 3, 4, 5])), body_bytes)
    return draw(st.binary(min_size=1, max_size=40))


@st.composite
def handshake_cases(draw: st.DrawFn) -> tuple[str, bytes, bool]:
    """(certificate, bytes, trickle) for the first moments of a link."""
    identity = draw(st.sampled_from(["node-2", "node-2", "node-2", "node-9", "node-1"]))
    data = b"".join(draw(st.lists(peer_frames(identity), min_size=1, max_size=3)))
    if draw(st.integers(0, 4)) == 4:
        data = data[: draw(st.integers(0, len(data)))]
    trickle = len(data) <= 200 and draw(st.integers(0, 5)) == 5
    return identity, data, trickle


# -- the peer port ------------------------------------------------------------------------


HELLO_BODY = hello_frame()[wire.HEADER_SIZE :]
HANDSHAKE_EXAMPLES = [
    ("node-2", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),  # bad_magic
    ("node-2", frame(1, HELLO_BODY, version=4)),  # unsupported_version
    ("node-2", frame(1, HELLO_BODY, version=1)),  # a downgrade: unsupported_version
    ("node-2", frame(9, HELLO_BODY)),  # unknown_type
    ("node-2", frame(1, HELLO_BODY, flags=1)),  # bad_flags
    ("node-2", frame(1, b"", length=wire.DEFAULT_MAX_FRAME + 1)),  # frame_too_large
    ("node-2", frame(1, b"\xc1")),  # malformed_body
    ("node-2", frame(1, pk({}))),  # invalid_field
    ("node-2", wire.encode_message(Nudge())),  # out_of_order: before HELLO
    ("node-2", hello_frame() + hello_frame()),  # out_of_order: HELLO again
    ("node-2", hello_frame(cluster="other")),  # wrong_cluster
    ("node-2", hello_frame("node-1")),  # self_connection
    ("node-2", hello_frame("node-3")),  # unexpected_peer: not what the certificate says
    ("node-9", hello_frame("node-9")),  # unknown_node: a certificate, but no member
    ("node-2", hello_frame() + wire.encode_message(Bye("bye"))),  # a polite goodbye
]


def test_peer_handshake_garbage_is_refused_with_a_bye_and_counted(target: Target) -> None:
    before = target.counters(1)
    expected: Counter[str] = Counter()
    reasons: Counter[str] = Counter()

    @settings(SETTINGS, max_examples=350)
    @given(case=handshake_cases())
    def one(case: tuple[str, bytes, bool]) -> None:
        identity, data, trickle = case
        out = run_peer_case(target, data, identity=identity, trickle=trickle, expected=expected)
        reasons[out.violation or ("bye" if out.said_bye else "fine")] += 1

    for identity, data in HANDSHAKE_EXAMPLES:
        one = example(case=(identity, data, False))(one)
    one()
    check_counters(target, 1, before, expected)
    wanted = {
        "bad_magic",
        "unsupported_version",
        "unknown_type",
        "bad_flags",
        "frame_too_large",
        "malformed_body",
        "invalid_field",
        "out_of_order",
        "wrong_cluster",
        "self_connection",
        "unexpected_peer",
        "unknown_node",
        "bye",
        "fine",
    }
    assert wanted <= set(reasons), f"not exercised: {wanted - set(reasons)}"
    undisturbed(target)


@st.composite
def tick_cases(draw: st.DrawFn, t: Target, node: int) -> tuple[bytes, bool]:
    """A proper HELLO, a TICK with forged records, maybe one more message."""
    receiver, identity = f"node-{node}", f"node-{3 - node}"
    data = draw(good_hellos(identity))
    data += frame(MessageType.TICK, draw(tick_bodies(t, receiver, identity)))
    extra = draw(
        st.sampled_from(
            ["none", "none", "nudge", "nudge2", "tick", "hello", "tock", "bye", "garbage"]
        )
    )
    data += {
        "none": b"",
        "nudge": wire.encode_message(Nudge()),
        "nudge2": wire.encode_message(Nudge()) * 2,
        "tick": wire.encode_message(Tick(2, bytes(16), False, ())),
        "hello": hello_frame(identity),
        "tock": wire.encode_message(Tock(9, bytes(16), False, ())),
        "bye": wire.encode_message(Bye("done")),
        "garbage": b"\x00garbage",
    }[extra]
    trickle = len(data) <= 600 and draw(st.integers(0, 7)) == 7
    return data, trickle


def altered(rec: Record, **changes: Any) -> Record:
    """``rec`` with fields changed (and its caches dropped); the signature is kept
    unless changed too."""
    return dataclasses.replace(rec, _fingerprint=b"", _packed=b"", **changes)


def forged_examples(t: Target, node: int) -> bytes:
    """One of each kind of record that must be refused or ignored, then a NUDGE."""
    receiver, identity = f"node-{node}", f"node-{3 - node}"
    rec = t.old_records[receiver]
    past = altered(rec, incarnation=0, signature=b"")  # the receiver's past life
    records = [
        past,  # unsigned
        stranger(receiver).sign_record(past),  # bad_signature: not the trusted key
        altered(rec, incarnation=0),  # bad_signature: a real signature, tampered body
        stranger("mallory").sign_record(altered(past, origin="mallory")),  # unknown_origin
        rec,  # the receiver's own, this life: ignored
        altered(t.old_records[identity], incarnation=0),  # the link's node, stale: ignored
    ]
    return (
        hello_frame(identity)
        + tick_frame([r.to_wire() for r in records])
        + wire.encode_message(Nudge())
    )


@pytest.mark.parametrize(("node", "examples"), [(1, 250), (2, 100)])
def test_peer_forged_and_stale_records_change_nothing_and_are_counted(
    target: Target, node: int, examples: int
) -> None:
    before = target.counters(node)
    expected: Counter[str] = Counter()

    @settings(SETTINGS, max_examples=examples)
    @given(case=tick_cases(target, node))
    @example(case=(forged_examples(target, node), False))
    @example(case=(forged_examples(target, node), True))
    def one(case: tuple[bytes, bool]) -> None:
        run_peer_case(
            target,
            case[0],
            identity=f"node-{3 - node}",
            node=node,
            trickle=case[1],
            expected=expected,
        )

    one()
    check_counters(target, node, before, expected)
    assert expected["records_rejected_unsigned"] and expected["records_rejected_bad_signature"]
    assert expected["records_rejected_unknown_origin"] and expected["peer_rejected_invalid_field"]
    undisturbed(target)


# -- certificates and slow peers ---------------------------------------------------------


def issue_without_node_id(ca_dir: Path, out_dir: Path) -> tuple[Path, Path]:
    """A certificate of the cluster CA that names no node (a DNS name only)."""
    ca_cert, ca_key = pki.load_ca(ca_dir)
    key = ec.generate_private_key(ec.SECP256R1())
    start = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = out_dir / "anon.crt", out_dir / "anon.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    os.chmod(key_path, 0o600)
    return cert_path, key_path


def refused_connection(t: Target, ctx: ssl.SSLContext | None) -> bytes:
    """Try a link with ``ctx`` (None: plaintext) and say HELLO; what the daemon sent."""
    sock = socket.create_connection(("127.0.0.1", t.port(1)), timeout=IO_TIMEOUT)
    received = bytearray()
    try:
        if ctx is not None:
            sock = ctx.wrap_socket(sock)  # closes the plain one on failure
        sock.sendall(hello_frame())
        while chunk := sock.recv(65536):
            received += chunk
    except (OSError, ssl.SSLError):
        pass  # refused: an alert, a reset, or the end of the stream
    finally:
        sock.close()
    return bytes(received)


def test_untrusted_tls_peers_are_refused_in_the_handshake_and_counted(target: Target) -> None:
    before = target.counters(1)
    ca_dir = target.cluster.dir / "ca"
    ca = ca_dir / "ca.crt"
    member = pki.node_files(target.cluster.dir / "node-2" / "tls", "node-2")
    with tempfile.TemporaryDirectory() as tmp:
        other_ca = Path(tmp) / "rogue-ca"
        pki.init_ca(other_ca, name="rogue CA")
        rogue = pki.issue(other_ca, "node-2")  # the right name, the wrong CA
        expired = pki.issue(
            ca_dir,
            "node-2",
            days=1,
            out_dir=Path(tmp) / "expired",
            valid_from=dt.datetime.now(dt.UTC) - dt.timedelta(days=10),
        )
        no_cert = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        no_cert.check_hostname = False
        no_cert.load_verify_locations(cafile=str(ca))
        attempts: dict[str, ssl.SSLContext | None] = {
            "another CA": client_context(rogue.cert, rogue.key, ca),
            "expired": client_context(expired.cert, expired.key, ca),
            "no certificate": no_cert,
            "TLS 1.2": client_context(member.cert, member.key, ca, tls12=True),
            "plaintext": None,
        }
        for what, ctx in attempts.items():
            got = refused_connection(target, ctx)
            assert wire.MAGIC not in got, f"{what}: the daemon spoke to an unauthenticated peer"
        anon_cert, anon_key = issue_without_node_id(ca_dir, Path(tmp) / "anon")
        got = refused_connection(target, client_context(anon_cert, anon_key, ca))
        assert wire.MAGIC not in got, "a certificate naming no node got a HELLO"

    want = Counter(
        {"peer_refused_tls_handshake_failed": len(attempts), "peer_refused_tls_no_node_id": 1}
    )
    until(
        lambda: counter_delta(before, target.counters(1), "") >= want,
        timeout=5,
        what=f"counters {dict(want)}",
    )
    check_counters(target, 1, before, want)
    undisturbed(target)


def slow_peer(t: Target, how: str, result: dict[str, Any]) -> None:
    """One slowloris connection; records how long the daemon let it live and what it
    said."""
    t0 = time.monotonic()
    sock = socket.create_connection(("127.0.0.1", t.port(1)), timeout=HANDSHAKE_S + 5)
    received = bytearray()
    try:
        if how == "tls hello cut":
            sock.sendall(b"\x16\x03\x01\x02\x00\x01\x00")  # a ClientHello's first bytes
        elif not how.startswith("tcp idle"):
            sock = t.contexts["node-2"].wrap_socket(sock)
            if how == "half a header":
                sock.sendall(hello_frame()[:6])
            elif how == "trickled hello":  # a byte every 0.1 s, reading in between
                for byte in hello_frame()[:30]:
                    sock.sendall(bytes([byte]))
                    sock.settimeout(0.1)
                    with contextlib.suppress(TimeoutError):
                        chunk = sock.recv(65536)
                        if not chunk:
                            break
                        received += chunk
                sock.settimeout(HANDSHAKE_S + 5)
        while chunk := sock.recv(65536):
            received += chunk
    except (OSError, ssl.SSLError):
        pass
    finally:
        sock.close()
    result[how] = (time.monotonic() - t0, bytes(received))


def test_slow_peers_are_cut_off_at_the_handshake_deadline(target: Target) -> None:
    """Five kinds of slowloris, plus more idle TCP connections than ``max_connections``
    at once: each is closed at the deadline (TLS stage: counted; HELLO stage: with a
    BYE); the daemon serves everyone else meanwhile."""
    before = target.counters(1)
    result: dict[str, Any] = {}
    ways = ["tcp idle", "tls hello cut", "tls idle", "half a header", "trickled hello"]
    crowd = [f"tcp idle {i}" for i in range(MAX_CONNECTIONS + 16)]
    threads = [threading.Thread(target=slow_peer, args=(target, w, result)) for w in ways + crowd]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=HANDSHAKE_S + 10)
    assert set(result) == set(ways + crowd)
    for how, (took, received) in result.items():
        assert took <= HANDSHAKE_S + 2.5, (how, took)
        if how.startswith(("tcp", "tls hello")):
            assert wire.MAGIC not in received, how
        else:
            assert took >= HANDSHAKE_S - 0.3, (how, took)
            msgs = peer_messages(received)
            assert msgs and isinstance(msgs[0], Hello) and isinstance(msgs[-1], Bye), (how, msgs)
            assert msgs[-1].reason == f"no HELLO within {HANDSHAKE_S:g} s", (how, msgs)

    def cut_off() -> tuple[Counter[str], int, dict[str, int]]:
        after = target.counters(1)
        refused = counter_delta(before, after, "peer_refused_")
        turned_away = after.get("peer_connections_refused", 0) - before.get(
            "peer_connections_refused", 0
        )
        return refused, turned_away, after

    # The daemon counts a connection once it has closed it: the client may see the
    # close first, so wait for the counts rather than read them once.
    def counted() -> int:
        refused, turned_away, _ = cut_off()
        return sum(refused.values()) + turned_away

    until(lambda: counted() >= 2 + len(crowd), timeout=10, what="every slow connection counted")
    refused, turned_away, after = cut_off()
    assert set(refused) <= {"tls_handshake_timeout"}
    assert refused["tls_handshake_timeout"] + turned_away == 2 + len(crowd)
    moved = counter_delta(before, after, "peer_rejected_")
    target.notes["hello deadline counted"] = sum(moved.values())
    target.notes["turned away"] = turned_away
    undisturbed(target)


def test_slow_peers_past_tls_are_counted(target: Target) -> None:
    if "hello deadline counted" not in target.notes:
        pytest.skip("needs test_slow_peers_are_cut_off_at_the_handshake_deadline")
    assert target.notes["hello deadline counted"] == 3


def test_connections_in_the_tls_handshake_count_against_max_connections(
    target: Target,
) -> None:
    if "turned away" not in target.notes:
        pytest.skip("needs test_slow_peers_are_cut_off_at_the_handshake_deadline")
    assert target.notes["turned away"] >= 16


# -- replays and floods ----------------------------------------------------------------------


@pytest.mark.parametrize("node", [1, 2])
def test_replayed_records_change_nothing(target: Target, node: int) -> None:
    """Real signed records captured at epoch 1, sent again now: the link's own node's
    (stale), the receiver's own (this life), each twice and in two TICKs."""
    receiver, identity = f"node-{node}", f"node-{3 - node}"
    before = target.counters(node)
    expected: Counter[str] = Counter()
    replay = [target.old_records[identity].to_wire(), target.old_records[receiver].to_wire()]
    for _ in range(2):
        out = run_peer_case(
            target,
            hello_frame(identity) + tick_frame(replay * 2),
            identity=identity,
            node=node,
            expected=expected,
        )
        assert out.violation is None and not out.records
    check_counters(target, node, before, expected)
    assert expected == Counter({"peer_rejected_bad_magic": 2})  # the sentinels alone
    undisturbed(target)


def test_a_flood_of_forged_signatures_is_counted_and_does_not_stall_the_daemon(
    target: Target,
) -> None:
    n = 2000
    past = altered(target.old_records["node-1"], incarnation=0, signature=b"")
    forger = stranger("node-1")
    records = [forger.sign_record(altered(past, version=v)).to_wire() for v in range(n)]
    data = hello_frame("node-2") + tick_frame(records)
    assert len(data) < MAX_FRAME
    before = target.counters(1)
    expected: Counter[str] = Counter()
    t0 = time.monotonic()
    run_peer_case(target, data, expected=expected)
    target.notes["flood"] = (n, time.monotonic() - t0)
    assert expected == Counter({"records_rejected_bad_signature": n, "peer_rejected_bad_magic": 1})
    check_counters(target, 1, before, expected)
    undisturbed(target)


# -- at the end ----------------------------------------------------------------------------


def test_state_is_unchanged_and_warnings_were_rate_limited(target: Target) -> None:
    undisturbed(target)
    assert target.bystander.polls > 100
    minutes = (time.monotonic() - target.started) / 10 + 1  # warning periods elapsed
    for i in (1, 2):
        lines = [json.loads(x) for x in target.cluster.log(i).splitlines() if x.startswith("{")]
        bad = [x for x in lines if x.get("level") in ("error", "critical")]
        assert bad == [], bad
        assert "Traceback" not in target.cluster.log(i)
        counters = target.counters(i)
        events = Counter(x["event"] for x in lines if x.get("level") == "warning")
        reasons = {
            "peer broke the protocol; link closed": "peer_rejected_",
            "record rejected": "records_rejected_",
            "peer connection refused": "peer_refused_",
        }
        for event, prefix in reasons.items():
            kinds = sum(1 for k in counters if k.startswith(prefix))
            total = sum(v for k, v in counters.items() if k.startswith(prefix))
            assert events[event] <= kinds * minutes, (event, events[event], kinds, total)
        assert set(events) <= set(reasons), events
