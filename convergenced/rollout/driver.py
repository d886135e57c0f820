"""Walking a rollout plan: wave after wave, each node gated, upgraded and acknowledged.

The driver holds no state of its own that matters. What a node runs is its daemon's
report (`core.versions`); what happened to it is the audit trail the driver writes
into that node's log (``note_rollout``: one JSON object per step, kept through
restarts). So the driver may be stopped at any point and run again with the same
plan: a node that already runs the version is skipped; a node caught half way is
taken again from its gate (the upgrade hook must be safe to run twice, as any
upgrade script should); a node whose last note for this plan says it failed stops
the rollout again until ``--retry-failed``.

For each node, in order:

1. **gate**: ``convergencectl gate NODE --version COMPONENT=VERSION [--checkpoint]``
   on the node's daemon: every stream of the node has a restore point every member
   published at least as new as its newest epoch (or the checkpoint asked for the
   drain), and every member of each of its jobs accepts the version and has
   acknowledged that. Closed within ``gate_timeout_s``: the node fails;
2. note ``drained``: the restore point of each stream every member acknowledged, the
   stream's membership (the recovery generation its member map applies from) and its
   open recovery generations, and the acknowledgement's time;
3. **upgrade**: the plan's hook, with ``CONVERGENCED_NODE``, ``CONVERGENCED_COMPONENT``
   and ``CONVERGENCED_VERSION`` in its environment. It may reboot the node; a non-zero
   exit or ``upgrade_timeout_s`` fails the node;
4. **report**: once the daemon answers again, the node reports the new version and
   what it accepts (the plan's ``accepts``);
5. **acknowledged**: every job of the node sees it run the version, compatible, and
   every member acknowledged the version (knowledge ``published``), within
   ``back_timeout_s``;
6. note ``done``: the versions before and after, the epochs, the time.

A wave's nodes go in parallel, a wave starts when the one before is done, and the
first failure ends the rollout once the nodes under way finish. Timestamps in the
notes are wall-clock time for people reading the audit trail; no decision reads them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from convergenced.rollout.plan import Plan, waves

POLL_S = 0.5
"""How often the driver asks a node again while it waits for it."""
CTL_TIMEOUT_S = 60.0
"""A convergencectl call that is not a wait."""


class NodeFailed(Exception):
    """A node's step failed; the message says which and why."""


@dataclass
class Outcome:
    """What became of one node."""

    node: str
    state: str
    """``done``, ``already`` (ran the version before), ``failed``, ``skipped`` (the
    rollout stopped first), ``would`` (a dry run)."""
    detail: str = ""
    before: str | None = None


@dataclass
class Report:
    """The result of one run of the driver."""

    plan: str
    waves: list[list[str]]
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    dry_run: bool = False
    stopped: str = ""
    """Why the run stopped before the end ("" when it did not)."""

    @property
    def ok(self) -> bool:
        ended = all(o.state in ("done", "already", "would") for o in self.outcomes.values())
        return ended and not self.stopped

    def to_json(self) -> dict[str, Any]:
        return {
            "plan": self.plan,
            "dry_run": self.dry_run,
            "ok": self.ok,
            "stopped": self.stopped,
            "waves": self.waves,
            "nodes": {
                n: {"state": o.state, "detail": o.detail, "before": o.before}
                for n, o in self.outcomes.items()
            },
        }


Runner = Callable[[list[str], float, dict[str, str] | None], tuple[int, str, str]]
"""Runs a command with a timeout and extra environment: (exit code, stdout, stderr)."""


