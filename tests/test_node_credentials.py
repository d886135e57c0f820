"""Credentials judged against a real CA (`security.node_credentials`): what is admitted,
what is refused and why, and the revocations that take trust away."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import msgpack
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes

from convergenced.core.packing import pack
from convergenced.daemon.fleet_config import RevocationConfig, load_revocations
from convergenced.security import pki
from convergenced.security.keys import NodeIdentity
from convergenced.security.node_credentials import (
    CredentialJudge,
    Refusal,
    Revocations,
    fingerprint,
    make_credential,
)


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("ca")
    pki.init_ca(d)
    for node in ("n1", "n2"):
        pki.issue(d, node)
    return d


def credential(ca: Path, node: str = "n1", *, cluster: str = "c", serial: int = 1) -> bytes:
    files = pki.node_files(ca, node)
    return make_credential(
        cluster=cluster,
        node=node,
        record_key=NodeIdentity.generate(node).public_key_bytes(),
        address="10.0.0.1:7946",
        serial=serial,
        certificate=pki.load_certificate(files.cert),
        tls_key=pki.load_private_key(files.key),
    )


def judge(ca: Path, revocations: Revocations | None = None, **kw: object) -> CredentialJudge:
    return CredentialJudge("c", pki.load_ca_certificates(ca / pki.CA_CERT), revocations, **kw)  # type: ignore[arg-type]


def refusal(j: CredentialJudge, blob: bytes) -> Refusal | None:
    verdict = j.check(blob)
    return verdict[0] if isinstance(verdict, tuple) else None


def test_a_valid_credential_is_admitted_with_its_rank(ca: Path) -> None:
    j = judge(ca)
    blob = credential(ca, serial=7)
    admitted = j.admit(blob, None)
    assert admitted is not None
    node, rank = admitted
    assert node == "n1" and rank[1] == 7
    info = j.info(blob)
    assert info is not None and info.address == "10.0.0.1:7946" and len(info.record_key) == 32
    assert j.stats.admitted == 1


def test_a_later_signing_of_the_same_certificate_ranks_higher(ca: Path) -> None:
    j = judge(ca)
    a, b = j.admit(credential(ca, serial=1), None), j.admit(credential(ca, serial=2), None)
    assert a is not None and b is not None and b[1] > a[1]


def test_refusals_name_their_reason_and_are_counted(ca: Path, tmp_path: Path) -> None:
    told: list[Refusal] = []
    j = judge(ca, on_refused=lambda reason, detail, via: told.append(reason))
    assert refusal(j, credential(ca, cluster="other")) is Refusal.WRONG_CLUSTER
    other_ca = tmp_path / "other"
    pki.init_ca(other_ca)
    pki.issue(other_ca, "n1")
    assert refusal(j, credential(other_ca)) is Refusal.UNTRUSTED
    # n2's certificate inside a credential that claims to be n1.
    files = pki.node_files(ca, "n2")
    forged = make_credential(
        cluster="c", node="n1", record_key=NodeIdentity.generate("n1").public_key_bytes(),
        address="", serial=1, certificate=pki.load_certificate(files.cert),
        tls_key=pki.load_private_key(files.key),
    )  # fmt: skip
    assert refusal(j, forged) is Refusal.WRONG_NODE
    body, signature = msgpack.unpackb(credential(ca))
    fields = msgpack.unpackb(body)
    fields[4] = NodeIdentity.generate("n1").public_key_bytes()  # another record key
    tampered = pack([pack(fields), signature])
    assert refusal(j, tampered) is Refusal.BAD_SIGNATURE
    assert refusal(j, b"\x92\xc4\x00") is Refusal.MALFORMED
    assert j.admit(tampered, "n2") is None
    assert told == [Refusal.BAD_SIGNATURE]
    assert j.stats.refused[Refusal.BAD_SIGNATURE] == 1


def test_an_expired_or_not_yet_valid_certificate_is_refused(ca: Path) -> None:
    blob = credential(ca)
    later = judge(ca, clock=lambda: dt.datetime.now(dt.UTC) + dt.timedelta(days=3000))
    assert refusal(later, blob) is Refusal.EXPIRED
    earlier = judge(ca, clock=lambda: dt.datetime.now(dt.UTC) - dt.timedelta(days=2))
    assert refusal(earlier, blob) is Refusal.EXPIRED


def test_revocation_by_node_serial_fingerprint_and_crl(ca: Path, tmp_path: Path) -> None:
    blob = credential(ca)
    cert = pki.load_certificate(pki.node_files(ca, "n1").cert)
    for entries in (["n1"], [hex(cert.serial_number)], [fingerprint(cert)]):
        assert refusal(judge(ca, Revocations.from_entries(entries)), blob) is Refusal.REVOKED
    assert refusal(judge(ca, Revocations.from_entries(["n2"])), blob) is None
    ca_cert, ca_key = pki.load_ca(ca)
    now = dt.datetime.now(dt.UTC)
    crl = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now)
        .next_update(now + dt.timedelta(days=1))
        .add_revoked_certificate(
            x509.RevokedCertificateBuilder()
            .serial_number(cert.serial_number)
            .revocation_date(now)
            .build()
        )
        .sign(ca_key, hashes.SHA256())
    )
    from cryptography.hazmat.primitives.serialization import Encoding

    (tmp_path / "ca.crl").write_bytes(crl.public_bytes(Encoding.PEM))
    (tmp_path / "deny.txt").write_text("# none yet\n\n")
    revs = load_revocations(
        RevocationConfig(deny_file=tmp_path / "deny.txt", crl=tmp_path / "ca.crl")
    )
    assert refusal(judge(ca, revs), blob) is Refusal.REVOKED


def test_bad_deny_entries_and_files_are_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="expected a node id"):
        Revocations.from_entries(["not an id!"])
    (tmp_path / "bad.crl").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"bad\.crl: not a PEM or DER CRL"):
        load_revocations(RevocationConfig(crl=tmp_path / "bad.crl"))
    with pytest.raises(ValueError, match="cannot read"):
        load_revocations(RevocationConfig(deny_file=tmp_path / "missing.txt"))
