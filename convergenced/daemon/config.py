"""Daemon configuration: a TOML file, validated with errors that name file and key.

Every setting has a default that suits a single GPU host, so a minimal file is::

    node_id = "gpu-node-01"

Unknown keys are errors (a typo must not silently fall back to a default). Every
error says which file, which key, what was found and what was expected.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from convergenced.core.errors import FactError
from convergenced.core.facts import ComponentReport
from convergenced.core.limits import MAX_MEMBERS
from convergenced.core.validate import NAME_RE
from convergenced.core.versions import MAX_COMPONENTS, Catalogue, check_report
from convergenced.daemon.fleet_config import (
    FleetConfig,
    default_advertise,
    node_id_from_environment,
    parse_fleet,
)
from convergenced.daemon.verification.config import (
    DrillConfig,
    VerificationConfig,
    parse_drill,
    parse_verification,
)
from convergenced.discovery.contacts import (
    DiscoveryConfig,
    parse_address,
    parse_discovery_table,
)
from convergenced.errors import ConfigError
from convergenced.security.trust import parse_trust_list

__all__ = ["Config", "ConfigError", "Limits", "Peer", "TlsFiles", "load", "parse"]

DEFAULT_PORT = 7946
DEFAULT_SOCKET = Path("/run/convergenced/convergenced.sock")
DEFAULT_STATE_DIR = Path("/var/lib/convergenced")
DEFAULT_IDENTITY = Path("/etc/convergenced/identity.key")
"""Outside the state directory on purpose: a lost state directory must not take the
node's identity with it (a host that lost its key is a replaced host)."""
DEFAULT_TICK_MS = 200
DEFAULT_IDLE_TICKS = 5
DEFAULT_DEAD_TICKS = 10
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True, slots=True)
class Peer:
    """A node to dial: its id and ``host:port``."""

    node_id: str
    host: str
    port: int


@dataclass(frozen=True, slots=True)
class Limits:
    """Hard limits; every parser and queue is bounded by one of these."""

    max_frame_bytes: int = 1 << 20
    max_records_per_message: int = 4096
    max_streams: int = 1024
    max_members: int = MAX_MEMBERS
    """Members of one stream (a declaration with more is refused)."""
    max_connections: int = 256
    max_clients: int = 1024
    client_queue: int = 256
    """Messages queued for one local client before it counts as stuck."""
    handshake_timeout_s: float = 5.0


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """This node's certificate and key, and the cluster CA (``convergenced ca``)."""

    cert: Path
    key: Path
    ca: Path


MAX_LABELS = 32
"""Labels of one node (``[labels]``)."""


