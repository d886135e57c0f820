"""The configuration keys that let one file serve a whole fleet.

A fleet's nodes share one configuration: the node id comes from the environment (the
Kubernetes downward API, or the host name), the address peers dial from
``advertise`` or the environment, trust from the cluster CA (``trust_mode = "ca"``)
instead of a list of every node's key, revocations from a deny list or the CA's CRL,
and peers from discovery (`convergenced.discovery`) instead of ``[[peers]]``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from convergenced.core.validate import NAME_RE
from convergenced.discovery.contacts import parse_address
from convergenced.errors import ConfigError
from convergenced.security.node_credentials import Revocations

NODE_ID_ENV = "CONVERGENCED_NODE_ID"
"""Where the node id comes from when the file names none (set it from the downward
API's ``spec.nodeName`` in a DaemonSet)."""
ADVERTISE_ENV = "CONVERGENCED_ADVERTISE"
"""Where ``advertise`` comes from when the file names none."""
TRUST_MODES = ("list", "ca")
MAX_DENY_ENTRIES = 65536
DEFAULT_RECHECK_S = 30.0


@dataclass(frozen=True, slots=True)
class RevocationConfig:
    """``[revocation]``: who is no longer trusted, and how often to look again."""

    deny: tuple[str, ...] = ()
    deny_file: Path | None = None
    crl: Path | None = None
    recheck_s: float = DEFAULT_RECHECK_S
    """How often the deny file, the CRL and the TLS certificate files are checked for
    changes (a SIGHUP checks at once)."""


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """How this node finds and trusts the rest of the fleet."""

    trust_mode: str = "list"
    """``list``: records are checked against ``[trust]``; ``ca``: against the
    credentials the cluster CA vouches for (and ``[trust]``, while migrating)."""
    advertise: tuple[str, int] | None = None
    """The address peers dial to reach this node (in its credential)."""
    revocation: RevocationConfig = field(default_factory=RevocationConfig)

    @property
    def ca_trust(self) -> bool:
        """True in CA mode."""
        return self.trust_mode == "ca"


def node_id_from_environment(env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The node id when the file names none, and where it came from.

    Raises:
        ValueError: the variable or the host name is not a valid node id.
    """
    env = os.environ if env is None else env
    value, origin = env.get(NODE_ID_ENV, ""), f"${NODE_ID_ENV}"
    if not value:
        value, origin = socket.gethostname(), "the host name"
    if not NAME_RE.match(value):
        raise ValueError(
            f"{origin} is {value!r}, not a node id (1-128 of A-Z a-z 0-9 . _ / -, starting "
            f"with a letter or digit); set node_id or {NODE_ID_ENV}"
        )
    return value, origin


def _advertised(value: Any) -> tuple[str, int] | None:
    """``host:port`` (``[v6]:port``, port 1-65535) or None when it is not one."""
    if not isinstance(value, str):
        return None
    try:
        host, port = parse_address(value, None)
    except ValueError:
        return None
    return (host, port) if port > 0 else None


def default_advertise(listen_host: str, listen_port: int) -> tuple[str, int]:
    """Where peers dial this node when neither the file nor the environment says:
    the listen address unless it is a wildcard, else the host name."""
    if listen_host not in ("0.0.0.0", "::", ""):
        return listen_host, listen_port
    return socket.gethostname(), listen_port


def parse_fleet(
    raw: Mapping[str, Any], source: str, env: Mapping[str, str] | None = None
) -> FleetConfig:
    """Validate ``trust_mode``, ``advertise`` and ``[revocation]``.

    Raises:
        ConfigError: naming the key.
    """
    env = os.environ if env is None else env
    mode = raw.get("trust_mode", "list")
    if mode not in TRUST_MODES:
        raise ConfigError(
            source, "trust_mode", f"{mode!r}; expected one of {', '.join(TRUST_MODES)}"
        )
    advertise = None
    if "advertise" in raw or env.get(ADVERTISE_ENV):
        key = "advertise" if "advertise" in raw else f"${ADVERTISE_ENV}"
        value = raw.get("advertise", env.get(ADVERTISE_ENV))
        advertise = _advertised(value)
        if advertise is None:
            raise ConfigError(source, key, f"{value!r}; expected 'host:port' (port 1-65535)")
    return FleetConfig(mode, advertise, _revocation(raw.get("revocation", {}), source))


def _revocation(table: Any, source: str) -> RevocationConfig:
    if not isinstance(table, Mapping):
        raise ConfigError(source, "revocation", "expected a table")
    known = {"deny", "deny_file", "crl", "recheck_s"}
    for key in table:
        if key not in known:
            raise ConfigError(
                source,
                f"revocation.{key}",
                f"unknown key; expected one of {', '.join(sorted(known))}",
            )
    deny = table.get("deny", [])
    if not isinstance(deny, list) or not all(isinstance(x, str) for x in deny):
        raise ConfigError(source, "revocation.deny", "expected a list of strings")
    if len(deny) > MAX_DENY_ENTRIES:
        raise ConfigError(
            source, "revocation.deny", f"{len(deny)} entries above {MAX_DENY_ENTRIES}"
        )
    try:
        Revocations.from_entries(deny)
    except ValueError as exc:
        raise ConfigError(source, "revocation.deny", str(exc)) from None
    paths: dict[str, Path | None] = {}
    for key in ("deny_file", "crl"):
        value = table.get(key)
        if value is not None and (not isinstance(value, str) or not value.startswith("/")):
            raise ConfigError(source, f"revocation.{key}", f"{value!r}; expected an absolute path")
        paths[key] = Path(value) if value is not None else None
    recheck = table.get("recheck_s", DEFAULT_RECHECK_S)
    if (
        isinstance(recheck, bool)
        or not isinstance(recheck, int | float)
        or not 1 <= recheck <= 86400
    ):
        raise ConfigError(
            source, "revocation.recheck_s", f"{recheck!r}; expected seconds from 1 to 86400"
        )
    return RevocationConfig(tuple(deny), paths["deny_file"], paths["crl"], float(recheck))


def load_revocations(cfg: RevocationConfig) -> Revocations:
    """The deny list (inline and file) and the CRL's serials, read now.

    Raises:
        ValueError: naming the file and what is wrong with it.
    """
    entries = list(cfg.deny)
    if cfg.deny_file is not None:
        try:
            text = cfg.deny_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{cfg.deny_file}: cannot read: {exc}") from None
        for line in text.splitlines():
            entry = line.split("#", 1)[0].strip()
            if entry:
                entries.append(entry)
            if len(entries) > MAX_DENY_ENTRIES:
                raise ValueError(f"{cfg.deny_file}: more than {MAX_DENY_ENTRIES} entries")
    serials: set[int] = set()
    if cfg.crl is not None:
        serials = _crl_serials(cfg.crl)
    try:
        return Revocations.from_entries(entries, serials)
    except ValueError as exc:
        raise ValueError(f"{cfg.deny_file or 'revocation.deny'}: {exc}") from None


def _crl_serials(path: Path) -> set[int]:
    from cryptography import x509

    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        crl = (
            x509.load_pem_x509_crl(data)
            if data.lstrip().startswith(b"-----")
            else x509.load_der_x509_crl(data)
        )
    except ValueError as exc:
        raise ValueError(f"{path}: not a PEM or DER CRL ({exc})") from None
    return {entry.serial_number for entry in crl}
