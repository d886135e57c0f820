"""Peer discovery: contacts, the ``[discovery]`` table, and the sources for real.

The DNS sources are tested against a real DNS server on 127.0.0.1 (tests/dns_server.py)
through dnspython's real resolver in real worker threads; the file source against
real files. Only the refresh loop runs on trio's MockClock, with blocking work run
inline so that autojump cannot mistake a worker thread's wait for idle time.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio
import trio.testing
from dns_server import DnsServer

from convergenced.daemon import config as daemon_config
from convergenced.discovery import contacts as contacts_module
from convergenced.discovery import sources as sources_module
from convergenced.discovery.contacts import (
    MAX_FILE_BYTES,
    Contact,
    DiscoveryConfig,
    merge_contacts,
    parse_address,
    parse_contacts_file,
    parse_discovery_table,
)
from convergenced.discovery.sources import Discovery
from convergenced.errors import ConfigError

PORT = 7946
LIFETIME_S = 0.3
"""DNS lifetime in these tests: a muted name times out in 0.3 s, not 2."""
_T = TypeVar("_T")


async def inline(fn: Callable[[], _T]) -> _T:
    """Run blocking work on trio's thread (files only: fast, and MockClock-safe)."""
    return fn()


@pytest.fixture
def dns_server() -> Iterator[DnsServer]:
    with DnsServer() as server:
        yield server


def with_dns(server: DnsServer, **table: Any) -> Discovery:
    config = parse_discovery_table({"nameservers": [server.nameserver], **table}, "test.toml", PORT)
    return Discovery(config, dns_lifetime_s=LIFETIME_S)


