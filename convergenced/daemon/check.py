"""`convergenced check`: would the daemon start with this configuration?

Everything a start reads before it writes, read the same way, with nothing started,
bound or written: the file itself (`config.load`), the certificates and keys, checked
against each other (`peers.security.read_key_files`, which the daemon itself runs), and
whether the socket and the state directory can be made where the file puts them. What
only a start can tell, a port someone else holds or a damaged log, is left to the start,
which also leaves the state as it was when it fails (see `daemon.main`).

Access is judged for the user running the check, so run it as the daemon's user.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from convergenced.daemon import config as config_mod
from convergenced.daemon.config import Config
from convergenced.daemon.localapi.unix_socket import prepare_socket_dir
from convergenced.daemon.peers.security import read_key_files
from convergenced.errors import ConfigError


def check(path: Path | str) -> Config:
    """Validate the configuration in ``path`` as a start would, writing nothing.

    Returns:
        The configuration.

    Raises:
        ConfigError: the file, or a directory it names, is wrong; naming file and key.
        StartupError: a certificate or key file is wrong; naming file and key.
    """
    cfg = config_mod.load(path)
    read_key_files(cfg)
    _check_socket(cfg)
    _check_dir(cfg, "state_dir", cfg.state_dir)
    return cfg


def _check_socket(cfg: Config) -> None:
    directory = cfg.socket_path.parent
    if directory.exists():
        try:
            prepare_socket_dir(directory)  # an existing directory is judged, never changed
        except OSError as exc:
            raise ConfigError(cfg.source, "socket_path", str(exc)) from None
    _check_dir(cfg, "socket_path", directory)
    try:
        st = os.lstat(cfg.socket_path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(
            cfg.source,
            "socket_path",
            f"{cfg.socket_path}: exists and is not a socket; the daemon never replaces it",
        )


def _check_dir(cfg: Config, key: str, directory: Path) -> None:
    """``directory`` is one this user may write in, or one it may create."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(cfg.source, key, f"{existing}: not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        if existing == directory:
            problem = f"{directory}: not writable by this user"
        else:
            problem = f"{directory}: missing, and this user cannot create it in {existing}"
        raise ConfigError(cfg.source, key, problem)
