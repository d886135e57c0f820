"""Security building blocks: node identities and signed records, the cluster CA, mutual
TLS 1.3 over real loopback sockets, and a smoke pass of the decoder fuzz target."""

from __future__ import annotations

import dataclasses
import datetime as dt
import importlib.util
import os
import ssl
import stat
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import msgpack
import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from hypothesis import given, settings
from hypothesis import strategies as st

from convergenced.core.errors import LocalProtocolError
from convergenced.core.interval_set import IntervalSet
from convergenced.core.records import Record
from convergenced.daemon.config import ConfigError
from convergenced.security import pki, tls
from convergenced.security.keys import IdentityError, NodeIdentity, is_weak_public_key
from convergenced.security.pki import PkiError
from convergenced.security.tls import PeerIdentityError, TlsConfigError
from convergenced.security.trust import (
    DEFAULT_CACHE_SIZE,
    RejectReason,
    TrustList,
    parse_trust_list,
)

SPEC = bytes(range(32))
ROOT = Path(__file__).resolve().parent.parent

# -- helpers --------------------------------------------------------------------------


def make_record(origin: str = "node-a", **changes: Any) -> Record:
    """A realistic record: a few ranges, four domains, proposals, two generations."""
    fields: dict[str, Any] = {
        "stream": "llama-70b",
        "origin": origin,
        "incarnation": 3,
        "version": 1042,
        "spec_digest": SPEC,
        "recoverable": IntervalSet([(100, 180), (200, 260), (300, 412)]),
        "newest": (("gpu", 415), ("nvme", 412), ("ram", 414), ("s3", 380)),
        "proposal": 410,
        "restore_point": 400,
        "high_water": 400,
        "generations": ((7, IntervalSet([(300, 380)])), (8, IntervalSet([(300, 400)]))),
    }
    fields.update(changes)
    return Record(**fields)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(scope="module")
def ids() -> dict[str, NodeIdentity]:
    return {n: NodeIdentity.generate(n) for n in ("node-a", "node-b", "node-c")}


@pytest.fixture
def trust(ids: dict[str, NodeIdentity]) -> TrustList:
    return TrustList({n: i.public_key_bytes() for n, i in ids.items()})


# -- identity files -----------------------------------------------------------------


def test_identity_round_trips_through_a_0600_file(tmp_path: Path) -> None:
    me = NodeIdentity.generate("rack2/gpu-7")
    path = tmp_path / "node.key"
    me.save(path)
    assert mode_of(path) == 0o600
    back = NodeIdentity.load(path)
    assert back.node_id == "rack2/gpu-7"
    assert back.public_key_bytes() == me.public_key_bytes()
    assert len(me.public_key_bytes()) == 32
    assert me.public_key_hex() == me.public_key_bytes().hex()
    assert not list(tmp_path.glob(".*.tmp")), "temporary file left behind"


def test_identity_file_is_a_pkcs8_pem_key_with_explanatory_text(tmp_path: Path) -> None:
    me = NodeIdentity.generate("node-a")
    path = tmp_path / "node.key"
    me.save(path)
    text = path.read_text()
    assert "node-id: node-a" in text
    assert f"public-key: {me.public_key_hex()}" in text
    assert "-----BEGIN PRIVATE KEY-----" in text
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    assert (
        key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        == me.public_key_bytes()
    )


def test_identity_repr_does_not_show_the_key() -> None:
    me = NodeIdentity.generate("node-a")
    assert "private" not in repr(me)


