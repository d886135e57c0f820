"""A node's Ed25519 identity (its key file and record signing), and public-key checks.

Why: records travel through relays (the overlay past ``mesh_limit`` nodes), so the
link a record arrives on says nothing about who wrote it. Each origin therefore signs
its records with its own Ed25519 key, over the canonical body of PROTOCOL.md 7.2
(`Record.body_bytes`, the same bytes the fingerprint hashes); `NodeIdentity` does the
signing and `convergenced.security.trust` the checking.

Identity files are PEM PKCS#8 keys with RFC 7468 "explanatory text" above the PEM
block naming the node and its public key, so ``openssl pkey`` reads them unchanged and
an operator can see whose key a file holds without extracting anything. They are
written atomically (temporary file, fsync, link or rename, fsync of the directory)
with mode 0600, and never silently overwritten: replacing a node's key changes its
identity for the whole cluster. `check_private_mode` is the ssh-style permission check
this module and the CA's key files (`convergenced.security.pki`) share.

Public keys of other nodes (the trust list's) are checked here too: OpenSSL accepts
Ed25519 keys of small order, under which anyone can forge signatures, so
`is_weak_public_key` does the bit of curve arithmetic needed to refuse them.

Everything here is synchronous and free of trio, so the daemon, the CLI and offline
tools share it.
"""

from __future__ import annotations

import binascii
import dataclasses
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from convergenced.core.errors import LocalProtocolError
from convergenced.core.records import Record
from convergenced.core.validate import NAME_RE
from convergenced.errors import ConvergencedError
from convergenced.fsutil import write_atomic

PUBLIC_KEY_LEN = 32
_HEADER_TITLE = (
    "convergenced node identity (Ed25519). Keep it secret: whoever holds this file "
    "speaks for the node."
)


class IdentityError(ConvergencedError):
    """An identity file is missing, unreadable, corrupt, too open, or for another node.

    The message starts with the file's path when there is one (``path`` holds it).
    """

    def __init__(self, path: Path | str | None, problem: str) -> None:
        super().__init__(f"{path}: {problem}" if path is not None else problem)
        self.path = None if path is None else str(path)


# -- files ----------------------------------------------------------------------


def check_private_mode(path: Path | str, st: os.stat_result) -> str | None:
    """Why ``path`` is too open for a private key (group/other bits set), or None."""
    bits = stat.S_IMODE(st.st_mode)
    if bits & 0o077:
        return f"permissions {bits:04o} are too open for a private key; run: chmod 600 {path}"
    return None


# -- Ed25519 helpers ---------------------------------------------------------------