def run_command(
    argv: list[str], timeout: float, env: dict[str, str] | None
) -> tuple[int, str, str]:
    """`Runner` over subprocess (exit code 124 on a timeout, 127 when not found)."""
    full = {**os.environ, **env} if env else None
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=full,
                           stdin=subprocess.DEVNULL, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        return 124, "", f"timed out after {timeout:.0f} s"
    except OSError as exc:
        return 127, "", str(exc)
    return p.returncode, p.stdout, p.stderr


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class Rollout:
    """One run of a plan (see the module docstring)."""

    def __init__(
        self,
        plan: Plan,
        *,
        runner: Runner = run_command,
        say: Callable[[str], None] = print,
        retry_failed: bool = False,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.plan = plan
        self.runner = runner
        self.say = say
        self.retry_failed = retry_failed
        self.sleep = sleep
        self.clock = clock

    # -- talking to a node's daemon -------------------------------------------------

    def ctl(self, node: str, *args: str, timeout: float = CTL_TIMEOUT_S) -> tuple[int, Any, str]:
        """Run convergencectl on ``node`` with ``--json``: (exit code, result, stderr).

        ssh hands the remote shell one line, which would split the words the rollout
        adds (a note is JSON, with blanks and quotes): when the template runs ssh,
        those words are quoted for the remote shell."""
        template = self.plan.argv(self.plan.ctl, node)
        words = ["--json", *args]
        if Path(template[0]).name == "ssh":
            words = [shlex.quote(w) for w in words]
        argv = [*template, *words]
        rc, out, err = self.runner(argv, timeout + 10, None)
        try:
            result = json.loads(out.strip().splitlines()[-1]) if out.strip() else None
        except json.JSONDecodeError:
            result = None
        return rc, result, err.strip()

    def ask(self, node: str, *args: str) -> Any:
        """A read on ``node`` that must succeed.

        Raises:
            NodeFailed: the daemon did not answer.
        """
        rc, result, err = self.ctl(node, *args)
        if rc != 0 or result is None:
            raise NodeFailed(f"{node}: convergencectl {args[0]} failed: {err or rc}")
        return result

    def wait_for(self, what: str, timeout: float, probe: Callable[[], str]) -> None:
        """Poll ``probe`` (returns why not yet, "" when done) until done or ``timeout``.

        Raises:
            NodeFailed: not done in time, with the last reason.
        """
        deadline = self.clock() + timeout
        while True:
            try:
                why = probe()
            except NodeFailed as exc:
                why = str(exc)
            if not why:
                return
            if self.clock() >= deadline:
                raise NodeFailed(f"{what}: not within {timeout:.0f} s: {why}")
            self.sleep(POLL_S)

    def note(self, node: str, step: str, **fields: Any) -> None:
        """Add a note of this plan to ``node``'s audit trail."""
        text = json.dumps({"plan": self.plan.id, "node": node, "step": step,
                           "component": self.plan.component, "at": _now(), **fields},
                          sort_keys=True)  # fmt: skip
        rc, _, err = self.ctl(node, "rollout-note", text)
        if rc != 0:
            raise NodeFailed(f"{node}: cannot write its audit note: {err or rc}")

    # -- the walk ---------------------------------------------------------------------

    def survey(self) -> tuple[list[str], dict[str, list[str]], dict[str, Outcome]]:
        """The plan's nodes that match its labels, the jobs of each, and the nodes that
        need nothing (already on the version) or stop the rollout (failed before)."""
        p = self.plan
        chosen: list[str] = []
        jobs_of: dict[str, list[str]] = {}
        settled: dict[str, Outcome] = {}
        for node in p.nodes:
            if p.select:
                labels = self.ask(node, "status").get("labels", {})
                if any(labels.get(k) != v for k, v in p.select.items()):
                    continue
            chosen.append(node)
            v = self.ask(node, "versions")
            mine = v["components"].get(p.component)
            if mine is None:
                settled[node] = Outcome(node, "failed", f"no catalogue of {p.component} in "
                                        "its configuration ([components.NAME])")  # fmt: skip
                continue
            jobs_of[node] = sorted(v["streams"])
            running = mine["running"]
            last = [n for n in _notes(v) if n.get("plan") == p.id]
            if running == p.version:
                settled[node] = Outcome(node, "already", "")
            elif last and last[-1].get("step") == "failed" and not self.retry_failed:
                why = last[-1].get("reason", "")
                settled[node] = Outcome(node, "failed", f"failed before: {why}", running)
        return chosen, jobs_of, settled

    def run(self, *, dry_run: bool = False) -> Report:
        """Walk the plan (or, with ``dry_run``, say what would happen, changing nothing)."""
        p = self.plan
        try:
            chosen, jobs_of, settled = self.survey()
        except NodeFailed as exc:
            self.say(f"stopped before any node: {exc}")
            return Report(p.id, [], {}, dry_run, stopped=str(exc))
        todo = [n for n in chosen if n not in settled]
        plan_waves = waves(todo, jobs_of, canary=p.canary, wave_size=p.wave_size,
                           max_down_per_job=p.max_down_per_job)  # fmt: skip
        report = Report(p.id, plan_waves, dict(settled), dry_run)
        for node, o in settled.items():
            self.say(f"{node}: {o.state}{': ' + o.detail if o.detail else ''}")
        if any(o.state == "failed" for o in settled.values()):
            report.stopped = ("fix the nodes above first (a node that failed in an earlier "
                              "run of this plan is taken again with --retry-failed)")  # fmt: skip
            self.say(f"stopped: {report.stopped}")
            return report
        for i, wave in enumerate(plan_waves, 1):
            kind = "canary" if i == 1 else f"wave {i}"
            self.say(f"{kind}: {', '.join(wave)}")
            if dry_run:
                for node in wave:
                    o = report.outcomes[node] = self._dry(node)
                    self.say(f"{node}: {o.detail}")
                continue
            with ThreadPoolExecutor(max_workers=len(wave)) as pool:
                for o in pool.map(self._node, wave):
                    report.outcomes[o.node] = o
                    self.say(f"{o.node}: {o.state}{': ' + o.detail if o.detail else ''}")
            if not report.ok:
                rest = [n for w in plan_waves[i:] for n in w]
                for node in rest:
                    report.outcomes[node] = Outcome(node, "skipped", "the rollout stopped")
                report.stopped = f"a node failed in {kind}: {len(rest)} nodes not started"
                self.say(f"stopped after {kind}: {len(rest)} nodes not started")
                break
        return report

    def _dry(self, node: str) -> Outcome:
        p = self.plan
        rc, answer, err = self.ctl(node, "gate", node, "--version", f"{p.component}={p.version}",
                                   "--timeout", "0")  # fmt: skip
        if answer is None:
            return Outcome(node, "failed", f"gate: {err or rc}")
        why = _reasons(answer)
        return Outcome(node, "would", "would drain now" if rc == 0 else f"would wait: {why}")

    def _node(self, node: str) -> Outcome:
        before: str | None = None
        try:
            before = self.ask(node, "versions")["components"][self.plan.component]["running"]
            self._move(node, before)
        except NodeFailed as exc:
            # An unreachable node keeps no note: the failure is in this run's report.
            with contextlib.suppress(NodeFailed):
                self.note(node, "failed", before=before, target=self.plan.version,
                          reason=str(exc))  # fmt: skip
            return Outcome(node, "failed", str(exc), before)
        return Outcome(node, "done", "", before)

    def _move(self, node: str, before: str | None) -> None:
        p = self.plan
        gate = ["gate", node, "--version", f"{p.component}={p.version}",
                "--timeout", str(p.gate_timeout_s)]  # fmt: skip
        if p.checkpoint:
            gate.append("--checkpoint")
        rc, answer, err = self.ctl(node, *gate, timeout=p.gate_timeout_s)
        if rc != 0 or answer is None or not answer.get("safe"):
            raise NodeFailed(f"{node}: drain gate closed: {_reasons(answer) if answer else err}")
        epochs = {s: {"restore_point": v["restore_point"], "knowledge": v["knowledge"]}
                  for s, v in answer["streams"].items()}  # fmt: skip
        states = {s: self.ask(node, "state", s) for s in epochs}
        memberships = {s: st.get("membership") for s, st in states.items()}
        generations = {s: st.get("generations", []) for s, st in states.items()}
        self.note(node, "drained", before=before, target=p.version, epochs=epochs,
                  memberships=memberships, generations=generations)  # fmt: skip
        env = {"CONVERGENCED_NODE": node, "CONVERGENCED_COMPONENT": p.component,
               "CONVERGENCED_VERSION": p.version}  # fmt: skip
        rc, _, err = self.runner(p.argv(p.upgrade, node), p.upgrade_timeout_s, env)
        if rc != 0:
            tail = err.strip().splitlines()[-1] if err.strip() else f"exit {rc}"
            raise NodeFailed(f"{node}: upgrade hook failed (exit {rc}): {tail}")

        def reported() -> str:
            rc, _, err = self.ctl(node, "report-version", p.component, p.version,
                                  "--accepts", ",".join(p.accepts))  # fmt: skip
            return "" if rc == 0 else f"{node}: report-version: {err or rc}"

        self.wait_for(f"{node}: back after the upgrade", p.back_timeout_s, reported)

        def acknowledged() -> str:
            v = self.ask(node, "versions")
            for stream, per in v["streams"].items():
                h = per.get(p.component, {})
                if h.get("running", {}).get(node) != p.version:
                    return f"{stream}: {node} not yet seen on {p.version}"
                if not h.get("compatible") or h.get("knowledge") != "published":
                    return f"{stream}: not yet acknowledged by every member ({h.get('knowledge')})"
            return ""

        self.wait_for(f"{node}: acknowledged", p.back_timeout_s, acknowledged)
        self.note(node, "done", before=before, after=p.version, epochs=epochs,
                  memberships=memberships, generations=generations)  # fmt: skip


def _notes(versions: dict[str, Any]) -> list[dict[str, Any]]:
    """The audit notes of a ``versions`` result that are JSON objects (anyone allowed
    on the socket may add a note; the others are no rollout's)."""
    out = []
    for text in versions.get("rollout_notes", []):
        try:
            note = json.loads(text)
        except json.JSONDecodeError:
            continue
        if isinstance(note, dict):
            out.append(note)
    return out


def _reasons(answer: dict[str, Any]) -> str:
    """The reasons a gate answer gives, in one line."""
    why = [v["reason"] for v in answer.get("streams", {}).values() if v.get("reason")]
    why += [m["reason"] for m in answer.get("versions", []) if m.get("reason")]
    return "; ".join(why) or "not safe"


def summary(report: Report, nodes: Sequence[str]) -> str:
    """The closing lines of a run, for people."""
    counts: dict[str, int] = {}
    for o in report.outcomes.values():
        counts[o.state] = counts.get(o.state, 0) + 1
    parts = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    head = "dry run" if report.dry_run else ("done" if report.ok else "STOPPED")
    return f"rollout {report.plan}: {head}: {parts} (of {len(nodes)} nodes in the plan)"
