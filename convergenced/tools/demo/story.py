"""The story the demo tells: one run, phase by phase, and what it verifies.

`Demo` drives the phases listed in the package docstring: start the cluster, launch
generation 0 of the trainers, kill node-3's trainer and daemon in the middle of a
checkpoint, evaluate what rank 0's ``latest`` marker would have restored at that moment,
restart the daemon, relaunch every rank as generation 1, and verify the final weights
against an uninterrupted reference run. In the ``replace`` scenario node-3's host is
gone for good instead (its disk with it, while its upload of the last checkpoint was on
its way), and the relaunch runs rank 2 on the spare node-4: rank 0 asks node-1 for the
launch, every rank's store declares the new member map for it, node-4's store adopts
rank 2's shards from the shared tier, and every rank restores the epoch before. Its
output (one line per event, and a live progress line) goes through a `console.Console`.
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
SPARE = NODES + 1
"""The spare of the ``replace`` scenario (node-4): it runs from the start, hosting no
rank, and takes over the victim's rank."""


class DemoFailed(ConvergencedError):
    """A phase of the demo did not happen as planned (the message says which)."""


class Demo:
    """One demo run: the cluster, the trainers, the progress line and the checks."""

    def __init__(self, opts: Options, out: TextIO) -> None:
        """A run with ``opts``, printing progress to ``out``."""
        self.opts = opts
        self.replace = opts.scenario == "replace"
        self.started = time.monotonic()
        self.cluster = DemoCluster(SPARE if self.replace else NODES, tick_ms=opts.tick_ms)
        self.progress = Progress()
        self.console = Console(out, self.started, self.cluster, self.progress, opts.steps)
        self.result = DemoResult(steps=opts.steps, every=opts.every, crash_epoch=opts.crash_at,
                                 scenario=opts.scenario)  # fmt: skip
        self.members = {node_name(i): [i - 1] for i in range(1, NODES + 1)}
        """The hosts of the current launch: node id -> its ranks."""
        self.held = (VICTIM, opts.crash_at - opts.every) if self.replace else None
        """(node, epoch) of an upload still on its way when the node's host dies."""
        self._launches: list[tuple[Collective, Crash | None, list[Trainer]]] = []
        self._reference_shards: list[bytes] | None = None

    # -- layout ------------------------------------------------------------------------

    def spec(self) -> dict[str, Any]:
        """The stream: one rank per node of the current launch, an epoch counts once on
        nvme or s3, and s3 (the object store) is readable from any host."""
        spec = {
            "name": STREAM,
            "members": {node: list(ranks) for node, ranks in self.members.items()},
            "policy": {"mode": "any", "domains": ["nvme", "s3"]},
            "retention": self.opts.retention,
        }
        if self.replace:  # the restart scenario keeps the spec it always had
            spec["shared"] = ["s3"]
        return spec

    def host_of(self, rank: int) -> int:
        """The node hosting ``rank`` in the current launch."""
        return next(int(n.removeprefix("node-")) for n, r in self.members.items() if rank in r)

    def local_tier(self, node: int) -> Tier:
        """Node ``node``'s local NVMe (a directory of its own)."""
        return Tier("nvme", self.cluster.dir / node_name(node) / "nvme")

    def remote_tier(self) -> Tier:
        """The object store every node uploads to (one shared directory)."""
        return Tier("s3", self.cluster.dir / "s3")

    def marker_path(self) -> Path:
        """Where rank 0 writes the baseline's ``latest`` marker."""
        return self.remote_tier().directory / STREAM / "latest"

    def upload_delay(self, node: int, rank: int) -> Callable[[int], float]:
        """An upload's lag: the configured mean, jittered by +-50 % (the held one: still
        on its way when its host dies)."""
        rng = random.Random(rank)
        lag, held = self.opts.upload_lag_s, self.held

        def delay(epoch: int) -> float:
            return PHASE_TIMEOUT if (node, epoch) == held else lag * (0.5 + rng.random())

        return delay

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
            f"cluster: {self.cluster.n} daemons on loopback (mutual TLS), directory "
            f"{self.cluster.dir}"
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
            + (", s3 readable from any host (shared)" if self.replace else "")
        )
        if self.replace:
            self.event(
                f"{node_name(SPARE)} is a spare: its daemon runs, in every node's peer and "
                "trust lists, on an empty disk, and it hosts no rank"
            )
            self.cluster.wait_linked()  # the first launch asks node-1, which knows nothing yet
        self.console.start()

        # Launch 0: train until node-3 dies in the middle of checkpoint `crash_at`.
        crash = Crash(VICTIM, opts.crash_at)
        if self.replace:
            self.event(f"first launch: rank 0 asks its daemon for it; {NODES} ranks declare")
        else:
            self.event(f"launch generation 0: {NODES} ranks ask for their restore point")
        first = self._launch(None if self.replace else 0, crash)
        if not self._wait_crash_point(first, crash):
            self._stop_trainers()
            raise DemoFailed(f"the run did not reach the crash point: {self._outcomes(first)}")
        self.cluster.kill(VICTIM)
        crash.die.set()
        self.event(
            f"CRASH: {node_name(VICTIM)}'s trainer died writing its shard of epoch "
            f"{opts.crash_at}; its daemon got SIGKILL"
        )
        if self.replace:
            self._join(first)
            self.cluster.wipe(VICTIM)
            self.event(
                f"{node_name(VICTIM)}'s host is gone for good, its disk with it (state "
                f"directory, nvme); its upload of epoch {opts.crash_at - opts.every} was "
                f"still on its way, so s3 holds rank 2 up to epoch "
                f"{opts.crash_at - 2 * opts.every}"
            )
        self._evaluate_marker()
        self._join(first)
        unexpected = [t for t in first if t.outcome not in ("killed", "stopped")]
        if unexpected:
            raise DemoFailed(f"launch 0 ended unexpectedly: {self._outcomes(first)}")
        self.event("the launcher stopped the other ranks (their collective broke)")
        second = self._relaunch_on_the_spare() if self.replace else self._relaunch()
        self._join(second)
        failed = [t for t in second if t.outcome != "finished"]
        if failed:
            raise DemoFailed(f"launch 1 did not finish: {self._outcomes(second)}")
        self._verify(second)
        return self.result

    def _relaunch(self) -> list[Trainer]:
        """Restart node-3's daemon; relaunch every rank as recovery generation 1."""
        self.cluster.start(VICTIM)
        st = self.cluster.wait_ready(VICTIM)
        self.event(f"{node_name(VICTIM)}'s daemon restarted (incarnation {st['incarnation']})")
        self.event(f"launch generation 1: {NODES} ranks ask for their restore point")
        return self._launch(1, None)

    def _relaunch_on_the_spare(self) -> list[Trainer]:
        """Relaunch with rank 2 on the spare: a new member map, asked for by rank 0."""
        self.members = {node_name(1): [0], node_name(2): [1], node_name(SPARE): [2]}
        self.console.nodes = [1, 2, SPARE]
        self.event(
            f"relaunch on node-1, node-2 and {node_name(SPARE)}, which takes over rank 2: "
            "rank 0 asks its daemon for a new launch, every rank declares the new member map"
        )
        return self._launch(None, None)

    def _wait_crash_point(self, trainers: list[Trainer], crash: Crash) -> bool:
        """Wait until the victim is mid-write and every other rank saved that epoch (and,
        with an upload held, the victim's upload of the checkpoint before it is done)."""
        waits = [crash.mid_write] + [
            self.progress.saved_event(t.rank, crash.epoch) for t in trainers if t.node != crash.node
        ]
        victim = next(t for t in trainers if t.node == crash.node)
        before = crash.epoch - 2 * self.opts.every

        def uploaded() -> bool:
            store = victim.store
            return self.held is None or (store is not None and before in store.uploaded)

        deadline = time.monotonic() + PHASE_TIMEOUT
        while not (all(e.is_set() for e in waits) and uploaded()):
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

    def _launch(self, generation: int | None, crash: Crash | None) -> list[Trainer]:
        collective = Collective(NODES)
        self.progress.step.clear()  # each rank reports again once it restored
        trainers = [Trainer(self, self.host_of(r), r, generation, collective=collective,
                            crash=crash) for r in range(NODES)]  # fmt: skip
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
        tiers = (self.local_tier(self.host_of(rank)), self.remote_tier())
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
        res.restored_from = {node_name(t.node): t.restored_from for t in trainers}
        res.members = {node: list(ranks) for node, ranks in self.members.items()}
        launch = trainers[0].launch
        if launch is not None:
            res.launch = {"generation": launch.generation, "membership": launch.membership}
        res.adopted = [e for t in trainers for e in t.adopted]
        points = set(restored.values())
        # Moved, rank 2 restores from the shared tier, one checkpoint behind its nvme.
        expected = opts.crash_at - (2 if self.replace else 1) * opts.every
        res.restore_point = next(iter(points)) if len(points) == 1 else None
        if len(points) != 1:
            res.problems.append(f"ranks restored different epochs: {restored}")
        elif res.restore_point != expected:
            res.problems.append(
                f"restored epoch {res.restore_point}, expected {expected} (the newest "
                "checkpoint every rank could read after the crash)"
            )
        moved = res.restored_from.get(node_name(SPARE), "s3") if self.replace else "s3"
        if moved != "s3":
            res.problems.append(f"{node_name(SPARE)} restored rank 2 from {moved}, not s3")
        # The final checkpoint, agreed on every node, read back from disk.
        for i in sorted(self.host_of(r) for r in range(NODES)):
            with Client(self.cluster.socket_path(i), timeout=10) as c:
                st = c.wait(STREAM, opts.steps, timeout=PHASE_TIMEOUT)
            if i == 1:
                res.final_restore_point = st["restore_point"]
        shards = [
            read_shard(
                shard_path(self.local_tier(self.host_of(r)).directory, STREAM, opts.steps, r),
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