@dataclass(frozen=True, slots=True)
class ComponentConfig:
    """``[components.NAME]``: the fleet's versions of a component, oldest first, and
    optionally this node's own report, applied when its log holds none."""

    catalogue: Catalogue
    running: str | None = None
    accepts: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Config:
    """The whole daemon configuration (see deploy/config/convergenced.toml)."""

    node_id: str
    cluster: str = "default"
    listen_host: str = "0.0.0.0"
    listen_port: int = DEFAULT_PORT
    peers: tuple[Peer, ...] = ()
    socket_path: Path = DEFAULT_SOCKET
    state_dir: Path = DEFAULT_STATE_DIR
    tick_ms: int = DEFAULT_TICK_MS
    """Link timer period; heartbeats and failure detection count these ticks. Each
    tick wakes the daemon once, so it is no finer than failure detection needs."""
    idle_ticks: int = DEFAULT_IDLE_TICKS
    """An idle link exchanges a heartbeat every this many ticks (1 s by default). Each
    side of a link then hears from the other about once a second: in an idle
    16-node mesh 16 daemons use 16-18% of one core together, against 30-34% with a
    500 ms heartbeat (BENCHMARKS.md, "Footprint at N = 16")."""
    dead_ticks: int = DEFAULT_DEAD_TICKS
    """Silence for this many ticks declares a link down (2 s by default: a peer may
    stall for about a second, one missed heartbeat, without losing its links)."""
    mesh_limit: int = 16
    wal_compact_bytes: int = 64 << 20
    """Compact the write-ahead log once it grows past this (and past twice its size
    after the last compaction)."""
    wal_group_commit: bool = True
    """False: one fsync per log entry instead of one per group; slower, never safer
    (only to measure what group commit buys)."""
    log_level: str = "info"
    metrics_listen: tuple[str, int] | None = ("127.0.0.1", 9464)
    """Where /metrics, /healthz and /readyz are served (None: not at all)."""
    limits: Limits = field(default_factory=Limits)
    insecure: bool = False
    """Plaintext peer links and unsigned records: only for a throwaway local cluster."""
    tls: TlsFiles | None = None
    identity: Path | None = None
    """This node's Ed25519 key (``convergenced keygen``); default
    /etc/convergenced/identity.key, outside the state directory so that it (and the
    incarnation floor beside it) outlives a lost state directory. Unset, a key at
    state_dir/identity.key (the default of earlier versions) is still used when the
    default one does not exist."""
    trust: tuple[tuple[str, str], ...] = ()
    """(node id, public key hex) of every other node: records are verified against it."""
    allowed_uids: tuple[int, ...] = ()
    """Local API clients allowed besides root and the daemon's own user."""
    allowed_gids: tuple[int, ...] = ()
    """Local API clients allowed by group (primary or supplementary)."""
    components: tuple[ComponentConfig, ...] = ()
    """The version catalogues (and seed reports) of the version handshake."""
    labels: tuple[tuple[str, str], ...] = ()
    """(name, value) pairs this node carries (``[labels]``): what a rollout plan's
    ``select`` matches, shown by ``status``."""
    discovery: DiscoveryConfig | None = None
    """Where peers come from besides ``[[peers]]`` (`convergenced.discovery`)."""
    fleet: FleetConfig = field(default_factory=FleetConfig)
    """Trust mode, advertised address and revocations (`fleet_config`)."""
    verification: VerificationConfig = field(default_factory=VerificationConfig)
    """How often and how fast the daemon re-reads its ranks' checkpoints."""
    drill: DrillConfig = field(default_factory=DrillConfig)
    """Scheduled test restores, their hook and scratch folder."""
    node_id_origin: str = "node_id"
    """Where the node id came from: the file, ``$CONVERGENCED_NODE_ID`` or the host name."""
    source: str = "<defaults>"

    @property
    def advertise(self) -> tuple[str, int]:
        """The address peers dial to reach this node."""
        return self.fleet.advertise or default_advertise(self.listen_host, self.listen_port)

    @property
    def identity_path(self) -> Path:
        """Where this node's identity key is."""
        if self.identity is not None:
            return self.identity
        if not DEFAULT_IDENTITY.exists() and self.legacy_identity.exists():
            return self.legacy_identity
        return DEFAULT_IDENTITY

    @property
    def legacy_identity(self) -> Path:
        """The default identity key of earlier versions, inside the state directory
        (lost with it)."""
        return self.state_dir / "identity.key"

    @property
    def incarnation_floor_path(self) -> Path:
        """Where the incarnation floor lives: beside the identity key
        (`durability.floor`)."""
        key = self.identity_path
        return key.with_name(key.name + ".incarnation")


_TOP = {
    "node_id", "cluster", "listen", "peers", "socket_path", "state_dir",
    "tick_ms", "idle_ticks", "dead_ticks", "mesh_limit", "log_level", "limits",
    "wal_compact_bytes", "wal_group_commit", "insecure", "tls", "identity", "trust", "local",
    "metrics_listen", "components", "labels", "trust_mode", "advertise", "revocation", "discovery",
    "verification", "drill",
}  # fmt: skip


