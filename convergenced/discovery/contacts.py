"""Contacts, the addresses they are written as, and the ``[discovery]`` table.

A contact is a candidate peer: an address to dial and, when the source knows it, the
node id expected there. It is never proof of identity: the dialler verifies the peer,
so a wrong or stale contact costs a failed dial, never a wrong member.

Sans-IO on purpose: no trio, no sockets, no clock. The configuration loader parses the
``[discovery]`` table with this module, and the trio adapter (`sources`) feeds it the
bytes of the contacts file, so both are tested without a network or a file system.

Limits are explicit because every input here comes from outside the daemon: an
orchestrator's file, an operator's table. A runaway generator must produce a clear
error, not a daemon that dials a million addresses or holds a gigabyte of text.

Addresses are normalised when parsed (IP literals to their canonical text, host names
to lower case), so that one peer written two ways is one contact, not two.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import total_ordering
from pathlib import Path
from typing import Any, Final, Literal

from convergenced.core.validate import NAME_RE
from convergenced.errors import ConfigError

__all__ = [
    "DEFAULT_REFRESH_S",
    "MAX_CONTACTS",
    "MAX_FILE_BYTES",
    "MAX_LINE_CHARS",
    "MAX_NAMESERVERS",
    "MAX_SEEDS",
    "SOURCE_KINDS",
    "Contact",
    "DiscoveryConfig",
    "SourceKind",
    "format_address",
    "merge_contacts",
    "parse_address",
    "parse_contacts_file",
    "parse_discovery_table",
]

MAX_CONTACTS: Final = 65_536
"""Contacts one source may yield (the contacts file, an SRV answer): far above any
fleet we run, low enough that a runaway generator is an error, not a dial storm."""
MAX_LINE_CHARS: Final = 512
"""Characters of one line of the contacts file: a node id (128) and an address fit
with room for a comment; a longer line is a generator bug, reported as such."""
MAX_FILE_BYTES: Final = 8 << 20
"""Bytes of the contacts file: 65,536 lines of about 100 characters, with margin."""
MAX_SEEDS: Final = 1024
"""Entries of ``discovery.seeds``: seeds are a bootstrap, not the fleet's list."""
MAX_NAMESERVERS: Final = 8
"""Entries of ``discovery.nameservers`` (resolv.conf itself takes three)."""
MAX_DNS_NAME_CHARS: Final = 253
"""The longest DNS name in text form (RFC 1035, without the trailing dot)."""
DEFAULT_REFRESH_S: Final = 15.0
"""Seconds between lookups: quick enough to see a replaced pod before its job's next
restart needs it, slow enough that a 10,000-node fleet asks DNS ~700 times a second."""
MIN_REFRESH_S: Final = 1.0
MAX_REFRESH_S: Final = 3600.0
DNS_PORT: Final = 53

SourceKind = Literal["seeds", "dns", "srv", "file"]
"""Where contacts come from; also a bounded metric label."""
SOURCE_KINDS: Final[tuple[SourceKind, ...]] = ("seeds", "dns", "srv", "file")

_LABEL_RE = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?\Z")
"""One label of a host or DNS name. Underscores are allowed: SRV names need them and
some resolvers hand them out; a name that cannot resolve fails at lookup anyway."""
_PORT_RE = re.compile(r"[0-9]{1,5}\Z")
"""ASCII digits only: ``str.isdigit`` would also take '²' and other Unicode digits."""
_Fail = Callable[[str, str], ConfigError]
_NODE_ID_HINT = "1-128 of A-Z a-z 0-9 . _ / -, starting with a letter or digit"


def format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets so the result parses back."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@total_ordering
@dataclass(frozen=True, slots=True)
class Contact:
    """A candidate peer: where to dial and, if the source knows it, who should answer.

    ``node_id`` is None for an address-only contact (a seed, a DNS answer): the node
    id is learned when it is dialled. Contacts are hashable and sort by address, so
    sets of them compare cheaply and print in a stable order.
    """

    host: str
    port: int
    node_id: str | None = None

    @property
    def address(self) -> str:
        """``host:port`` as an operator writes it (IPv6 in brackets)."""
        return format_address(self.host, self.port)

    def __str__(self) -> str:
        return self.address if self.node_id is None else f"{self.node_id}@{self.address}"

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Contact):
            return NotImplemented
        return _sort_key(self) < _sort_key(other)


