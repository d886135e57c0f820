"""`convergencectl`, the command-line client of the local daemon.

`main` is the entry point (the console script and ``python -m convergenced.ctl``). The
command is split along its ideas: `parser` (arguments, spec files, exit codes),
`formatting` (results for people), `top` (the live view) and `main` (the commands,
``watch``, failures and exit codes; its docstring describes the command). The public
names are re-exported here, where they lived before the split.
"""

from convergenced.ctl.commands import COMMANDS, Command, main
from convergenced.ctl.formatting import (
    format_duration,
    format_intervals,
    format_restore_point,
    format_state,
    format_status,
    format_watch_event,
)
from convergenced.ctl.parser import (
    EXIT_CODES_HELP,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    JSON_HELP,
    SOCKET_HELP,
    UsageError,
    build_parser,
    load_spec_file,
)
from convergenced.ctl.top import CLEAR_SCREEN, LAGGARD_MARK, STALE_MARK, render_top

__all__ = [
    "CLEAR_SCREEN",
    "COMMANDS",
    "EXIT_CODES_HELP",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "JSON_HELP",
    "LAGGARD_MARK",
    "SOCKET_HELP",
    "STALE_MARK",
    "Command",
    "UsageError",
    "build_parser",
    "format_duration",
    "format_intervals",
    "format_restore_point",
    "format_state",
    "format_status",
    "format_watch_event",
    "load_spec_file",
    "main",
    "render_top",
]