def write(path: Path, text: str) -> None:
    """Replace ``path`` atomically, as an orchestrator should."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def ok(d: Discovery, kind: str) -> int:
    return d.stats.lookups[(kind, "ok")]  # type: ignore[index]


def failed(d: Discovery, kind: str) -> int:
    return d.stats.lookups[(kind, "failed")]  # type: ignore[index]


# -- addresses -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10.0.0.1:9000", ("10.0.0.1", 9000)),
        ("10.0.0.1", ("10.0.0.1", PORT)),
        ("[fd00::1]:9000", ("fd00::1", 9000)),
        ("[FD00:0:0::1]", ("fd00::1", PORT)),
        ("Node-1.Example.internal:1", ("node-1.example.internal", 1)),
        ("localhost:0", ("localhost", 0)),
    ],
)
def test_addresses_parse_to_a_canonical_host_and_port(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text, PORT) == expected


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("fd00::1:7946", "needs brackets"),
        ("h:70000", "port from 0 to 65535"),
        ("h:7x", "port from 0 to 65535"),
        ("h:²", "port from 0 to 65535"),
        (":7946", "host before the colon"),
        ("[fd00::1:7946", "no ']'"),
        ("[10.0.0.1]:1", "not an IPv6 address"),
        ("[fd00::1]7946", "':port' after ']'"),
        ("h :1", "without spaces"),
        ("", "without spaces"),
        ("10.0.0.256:1", "neither an IP address nor a host name"),
        ("a..b:1", "neither an IP address nor a host name"),
        ("-a:1", "neither an IP address nor a host name"),
    ],
)
def test_bad_addresses_say_what_was_expected(text: str, problem: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_address(text, PORT)
    assert problem in str(err.value)
    assert repr(text) in str(err.value)


def test_a_listen_address_needs_its_port_and_config_uses_the_same_parser() -> None:
    with pytest.raises(ValueError, match="expected 'host:port'"):
        parse_address("10.0.0.1", None)
    cfg = daemon_config.parse({"node_id": "a", "listen": "[::1]:0"})
    assert (cfg.listen_host, cfg.listen_port) == ("::1", 0)
    with pytest.raises(ConfigError, match="needs brackets") as err:
        daemon_config.parse({"node_id": "a", "listen": "::1:7946"})
    assert err.value.key == "listen"


# -- contacts and the contacts file --------------------------------------------------


def test_contacts_sort_print_and_merge_named_over_bare() -> None:
    bare, named = Contact("10.0.0.1", PORT), Contact("10.0.0.1", PORT, "node-a")
    other = Contact("fd00::2", 1)
    assert sorted([other, named, bare]) == [bare, named, other]
    assert (str(named), str(other)) == ("node-a@10.0.0.1:7946", "[fd00::2]:1")
    assert merge_contacts([bare, named, other]) == {named, other}
    assert len({bare, Contact("10.0.0.1", PORT)}) == 1


def test_contacts_file_takes_both_forms_comments_and_repeats() -> None:
    text = (
        "# written by the orchestrator\r\n"
        "\n"
        "node-a 10.0.0.1:7000   # the first\r\n"
        "10.0.0.2\n"
        "   \t\n"
        "[FD00::3]:7003\n"
        "10.0.0.1:7000\n"  # the bare form of node-a's address: one contact
        "node-a 10.0.0.1:7000\n"  # a repeat
        "10.0.0.2:7946"  # the same as the bare host on the default port; no final newline
    )
    assert parse_contacts_file(text, "/run/peers", PORT) == (
        Contact("10.0.0.1", 7000, "node-a"),
        Contact("10.0.0.2", PORT),
        Contact("fd00::3", 7003),
    )
    assert parse_contacts_file("# nobody\n", "/run/peers", PORT) == ()


@pytest.mark.parametrize(
    ("text", "line", "problem"),
    [
        ("10.0.0.1:1\nnode-a 10.0.0.2:1 extra\n", 2, "3 fields"),
        ("\n\n-bad 10.0.0.1:1\n", 3, "'-bad' is not a node id"),
        ("node-a fd00::1:7946\n", 1, "needs brackets"),
        ("10.0.0.1:0\n", 1, "port 0 cannot be dialled"),
        ("a 10.0.0.1:1\nb 10.0.0.1:1\n", 2, "already listed as 'a' on line 1"),
        ("a 10.0.0.1:1\n10.0.0.2:1\na 10.0.0.3:1\n", 3, "'a' is already listed at 10.0.0.1:1"),
        ("ok:1\n" + "x" * 513 + "\n", 2, "513 characters, above the limit of 512"),
    ],
)
def test_bad_contacts_file_lines_name_the_line(text: str, line: int, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_contacts_file(text, "/run/peers", PORT)
    assert err.value.key == f"line {line}"
    assert str(err.value).startswith(f"/run/peers: line {line}: ")
    assert problem in str(err.value)


def test_contacts_file_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=f"above the limit of {MAX_FILE_BYTES} bytes"):
        parse_contacts_file("#" * (MAX_FILE_BYTES + 1), "/run/peers", PORT)
    monkeypatch.setattr(contacts_module, "MAX_CONTACTS", 2)
    text = "10.0.0.1:1\n10.0.0.1:1\nn 10.0.0.1:1\n10.0.0.2:1\n10.0.0.3:1\n"
    with pytest.raises(ConfigError, match="more than 2 contacts") as err:
        parse_contacts_file(text, "/run/peers", PORT)
    assert err.value.key == "line 5"  # repeats and merges do not count


# -- the [discovery] table -----------------------------------------------------------


def test_discovery_table_values_and_defaults() -> None:
    cfg = parse_discovery_table(
        {
            "seeds": ["10.0.0.2:1", "seed.example", "10.0.0.2:1"],
            "dns": "peers.example.internal",
            "srv": "_peer._tcp.convergenced.convergenced.svc.cluster.local",
            "file": "/run/convergenced/peers",
            "nameservers": ["10.96.0.10", "[fd00::53]:5353", "::1"],
            "refresh_s": 5,
        },
        "test.toml",
        PORT,
    )
    assert cfg.seeds == (Contact("10.0.0.2", 1), Contact("seed.example", PORT))
    assert (cfg.dns, cfg.dns_port, cfg.default_port) == ("peers.example.internal", None, PORT)
    assert cfg.nameservers == (("10.96.0.10", 53), ("fd00::53", 5353), ("::1", 53))
    assert cfg.file == Path("/run/convergenced/peers")
    assert cfg.refresh_s == 5.0 and isinstance(cfg.refresh_s, float)
    assert cfg.kinds == ("seeds", "dns", "srv", "file")
    empty = parse_discovery_table({}, "test.toml", PORT)
    assert empty == DiscoveryConfig(default_port=PORT) and empty.kinds == ()
    assert empty.refresh_s == 15.0


@pytest.mark.parametrize(
    ("table", "key", "problem"),
    [
        ({"seed": []}, "discovery.seed", "unknown key; expected one of dns, dns_port, file, "),
        ({"seeds": ["10.0.0.1:1", "fd00::1:1"]}, "discovery.seeds[1]", "needs brackets"),
        ({"seeds": "10.0.0.1:1"}, "discovery.seeds", "list of 'host:port' strings"),
        ({"seeds": ["h"] * 1025}, "discovery.seeds", "above the limit of 1024"),
        ({"refresh_s": 0.5}, "discovery.refresh_s", "seconds from 1 to 3600"),
        ({"refresh_s": 3601}, "discovery.refresh_s", "seconds from 1 to 3600"),
        ({"refresh_s": True}, "discovery.refresh_s", "seconds from 1 to 3600"),
        ({"refresh_s": math.nan}, "discovery.refresh_s", "seconds from 1 to 3600"),
        ({"dns": "10.0.0.1"}, "discovery.dns", "list fixed addresses in seeds"),
        ({"dns": "bad name"}, "discovery.dns", "expected a DNS name"),
        ({"dns": "p.example", "dns_port": 0}, "discovery.dns_port", "from 1 to 65535"),
        ({"dns_port": 7000}, "discovery.dns_port", "goes with dns"),
        ({"srv": "peers.example"}, "discovery.srv", "'_service._proto.name'"),
        ({"file": "peers.txt"}, "discovery.file", "absolute path"),
        ({"dns": "p.example", "nameservers": ["dns.example"]}, "discovery.nameservers[0]", "IP"),
        ({"nameservers": ["10.0.0.53"]}, "discovery.nameservers", "goes with dns or srv"),
    ],
)
def test_discovery_table_errors_name_the_key(table: dict[str, Any], key: str, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_discovery_table(table, "test.toml", PORT)
    assert err.value.key == key
    assert str(err.value).startswith(f"test.toml: {key}: ")
    assert problem in str(err.value)


def test_discovery_table_must_be_a_table() -> None:
    with pytest.raises(ConfigError, match="expected a table") as err:
        parse_discovery_table(["10.0.0.1"], "test.toml", PORT)
    assert err.value.key == "discovery"


def test_contacts_module_is_sans_io() -> None:
    probe = (
        "import json, sys, convergenced.discovery.contacts, convergenced.daemon.config; "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    loaded = set(json.loads(out.stdout))
    # contacts never; the configuration loader not through discovery either.
    assert not loaded & {"trio", "dns"}


# -- DNS -------------------------------------------------------------------------


async def test_dns_source_unites_a_and_aaaa_records(dns_server: DnsServer) -> None:
    dns_server.set("peers.test", "A", "10.0.0.1", "10.0.0.2")
    dns_server.set("peers.test", "AAAA", "fd00:0::1")
    d = with_dns(dns_server, dns="peers.test", dns_port=9000)
    assert await d.lookup() == {
        Contact("10.0.0.1", 9000),
        Contact("10.0.0.2", 9000),
        Contact("fd00::1", 9000),
    }
    assert sorted(dns_server.queries) == [("peers.test.", "A"), ("peers.test.", "AAAA")]
    assert (ok(d, "dns"), failed(d, "dns"), d.stats.contacts["dns"]) == (1, 0, 3)


async def test_dns_port_defaults_to_the_daemon_port(dns_server: DnsServer) -> None:
    dns_server.set("peers.test", "A", "10.0.0.1")
    assert await with_dns(dns_server, dns="peers.test").lookup() == {Contact("10.0.0.1", PORT)}


async def test_srv_targets_come_from_the_additional_section(dns_server: DnsServer) -> None:
    dns_server.set(
        "_peer._tcp.peers.test", "SRV", "0 0 7001 a.peers.test.", "0 0 7002 b.peers.test."
    )
    dns_server.set("a.peers.test", "A", "10.0.0.1")
    dns_server.set("b.peers.test", "AAAA", "fd00::2")
    d = with_dns(dns_server, srv="_peer._tcp.peers.test")
    assert await d.lookup() == {Contact("10.0.0.1", 7001), Contact("fd00::2", 7002)}
    assert dns_server.queries == [("_peer._tcp.peers.test.", "SRV")]  # nothing more to ask


async def test_srv_targets_without_additional_records_are_resolved(dns_server: DnsServer) -> None:
    dns_server.additional = False
    dns_server.set(
        "_peer._tcp.peers.test",
        "SRV",
        "0 0 7001 a.peers.test.",
        "0 0 7002 b.peers.test.",
        "0 0 7003 gone.peers.test.",  # removed since: no address, not a failure
        "0 0 7004 .",  # "no service here"
    )
    dns_server.set("a.peers.test", "A", "10.0.0.1")
    dns_server.set("a.peers.test", "AAAA", "fd00::1")
    dns_server.set("b.peers.test", "A", "10.0.0.2")
    d = with_dns(dns_server, srv="_peer._tcp.peers.test")
    assert await d.lookup() == {
        Contact("10.0.0.1", 7001),
        Contact("fd00::1", 7001),
        Contact("10.0.0.2", 7002),
    }
    asked = {name for name, _ in dns_server.queries}
    assert asked == {"_peer._tcp.peers.test.", "a.peers.test.", "b.peers.test.", "gone.peers.test."}
    assert (ok(d, "srv"), failed(d, "srv")) == (1, 0)


async def test_nxdomain_keeps_the_last_good_answer_and_counts_a_failure(
    dns_server: DnsServer,
) -> None:
    dns_server.set("peers.test", "A", "10.0.0.1")
    d = with_dns(dns_server, dns="peers.test", seeds=["10.0.0.9"])
    good = {Contact("10.0.0.1", PORT), Contact("10.0.0.9", PORT)}
    assert await d.lookup() == good
    dns_server.remove("peers.test")
    assert await d.lookup() == good
    assert (ok(d, "dns"), failed(d, "dns")) == (1, 1)
    assert "peers.test" in (d.stats.last_error["dns"] or "")
    assert "does not exist" in (d.stats.last_error["dns"] or "")
    assert (ok(d, "seeds"), d.stats.last_error["seeds"]) == (2, None)
    dns_server.set("peers.test", "A", "10.0.0.3")
    assert await d.lookup() == {Contact("10.0.0.3", PORT), Contact("10.0.0.9", PORT)}
    assert d.stats.last_error["dns"] is None


async def test_a_timeout_keeps_the_last_good_answer(dns_server: DnsServer) -> None:
    dns_server.set("_peer._tcp.peers.test", "SRV", "0 0 7001 a.peers.test.")
    dns_server.set("a.peers.test", "A", "10.0.0.1")
    d = with_dns(dns_server, srv="_peer._tcp.peers.test")
    assert await d.lookup() == {Contact("10.0.0.1", 7001)}
    dns_server.mute("_peer._tcp.peers.test")
    with trio.fail_after(5 * LIFETIME_S + 2):
        assert await d.lookup() == {Contact("10.0.0.1", 7001)}
    assert failed(d, "srv") == 1
    assert "lifetime expired" in (d.stats.last_error["srv"] or "")


async def test_an_authoritative_empty_answer_clears_the_source(dns_server: DnsServer) -> None:
    dns_server.set("peers.test", "A", "10.0.0.1")
    d = with_dns(dns_server, dns="peers.test")
    assert await d.lookup() == {Contact("10.0.0.1", PORT)}
    dns_server.set("peers.test", "A")  # the name exists, with no address at all (NODATA)
    assert await d.lookup() == frozenset()
    assert (ok(d, "dns"), failed(d, "dns"), d.stats.contacts["dns"]) == (2, 0, 0)


async def test_sources_are_united_and_a_named_contact_replaces_a_bare_one(
    dns_server: DnsServer, tmp_path: Path
) -> None:
    dns_server.set("peers.test", "A", "10.0.0.1", "10.0.0.2")
    path = tmp_path / "peers"
    write(path, "node-a 10.0.0.1:7946\n")
    d = with_dns(dns_server, dns="peers.test", seeds=["10.0.0.1", "seed.test:1"], file=str(path))
    assert await d.lookup() == {
        Contact("10.0.0.1", PORT, "node-a"),
        Contact("10.0.0.2", PORT),
        Contact("seed.test", 1),
    }
    assert d.stats.contacts == {"seeds": 2, "dns": 2, "srv": 0, "file": 1}


# -- the contacts file ----------------------------------------------------------------


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every parse of a contacts file, by source path: shows when the file is re-read."""
    seen: list[str] = []
    real = contacts_module.parse_contacts_file

    def counting(text: str, source: str, default_port: int) -> tuple[Contact, ...]:
        seen.append(source)
        return real(text, source, default_port)

    monkeypatch.setattr(sources_module, "parse_contacts_file", counting)
    return seen