def _sort_key(c: Contact) -> tuple[str, int, str]:
    # "" sorts address-only contacts first and never equals a node id (NAME_RE).
    return (c.host, c.port, c.node_id or "")


def merge_contacts(contacts: Iterable[Contact]) -> frozenset[Contact]:
    """The union of contacts from several sources, without redundant address-only ones.

    An address-only contact whose address another contact names with a node id adds
    nothing (dialling it would reach the same peer), so it is dropped. Two different
    node ids at one address are both kept: the dialler finds out which one answers.
    """
    pool = set(contacts)
    named = {(c.host, c.port) for c in pool if c.node_id is not None}
    return frozenset(c for c in pool if c.node_id is not None or (c.host, c.port) not in named)


def _host(text: str, whole: str) -> str:
    """The canonical form of a host: an IP literal's standard text, a name in lower case."""
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        pass
    name = text[:-1] if text.endswith(".") else text
    labels = name.split(".")
    if (
        not name
        or len(name) > MAX_DNS_NAME_CHARS
        or not all(_LABEL_RE.match(label) for label in labels)
        # An all-digit last label is a mistyped IPv4 address ("10.0.0.256", "010.0.0.1"),
        # which some resolvers would read as octal or as a number: never a host name.
        or labels[-1].isdigit()
    ):
        raise ValueError(f"{whole!r}; {text!r} is neither an IP address nor a host name")
    return text.lower()


def parse_address(text: str, default_port: int | None) -> tuple[str, int]:
    """Split ``host:port``, ``[v6]:port`` or a bare host into (host, port).

    Args:
        text: the address as written. An IPv6 address takes brackets even without a
            port: ``fd00::1:7946`` could be a host and a port or one address, and a
            guess would dial the wrong place.
        default_port: the port of a bare host; None when the port is required (a
            listen address).

    Returns:
        The canonical host (an IPv6 address without brackets) and the port (0-65535;
        a caller that dials rejects 0 itself).

    Raises:
        ValueError: with a message that quotes ``text`` and says what was expected.
    """
    if not text or any(ch.isspace() for ch in text):
        raise ValueError(f"{text!r}; expected 'host:port' without spaces")
    port_s: str | None
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError(f"{text!r}; no ']' closes the IPv6 address")
        inner, rest = text[1:end], text[end + 1 :]
        try:
            host = str(ipaddress.IPv6Address(inner))
        except ValueError:
            raise ValueError(f"{text!r}; {inner!r} in brackets is not an IPv6 address") from None
        if rest and not rest.startswith(":"):
            raise ValueError(f"{text!r}; expected ':port' after ']'")
        port_s = rest[1:] if rest else None
    elif text.count(":") > 1:
        raise ValueError(f"{text!r}; an IPv6 address needs brackets, as in '[fd00::1]:7946'")
    else:
        host_s, sep, after = text.partition(":")
        if not host_s:
            raise ValueError(f"{text!r}; expected 'host:port' with a host before the colon")
        host = _host(host_s, text)
        port_s = after if sep else None
    if port_s is None:
        if default_port is None:
            raise ValueError(f"{text!r}; expected 'host:port'")
        return host, default_port
    if not _PORT_RE.match(port_s) or int(port_s) > 65535:
        raise ValueError(f"{text!r}; expected 'host:port' with a port from 0 to 65535")
    return host, int(port_s)


def _dialable(text: str, default_port: int) -> tuple[str, int]:
    host, port = parse_address(text, default_port)
    if port == 0:
        raise ValueError(f"{text!r}; port 0 cannot be dialled")
    return host, port


