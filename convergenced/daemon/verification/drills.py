"""Drills: a full test restore of one epoch for this node's ranks, on request
(``convergencectl drill``) or on a schedule (``[drill]``), timed per rank and per
domain, and recorded (docs/verification.md#drills).

A drill reads every byte of the epoch's checkpoints of this node's ranks, unthrottled
(it measures load bandwidth), checks them against their commits as the verifier does,
and restores them into a scratch folder when one is configured. A user hook may then
load them for real (into a model, a forward pass): it runs with the scratch folder and
the locations in its environment, and its exit status decides. Evidence against the
bytes (mismatch, missing, corrupt) is retracted as the verifier retracts it; a failing
hook retracts nothing (it may fail for reasons of its own) but fails the drill.

The outcome is counted, kept in memory for the state map, and appended to
``drills.jsonl`` in the state directory (the newest `KEEP_RECORDS`), so it outlives a
restart.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Final

import structlog
import trio
from prometheus_client import CollectorRegistry, Counter, Gauge

from convergenced.core.errors import UnknownStreamError
from convergenced.core.local_api_codec import ApiError, ErrorKind
from convergenced.core.locations import Location
from convergenced.core.node import NodeCore
from convergenced.daemon.metrics import spec
from convergenced.daemon.verification.config import DrillConfig
from convergenced.daemon.verification.digests import Throttle
from convergenced.daemon.verification.verifier import EVIDENCE, Check, Verifier

__all__ = ["KEEP_RECORDS", "Drills"]

log = structlog.get_logger("convergenced.drills")

KEEP_RECORDS: Final = 256
"""Drill records kept in ``drills.jsonl`` (the oldest go first)."""
RECORDS_NAME: Final = "drills.jsonl"
HOOK_OUTPUT_CHARS: Final = 2000
"""The tail of a hook's output kept in the result."""
HOOK_OUTPUT_NAME: Final = "drill-hook.log"
"""Where the last hook's output is written, beside ``drills.jsonl``."""


@dataclass(frozen=True, slots=True)
class _Read:
    check: Check
    outcome: str
    detail: str
    bytes: int
    seconds: float


def _rate(n: int, seconds: float) -> float:
    return round(n / seconds / 1e6, 3) if seconds > 0 else 0.0


