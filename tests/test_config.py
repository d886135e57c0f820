"""Configuration: defaults for one GPU host, errors that name file, key and expectation."""

from __future__ import annotations

from pathlib import Path

import pytest

from convergenced.daemon import config as config_mod
from convergenced.daemon.config import DEFAULT_IDENTITY, DEFAULT_PORT, ConfigError, load

EXAMPLE = Path(__file__).resolve().parent.parent / "deploy" / "config" / "convergenced.toml"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_the_shipped_example_loads() -> None:
    cfg = load(EXAMPLE)
    assert cfg.node_id == "gpu-node-01"
    assert cfg.limits.max_frame_bytes == 1 << 20


def test_a_minimal_file_gets_single_host_defaults(tmp_path: Path) -> None:
    cfg = load(_write(tmp_path, 'node_id = "n1"\n'))
    assert cfg.listen_port == DEFAULT_PORT
    assert cfg.peers == ()
    assert str(cfg.socket_path) == "/run/convergenced/convergenced.sock"
    assert cfg.dead_ticks > cfg.idle_ticks


def test_the_shipped_example_and_the_help_give_the_daemons_link_timer(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The example file and `convergenced cluster --help` spell the defaults out; they
    # must not drift from what the daemon does without them.
    cfg = load(EXAMPLE)
    assert (cfg.tick_ms, cfg.idle_ticks, cfg.dead_ticks) == (
        config_mod.DEFAULT_TICK_MS,
        config_mod.DEFAULT_IDLE_TICKS,
        config_mod.DEFAULT_DEAD_TICKS,
    )
    from convergenced.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["cluster", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"the daemon's, {config_mod.DEFAULT_TICK_MS})" in help_text


def test_peers_are_parsed(tmp_path: Path) -> None:
    cfg = load(
        _write(
            tmp_path,
            'node_id = "a"\ninsecure = true\n[[peers]]\nid = "b"\naddress = "127.0.0.1:9001"\n'
            '[[peers]]\nid = "c"\naddress = "[::1]:9002"\n',
        )
    )
    assert [(p.node_id, p.host, p.port) for p in cfg.peers] == [
        ("b", "127.0.0.1", 9001),
        ("c", "::1", 9002),
    ]


@pytest.mark.parametrize(
    ("text", "key", "expected"),
    [
        ('node_id = "a b"', "node_id", "no spaces"),
        ('node_id = "a"\nlisten = "nowhere"', "listen", "host:port"),
        ('node_id = "a"\nlisten = "h:70000"', "listen", "0 to 65535"),
        ('node_id = "a"\ntick_ms = "fast"', "tick_ms", "integer from 1"),
        ('node_id = "a"\nidle_ticks = 5\ndead_ticks = 5', "dead_ticks", "must exceed"),
        ('node_id = "a"\nlog_level = "loud"', "log_level", "one of debug"),
        ('node_id = "a"\nwal_group_commit = 0', "wal_group_commit", "true or false"),
        ('node_id = "a"\nsocket_path = "rel/x"', "socket_path", "absolute path"),
        ('node_id = "a"\nnode_idd = "b"', "node_idd", "unknown key"),
        ('node_id = "a"\n[[peers]]\nid = "a"\naddress = "h:1"', "peers[0].id", "itself"),
        (
            'node_id = "a"\n[[peers]]\nid = "b"\naddress = "h:1"\n[[peers]]\nid = "b"\n'
            'address = "h:2"',
            "peers[1].id",
            "twice",
        ),
        ('node_id = "a"\n[[peers]]\nid = "b"', "peers[0].address", "host:port"),
        ('node_id = "a"\n[limits]\nmax_frame_bytes = 1', "limits.max_frame_bytes", "from 4096"),
        ('node_id = "a"\n[limits]\nmax_frame = 1', "limits.max_frame", "unknown key"),
        (
            'node_id = "a"\n[limits]\nhandshake_timeout_s = 0',
            "limits.handshake_timeout_s",
            "seconds",
        ),
    ],
)
def test_bad_values_name_the_file_the_key_and_what_was_expected(
    tmp_path: Path, text: str, key: str, expected: str
) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load(path)
    assert err.value.key == key
    message = str(err.value)
    assert message.startswith(f"{path}: {key}: ")
    assert expected in message


def test_unreadable_and_malformed_files_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load(tmp_path / "absent.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(_write(tmp_path, "node_id = \n"))


# -- security settings -------------------------------------------------------------------

_PEER = '[[peers]]\nid = "b"\naddress = "127.0.0.1:9001"\n'
_KEY = "9210d5ee616bf2ddcc132975e7e0b284d8cff6fdf0bb0c3baef682a392d20c10"
_TLS = '[tls]\ncert = "/t/a.crt"\nkey = "/t/a.key"\nca = "/t/ca.crt"\n'


@pytest.mark.parametrize(
    ("text", "key", "expected"),
    [
        ('node_id = "a"\n' + _PEER, "tls", "peer links use mutual TLS"),
        ('node_id = "a"\n' + _TLS + _PEER, "trust.b", "every peer needs its public key"),
        ('node_id = "a"\n' + _TLS + '[trust]\nb = "00"\n' + _PEER, "trust.b", ""),
        ('node_id = "a"\n[tls]\ncert = "/t/a.crt"\n', "tls.key", "missing"),
        (
            'node_id = "a"\n[tls]\ncert = "rel.crt"\nkey = "/k"\nca = "/c"\n',
            "tls.cert",
            "absolute path",
        ),
        ('node_id = "a"\ninsecure = "yes"\n', "insecure", "true or false"),
        ('node_id = "a"\n[local]\nallowed_uids = [-1]\n', "local.allowed_uids", "numeric ids"),
        ('node_id = "a"\n[local]\nallowed_users = [1]\n', "local.allowed_users", "unknown key"),
    ],
)
def test_security_settings_are_checked(tmp_path: Path, text: str, key: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(_write(tmp_path, text))
    assert info.value.key == key
    assert expected in str(info.value)


def test_a_secure_config_and_an_insecure_one(tmp_path: Path) -> None:
    cfg = load(_write(tmp_path, f'node_id = "a"\n{_TLS}[trust]\nb = "{_KEY}"\n{_PEER}'))
    assert cfg.tls is not None and str(cfg.tls.ca) == "/t/ca.crt"
    assert cfg.trust == (("b", _KEY),)
    assert not cfg.insecure
    assert cfg.identity_path == DEFAULT_IDENTITY  # outside the state directory
    plain = load(_write(tmp_path, 'node_id = "a"\ninsecure = true\n' + _PEER))
    assert plain.insecure and plain.tls is None
    alone = load(_write(tmp_path, 'node_id = "a"\n[local]\nallowed_gids = [1000]\n'))
    assert alone.tls is None and alone.allowed_gids == (1000,)


def test_a_key_left_in_the_state_directory_is_still_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Earlier versions kept the identity key in the state directory: without an
    `identity` setting and with no key at the default path, that one is used."""
    monkeypatch.setattr(config_mod, "DEFAULT_IDENTITY", tmp_path / "etc" / "identity.key")
    state = tmp_path / "state"
    cfg = load(_write(tmp_path, f'node_id = "a"\nstate_dir = "{state}"\n'))
    assert cfg.identity_path == tmp_path / "etc" / "identity.key"
    state.mkdir()
    (state / "identity.key").write_text("")
    assert cfg.identity_path == state / "identity.key" == cfg.legacy_identity
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "identity.key").write_text("")
    assert cfg.identity_path == tmp_path / "etc" / "identity.key"
    assert cfg.incarnation_floor_path == tmp_path / "etc" / "identity.key.incarnation"