def parse_contacts_file(text: str, source: str, default_port: int) -> tuple[Contact, ...]:
    """Parse the contacts file an orchestrator keeps up to date.

    One contact per line: ``host:port`` (or a bare host, on ``default_port``) or
    ``NODE_ID host:port``. ``#`` starts a comment; blank lines are ignored. A line
    repeated, or an address listed bare and also with its node id, is one contact.
    One address under two node ids, or one node id at two addresses, is an error: the
    file is a single authority, and a contradiction in it is a generator bug that a
    silent choice would hide.

    Returns:
        The contacts, sorted.

    Raises:
        ConfigError: naming ``source`` and ``line N`` (1-based) and the problem, or the
            whole file when it is above `MAX_FILE_BYTES`.
    """
    if len(text) > MAX_FILE_BYTES:  # characters <= bytes: a cheap, sound first check
        raise ConfigError(source, "", f"above the limit of {MAX_FILE_BYTES} bytes")
    by_address: dict[tuple[str, int], tuple[Contact, int]] = {}
    by_node: dict[str, tuple[Contact, int]] = {}
    for n, raw in enumerate(text.split("\n"), start=1):
        key = f"line {n}"
        line = raw.removesuffix("\r")
        if len(line) > MAX_LINE_CHARS:
            raise ConfigError(
                source, key, f"{len(line)} characters, above the limit of {MAX_LINE_CHARS}"
            )
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 2:
            raise ConfigError(
                source, key, f"{len(fields)} fields; expected 'host:port' or 'NODE_ID host:port'"
            )
        node_id = fields[0] if len(fields) == 2 else None
        if node_id is not None and not NAME_RE.match(node_id):
            raise ConfigError(source, key, f"{node_id!r} is not a node id ({_NODE_ID_HINT})")
        try:
            host, port = _dialable(fields[-1], default_port)
        except ValueError as exc:
            raise ConfigError(source, key, str(exc)) from None
        contact = Contact(host, port, node_id)
        earlier = by_address.get((host, port))
        if earlier is not None:
            first, first_line = earlier
            if node_id is None or first == contact:
                continue  # a repeat, or a bare address already known with its node id
            if first.node_id is not None:
                raise ConfigError(
                    source,
                    key,
                    f"{contact.address} is already listed as {first.node_id!r} on line "
                    f"{first_line}",
                )
        if node_id is not None:
            named = by_node.get(node_id)
            if named is not None:
                raise ConfigError(
                    source,
                    key,
                    f"{node_id!r} is already listed at {named[0].address} on line {named[1]}",
                )
            by_node[node_id] = (contact, n)
        if earlier is None and len(by_address) >= MAX_CONTACTS:
            raise ConfigError(source, key, f"more than {MAX_CONTACTS} contacts")
        by_address[(host, port)] = (contact, n)
    return tuple(sorted(c for c, _ in by_address.values()))


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    """The ``[discovery]`` table: every source of contacts this node asks.

    All sources are optional and their answers are united; a table with none of
    them discovers nothing (a node whose peers all dial it, or a single host).
    """

    default_port: int
    """The port of an address written without one (a bare seed, a bare host in the
    contacts file, every `dns` answer unless `dns_port` says otherwise): the daemon's
    own peer port, since a fleet sharing one configuration listens on one port."""
    seeds: tuple[Contact, ...] = ()
    """Fixed addresses: a bootstrap that works when DNS does not."""
    dns: str | None = None
    """A name whose A and AAAA records are peers (a Kubernetes headless service)."""
    dns_port: int | None = None
    """The port of every address `dns` yields; None: `default_port`."""
    srv: str | None = None
    """An SRV name: each record gives a target (resolved to addresses) and a port."""
    file: Path | None = None
    """A contacts file (`parse_contacts_file`), re-read when it changes."""
    nameservers: tuple[tuple[str, int], ...] = ()
    """(IP, port) of the DNS servers to ask; empty: the system's (/etc/resolv.conf)."""
    refresh_s: float = DEFAULT_REFRESH_S
    """Seconds between lookups."""

    @property
    def kinds(self) -> tuple[SourceKind, ...]:
        """The configured sources, in `SOURCE_KINDS` order."""
        present = {
            "seeds": bool(self.seeds),
            "dns": self.dns is not None,
            "srv": self.srv is not None,
            "file": self.file is not None,
        }
        return tuple(k for k in SOURCE_KINDS if present[k])


_DISCOVERY_KEYS = frozenset({"seeds", "dns", "dns_port", "srv", "file", "nameservers", "refresh_s"})