def file_discovery(path: Path, **kwargs: Any) -> Discovery:
    return Discovery(
        parse_discovery_table({"file": str(path), "refresh_s": 10}, "test.toml", PORT), **kwargs
    )


async def test_the_file_is_read_again_only_when_it_changed(
    tmp_path: Path, parses: list[str]
) -> None:
    path = tmp_path / "peers"
    write(path, "10.0.0.1\n")
    d = file_discovery(path)
    assert await d.lookup() == {Contact("10.0.0.1", PORT)}
    assert await d.lookup() == {Contact("10.0.0.1", PORT)}
    assert len(parses) == 1  # unchanged: one stat, no read
    write(path, "10.0.0.2\n")  # replaced: a new inode
    assert await d.lookup() == {Contact("10.0.0.2", PORT)}
    with path.open("r+") as f:  # rewritten in place (longer: see the module's note on mtime)
        f.write("10.0.0.33\n")
    assert await d.lookup() == {Contact("10.0.0.33", PORT)}
    assert len(parses) == 3
    d.reload()  # unchanged, but forced
    assert await d.lookup() == {Contact("10.0.0.33", PORT)}
    assert len(parses) == 4
    assert (ok(d, "file"), failed(d, "file")) == (5, 0)


async def test_a_bad_or_missing_file_keeps_the_last_good_contacts(
    tmp_path: Path, parses: list[str]
) -> None:
    path = tmp_path / "peers"
    write(path, "10.0.0.1\n")
    d = file_discovery(path)
    assert await d.lookup() == {Contact("10.0.0.1", PORT)}
    write(path, "10.0.0.2\n\nnode-x 10.0.0.3:1 oops\n")
    assert await d.lookup() == {Contact("10.0.0.1", PORT)}
    assert await d.lookup() == {Contact("10.0.0.1", PORT)}
    assert len(parses) == 2  # the bad file is not parsed again until it changes
    assert failed(d, "file") == 2
    assert f"{path}: line 3: 3 fields" in (d.stats.last_error["file"] or "")
    path.unlink()
    assert await d.lookup() == {Contact("10.0.0.1", PORT)}
    assert "No such file" in (d.stats.last_error["file"] or "")
    path.write_bytes(b"\xff\n")
    assert await d.lookup() == {Contact("10.0.0.1", PORT)}
    assert "not UTF-8" in (d.stats.last_error["file"] or "")
    write(path, "")
    assert await d.lookup() == frozenset()  # a valid, empty file: nobody
    assert d.stats.last_error["file"] is None