# Curve25519 in twisted Edwards form, for the small-order check below only (signing
# and verification are cryptography's/OpenSSL's).
_P = 2**255 - 19
_D = (-121665 * pow(121666, -1, _P)) % _P
_SQRT_M1 = pow(2, (_P - 1) // 4, _P)


def _decode_point(raw: bytes) -> tuple[int, int] | None:
    y = int.from_bytes(raw, "little") & ((1 << 255) - 1)
    sign = raw[31] >> 7
    if y >= _P:
        return None
    x2 = (y * y - 1) * pow(_D * y * y + 1, -1, _P) % _P
    x = pow(x2, (_P + 3) // 8, _P)
    if (x * x - x2) % _P:
        x = x * _SQRT_M1 % _P
    if (x * x - x2) % _P:
        return None
    if x == 0 and sign:
        return None
    if x & 1 != sign:
        x = _P - x
    return x, y


def _double(pt: tuple[int, int, int]) -> tuple[int, int, int]:
    """Projective doubling on -x^2 + y^2 = 1 + d x^2 y^2 (dbl-2008-bbjlp): no inversions."""
    x, y, z = pt
    b = (x + y) * (x + y) % _P
    c = x * x % _P
    d = y * y % _P
    f = (d - c) % _P
    j = (f - 2 * z * z) % _P
    return (b - c - d) * j % _P, f * (-c - d) % _P, f * j % _P


def is_weak_public_key(raw: bytes) -> bool:
    """True when ``raw`` is not a usable Ed25519 public key.

    That is: not 32 bytes, not a canonical point on the curve, or a point of small
    order (such as all zeros or the identity ``01 00 .. 00``). OpenSSL accepts small-
    order keys, and with one anyone can forge signatures that verify under it, so a
    trust list must never contain one.
    """
    if len(raw) != PUBLIC_KEY_LEN:
        return True
    affine = _decode_point(raw)
    if affine is None:
        return True
    pt = (affine[0], affine[1], 1)
    for _ in range(3):
        pt = _double(pt)
    x, y, z = pt
    return x == 0 and (y - z) % _P == 0  # 8P is the neutral element (0, 1)


def public_key_from_hex(text: str) -> bytes:
    """Raw public key bytes from 64 hex digits (case-insensitive).

    Raises:
        ValueError: not 64 hex digits, or a weak key (see `is_weak_public_key`).
    """
    if len(text) != 2 * PUBLIC_KEY_LEN:
        raise ValueError(f"expected {2 * PUBLIC_KEY_LEN} hex digits, got {len(text)} characters")
    try:
        raw = binascii.unhexlify(text)
    except (binascii.Error, ValueError):
        raise ValueError("not hexadecimal") from None
    if is_weak_public_key(raw):
        raise ValueError("not a valid Ed25519 public key (off the curve or of small order)")
    return raw


# -- node identity -----------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class NodeIdentity:
    """A node id and its Ed25519 private key: what the node signs its records with.

    Compared by identity (``is``), never by value: two objects with one node id may
    hold different keys.
    """

    node_id: str
    private_key: Ed25519PrivateKey = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.node_id, str) or not NAME_RE.match(self.node_id):
            raise IdentityError(
                None,
                f"node id {self.node_id!r}: expected 1-128 of A-Z a-z 0-9 . _ / -, "
                "starting with a letter or digit",
            )

    @classmethod
    def generate(cls, node_id: str) -> NodeIdentity:
        """A fresh random identity for ``node_id``.

        Raises:
            IdentityError: ``node_id`` is not a valid name.
        """
        return cls(node_id, Ed25519PrivateKey.generate())

    def public_key_bytes(self) -> bytes:
        """The raw 32-byte public key (what the trust list holds)."""
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    def public_key_hex(self) -> str:
        """The public key as 64 lower-case hex digits (the trust list's TOML form)."""
        return self.public_key_bytes().hex()

    def trust_entry(self) -> str:
        """This node's line for a ``[trust]`` table: ``"node-1" = "<hex>"``."""
        return f'"{self.node_id}" = "{self.public_key_hex()}"'

    def sign(self, data: bytes) -> bytes:
        """Ed25519 signature (64 bytes) of ``data``."""
        return self.private_key.sign(data)

    def sign_record(self, record: Record) -> Record:
        """``record`` with its signature set: Ed25519 over the canonical body (7.2).

        The result has the same fingerprint (the signature is not part of the body);
        signing is deterministic, so re-signing gives identical bytes.

        Raises:
            LocalProtocolError: the record's origin is another node (a node signs
                only what it publishes itself; relays forward records unchanged).
        """
        if record.origin != self.node_id:
            raise LocalProtocolError(
                f"cannot sign a record of origin {record.origin!r} as {self.node_id!r}",
                reason="foreign_origin",
            )
        signature = self.sign(record.body_bytes())
        # `_packed` caches the wire bytes, which include the signature: drop it. The
        # cached fingerprint stays valid (same body).
        return dataclasses.replace(record, signature=signature, _packed=b"")

    def to_pem(self) -> bytes:
        """The file form: explanatory header lines, then the PKCS#8 PEM block."""
        pem = self.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        header = (
            f"{_HEADER_TITLE}\nnode-id: {self.node_id}\npublic-key: {self.public_key_hex()}\n\n"
        )
        return header.encode() + pem

    def save(self, path: Path | str, *, overwrite: bool = False) -> None:
        """Write the identity to ``path`` atomically, mode 0600.

        Raises:
            IdentityError: ``path`` exists (and ``overwrite`` is false) or cannot be
                written; the message names the file.
        """
        try:
            write_atomic(path, self.to_pem(), chmod=0o600, overwrite=overwrite)
        except FileExistsError:
            raise IdentityError(
                path,
                "already exists; refusing to replace a node identity (the cluster's trust "
                "list names its public key)",
            ) from None
        except OSError as exc:
            raise IdentityError(path, f"cannot write: {exc.strerror or exc}") from None

    @classmethod
    def load(
        cls, path: Path | str, node_id: str | None = None, *, check_mode: bool = True
    ) -> NodeIdentity:
        """Read an identity written by `save` (or any PKCS#8 Ed25519 PEM key).

        Args:
            path: the file.
            node_id: the node id expected (from configuration). Required when the file
                has no ``node-id:`` line; otherwise it must match that line.
            check_mode: refuse a file that group or others may read, as ssh does.

        Raises:
            IdentityError: naming ``path``: missing, unreadable, too open, not an
                Ed25519 PEM key, header inconsistent with the key, or another node's.
        """
        path = Path(path)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                data = f.read(1 << 16)
        except FileNotFoundError:
            raise IdentityError(path, "not found (create one with: convergenced keygen)") from None
        except OSError as exc:
            raise IdentityError(path, f"cannot read: {exc.strerror or exc}") from None
        if check_mode:
            problem = check_private_mode(path, st)
            if problem:
                raise IdentityError(path, problem)
        headers = _explanatory_headers(data)
        try:
            key: Any = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as exc:
            reason = str(exc).split(". See https://", 1)[0]
            raise IdentityError(path, f"not a PEM private key ({reason})") from None
        except Exception as exc:  # cryptography raises its own types for odd encodings
            raise IdentityError(path, f"not a PEM private key ({type(exc).__name__})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityError(path, f"holds a {type(key).__name__}, expected an Ed25519 key")
        named = headers.get("node-id")
        if named is None and node_id is None:
            raise IdentityError(path, "has no 'node-id:' line; pass the node id")
        if named is not None and node_id is not None and named != node_id:
            raise IdentityError(path, f"is the identity of {named!r}, not of {node_id!r}")
        try:
            identity = cls(node_id or named or "", key)
        except IdentityError as exc:
            raise IdentityError(path, str(exc)) from None
        pub = headers.get("public-key")
        if pub is not None and pub.lower() != identity.public_key_hex():
            raise IdentityError(
                path, "'public-key:' line does not match the key (file edited or corrupt)"
            )
        return identity


def _explanatory_headers(data: bytes) -> dict[str, str]:
    """``name: value`` lines above the PEM block (RFC 7468 explanatory text)."""
    out: dict[str, str] = {}
    for raw in data.split(b"\n"):
        line = raw.decode("utf-8", "replace").strip()
        if line.startswith("-----BEGIN"):
            break
        name, sep, value = line.partition(":")
        if sep and name in ("node-id", "public-key"):
            out[name] = value.strip()
    return out