def parse_discovery_table(table: Any, source: str, default_port: int) -> DiscoveryConfig:
    """Validate the ``[discovery]`` table of a configuration file.

    Args:
        table: the parsed TOML value of ``discovery``.
        source: the file it came from, for error messages.
        default_port: the port of a seed or DNS address written without one (the
            daemon's peer port: a fleet sharing one configuration listens on one).

    Raises:
        ConfigError: naming ``discovery.<key>`` (``discovery.seeds[2]`` for one entry),
            what was found and what was expected. Unknown keys are errors: a typo must
            not silently leave a source unconfigured.
    """
    if not isinstance(table, Mapping):
        raise ConfigError(source, "discovery", "expected a table with seeds, dns, srv or file")

    def fail(key: str, problem: str) -> ConfigError:
        return ConfigError(source, f"discovery.{key}", problem)

    for key in table:
        if key not in _DISCOVERY_KEYS:
            raise fail(key, f"unknown key; expected one of {', '.join(sorted(_DISCOVERY_KEYS))}")

    seeds = _strings(table, "seeds", MAX_SEEDS, fail, "'host:port' strings")
    contacts: set[Contact] = set()
    for i, text in enumerate(seeds):
        try:
            contacts.add(Contact(*_dialable(text, default_port)))
        except ValueError as exc:
            raise fail(f"seeds[{i}]", str(exc)) from None

    dns = _dns_name(table, "dns", fail, srv=False)
    srv = _dns_name(table, "srv", fail, srv=True)
    dns_port: int | None = None  # None: default_port
    if "dns_port" in table:
        value = table["dns_port"]
        if dns is None:
            raise fail("dns_port", "goes with dns (the port of the addresses it resolves to)")
        if type(value) is not int or not 1 <= value <= 65535:
            raise fail("dns_port", f"{value!r}; expected an integer from 1 to 65535")
        dns_port = value

    nameservers: list[tuple[str, int]] = []
    if "nameservers" in table and dns is None and srv is None:
        raise fail("nameservers", "goes with dns or srv (the servers that answer them)")
    for i, text in enumerate(
        _strings(table, "nameservers", MAX_NAMESERVERS, fail, "'ip' or 'ip:port' strings")
    ):
        try:
            nameservers.append(_nameserver(text))
        except ValueError as exc:
            raise fail(f"nameservers[{i}]", str(exc)) from None

    file: Path | None = None
    if "file" in table:
        value = table["file"]
        if not isinstance(value, str) or not value.startswith("/"):
            raise fail("file", f"{value!r}; expected an absolute path")
        file = Path(value)

    refresh = table.get("refresh_s", DEFAULT_REFRESH_S)
    if (
        not isinstance(refresh, int | float)
        or isinstance(refresh, bool)
        or not MIN_REFRESH_S <= refresh <= MAX_REFRESH_S
    ):
        raise fail(
            "refresh_s",
            f"{refresh!r}; expected seconds from {MIN_REFRESH_S:g} to {MAX_REFRESH_S:g}",
        )
    return DiscoveryConfig(
        default_port=default_port,
        seeds=tuple(sorted(contacts)),
        dns=dns,
        dns_port=dns_port,
        srv=srv,
        file=file,
        nameservers=tuple(dict.fromkeys(nameservers)),
        refresh_s=float(refresh),
    )


def _strings(
    table: Mapping[str, Any],
    key: str,
    limit: int,
    fail: _Fail,
    what: str,
) -> list[str]:
    value = table.get(key, [])
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise fail(key, f"{value!r}; expected a list of {what}")
    if len(value) > limit:
        raise fail(key, f"{len(value)} entries, above the limit of {limit}")
    return value


def _dns_name(table: Mapping[str, Any], key: str, fail: _Fail, *, srv: bool) -> str | None:
    if key not in table:
        return None
    value = table[key]
    example = "_peer._tcp.convergenced.svc.cluster.local" if srv else "peers.example.internal"
    if not isinstance(value, str):
        raise fail(key, f"{value!r}; expected a DNS name like {example!r}")
    bare = value[:-1] if value.endswith(".") else value
    labels = bare.split(".")
    if (
        not bare
        or len(bare) > MAX_DNS_NAME_CHARS
        or not all(_LABEL_RE.match(label) for label in labels)
    ):
        raise fail(key, f"{value!r}; expected a DNS name like {example!r}")
    if srv and (len(labels) < 3 or not labels[0].startswith("_") or not labels[1].startswith("_")):
        raise fail(key, f"{value!r}; expected an SRV name '_service._proto.name' like {example!r}")
    if not srv and _is_ip(bare):
        raise fail(key, f"{value!r} is an address, not a name; list fixed addresses in seeds")
    return value


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _nameserver(text: str) -> tuple[str, int]:
    """``ip``, ``ip:port`` or ``[v6]:port``; a bare IPv6 address is unambiguous here."""
    if _is_ip(text):
        return str(ipaddress.ip_address(text)), DNS_PORT
    host, port = _dialable(text, DNS_PORT)
    if not _is_ip(host):
        raise ValueError(f"{text!r}; a nameserver is an IP address (a name would need DNS)")
    return host, port
