"""Configuration: defaults for one GPU host, errors that name file, key and expectation."""

from __future__ import annotations

from pathlib import Path

import pytest

from convergenced.daemon.config import DEFAULT_PORT, ConfigError, load

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


def test_peers_are_parsed(tmp_path: Path) -> None:
    cfg = load(
        _write(
            tmp_path,
            'node_id = "a"\n[[peers]]\nid = "b"\naddress = "127.0.0.1:9001"\n'
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
        ("", "node_id", "missing"),
        ('node_id = "a b"', "node_id", "no spaces"),
        ('node_id = "a"\nlisten = "nowhere"', "listen", "host:port"),
        ('node_id = "a"\nlisten = "h:70000"', "listen", "0 to 65535"),
        ('node_id = "a"\ntick_ms = "fast"', "tick_ms", "integer from 1"),
        ('node_id = "a"\nidle_ticks = 5\ndead_ticks = 5', "dead_ticks", "must exceed"),
        ('node_id = "a"\nlog_level = "loud"', "log_level", "one of debug"),
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
