"""Logging: structlog, JSON lines off a terminal, readable console output on one.

Every event carries the node id (bound once here); callers add stream and peer.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def configure(
    level: str, node: str, *, stream: TextIO | None = None, json: bool | None = None
) -> None:
    """Set up structlog for the daemon (call again to change the level)."""
    out = stream or sys.stderr
    as_json = not out.isatty() if json is None else json
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer(sort_keys=False)
        if as_json
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(node=node)
