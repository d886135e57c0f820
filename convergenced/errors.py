"""Errors that every layer of convergenced may raise.

The base class lives here, below every package, so that no layer has to import a
higher one just to raise or catch an error: the sans-IO core, ``security`` and the
daemon all build on this module and on nothing above it.
"""

from __future__ import annotations

from pathlib import Path


class ConvergencedError(Exception):
    """Base class of every error raised by convergenced on purpose."""


class ConfigError(ConvergencedError):
    """A configuration file is unreadable or a key holds a bad value.

    The message names the file and the key (``/etc/convergenced/x.toml: trust.node-2:
    ...``), so an operator can go straight to the line at fault.
    """

    def __init__(self, path: Path | str, key: str, problem: str) -> None:
        where = f"{path}: {key}" if key else str(path)
        super().__init__(f"{where}: {problem}")
        self.path = str(path)
        self.key = key


class StartupError(ConvergencedError):
    """The daemon cannot start: state directory in use, port taken, bad key files..."""