def test_save_refuses_to_overwrite_an_identity(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    first = NodeIdentity.generate("node-a")
    first.save(path)
    with pytest.raises(IdentityError, match="already exists") as info:
        NodeIdentity.generate("node-a").save(path)
    assert info.value.path == str(path)
    assert NodeIdentity.load(path).public_key_bytes() == first.public_key_bytes()


def test_save_with_overwrite_replaces_the_identity(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    NodeIdentity.generate("node-a").save(path)
    second = NodeIdentity.generate("node-a")
    second.save(path, overwrite=True)
    assert NodeIdentity.load(path).public_key_bytes() == second.public_key_bytes()
    assert mode_of(path) == 0o600


def test_save_into_a_missing_directory_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "missing" / "node.key"
    with pytest.raises(IdentityError, match="cannot write") as info:
        NodeIdentity.generate("node-a").save(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    "content",
    [b"", b"garbage", b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"],
    ids=["empty", "garbage", "bad-base64-body"],
)
def test_corrupt_identity_file_is_an_error_naming_the_path(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "node.key"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(IdentityError) as info:
        NodeIdentity.load(path, "node-a")
    assert str(info.value).startswith(f"{path}: ")
    assert info.value.path == str(path)


def test_missing_identity_file_is_an_error_naming_the_path(tmp_path: Path) -> None:
    path = tmp_path / "absent.key"
    with pytest.raises(IdentityError, match="not found") as info:
        NodeIdentity.load(path, "node-a")
    assert str(path) in str(info.value)


def test_identity_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    NodeIdentity.generate("node-a").save(path)
    path.chmod(0o644)
    with pytest.raises(IdentityError, match="too open"):
        NodeIdentity.load(path)
    assert NodeIdentity.load(path, check_mode=False).node_id == "node-a"


def test_identity_of_another_node_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    NodeIdentity.generate("node-a").save(path)
    with pytest.raises(IdentityError, match="identity of 'node-a', not of 'node-b'"):
        NodeIdentity.load(path, "node-b")


def test_identity_with_a_public_key_line_that_lies_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    NodeIdentity.generate("node-a").save(path)
    other = NodeIdentity.generate("node-a").public_key_hex()
    text = path.read_text().replace("public-key: ", f"public-key: {other}\nx: ", 1)
    path.write_text(text)
    with pytest.raises(IdentityError, match="does not match the key"):
        NodeIdentity.load(path)


def test_bare_pem_key_needs_the_node_id(tmp_path: Path) -> None:
    me = NodeIdentity.generate("node-a")
    path = tmp_path / "bare.key"
    path.write_bytes(
        me.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)
    with pytest.raises(IdentityError, match="no 'node-id:' line"):
        NodeIdentity.load(path)
    assert NodeIdentity.load(path, "node-a").public_key_bytes() == me.public_key_bytes()


def test_non_ed25519_key_is_refused(tmp_path: Path) -> None:
    ca = pki.init_ca(tmp_path / "ca")
    with pytest.raises(IdentityError, match="expected an Ed25519 key"):
        NodeIdentity.load(ca.key, "node-a")


@pytest.mark.parametrize("bad", ["", "has space", "-lead", "x" * 129, "node\n"])
def test_invalid_node_id_is_refused(bad: str) -> None:
    with pytest.raises(IdentityError, match="node id"):
        NodeIdentity.generate(bad)


# -- signing and verification -----------------------------------------------------------


def test_signed_record_verifies(ids: dict[str, NodeIdentity], trust: TrustList) -> None:
    record = make_record()
    signed = ids["node-a"].sign_record(record)
    assert len(signed.signature) == 64
    assert signed.fingerprint == record.fingerprint  # the signature is not in the body
    assert trust.check(signed) is None
    assert trust.stats.verified == 1


def test_signature_covers_exactly_the_canonical_body(ids: dict[str, NodeIdentity]) -> None:
    signed = ids["node-a"].sign_record(make_record())
    public = ids["node-a"].private_key.public_key()
    public.verify(signed.signature, signed.body_bytes())  # raises if not


def test_signed_record_survives_the_wire(ids: dict[str, NodeIdentity], trust: TrustList) -> None:
    record = make_record()
    record.packed()  # fill the packed cache: signing must not keep the unsigned bytes
    signed = ids["node-a"].sign_record(record)
    decoded = Record.from_wire(msgpack.unpackb(signed.packed(), raw=False), "record")
    assert decoded.signature == signed.signature
    assert trust.verify(decoded)


def test_signing_is_deterministic(ids: dict[str, NodeIdentity]) -> None:
    record = make_record()
    assert ids["node-a"].sign_record(record) == ids["node-a"].sign_record(record)


def test_signing_a_record_of_another_origin_is_a_local_error(
    ids: dict[str, NodeIdentity],
) -> None:
    with pytest.raises(LocalProtocolError) as info:
        ids["node-a"].sign_record(make_record(origin="node-b"))
    assert info.value.reason == "foreign_origin"


TAMPERINGS: dict[str, Any] = {
    "stream": "other-job",
    "origin": "node-b",
    "incarnation": 4,
    "version": 1043,
    "spec_digest": bytes(32),
    "recoverable": IntervalSet([(100, 180), (200, 260), (300, 413)]),
    "newest": (("gpu", 416), ("nvme", 412), ("ram", 414), ("s3", 380)),
    "proposal": 412,
    "restore_point": None,
    "high_water": 401,
    "generations": ((7, IntervalSet([(300, 380)])),),
}


@pytest.mark.parametrize("name", sorted(TAMPERINGS))
def test_tampered_record_is_rejected_as_bad_signature(
    name: str, ids: dict[str, NodeIdentity], trust: TrustList
) -> None:
    signed = ids["node-a"].sign_record(make_record())
    assert trust.verify(signed)
    forged = dataclasses.replace(signed, _fingerprint=b"", _packed=b"", **{name: TAMPERINGS[name]})
    assert trust.check(forged) is RejectReason.BAD_SIGNATURE
    assert trust.stats.rejected[RejectReason.BAD_SIGNATURE] == 1


def test_record_of_an_unknown_origin_is_rejected(trust: TrustList) -> None:
    stranger = NodeIdentity.generate("node-x")
    signed = stranger.sign_record(make_record(origin="node-x"))
    assert trust.check(signed) is RejectReason.UNKNOWN_ORIGIN
    assert trust.stats.rejected[RejectReason.UNKNOWN_ORIGIN] == 1


def test_record_signed_with_another_nodes_key_is_rejected(
    ids: dict[str, NodeIdentity], trust: TrustList
) -> None:
    impostor = NodeIdentity("node-a", ids["node-b"].private_key)
    assert trust.check(impostor.sign_record(make_record())) is RejectReason.BAD_SIGNATURE


def test_unsigned_record_is_rejected(trust: TrustList) -> None:
    assert trust.check(make_record()) is RejectReason.UNSIGNED
    assert trust.stats.as_dict()["rejected_unsigned"] == 1


def test_record_straight_from_its_origins_link_rests_on_the_link(trust: TrustList) -> None:
    unsigned = make_record(origin="node-a")
    assert trust.check(unsigned, link_peer="node-a") is None
    assert trust.stats.link_trusted == 1
    # Relayed by another authenticated peer, it needs its own signature.
    assert trust.check(unsigned, link_peer="node-b") is RejectReason.UNSIGNED


def test_second_verification_of_a_version_is_a_cache_hit(
    ids: dict[str, NodeIdentity], trust: TrustList
) -> None:
    signed = ids["node-a"].sign_record(make_record())
    relayed = Record.from_wire(msgpack.unpackb(signed.packed(), raw=False), "record")
    assert trust.verify(signed)
    assert trust.verify(relayed)
    assert (trust.stats.verified, trust.stats.cache_hits) == (1, 1)


def test_cache_never_vouches_for_another_signature_on_a_cached_body(
    ids: dict[str, NodeIdentity], trust: TrustList
) -> None:
    signed = ids["node-a"].sign_record(make_record())
    assert trust.verify(signed)
    forged = dataclasses.replace(signed, signature=b"\xff" * 64, _packed=b"")
    assert trust.check(forged) is RejectReason.BAD_SIGNATURE
    assert trust.stats.cache_hits == 0


def test_verification_cache_is_a_bounded_lru(ids: dict[str, NodeIdentity]) -> None:
    trust = TrustList({"node-a": ids["node-a"].public_key_bytes()}, cache_size=2)
    r1, r2, r3 = (ids["node-a"].sign_record(make_record(version=v)) for v in (1, 2, 3))
    for r in (r1, r2, r1, r3):  # r1 used again before r3: r2 is the least recent
        assert trust.verify(r)
    assert trust.cached == 2
    assert trust.verify(r1) and trust.verify(r3)
    assert trust.stats.cache_hits == 3
    assert trust.verify(r2)
    assert trust.stats.verified == 4  # r2 was evicted and verified again


def test_replacing_keys_drops_the_cache_of_a_changed_origin(
    ids: dict[str, NodeIdentity], trust: TrustList
) -> None:
    signed = ids["node-a"].sign_record(make_record())
    assert trust.verify(signed)
    trust.replace_keys({"node-a": ids["node-b"].public_key_bytes()})
    assert trust.check(signed) is RejectReason.BAD_SIGNATURE


SIGNED = NodeIdentity.generate("node-a")
SIGNED_RECORD = SIGNED.sign_record(make_record())


@settings(max_examples=200, deadline=None)
@given(index=st.integers(0, 63), mask=st.integers(1, 255))
def test_any_single_byte_flip_in_the_signature_is_rejected(index: int, mask: int) -> None:
    trust = TrustList({"node-a": SIGNED.public_key_bytes()})
    assert trust.verify(SIGNED_RECORD)
    sig = bytearray(SIGNED_RECORD.signature)
    sig[index] ^= mask
    flipped = dataclasses.replace(SIGNED_RECORD, signature=bytes(sig), _packed=b"")
    assert trust.check(flipped) is RejectReason.BAD_SIGNATURE


def test_verify_never_raises_on_a_malformed_signature(trust: TrustList) -> None:
    odd = make_record(signature=b"\x01" * 63)
    assert trust.check(odd) is RejectReason.BAD_SIGNATURE


# -- trust list configuration -----------------------------------------------------------


def test_trust_list_parses_from_toml(ids: dict[str, NodeIdentity]) -> None:
    doc = "[trust]\n" + "\n".join(i.trust_entry() for i in ids.values())
    trust = parse_trust_list(tomllib.loads(doc)["trust"], "cluster.toml")
    assert list(trust) == ["node-a", "node-b", "node-c"]
    assert trust.public_key("node-b") == ids["node-b"].public_key_bytes()
    assert trust.cache_size == DEFAULT_CACHE_SIZE


@pytest.mark.parametrize(
    ("table", "key", "problem"),
    [
        ({"node-a": "abcd"}, "trust.node-a", "64 hex digits"),
        ({"node-a": "zz" * 32}, "trust.node-a", "not hexadecimal"),
        ({"node-a": 42}, "trust.node-a", "expected the node's public key"),
        ({"bad id": "00" * 32}, "trust.bad id", "not a node id"),
        ({"node-a": "00" * 32}, "trust.node-a", "small order"),
        ({"node-a": "01" + "00" * 31}, "trust.node-a", "small order"),
    ],
    ids=["short", "not-hex", "not-a-string", "bad-node-id", "zero-key", "identity-point"],
)
def test_bad_trust_entry_names_file_and_key(table: Any, key: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem) as info:
        parse_trust_list(table, "/etc/convergenced/convergenced.toml")
    assert info.value.path == "/etc/convergenced/convergenced.toml"
    assert info.value.key == key


def test_one_key_for_two_nodes_is_a_config_error(ids: dict[str, NodeIdentity]) -> None:
    key = ids["node-a"].public_key_hex()
    with pytest.raises(ConfigError, match="same public key as 'node-a'") as info:
        parse_trust_list({"node-a": key, "node-b": key}, "c.toml")
    assert info.value.key == "trust.node-b"


def test_trust_table_must_be_a_table() -> None:
    with pytest.raises(ConfigError, match="expected a table") as info:
        parse_trust_list(["node-a"], "c.toml")
    assert info.value.key == "trust"


def test_real_keys_are_not_weak(ids: dict[str, NodeIdentity]) -> None:
    assert not any(is_weak_public_key(i.public_key_bytes()) for i in ids.values())


# -- the cluster CA -------------------------------------------------------------------


@dataclass
class Pki:
    dir: Path
    ca: pki.CaFiles
    nodes: dict[str, pki.NodeFiles]
    other_ca: pki.CaFiles
    intruder: pki.NodeFiles
    expired: pki.NodeFiles


@pytest.fixture(scope="module")
def cluster_pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    base = tmp_path_factory.mktemp("pki")
    ca = pki.init_ca(base / "ca")
    nodes = {n: pki.issue(base / "ca", n) for n in ("node-a", "node-b", "rack2/gpu-7")}
    other = pki.init_ca(base / "other", name="someone-else")
    intruder = pki.issue(base / "other", "node-b")
    expired = pki.issue(
        base / "ca",
        "node-old",
        days=1,
        valid_from=dt.datetime.now(dt.UTC) - dt.timedelta(days=30),
    )
    return Pki(base / "ca", ca, nodes, other, intruder, expired)


def test_init_ca_writes_a_ca_certificate_and_a_private_key(cluster_pki: Pki) -> None:
    assert mode_of(cluster_pki.ca.key) == 0o600
    cert, _ = pki.load_ca(cluster_pki.dir)
    assert cert.subject.rfc4514_string() == "CN=convergenced-ca"
    bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert bc.ca and bc.path_length == 0


def test_init_ca_refuses_to_overwrite_a_ca(cluster_pki: Pki) -> None:
    before = cluster_pki.ca.cert.read_bytes()
    with pytest.raises(PkiError, match="refusing to replace the cluster CA"):
        pki.init_ca(cluster_pki.dir)
    assert cluster_pki.ca.cert.read_bytes() == before


def test_issued_certificate_chains_to_the_ca(cluster_pki: Pki) -> None:
    ca_cert, _ = pki.load_ca(cluster_pki.dir)
    files = cluster_pki.nodes["node-a"]
    assert mode_of(files.key) == 0o600
    cert = pki.load_certificate(files.cert)
    assert pki.verify_node_cert(cert, ca_cert) == "node-a"
    assert cert.subject.rfc4514_string() == "CN=node-a"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["convergenced://node/node-a"]
    assert set(san.get_values_for_type(x509.DNSName)) == {"node-a", "localhost"}
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]


def test_node_id_is_extracted_from_der_and_pem(cluster_pki: Pki) -> None:
    cert = pki.load_certificate(cluster_pki.nodes["node-b"].cert)
    assert pki.node_id_from_cert(cert.public_bytes(serialization.Encoding.DER)) == "node-b"
    assert pki.node_id_from_cert(cluster_pki.nodes["node-b"].cert.read_bytes()) == "node-b"


def test_node_id_with_a_slash_gets_an_encoded_file_name(cluster_pki: Pki) -> None:
    files = cluster_pki.nodes["rack2/gpu-7"]
    assert files.cert.name == "rack2%2Fgpu-7.crt"
    assert pki.node_id_from_cert(pki.load_certificate(files.cert)) == "rack2/gpu-7"


def test_certificate_without_a_node_uri_has_no_node_id(cluster_pki: Pki) -> None:
    with pytest.raises(PkiError, match="no subjectAltName"):
        pki.node_id_from_cert(pki.load_certificate(cluster_pki.ca.cert))


def test_issue_refuses_to_overwrite_a_node_unless_asked(cluster_pki: Pki, tmp_path: Path) -> None:
    files = pki.issue(cluster_pki.dir, "node-z", out_dir=tmp_path)
    before = files.cert.read_bytes()
    with pytest.raises(PkiError, match="already exists"):
        pki.issue(cluster_pki.dir, "node-z", out_dir=tmp_path)
    assert files.cert.read_bytes() == before
    again = pki.issue(cluster_pki.dir, "node-z", out_dir=tmp_path, overwrite=True)
    assert again.cert.read_bytes() != before


def test_issue_without_a_ca_names_the_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PkiError, match="not found") as info:
        pki.issue(tmp_path, "node-a")
    assert info.value.path == str(tmp_path / "ca.crt")


@pytest.mark.parametrize(
    ("node_id", "hosts", "problem"),
    [("bad id", (), "node id"), ("node-a", ("not a host!",), "host 'not a host!'")],
)
def test_issue_rejects_bad_names(
    cluster_pki: Pki, tmp_path: Path, node_id: str, hosts: tuple[str, ...], problem: str
) -> None:
    with pytest.raises(PkiError, match=problem):
        pki.issue(cluster_pki.dir, node_id, hosts=hosts, out_dir=tmp_path)


def test_certificate_of_another_ca_fails_verification(cluster_pki: Pki) -> None:
    ca_cert, _ = pki.load_ca(cluster_pki.dir)
    with pytest.raises(PkiError, match="convergenced-ca"):
        pki.verify_node_cert(pki.load_certificate(cluster_pki.intruder.cert), ca_cert)


def test_expired_certificate_fails_offline_verification(cluster_pki: Pki) -> None:
    ca_cert, _ = pki.load_ca(cluster_pki.dir)
    with pytest.raises(PkiError, match="expired"):
        pki.verify_node_cert(pki.load_certificate(cluster_pki.expired.cert), ca_cert)


# -- TLS contexts -----------------------------------------------------------------------


def contexts(p: Pki, node: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    f = p.nodes.get(node, p.expired)
    return (
        tls.server_context(f.cert, f.key, p.ca.cert),
        tls.client_context(f.cert, f.key, p.ca.cert),
    )


def raw_client(
    ca: Path, cert: Path | None = None, key: Path | None = None, **kw: Any
) -> ssl.SSLContext:
    """A client context built by hand, for clients our builders would refuse."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(cafile=str(ca))
    if cert is not None:
        ctx.load_cert_chain(str(cert), str(key))
    for name, value in kw.items():
        setattr(ctx, name, value)
    return ctx


@dataclass
class Side:
    peer: str | None = None
    received: bytes = b""
    error: BaseException | None = None


async def converse(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext) -> tuple[Side, Side]:
    """One real TLS connection over loopback: the client says ping, the server pongs."""
    server, client = Side(), Side()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def serve() -> None:
        transport = await listeners[0].accept()
        stream = trio.SSLStream(transport, server_ctx, server_side=True)
        try:
            await stream.do_handshake()
            server.peer = tls.peer_node_id(stream)
            server.received = await stream.receive_some(64)
            await stream.send_all(b"pong")
            await stream.aclose()
        except (trio.BrokenResourceError, ssl.SSLError) as exc:
            server.error = exc
            await trio.aclose_forcefully(stream)

    async def dial() -> None:
        transport = await trio.open_tcp_stream("127.0.0.1", port)
        stream = trio.SSLStream(transport, client_ctx, server_hostname="peer")
        try:
            await stream.do_handshake()
            client.peer = tls.peer_node_id(stream)
            await stream.send_all(b"ping")
            # In TLS 1.3 a refused client certificate shows up here, not in the handshake.
            client.received = await stream.receive_some(64)
            if not client.received:
                raise trio.BrokenResourceError("closed without data")
            await stream.aclose()
        except (trio.BrokenResourceError, ssl.SSLError) as exc:
            client.error = exc
            await trio.aclose_forcefully(stream)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            nursery.start_soon(dial)
    await listeners[0].aclose()
    return server, client


def ssl_reason(side: Side) -> str:
    exc = side.error
    while exc is not None and not isinstance(exc, ssl.SSLError):
        exc = exc.__cause__ or exc.__context__
    return str(exc)


async def test_mutual_tls13_handshake_exchanges_bytes_and_names_both_peers(
    cluster_pki: Pki,
) -> None:
    server_ctx, _ = contexts(cluster_pki, "node-a")
    _, client_ctx = contexts(cluster_pki, "rack2/gpu-7")
    server, client = await converse(server_ctx, client_ctx)
    assert (server.error, client.error) == (None, None)
    assert (server.received, client.received) == (b"ping", b"pong")
    assert (server.peer, client.peer) == ("rack2/gpu-7", "node-a")


def test_contexts_are_tls13_mutual_with_the_cluster_ca_only(cluster_pki: Pki) -> None:
    server_ctx, client_ctx = contexts(cluster_pki, "node-a")
    assert server_ctx.minimum_version == ssl.TLSVersion.TLSv1_3
    assert client_ctx.minimum_version == ssl.TLSVersion.TLSv1_3
    assert server_ctx.verify_mode == client_ctx.verify_mode == ssl.CERT_REQUIRED
    assert not client_ctx.check_hostname
    assert server_ctx.num_tickets == 0
    assert client_ctx.cert_store_stats()["x509_ca"] == 1  # the cluster CA, no system roots


async def test_client_with_a_certificate_of_another_ca_is_refused_on_both_sides(
    cluster_pki: Pki,
) -> None:
    server_ctx, _ = contexts(cluster_pki, "node-a")
    intruder = raw_client(cluster_pki.ca.cert, cluster_pki.intruder.cert, cluster_pki.intruder.key)
    server, client = await converse(server_ctx, intruder)
    assert server.error is not None and client.error is not None
    assert server.peer is None and server.received == b""
    assert "certificate verify failed" in ssl_reason(server)
    # The client finished its side of the handshake (TLS 1.3) and learns of the refusal
    # on its first receive: an alert or a bare EOF, depending on whether trio flushed
    # the server's alert before closing. Either way it never gets application data.
    assert client.received == b""


async def test_server_with_a_certificate_of_another_ca_is_refused_by_the_client(
    cluster_pki: Pki,
) -> None:
    f = cluster_pki.intruder
    evil_server = tls.server_context(f.cert, f.key, cluster_pki.other_ca.cert)
    _, client_ctx = contexts(cluster_pki, "node-a")
    server, client = await converse(evil_server, client_ctx)
    assert server.error is not None and client.error is not None
    assert client.peer is None
    assert "certificate verify failed" in ssl_reason(client)


async def test_client_without_a_certificate_is_refused(cluster_pki: Pki) -> None:
    server_ctx, _ = contexts(cluster_pki, "node-a")
    server, client = await converse(server_ctx, raw_client(cluster_pki.ca.cert))
    assert server.error is not None and client.error is not None
    assert "peer did not return a certificate" in ssl_reason(server)
    assert server.received == b""


async def test_tls12_only_client_is_refused(cluster_pki: Pki) -> None:
    server_ctx, _ = contexts(cluster_pki, "node-a")
    f = cluster_pki.nodes["node-b"]
    old = raw_client(cluster_pki.ca.cert, f.cert, f.key, maximum_version=ssl.TLSVersion.TLSv1_2)
    server, client = await converse(server_ctx, old)
    assert server.error is not None and client.error is not None
    assert "unsupported protocol" in ssl_reason(server)
    assert client.peer is None


async def test_expired_client_certificate_is_refused_in_the_handshake(cluster_pki: Pki) -> None:
    server_ctx, _ = contexts(cluster_pki, "node-a")
    _, expired_client = contexts(cluster_pki, "node-old")  # builders do not check dates
    server, client = await converse(server_ctx, expired_client)
    assert server.error is not None and client.error is not None
    assert "certificate has expired" in ssl_reason(server)


async def test_check_peer_refuses_a_peer_that_is_not_the_node_dialled(cluster_pki: Pki) -> None:
    server_ctx, _ = contexts(cluster_pki, "node-a")
    _, client_ctx = contexts(cluster_pki, "node-b")
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def serve() -> None:
        stream = trio.SSLStream(await listeners[0].accept(), server_ctx, server_side=True)
        await stream.do_handshake()
        await stream.aclose()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            transport = await trio.open_tcp_stream("127.0.0.1", port)
            stream = trio.SSLStream(transport, client_ctx, server_hostname="node-c")
            await stream.do_handshake()
            assert tls.check_peer(stream, "node-a") == "node-a"
            with pytest.raises(PeerIdentityError, match="'node-a', expected 'node-c'"):
                tls.check_peer(stream, "node-c")
            await trio.aclose_forcefully(stream)
    await listeners[0].aclose()


def test_peer_node_id_before_a_handshake_is_an_error() -> None:
    class NoCert:
        def getpeercert(self, binary_form: bool = False) -> Any:
            return None

    with pytest.raises(PeerIdentityError, match="no peer certificate"):
        tls.peer_node_id(NoCert())


def test_peer_node_id_reads_the_dict_form() -> None:
    info = {"subjectAltName": (("URI", "convergenced://node/node-a"), ("DNS", "node-a"))}
    assert tls.node_id_from_peercert_dict(info) == "node-a"
    with pytest.raises(PeerIdentityError, match="2 node ids"):
        tls.node_id_from_peercert_dict(
            {"subjectAltName": (("URI", "convergenced://node/a"), ("URI", "convergenced://node/b"))}
        )


def test_node_contexts_load_the_issued_files(cluster_pki: Pki) -> None:
    server_ctx, client_ctx = tls.node_contexts(cluster_pki.dir, "rack2/gpu-7")
    assert server_ctx.verify_mode == ssl.CERT_REQUIRED
    assert client_ctx.verify_mode == ssl.CERT_REQUIRED


def test_missing_certificate_file_is_named(cluster_pki: Pki, tmp_path: Path) -> None:
    f = cluster_pki.nodes["node-a"]
    with pytest.raises(TlsConfigError, match="not found") as info:
        tls.server_context(tmp_path / "absent.crt", f.key, cluster_pki.ca.cert)
    assert info.value.path == str(tmp_path / "absent.crt")


def test_missing_ca_file_is_named(cluster_pki: Pki, tmp_path: Path) -> None:
    f = cluster_pki.nodes["node-a"]
    with pytest.raises(TlsConfigError, match="not found") as info:
        tls.client_context(f.cert, f.key, tmp_path / "ca.crt")
    assert info.value.path == str(tmp_path / "ca.crt")


def test_key_that_does_not_match_the_certificate_is_named(cluster_pki: Pki) -> None:
    a, b = cluster_pki.nodes["node-a"], cluster_pki.nodes["node-b"]
    with pytest.raises(TlsConfigError, match="does not match the certificate") as info:
        tls.server_context(a.cert, b.key, cluster_pki.ca.cert)
    assert info.value.path == str(b.key)


def test_certificate_not_issued_by_the_ca_is_named(cluster_pki: Pki) -> None:
    f = cluster_pki.intruder
    with pytest.raises(TlsConfigError, match="not issued by the CA") as info:
        tls.client_context(f.cert, f.key, cluster_pki.ca.cert)
    assert info.value.path == str(f.cert)


def test_garbage_files_are_named(cluster_pki: Pki, tmp_path: Path) -> None:
    f = cluster_pki.nodes["node-a"]
    junk = tmp_path / "junk.pem"
    junk.write_bytes(b"not pem at all")
    junk.chmod(0o600)
    for args, culprit in [
        ((junk, f.key, cluster_pki.ca.cert), junk),
        ((f.cert, junk, cluster_pki.ca.cert), junk),
        ((f.cert, f.key, junk), junk),
    ]:
        with pytest.raises(TlsConfigError) as info:
            tls.server_context(*args)
        assert info.value.path == str(culprit)


def test_key_file_others_can_read_is_refused(cluster_pki: Pki, tmp_path: Path) -> None:
    f = pki.issue(cluster_pki.dir, "node-open", out_dir=tmp_path)
    os.chmod(f.key, 0o644)
    with pytest.raises(TlsConfigError, match="too open"):
        tls.server_context(f.cert, f.key, cluster_pki.ca.cert)
    tls.server_context(f.cert, f.key, cluster_pki.ca.cert, check_mode=False)


# -- fuzz target smoke pass ----------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_target() -> Iterator[ModuleType]:
    path = ROOT / "fuzz" / "fuzz_frame_decoder.py"
    spec = importlib.util.spec_from_file_location("fuzz_frame_decoder", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_fuzz_target_accepts_every_seed(fuzz_target: ModuleType) -> None:
    seeds = fuzz_target.seeds()
    assert len(seeds) > 50
    for data in seeds:
        fuzz_target.one_input(data)


def test_fuzz_target_survives_a_short_random_run(fuzz_target: ModuleType) -> None:
    report = fuzz_target.run_random(iterations=3000, seed=1)
    assert report.iterations == 3000
    assert not report.crashes


def test_security_package_loads_no_trio() -> None:
    # Tools and the daemon share it; it must stay synchronous and free of the event loop.
    probe = "import sys, convergenced.security; print('trio' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "False"