class Drills:
    """The drills of one daemon (see the module docstring)."""

    def __init__(
        self,
        node: NodeCore,
        verifier: Verifier,
        registry: CollectorRegistry,
        config: DrillConfig,
        state_dir: Path,
        *,
        clock: Callable[[], float] = trio.current_time,
        run_blocking: Callable[[Callable[[], Any]], Awaitable[Any]] | None = None,
    ) -> None:
        self.node = node
        self.verifier = verifier
        self.config = config
        self.records = state_dir / RECORDS_NAME
        self._clock = clock
        self._run_blocking = run_blocking or partial(trio.to_thread.run_sync,
                                                     abandon_on_cancel=True)  # fmt: skip
        d, b = spec("drills"), spec("drill_load_bytes_per_second")
        self.outcomes = Counter(d.name, d.help, list(d.labels), registry=registry)
        for outcome in ("passed", "failed"):
            self.outcomes.labels(outcome=outcome)
        self.bandwidth = Gauge(b.name, b.help, list(b.labels), registry=registry)
        self._last: dict[str, tuple[float, dict[str, Any]]] = {}
        self._lock = trio.Lock()

    # -- one drill -------------------------------------------------------------------

    async def drill(
        self, stream: str, epoch: int | None = None, domain: str | None = None
    ) -> dict[str, Any]:
        """Restore ``epoch`` (default: the restore point) of ``stream`` for this node's
        ranks, in ``domain`` (default: every domain they hold it in); see the module
        docstring. One drill at a time per daemon.

        Raises:
            ApiError: ``rejected``: the stream is not declared here (``unknown_stream``),
                has no restore point (``no_restore_point``), or this node holds no
                location of that epoch (``nothing_to_drill``).
        """
        async with self._lock:
            checks = self._checks(stream, epoch, domain)
            started = self._clock()
            scratch = self._scratch(stream, checks[0].epoch)
            try:
                reads = [await self._read(c, scratch) for c in checks]
                ok = all(r.outcome == "ok" for r in reads)
                hook = await self._hook(checks, scratch) if ok and self.config.hook else None
            finally:
                if scratch is not None:
                    await self._run_blocking(partial(shutil.rmtree, scratch, ignore_errors=True))
            passed = ok and (hook is None or hook["exit"] == 0)
            result = self._result(reads, hook, passed, self._clock() - started)
            await self._record(result)
            return result

    def _checks(self, stream: str, epoch: int | None, domain: str | None) -> list[Check]:
        try:
            target = self.node.restore_point(stream) if epoch is None else epoch
            held = self.node.located(stream)
        except UnknownStreamError:
            msg = f"stream {stream!r} is not declared on this node"
            raise ApiError(ErrorKind.REJECTED, "unknown_stream", msg) from None
        if target is None:
            msg = f"stream {stream!r} has no restore point to drill; name an epoch"
            raise ApiError(ErrorKind.REJECTED, "no_restore_point", msg)
        checks = [
            Check(stream, rank, d, e, Location.from_text(c.location), c.digest, c.size, c.location)
            for rank, d, e, c in held
            if e == target and (domain is None or d == domain)
        ]
        if not checks:
            where = f" in {domain!r}" if domain else ""
            msg = (
                f"stream {stream!r}: this node's ranks hold epoch {target}{where} with no "
                "location (not held, or its commits did not say where the bytes are)"
            )
            raise ApiError(ErrorKind.REJECTED, "nothing_to_drill", msg)
        return sorted(checks, key=lambda c: (c.domain, c.rank))

    def _scratch(self, stream: str, epoch: int) -> Path | None:
        if self.config.scratch is None:
            return None
        return self.config.scratch / f"{stream.replace('/', '_')}-epoch-{epoch}-{os.getpid()}"

    async def _read(self, check: Check, scratch: Path | None) -> _Read:
        into = None if scratch is None else scratch / check.domain / f"rank-{check.rank}"
        start = self._clock()
        outcome, detail, size = await self.verifier.read(check, Throttle(0), into)
        if outcome in EVIDENCE:
            await self.verifier.retract(check, outcome, detail)
        return _Read(check, outcome, detail, size, self._clock() - start)

    async def _hook(self, checks: list[Check], scratch: Path | None) -> dict[str, Any]:
        first = checks[0]
        env = {
            **os.environ,
            "CONVERGENCED_DRILL_STREAM": first.stream,
            "CONVERGENCED_DRILL_EPOCH": str(first.epoch),
            "CONVERGENCED_DRILL_DIR": "" if scratch is None else str(scratch),
            "CONVERGENCED_DRILL_LOCATIONS": json.dumps([
                {"rank": c.rank, "domain": c.domain, **c.location.to_wire()} for c in checks
            ]),
        }  # fmt: skip
        start = self._clock()
        # Its output goes to a file, not into memory: a chatty hook must not grow the
        # daemon; the result keeps the tail.
        output = self.records.with_name(HOOK_OUTPUT_NAME)
        code: int | None = None
        try:
            with output.open("wb") as sink, trio.move_on_after(self.config.hook_timeout_s):
                done = await trio.run_process(list(self.config.hook), env=env, check=False,
                                              stdout=sink, stderr=subprocess.STDOUT)  # fmt: skip
                code = done.returncode
            out = await self._run_blocking(partial(_tail, output))
            if code is None:
                out += f"\n(killed after {self.config.hook_timeout_s:g} s)"
                code = -1
        except OSError as exc:
            code, out = -1, f"could not run {self.config.hook[0]}: {exc}"
        return {"exit": code, "seconds": round(self._clock() - start, 3), "output": out}

    def _result(
        self, reads: list[_Read], hook: dict[str, Any] | None, passed: bool, seconds: float
    ) -> dict[str, Any]:
        stream, epoch = reads[0].check.stream, reads[0].check.epoch
        domains: dict[str, dict[str, Any]] = {}
        for r in reads:
            d = domains.setdefault(r.check.domain, {"bytes": 0, "seconds": 0.0, "ranks": 0})
            d["bytes"] += r.bytes
            d["seconds"] += r.seconds
            d["ranks"] += 1
        for name, d in domains.items():
            d["mb_s"] = _rate(d["bytes"], d["seconds"])
            d["seconds"] = round(d["seconds"], 3)
            if all(r.outcome == "ok" for r in reads if r.check.domain == name):
                self.bandwidth.labels(domain=name).set(d["bytes"] / max(d["seconds"], 1e-9))
        self.outcomes.labels(outcome="passed" if passed else "failed").inc()
        return {
            "stream": stream,
            "epoch": epoch,
            "passed": passed,
            "seconds": round(seconds, 3),
            "at": time.time(),  # for the record only: nothing decides by it
            "ranks": [
                {
                    "rank": r.check.rank,
                    "domain": r.check.domain,
                    "outcome": r.outcome,
                    "detail": r.detail,
                    "bytes": r.bytes,
                    "seconds": round(r.seconds, 3),
                    "mb_s": _rate(r.bytes, r.seconds),
                }
                for r in reads
            ],
            "domains": domains,
            "hook": hook,
        }

    async def _record(self, result: dict[str, Any]) -> None:
        self._last[result["stream"]] = (self._clock(), result)
        say = log.info if result["passed"] else log.warning
        say("drill passed" if result["passed"] else "drill failed", stream=result["stream"],
            epoch=result["epoch"], seconds=result["seconds"],
            failed=[r for r in result["ranks"] if r["outcome"] != "ok"],
            hook_exit=None if result["hook"] is None else result["hook"]["exit"])  # fmt: skip
        try:
            await self._run_blocking(partial(_append_record, self.records, result))
        except OSError as exc:
            log.warning("drill record not written", path=str(self.records), error=str(exc))

    # -- schedule and figures --------------------------------------------------------

    async def run(self) -> None:
        """Drill every ``every_s`` (returns at once when no schedule is configured)."""
        if self.config.every_s <= 0:
            return
        while True:
            await trio.sleep(self.config.every_s)
            for stream in self.config.streams or tuple(self.node.streams()):
                try:
                    await self.drill(stream)
                except ApiError as exc:
                    log.info("scheduled drill skipped", stream=stream, reason=exc.reason)

    def describe(self, stream: str) -> dict[str, Any] | None:
        """The ``drill`` part of the state map: the last drill of ``stream`` here and
        how long ago it ran (None: none since the daemon started)."""
        last = self._last.get(stream)
        if last is None:
            return None
        at, r = last
        return {"epoch": r["epoch"], "passed": r["passed"], "age_s": self._clock() - at,
                "seconds": r["seconds"],
                "mb_s": {d: v["mb_s"] for d, v in r["domains"].items()}}  # fmt: skip


def _tail(path: Path) -> str:
    """The last `HOOK_OUTPUT_CHARS` bytes of ``path``, as text."""
    with path.open("rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - HOOK_OUTPUT_CHARS))
        return f.read().decode(errors="replace")


def _append_record(path: Path, result: dict[str, Any]) -> None:
    """Append ``result`` as one JSON line, keeping the newest `KEEP_RECORDS`."""
    lines: deque[str] = deque(maxlen=KEEP_RECORDS - 1)
    try:
        with path.open(encoding="utf-8") as f:
            lines.extend(line.rstrip("\n") for line in f if line.strip())
    except FileNotFoundError:
        pass
    lines.append(json.dumps(result, sort_keys=True))
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    os.replace(tmp, path)
