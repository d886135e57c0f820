"""The story the demo tells: one run, phase by phase, and what it verifies.

`Demo` drives the phases listed in the package docstring: start the cluster, launch
generation 0 of the trainers, kill node-3's trainer and daemon in the middle of a
checkpoint, evaluate what rank 0's ``latest`` marker would have restored at that moment,
restart the daemon, relaunch every rank as generation 1, and verify the final weights
against an uninterrupted reference run. Its output (one line per event, and a live
progress line) goes through a `console.Console`.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from convergenced.client import Client
from convergenced.errors import ConvergencedError
from convergenced.integrations.files import (
    CorruptShardError,
    MixedEpochError,
    Shard,
    Tier,
    load_consistent,
    read_shard,
    shard_path,
)
from convergenced.tools.cluster import node_name
from convergenced.tools.demo.console import Console
from convergenced.tools.demo.nodes import DemoCluster
from convergenced.tools.demo.options import Options
from convergenced.tools.demo.result import DemoResult
from convergenced.tools.demo.trainer import (
    NODES,
    PHASE_TIMEOUT,
    STREAM,
    Collective,
    Crash,
    Progress,
    Trainer,
    _weights,
    init_shard,
    loss,
    pack,
    reference_run,
    train_step,
    unpack,
)

VICTIM = NODES
"""The node whose trainer and daemon die (node-3, rank 2: not the marker's writer)."""


class DemoFailed(ConvergencedError):
    """A phase of the demo did not happen as planned (the message says which)."""


class Demo:
    """One demo run: the cluster, the trainers, the progress line and the checks."""

    def __init__(self, opts: Options, out: TextIO) -> None:
        """A run with ``opts``, printing progress to ``out``."""
        self.opts = opts
        self.started = time.monotonic()
        self.cluster = DemoCluster(NODES, tick_ms=opts.tick_ms)
        self.progress = Progress()
        self.console = Console(out, self.started, self.cluster, self.progress, opts.steps)
        self.result = DemoResult(steps=opts.steps, every=opts.every, crash_epoch=opts.crash_at)
        self._launches: list[tuple[Collective, Crash | None, list[Trainer]]] = []
        self._reference_shards: list[bytes] | None = None

    # -- layout ------------------------------------------------------------------------

    def spec(self) -> dict[str, Any]:
        """The stream: one rank per node, an epoch counts once on nvme or s3."""
        return {
            "name": STREAM,
            "members": {node_name(i): [i - 1] for i in range(1, NODES + 1)},
            "policy": {"mode": "any", "domains": ["nvme", "s3"]},
            "retention": self.opts.retention,
        }

    def local_tier(self, node: int) -> Tier:
        """Node ``node``'s local NVMe (a directory of its own)."""
        return Tier("nvme", self.cluster.dir / node_name(node) / "nvme")

    def remote_tier(self) -> Tier:
        """The object store every node uploads to (one shared directory)."""
        return Tier("s3", self.cluster.dir / "s3")

    def marker_path(self) -> Path:
        """Where rank 0 writes the baseline's ``latest`` marker."""
        return self.remote_tier().directory / STREAM / "latest"

    def upload_delay(self, rank: int) -> Callable[[int], float]:
        """An upload's lag: the configured mean, jittered by +-50 %."""
        rng = random.Random(rank)
        lag = self.opts.upload_lag_s
        return lambda epoch: lag * (0.5 + rng.random())

    # -- output ------------------------------------------------------------------------

    def elapsed(self) -> float:
        """Seconds since the demo started."""
        return self.console.elapsed()

    def event(self, text: str) -> None:
        """Print one event line (above the live line on a terminal)."""
        self.console.event(text)

    # -- phases ------------------------------------------------------------------------------

    def run(self) -> DemoResult:
        """Run every phase; the result says what verified."""
        opts = self.opts
        statuses = self.cluster.start_all()
        self.event(
            f"cluster: {NODES} daemons on loopback (mutual TLS), directory {self.cluster.dir}"
        )
        for st in statuses:
            port = st.get("metrics_port")
            if port:
                self.result.metrics[st["node"]] = f"http://127.0.0.1:{port}/metrics"
        if self.result.metrics:
            self.event(
                "Prometheus can scrape: "
                + ", ".join(f"{url} ({node})" for node, url in self.result.metrics.items())
            )
        self.event(
            f"stream {STREAM!r}: node-1..node-{NODES} host ranks 0..{NODES - 1}; an epoch "
            f"counts once a rank has it on nvme or s3; checkpoint every {opts.every} steps, "
            f"retention {opts.retention}, s3 uploads lag ~{opts.upload_lag_s:.2f} s"
        )
        self.console.start()

        # Launch 0: train until node-3 dies in the middle of checkpoint `crash_at`.
        crash = Crash(VICTIM, opts.crash_at)
        self.event(f"launch generation 0: {NODES} ranks ask for their restore point")
        first = self._launch(0, crash)
        if not self._wait_crash_point(first, crash):
            self._stop_trainers()
            raise DemoFailed(f"the run did not reach the crash point: {self._outcomes(first)}")
        self.cluster.kill(VICTIM)
        crash.die.set()
        self.event(
            f"CRASH: {node_name(VICTIM)}'s trainer died writing its shard of epoch "
            f"{opts.crash_at}; its daemon got SIGKILL"
        )
        self._evaluate_marker()
        self._join(first)
        unexpected = [t for t in first if t.outcome not in ("killed", "stopped")]
        if unexpected:
            raise DemoFailed(f"launch 0 ended unexpectedly: {self._outcomes(first)}")
        self.event("the launcher stopped the other ranks (their collective broke)")

        # Restart node-3's daemon, relaunch every rank as recovery generation 1.
        self.cluster.start(VICTIM)
        st = self.cluster.wait_ready(VICTIM)
        self.event(f"{node_name(VICTIM)}'s daemon restarted (incarnation {st['incarnation']})")
        self.event(f"launch generation 1: {NODES} ranks ask for their restore point")
        second = self._launch(1, None)
        self._join(second)
        failed = [t for t in second if t.outcome != "finished"]
        if failed:
            raise DemoFailed(f"launch 1 did not finish: {self._outcomes(second)}")
        self._verify(second)
        return self.result

    def _wait_crash_point(self, trainers: list[Trainer], crash: Crash) -> bool:
        """Wait until the victim is mid-write and every other rank saved that epoch."""
        waits = [crash.mid_write] + [
            self.progress.saved_event(t.rank, crash.epoch) for t in trainers if t.node != crash.node
        ]
        deadline = time.monotonic() + PHASE_TIMEOUT
        while not all(e.is_set() for e in waits):
            if time.monotonic() > deadline or not all(t.is_alive() for t in trainers):
                return False
            time.sleep(0.02)
        return True

    def _stop_trainers(self) -> None:
        """Break every launch's collective and release a paused victim; join them."""
        for collective, crash, _ in self._launches:
            collective.abort()
            if crash is not None:
                crash.die.set()
        for _, _, trainers in self._launches:
            for t in trainers:
                t.join(30)

    def _launch(self, generation: int, crash: Crash | None) -> list[Trainer]:
        collective = Collective(NODES)
        self.progress.step.clear()  # each rank reports again once it restored
        trainers = [Trainer(self, i, generation, collective, crash) for i in range(1, NODES + 1)]
        self._launches.append((collective, crash, trainers))
        for t in trainers:
            t.start()
        return trainers

    def _join(self, trainers: list[Trainer]) -> None:
        deadline = time.monotonic() + PHASE_TIMEOUT
        for t in trainers:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in trainers if t.is_alive()]
        if alive:
            raise DemoFailed(f"trainers still running after {PHASE_TIMEOUT} s: {alive}")

    @staticmethod
    def _outcomes(trainers: list[Trainer]) -> str:
        return ", ".join(
            f"{node_name(t.node)} {t.outcome}" + (f" ({t.error!r})" if t.error else "")
            for t in trainers
        )

    def _find_shard(self, rank: int, newest: int, *, exact: bool) -> Shard | None:
        """Rank ``rank``'s valid shard of epoch ``newest`` in any tier or, unless
        ``exact``, its newest valid shard below it (what a naive loader falls back to)."""
        tiers = (self.local_tier(rank + 1), self.remote_tier())
        candidates = [newest] if exact else range(newest, -1, -1)
        for epoch in candidates:
            for tier in tiers:
                path = shard_path(tier.directory, STREAM, epoch, rank)
                with contextlib.suppress(FileNotFoundError, CorruptShardError):
                    return read_shard(path, stream=STREAM, rank=rank, epoch=epoch)
        return None

    def _evaluate_marker(self) -> None:
        """What restoring from rank 0's ``latest`` marker would give, right at the crash."""
        res = self.result
        try:
            marker = int(self.marker_path().read_text().strip())
        except (OSError, ValueError):
            self.event("latest marker: none written yet")
            return
        exact = {r: self._find_shard(r, marker, exact=True) for r in range(NODES)}
        missing = [r for r, shard in exact.items() if shard is None]
        res.marker_epoch = marker
        res.marker_valid = not missing
        res.marker_missing_ranks = missing
        if not missing:
            self.event(f"a latest marker points at epoch {marker}, complete on every rank")
            return
        self.event(
            f"a latest marker written by rank 0 points at epoch {marker}, but rank(s) "
            f"{missing} have no shard of it: loading it fails on those ranks"
        )
        fallback = [exact[r] or self._find_shard(r, marker, exact=False) for r in range(NODES)]
        shards = [s for s in fallback if s is not None]
        try:
            load_consistent(shards)
        except MixedEpochError as exc:
            res.marker_error = str(exc)
            self.event(f"a loader falling back to each rank's newest shard: {exc}")
        if len(shards) == NODES:
            # Forced anyway: resume every rank from the marker's step with mixed weights.
            weights = [w for s in shards for w in unpack(_weights(s.payload))]
            for step in range(marker, self.opts.steps):
                weights = [w for r in range(NODES) for w in train_step(weights, step, r)]
            res.marker_bitwise_equal = pack(weights) == b"".join(self._reference())
            if not res.marker_bitwise_equal:
                self.event("forced anyway, that run would end with weights that differ")

    def _reference(self) -> list[bytes]:
        if self._reference_shards is None:
            self._reference_shards = reference_run(self.opts.steps)
        return self._reference_shards

    def _verify(self, trainers: list[Trainer]) -> None:
        opts, res = self.opts, self.result
        restored = {node_name(t.node): t.restored for t in trainers}
        res.restored = restored
        points = set(restored.values())
        expected = opts.crash_at - opts.every
        res.restore_point = next(iter(points)) if len(points) == 1 else None
        if len(points) != 1:
            res.problems.append(f"ranks restored different epochs: {restored}")
        elif res.restore_point != expected:
            res.problems.append(
                f"restored epoch {res.restore_point}, expected {expected} (the newest "
                "checkpoint every rank had committed before the crash)"
            )
        # The final checkpoint, agreed on every node, read back from disk.
        for i in range(1, NODES + 1):
            with Client(self.cluster.socket_path(i), timeout=10) as c:
                st = c.wait(STREAM, opts.steps, timeout=PHASE_TIMEOUT)
            if i == 1:
                res.final_restore_point = st["restore_point"]
        shards = [
            read_shard(
                shard_path(self.local_tier(r + 1).directory, STREAM, opts.steps, r),
                stream=STREAM,
                rank=r,
                epoch=opts.steps,
            )
            for r in range(NODES)
        ]
        on_disk = load_consistent(shards, epoch=opts.steps)
        disk_bytes = b"".join(_weights(p) for _, p in sorted(on_disk.items()))
        memory_bytes = b"".join(t.final or b"" for t in trainers)
        reference = b"".join(self._reference())
        res.final_digest = "sha256:" + hashlib.sha256(memory_bytes).hexdigest()
        res.reference_digest = "sha256:" + hashlib.sha256(reference).hexdigest()
        res.bitwise_equal = memory_bytes == reference and disk_bytes == reference
        if not res.bitwise_equal:
            res.problems.append("final weights differ from the uninterrupted reference run")
        if res.marker_epoch is None:
            res.problems.append("the latest-marker baseline was not evaluated")
        res.verified = not res.problems
        start = [w for r in range(NODES) for w in init_shard(r)]
        self.event(
            f"finished: step {opts.steps}/{opts.steps} on every rank, restore point "
            f"{res.final_restore_point} on every node; loss {loss(start, 0):.4f} -> "
            f"{loss(unpack(memory_bytes), opts.steps):.4f}"
        )

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the progress line and every daemon; remove the directory unless kept."""
        self._stop_trainers()
        self.console.stop()
        self.cluster.stop_all()
        if self.opts.keep:
            self.event(f"kept {self.cluster.dir} (daemon logs, tiers)")
        else:
            self.cluster.remove()