def load(path: Path | str) -> Config:
    """Read and validate ``path``.

    Raises:
        ConfigError: naming the file, the key and what was expected.
    """
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(path, "", "file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(path, "", f"cannot read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(path, "", f"not valid TOML: {exc}") from None
    return parse(raw, str(path))


def parse(
    raw: Mapping[str, Any], source: str = "<config>", env: Mapping[str, str] | None = None
) -> Config:
    """Validate an already-parsed TOML document; ``env`` (default the process's) gives
    the node id and advertised address the file leaves out (`fleet_config`)."""
    v = _Validator(source)
    v.no_unknown(raw, _TOP, "")
    node_id = v.name(raw, "node_id")
    origin = "node_id"
    if node_id is None:
        try:
            node_id, origin = node_id_from_environment(env)
        except ValueError as exc:
            raise ConfigError(source, "node_id", f"missing, and {exc}") from None
    fleet = parse_fleet(raw, source, env)
    host, port = v.address(raw.get("listen", f"0.0.0.0:{DEFAULT_PORT}"), "listen")
    peers = v.peers(raw.get("peers", []), node_id)
    idle = v.integer(raw, "idle_ticks", DEFAULT_IDLE_TICKS, lo=1, hi=1000)
    dead = v.integer(raw, "dead_ticks", DEFAULT_DEAD_TICKS, lo=2, hi=100_000)
    if dead <= idle:
        raise ConfigError(source, "dead_ticks", f"{dead} must exceed idle_ticks ({idle})")
    level = raw.get("log_level", "info")
    if level not in LOG_LEVELS:
        raise ConfigError(
            source, "log_level", f"{level!r}; expected one of {', '.join(LOG_LEVELS)}"
        )
    return Config(
        node_id=node_id,
        cluster=v.name(raw, "cluster") or "default",
        listen_host=host,
        listen_port=port,
        peers=peers,
        socket_path=v.path(raw, "socket_path", DEFAULT_SOCKET),
        state_dir=v.path(raw, "state_dir", DEFAULT_STATE_DIR),
        tick_ms=v.integer(raw, "tick_ms", DEFAULT_TICK_MS, lo=1, hi=60_000),
        idle_ticks=idle,
        dead_ticks=dead,
        mesh_limit=v.integer(raw, "mesh_limit", 16, lo=1, hi=100_000),
        wal_compact_bytes=v.integer(raw, "wal_compact_bytes", 64 << 20, lo=1 << 16, hi=1 << 40),
        wal_group_commit=v.boolean(raw, "wal_group_commit", True),
        log_level=level,
        metrics_listen=(
            None
            if raw.get("metrics_listen") == "off"
            else v.address(raw.get("metrics_listen", "127.0.0.1:9464"), "metrics_listen")
        ),
        limits=v.limits(raw.get("limits", {})),
        components=v.components(raw.get("components", {})),
        labels=v.labels(raw.get("labels", {})),
        **v.security(raw, node_id, peers, fleet),
        discovery=(
            parse_discovery_table(raw["discovery"], source, port) if "discovery" in raw else None
        ),
        fleet=fleet,
        verification=parse_verification(raw, source),
        drill=parse_drill(raw, source),
        node_id_origin=origin,
        source=source,
    )


class _Validator:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, key: str, problem: str) -> ConfigError:
        return ConfigError(self.source, key, problem)

    def no_unknown(self, table: Mapping[str, Any], known: set[str], prefix: str) -> None:
        for key in table:
            if key not in known:
                raise self.fail(
                    prefix + key, f"unknown key; expected one of {', '.join(sorted(known))}"
                )

    def name(self, table: Mapping[str, Any], key: str, *, required: bool = False) -> str | None:
        if key not in table:
            if required:
                raise self.fail(key, "missing; expected a name like 'gpu-node-01'")
            return None
        value = table[key]
        if not isinstance(value, str) or not NAME_RE.match(value):
            raise self.fail(
                key,
                f"{value!r}; expected 1-128 of A-Z a-z 0-9 . _ / - (no spaces), "
                "starting with a letter or digit",
            )
        return value

    def integer(
        self,
        table: Mapping[str, Any],
        key: str,
        default: int,
        *,
        lo: int,
        hi: int,
        prefix: str = "",
    ) -> int:
        value = table.get(key, default)
        if type(value) is not int or not lo <= value <= hi:
            raise self.fail(prefix + key, f"{value!r}; expected an integer from {lo} to {hi}")
        return value

    def boolean(self, table: Mapping[str, Any], key: str, default: bool) -> bool:
        value = table.get(key, default)
        if type(value) is not bool:
            raise self.fail(key, f"{value!r}; expected true or false")
        return value

    def path(self, table: Mapping[str, Any], key: str, default: Path, *, prefix: str = "") -> Path:
        value = table.get(key, str(default))
        if not isinstance(value, str) or not value.startswith("/"):
            raise self.fail(prefix + key, f"{value!r}; expected an absolute path")
        return Path(value)

    def address(self, value: Any, key: str) -> tuple[str, int]:
        if not isinstance(value, str):
            raise self.fail(key, f"{value!r}; expected 'host:port'")
        try:
            return parse_address(value, None)  # the one parser, shared with discovery
        except ValueError as exc:
            raise self.fail(key, str(exc)) from None

    def peers(self, value: Any, me: str) -> tuple[Peer, ...]:
        if not isinstance(value, list):
            raise self.fail(
                "peers", "expected an array of tables: [[peers]] id = ..., address = ..."
            )
        out: list[Peer] = []
        seen: set[str] = set()
        for i, item in enumerate(value):
            key = f"peers[{i}]"
            if not isinstance(item, Mapping):
                raise self.fail(key, "expected a table with id and address")
            self.no_unknown(item, {"id", "address"}, f"{key}.")
            node_id = _Validator(self.source).name(
                {"id": item.get("id")} if "id" in item else {}, "id", required=True
            )
            assert node_id is not None
            if node_id == me:
                raise self.fail(f"{key}.id", f"{node_id!r} is this node itself")
            if node_id in seen:
                raise self.fail(f"{key}.id", f"{node_id!r} is listed twice")
            seen.add(node_id)
            host, port = self.address(item.get("address"), f"{key}.address")
            out.append(Peer(node_id, host, port))
        return tuple(out)

    def security(
        self, raw: Mapping[str, Any], me: str, peers: tuple[Peer, ...], fleet: FleetConfig
    ) -> dict[str, Any]:
        insecure = raw.get("insecure", False)
        if type(insecure) is not bool:
            raise self.fail("insecure", f"{insecure!r}; expected true or false")
        tls: TlsFiles | None = None
        if "tls" in raw:
            table = raw["tls"]
            if not isinstance(table, Mapping):
                raise self.fail("tls", "expected a table with cert, key and ca")
            self.no_unknown(table, {"cert", "key", "ca"}, "tls.")
            missing = [k for k in ("cert", "key", "ca") if k not in table]
            if missing:
                raise self.fail(f"tls.{missing[0]}", "missing (see convergenced ca issue)")
            tls = TlsFiles(
                *(self.path(table, k, Path("/"), prefix="tls.") for k in ("cert", "key", "ca"))
            )
        elif not insecure and (peers or fleet.ca_trust):
            # Without peers nobody can be admitted on the peer port (a HELLO must name
            # a configured peer), so a single host needs no certificates.
            raise self.fail(
                "tls",
                "missing: peer links use mutual TLS; set [tls] cert, key and ca (made by "
                "'convergenced ca init' and 'convergenced ca issue'), or insecure = true for "
                "a throwaway local cluster",
            )
        if insecure and fleet.ca_trust:
            raise self.fail("trust_mode", "'ca' needs certificates; it cannot go with insecure")
        identity = self.path(raw, "identity", Path("/")) if "identity" in raw else None
        trust: tuple[tuple[str, str], ...] = ()
        if "trust" in raw:
            parse_trust_list(raw["trust"], self.source)  # validates names and keys
            trust = tuple(sorted((str(k), str(v).lower()) for k, v in raw["trust"].items()))
        if not insecure and not fleet.ca_trust:
            known = {n for n, _ in trust}
            for p in peers:
                if p.node_id not in known:
                    raise self.fail(
                        f"trust.{p.node_id}",
                        "missing: every peer needs its public key here (its "
                        "'convergenced keygen' prints the line)",
                    )
        local = raw.get("local", {})
        if not isinstance(local, Mapping):
            raise self.fail("local", "expected a table with allowed_uids and allowed_gids")
        self.no_unknown(local, {"allowed_uids", "allowed_gids"}, "local.")
        return {
            "insecure": insecure,
            "tls": tls,
            "identity": identity,
            "trust": trust,
            "allowed_uids": self.ids(local, "allowed_uids"),
            "allowed_gids": self.ids(local, "allowed_gids"),
        }

    def ids(self, table: Mapping[str, Any], key: str) -> tuple[int, ...]:
        value = table.get(key, [])
        if not isinstance(value, list) or not all(type(x) is int and 0 <= x < 2**32 for x in value):
            raise self.fail(f"local.{key}", f"{value!r}; expected a list of numeric ids")
        return tuple(value)

    def labels(self, value: Any) -> tuple[tuple[str, str], ...]:
        if not isinstance(value, Mapping) or len(value) > MAX_LABELS:
            raise self.fail("labels", f'expected a table of at most {MAX_LABELS} name = "value"')
        for k, v in value.items():
            if not NAME_RE.match(k):
                raise self.fail(f"labels.{k}", "not a label name (letters, digits, '.', '_', "
                                "'/', '-', not starting with a symbol)")  # fmt: skip
            if not isinstance(v, str) or len(v) > 128:
                raise self.fail(f"labels.{k}", f"{v!r}; expected a string of at most 128 chars")
        return tuple(sorted(value.items()))

    def components(self, value: Any) -> tuple[ComponentConfig, ...]:
        if not isinstance(value, Mapping):
            raise self.fail("components", "expected tables [components.NAME]")
        if len(value) > MAX_COMPONENTS:
            raise self.fail("components", f"{len(value)} components above {MAX_COMPONENTS}")
        out = []
        for name, table in sorted(value.items()):
            key = f"components.{name}"
            if not isinstance(table, Mapping):
                raise self.fail(key, "expected a table with versions, running, accepts")
            self.no_unknown(table, {"versions", "running", "accepts"}, key + ".")
            versions, running = table.get("versions"), table.get("running")
            accepts = table.get("accepts", [] if running is None else [running])
            if not isinstance(versions, list) or not isinstance(accepts, list):
                raise self.fail(key, "versions and accepts are lists of version strings")
            try:
                catalogue = Catalogue.create(name, versions)
                if running is not None:
                    check_report(ComponentReport(name, running, tuple(accepts)), catalogue)
                elif accepts:
                    raise self.fail(key + ".accepts", "goes with running")
            except FactError as exc:
                raise self.fail(key, str(exc)) from None
            out.append(ComponentConfig(catalogue, running, tuple(accepts)))
        return tuple(out)

    def limits(self, value: Any) -> Limits:
        if not isinstance(value, Mapping):
            raise self.fail("limits", "expected a table")
        d = Limits()
        known = set(Limits.__slots__)
        self.no_unknown(value, known, "limits.")

        def num(key: str, lo: int, hi: int) -> int:
            return self.integer(value, key, getattr(d, key), lo=lo, hi=hi, prefix="limits.")

        timeout = value.get("handshake_timeout_s", d.handshake_timeout_s)
        if (
            not isinstance(timeout, int | float)
            or isinstance(timeout, bool)
            or not 0 < timeout <= 3600
        ):
            raise self.fail(
                "limits.handshake_timeout_s", f"{timeout!r}; expected seconds in (0, 3600]"
            )
        return Limits(
            max_frame_bytes=num("max_frame_bytes", 4096, 64 << 20),
            max_records_per_message=num("max_records_per_message", 1, 1 << 20),
            max_streams=num("max_streams", 1, 1 << 20),
            max_members=num("max_members", 1, MAX_MEMBERS),
            max_connections=num("max_connections", 1, 1 << 16),
            max_clients=num("max_clients", 1, 1 << 16),
            client_queue=num("client_queue", 1, 1 << 20),
            handshake_timeout_s=float(timeout),
        )