# -- the refresh loop ---------------------------------------------------------------


async def test_run_reports_the_first_set_then_only_changes(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    path = tmp_path / "peers"
    write(path, "10.0.0.1\n")
    d = file_discovery(path, run_blocking=inline)
    send, receive = trio.open_memory_channel[frozenset[Contact]](math.inf)
    async with trio.open_nursery() as nursery:
        start = trio.current_time()
        await nursery.start(d.run, send.send_nowait)
        assert receive.receive_nowait() == {Contact("10.0.0.1", PORT)}
        await trio.sleep(35)  # lookups at 10, 20 and 30 s find nothing new
        with pytest.raises(trio.WouldBlock):
            receive.receive_nowait()
        assert ok(d, "file") == 4
        write(path, "10.0.0.1\n10.0.0.2\n")
        assert await receive.receive() == {Contact("10.0.0.1", PORT), Contact("10.0.0.2", PORT)}
        assert trio.current_time() - start == pytest.approx(40)  # the next refresh, on trio's clock
        assert d.stats.changes == 2
        nursery.cancel_scope.cancel()


async def test_reload_starts_a_lookup_at_once(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    path = tmp_path / "peers"
    write(path, "10.0.0.1\n")
    d = file_discovery(path, run_blocking=inline)
    send, receive = trio.open_memory_channel[frozenset[Contact]](math.inf)
    async with trio.open_nursery() as nursery:
        await nursery.start(d.run, send.send_nowait)
        await receive.receive()
        await trio.sleep(3)
        write(path, "10.0.0.2\n")
        before = trio.current_time()
        d.reload()
        assert await receive.receive() == {Contact("10.0.0.2", PORT)}
        assert trio.current_time() == before  # no wait for the refresh at 10 s
        nursery.cancel_scope.cancel()
