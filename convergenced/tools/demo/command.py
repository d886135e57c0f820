"""The ``demo`` command: run the story, print the verdict, return the exit code.

`run_demo` is what ``convergenced demo`` calls (with the subcommand's parsed arguments)
and `main` what ``python -m convergenced.tools.demo`` calls (with a command line).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Sequence

from convergenced.errors import ConvergencedError
from convergenced.tools.cluster import node_name
from convergenced.tools.demo.options import DESCRIPTION, Options, add_arguments, options_from
from convergenced.tools.demo.result import DemoResult
from convergenced.tools.demo.story import SPARE, VICTIM, Demo


def _verdict(res: DemoResult, opts: Options) -> str:
    if res.problems == ["interrupted"]:
        return "INTERRUPTED: every daemon stopped, the demo directory removed"
    if not res.verified:
        return "FAILED: " + "; ".join(res.problems or ["see above"])
    if res.marker_valid is False:
        forced = (
            ", and forced, its run would not match" if res.marker_bitwise_equal is False else ""
        )
        marker = (
            f"a latest marker would have pointed at epoch {res.marker_epoch}, which rank(s) "
            f"{res.marker_missing_ranks} never finished{forced}"
        )
    else:
        marker = f"a latest marker would have pointed at epoch {res.marker_epoch} (complete)"
    if opts.scenario == "replace":
        what = (
            f"node-{VICTIM} died for good mid-checkpoint of epoch {opts.crash_at}, its disk "
            f"with it; spare node-{SPARE} took over rank {VICTIM - 1} from the shared tier"
        )
    else:
        what = f"node-{VICTIM} died mid-checkpoint of epoch {opts.crash_at}"
    return (
        f"VERIFIED: {what}; every rank restored the agreed epoch {res.restore_point} and the "
        f"final weights equal the uninterrupted run bit for bit ({res.elapsed_s:.1f} s); "
        f"{marker}."
    )


def run_demo(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """Run the demo; return the exit code (0 verified, 1 not, 2 bad options, 130 on Ctrl-C).

    ``args`` is the parsed ``demo`` subcommand (see `add_arguments`), or a list of
    command-line arguments, or None for ``sys.argv[1:]``.
    """
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(prog="convergenced demo", description=DESCRIPTION)
        add_arguments(parser)
        args = parser.parse_args(None if args is None else list(args))
    try:
        opts = options_from(args)
    except ValueError as exc:
        print(f"convergenced demo: {exc}", file=sys.stderr)
        return 2
    out = sys.stderr if opts.json else sys.stdout
    demo: Demo | None = None
    code = 1
    result = DemoResult(steps=opts.steps, every=opts.every, crash_epoch=opts.crash_at,
                        scenario=opts.scenario)  # fmt: skip
    try:
        demo = Demo(opts, out)
        result = demo.result
        demo.run()
        code = 0 if result.verified else 1
    except KeyboardInterrupt:
        result.problems.append("interrupted")
        code = 130
    except (ConvergencedError, RuntimeError, OSError) as exc:
        result.problems.append(f"{type(exc).__name__}: {exc}")
        if demo is not None:
            for i in range(1, demo.cluster.n + 1):
                tail = demo.cluster.log_tail(i, 1500)
                if tail:
                    print(f"--- {node_name(i)} log (end) ---\n{tail}", file=sys.stderr)
    finally:
        if demo is not None:
            with contextlib.suppress(KeyboardInterrupt):
                demo.close()
    result.verified = result.verified and code == 0
    result.elapsed_s = round(time.monotonic() - (demo.started if demo else time.monotonic()), 2)
    result.verdict = _verdict(result, opts)
    print(result.verdict, file=out, flush=True)
    if opts.json:
        print(json.dumps(result.as_json(), sort_keys=True), flush=True)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m convergenced.tools.demo``: the same as ``convergenced demo``."""
    return run_demo(argv)
