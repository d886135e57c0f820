"""`convergenced demo`: a crash in the middle of a checkpoint, and why convergence wins.

On embedded defaults, with no configuration and no framework, the demo

1. writes a 3-node loopback cluster (mutual TLS, as `convergenced cluster` does) into a
   temporary directory and starts one real ``convergenced run`` process per node;
2. runs a small deterministic data-parallel training job, one rank per node (a linear
   model whose weights are sharded across the ranks, stepping in lockstep through an
   all-gather), each rank checkpointing its shard every few steps with
   `convergenced.integrations.files`: to its node's local ``nvme`` tier, then, by a
   lagging background uploader, to a shared ``s3`` tier, committing each to its own
   daemon and collecting garbage as it goes;
3. kills node-3's trainer while it is writing its shard of a checkpoint, and its daemon
   with SIGKILL; the other ranks lose their collective and the "launcher" stops them;
4. restarts node-3's daemon, relaunches every rank as recovery generation 1: each asks
   its own daemon for the restore point, restores its own shard of that epoch, and
   trains to the end;
5. checks that the final weights equal an uninterrupted reference run bit for bit, and
   what a ``latest`` marker (written by rank 0 after its own save) would have restored
   at the crash.

It prints live progress (per node and domain the newest epoch, each node's restore
point, the skew), where Prometheus can scrape the daemons, and a one-line verdict;
``--json`` prints a final JSON object. Exit 0 when everything verified, 1 otherwise,
130 on Ctrl-C. Everything it started is stopped and its directory removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from convergenced.client import Client, DaemonUnreachable
from convergenced.core.api import ApiError
from convergenced.daemon.cluster import (
    free_base_port,
    node_name,
    spawn_daemon,
    stop_daemons,
    write_cluster,
)
from convergenced.errors import ConvergencedError
from convergenced.integrations.files import (
    CheckpointError,
    CheckpointStore,
    CorruptShardError,
    MixedEpochError,
    NoRestorePointError,
    Payload,
    Shard,
    Tier,
    encode_shard,
    load_consistent,
    read_shard,
    shard_path,
    write_atomic,
)

__all__ = [
    "DESCRIPTION",
    "HELP",
    "DemoResult",
    "Options",
    "add_arguments",
    "init_shard",
    "main",
    "reference_run",
    "run_demo",
    "train_step",
]

HELP = "run a local 3-node cluster, crash a node mid-checkpoint, restore, verify"
DESCRIPTION = (
    "Start a 3-node cluster of real daemons on loopback (in a temporary directory), run "
    "a small deterministic training job on it that checkpoints every few steps to a local "
    "nvme tier and a lagging s3 tier, kill one node's trainer and daemon in the middle of a "
    "checkpoint, restart it, restore every rank from the agreed restore point, finish, and "
    "verify that the final weights equal an uninterrupted run bit for bit; also report what "
    "a latest marker would have restored. No configuration needed. Exit 0 when verified, "
    "1 on any mismatch or failure, 130 when interrupted."
)

STREAM = "demo"
NODES = 3
DIM = 8
"""Weights per rank (the model has ``NODES * DIM`` weights, sharded by rank)."""
BATCH = 16
LEARNING_RATE = 0.1
VICTIM = NODES
"""The node whose trainer and daemon die (node-3, rank 2: not the marker's writer)."""
READY_TIMEOUT = 60.0
COLLECTIVE_TIMEOUT = 120.0
PHASE_TIMEOUT = 240.0


# -- the deterministic training job ------------------------------------------------------


def init_shard(rank: int) -> list[float]:
    """Rank ``rank``'s initial slice of the weights."""
    return [((rank * DIM + i) % 5 - 2) * 0.1 for i in range(DIM)]


def _true_weights(n_weights: int) -> list[float]:
    return [((i * 37) % 11 - 5) / 5 for i in range(n_weights)]


def _batch(step: int, n_weights: int) -> list[tuple[list[float], float]]:
    # Seeded per step, so the data-loader position is the step number.
    rng = random.Random(1_000_003 * step + 12_345)
    truth = _true_weights(n_weights)
    out = []
    for _ in range(BATCH):
        x = [rng.uniform(-1.0, 1.0) for _ in range(n_weights)]
        y = sum(w * xi for w, xi in zip(truth, x, strict=True)) + rng.gauss(0.0, 0.01)
        out.append((x, y))
    return out


def train_step(weights: Sequence[float], step: int, rank: int) -> list[float]:
    """One SGD step on the mean squared error: rank ``rank``'s new slice, given all weights.

    A pure function of its arguments, so a run from any checkpoint reproduces the
    uninterrupted run bit for bit.
    """
    n = len(weights)
    lo, hi = rank * DIM, (rank + 1) * DIM
    grad = [0.0] * DIM
    for x, y in _batch(step, n):
        err = sum(w * xi for w, xi in zip(weights, x, strict=True)) - y
        for j in range(lo, hi):
            grad[j - lo] += 2.0 * err * x[j] / BATCH
    return [weights[j] - LEARNING_RATE * grad[j - lo] for j in range(lo, hi)]


def loss(weights: Sequence[float], step: int) -> float:
    """The mean squared error of ``weights`` on the batch of ``step``."""
    batch = _batch(step, len(weights))
    total = 0.0
    for x, y in batch:
        total += (sum(w * xi for w, xi in zip(weights, x, strict=True)) - y) ** 2
    return total / len(batch)


def pack(shard: Sequence[float]) -> bytes:
    """A shard's weights as bytes (little-endian float64)."""
    return struct.pack(f"<{len(shard)}d", *shard)


def unpack(data: bytes) -> list[float]:
    """The inverse of `pack`."""
    if len(data) % 8:
        raise ValueError(f"{len(data)} bytes is not a whole number of float64")
    return list(struct.unpack(f"<{len(data) // 8}d", data))


def _weights(payload: Payload) -> bytes:
    if not isinstance(payload, dict) or "weights" not in payload:
        raise CorruptShardError(None, "payload has no weights")
    return payload["weights"]


def reference_run(steps: int, nodes: int = NODES) -> list[bytes]:
    """The uninterrupted run: every rank's final shard, as bytes."""
    shards = [init_shard(r) for r in range(nodes)]
    for step in range(steps):
        full = [w for s in shards for w in s]
        shards = [train_step(full, step, r) for r in range(nodes)]
    return [pack(s) for s in shards]


# -- options -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """What one demo run does (the command line's values, checked)."""

    steps: int = 60
    every: int = 5
    crash_at: int = 30
    step_s: float = 0.08
    upload_lag_s: float = 0.3
    retention: int = 5
    tick_ms: int = 50
    json: bool = False
    keep: bool = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser`` (the ``demo`` subcommand's parser)."""
    parser.add_argument(
        "--json", action="store_true", help="print a final JSON object (progress goes to stderr)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a shorter, faster run (24 steps, checkpoint every 4, little sleeping)",
    )
    parser.add_argument("--steps", type=int, metavar="N", help="training steps (default 60)")
    parser.add_argument(
        "--every", type=int, metavar="K", help="checkpoint every K steps (default 5)"
    )
    parser.add_argument(
        "--crash-at",
        type=int,
        metavar="E",
        help="the checkpoint epoch during which node-3 dies (default: the middle one)",
    )
    parser.add_argument(
        "--step-ms", type=float, metavar="MS", help="compute time per step (default 80)"
    )
    parser.add_argument(
        "--upload-lag-ms",
        type=float,
        metavar="MS",
        help="mean extra time an s3 upload takes (default 300)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the cluster directory (logs, tiers) at the end"
    )


def options_from(args: argparse.Namespace) -> Options:
    """`Options` from parsed arguments.

    Raises:
        ValueError: inconsistent values (the message names the option).
    """
    quick = bool(getattr(args, "quick", False))
    steps = args.steps if args.steps is not None else (24 if quick else 60)
    every = args.every if args.every is not None else (4 if quick else 5)
    step_ms = args.step_ms if args.step_ms is not None else (15.0 if quick else 80.0)
    lag_ms = args.upload_lag_ms if args.upload_lag_ms is not None else (80.0 if quick else 300.0)
    if every < 1:
        raise ValueError(f"--every {every}: expected at least 1")
    if steps < 3 * every:
        raise ValueError(f"--steps {steps}: expected at least 3 checkpoints (3 x --every)")
    crash_at = args.crash_at if args.crash_at is not None else (steps // 2 // every) * every
    if crash_at % every or not 2 * every <= crash_at < steps:
        raise ValueError(
            f"--crash-at {crash_at}: expected a checkpoint epoch (a multiple of --every) "
            f"from {2 * every} to below {steps}"
        )
    if step_ms < 0 or lag_ms < 0:
        raise ValueError("--step-ms and --upload-lag-ms must not be negative")
    return Options(
        steps=steps,
        every=every,
        crash_at=crash_at,
        step_s=step_ms / 1000,
        upload_lag_s=lag_ms / 1000,
        retention=every,
        json=bool(args.json),
        keep=bool(args.keep),
    )


# -- the cluster -------------------------------------------------------------------------


class DemoCluster:
    """``n`` real daemon processes on loopback, in a short directory under /tmp."""

    def __init__(self, n: int, *, tick_ms: int) -> None:
        """Write the configs (nothing runs yet)."""
        self.n = n
        self.tick_ms = tick_ms
        self.dir = Path(tempfile.mkdtemp(prefix="cvg-demo-", dir="/tmp"))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.configs: list[Path] = []
        self._configure()

    def _configure(self) -> None:
        base = free_base_port(2 * self.n)
        self.configs = write_cluster(
            self.dir, self.n, base, tick_ms=self.tick_ms, metrics_base_port=base + self.n
        )

    def socket_path(self, i: int) -> Path:
        """Node ``i``'s local socket."""
        return self.dir / node_name(i) / "convergenced.sock"

    def log_path(self, i: int) -> Path:
        """Node ``i``'s stderr (appended across restarts)."""
        return self.dir / f"{node_name(i)}.log"

    def log_tail(self, i: int, chars: int = 3000) -> str:
        """The end of node ``i``'s log."""
        try:
            return self.log_path(i).read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def start(self, i: int) -> None:
        """Start node ``i`` (returns at once; see `wait_ready`)."""
        self.procs[i] = spawn_daemon(self.configs[i - 1], self.log_path(i))

    def wait_ready(self, i: int, timeout: float = READY_TIMEOUT) -> dict[str, Any]:
        """Wait until node ``i`` answers ``status``; return the status.

        Raises:
            RuntimeError: it exited or did not answer in time.
        """
        deadline = time.monotonic() + timeout
        while True:
            proc = self.procs[i]
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{node_name(i)} exited with {proc.returncode}:\n{self.log_tail(i)}"
                )
            try:
                with Client(self.socket_path(i), timeout=2) as c:
                    return c.status()
            except (DaemonUnreachable, ApiError):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{node_name(i)} not ready after {timeout} s:\n{self.log_tail(i)}"
                    ) from None
                time.sleep(0.05)

    def start_all(self, attempts: int = 3) -> list[dict[str, Any]]:
        """Start every node and wait for each; retry on other ports if one cannot bind."""
        for attempt in range(attempts):
            for i in range(1, self.n + 1):
                self.start(i)
            try:
                return [self.wait_ready(i) for i in range(1, self.n + 1)]
            except RuntimeError:
                self.stop_all()
                if attempt == attempts - 1:
                    raise
                self._configure()  # a port was taken meanwhile: pick others
        raise AssertionError("unreachable")

    def kill(self, i: int) -> None:
        """SIGKILL node ``i`` and reap it."""
        proc = self.procs[i]
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

    def stop_all(self) -> None:
        """SIGTERM every running node, then SIGKILL what has not exited after 10 s."""
        stop_daemons(self.procs.values())

    def remove(self) -> None:
        """Delete the directory."""
        shutil.rmtree(self.dir, ignore_errors=True)


# -- the trainers ----------------------------------------------------------------------


class Killed(Exception):
    """Raised inside the victim trainer: its process "dies" here."""


class Collective:
    """An all-gather among the trainer threads (their NCCL/gloo), with a timeout."""

    def __init__(self, n: int) -> None:
        """A collective of ``n`` ranks."""
        self._barrier = threading.Barrier(n)
        self._slots: list[list[float]] = [[] for _ in range(n)]

    def all_gather(self, rank: int, shard: list[float]) -> list[float]:
        """Every rank's shard, concatenated in rank order.

        Raises:
            threading.BrokenBarrierError: a rank died (or timed out).
        """
        self._slots[rank] = shard
        self._barrier.wait(COLLECTIVE_TIMEOUT)
        full = [w for s in self._slots for w in s]
        self._barrier.wait(COLLECTIVE_TIMEOUT)  # nobody overwrites a slot before all read
        return full

    def abort(self) -> None:
        """Break the collective: every rank waiting in it (or arriving) fails."""
        self._barrier.abort()


@dataclass
class Crash:
    """The crash plan and what the orchestrator and the victim tell each other."""

    node: int
    epoch: int
    mid_write: threading.Event = field(default_factory=threading.Event)
    die: threading.Event = field(default_factory=threading.Event)


@dataclass
class Progress:
    """Shared between trainers, the orchestrator and the progress line."""

    step: dict[int, int] = field(default_factory=dict)
    saved: dict[tuple[int, int], threading.Event] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def saved_event(self, rank: int, epoch: int) -> threading.Event:
        """Set once ``rank`` saved and committed ``epoch`` locally."""
        with self.lock:
            return self.saved.setdefault((rank, epoch), threading.Event())


class Trainer(threading.Thread):
    """One rank's training process (a thread here), for one launch (generation)."""

    def __init__(
        self,
        demo: Demo,
        node: int,
        generation: int,
        collective: Collective,
        crash: Crash | None,
    ) -> None:
        """Rank ``node - 1`` on node ``node``, launched as ``generation``."""
        super().__init__(name=f"trainer-{node_name(node)}-g{generation}", daemon=True)
        self.demo = demo
        self.node = node
        self.rank = node - 1
        self.generation = generation
        self.collective = collective
        self.crash = crash
        self.restored: int | None = None
        self.restored_from: str | None = None
        self.final: bytes | None = None
        self.outcome = "running"
        self.error: BaseException | None = None

    def run(self) -> None:
        """Restore, train, checkpoint; record how it ended."""
        demo, opts = self.demo, self.demo.opts
        try:
            client = Client(demo.cluster.socket_path(self.node), timeout=10)
        except DaemonUnreachable as exc:
            self.outcome, self.error = "failed", exc
            self.collective.abort()
            return
        store = CheckpointStore(
            client,
            STREAM,
            self.rank,
            demo.local_tier(self.node),
            demo.remote_tier(),
            upload_delay=demo.upload_delay(self.rank),
        )
        flush = False
        try:
            client.declare(demo.spec())  # every rank may; the same spec again is a no-op
            shard, start = self._restore(store)
            for step in range(start, opts.steps):
                full = self.collective.all_gather(self.rank, shard)
                if opts.step_s:
                    time.sleep(opts.step_s)  # the forward and backward pass
                shard = train_step(full, step, self.rank)
                done = step + 1
                demo.progress.step[self.rank] = done
                if done % opts.every == 0 or done == opts.steps:
                    self._checkpoint(store, done, shard)
            self.final = pack(shard)
            self.outcome = "finished"
            flush = True
        except Killed:
            self.outcome = "killed"
            self.collective.abort()
        except threading.BrokenBarrierError:
            self.outcome = "stopped"  # a peer died: the launcher stops this rank too
        except BaseException as exc:
            self.outcome, self.error = "failed", exc
            self.collective.abort()
        finally:
            try:
                store.close(flush=flush, timeout=PHASE_TIMEOUT)
            except (CheckpointError, TimeoutError) as exc:
                if self.error is None:
                    self.outcome, self.error = "failed", exc
            finally:
                client.close()

    def _restore(self, store: CheckpointStore) -> tuple[list[float], int]:
        try:
            epoch = store.agreed_epoch(self.generation, timeout=PHASE_TIMEOUT)
        except NoRestorePointError:
            self.demo.event(
                f"{node_name(self.node)} rank {self.rank}: generation {self.generation} has "
                "no restore point, starting from step 0"
            )
            self.demo.progress.step[self.rank] = 0
            return init_shard(self.rank), 0
        shard = store.read(epoch)
        payload = shard.payload
        if not isinstance(payload, dict) or payload.get("step") != str(epoch).encode():
            raise CorruptShardError(shard.path, f"payload is not the state after step {epoch}")
        self.restored, self.restored_from = epoch, shard.domain
        self.demo.event(
            f"{node_name(self.node)} rank {self.rank}: generation {self.generation} restore "
            f"point is epoch {epoch}; restored its shard from {shard.domain}"
        )
        self.demo.progress.step[self.rank] = epoch
        return unpack(payload["weights"]), epoch

    def _checkpoint(self, store: CheckpointStore, epoch: int, shard: list[float]) -> None:
        payload = {"weights": pack(shard), "step": str(epoch).encode()}
        crash = self.crash
        if crash is not None and crash.node == self.node and crash.epoch == epoch:
            # Die in the middle of writing the shard: half a temporary file, no rename.
            data = encode_shard(STREAM, self.rank, epoch, payload)[0]
            final = store.path(store.local, epoch)
            final.parent.mkdir(parents=True, exist_ok=True)
            final.with_name(f".{final.name}.tmp").write_bytes(data[: len(data) // 2])
            crash.mid_write.set()
            crash.die.wait(PHASE_TIMEOUT)
            raise Killed
        store.save(epoch, payload)
        if self.rank == 0:  # the baseline: rank 0 points `latest` at its own newest save
            write_atomic(self.demo.marker_path(), f"{epoch}\n".encode())
        self.demo.progress.saved_event(self.rank, epoch).set()
        store.gc()


# -- the demo ------------------------------------------------------------------------------


@dataclass
class DemoResult:
    """What the demo found; `as_json` is what ``--json`` prints."""

    verified: bool = False
    restore_point: int | None = None
    bitwise_equal: bool = False
    marker_epoch: int | None = None
    marker_valid: bool | None = None
    marker_missing_ranks: list[int] = field(default_factory=list)
    marker_error: str | None = None
    marker_bitwise_equal: bool | None = None
    crash_epoch: int | None = None
    restored: dict[str, int | None] = field(default_factory=dict)
    final_restore_point: int | None = None
    final_digest: str | None = None
    reference_digest: str | None = None
    metrics: dict[str, str] = field(default_factory=dict)
    steps: int = 0
    every: int = 0
    elapsed_s: float = 0.0
    problems: list[str] = field(default_factory=list)
    verdict: str = ""

    def as_json(self) -> dict[str, Any]:
        """The JSON object printed by ``--json``."""
        return {
            "verified": self.verified,
            "restore_point": self.restore_point,
            "bitwise_equal": self.bitwise_equal,
            "marker_epoch": self.marker_epoch,
            "marker_valid": self.marker_valid,
            "marker_missing_ranks": self.marker_missing_ranks,
            "marker_error": self.marker_error,
            "marker_bitwise_equal": self.marker_bitwise_equal,
            "crash_epoch": self.crash_epoch,
            "restored": self.restored,
            "final_restore_point": self.final_restore_point,
            "final_digest": self.final_digest,
            "reference_digest": self.reference_digest,
            "metrics": self.metrics,
            "steps": self.steps,
            "every": self.every,
            "elapsed_s": self.elapsed_s,
            "problems": self.problems,
            "verdict": self.verdict,
        }


class DemoFailed(ConvergencedError):
    """A phase of the demo did not happen as planned (the message says which)."""


class Demo:
    """One demo run: the cluster, the trainers, the progress line and the checks."""

    def __init__(self, opts: Options, out: TextIO) -> None:
        """A run with ``opts``, printing progress to ``out``."""
        self.opts = opts
        self.out = out
        self.tty = out.isatty()
        self.started = time.monotonic()
        self.cluster = DemoCluster(NODES, tick_ms=opts.tick_ms)
        self.progress = Progress()
        self.result = DemoResult(steps=opts.steps, every=opts.every, crash_epoch=opts.crash_at)
        self._print_lock = threading.Lock()
        self._status_line = ""
        self._stop_monitor = threading.Event()
        self._monitor: threading.Thread | None = None
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
        return time.monotonic() - self.started

    def event(self, text: str) -> None:
        """Print one event line (above the live line on a terminal)."""
        with self._print_lock:
            stamp = f"[{self.elapsed():5.1f}s] "
            if self.tty:
                self.out.write(f"\r\x1b[K{stamp}{text}\n{self._status_line}")
            else:
                self.out.write(f"{stamp}{text}\n")
            self.out.flush()

    def _status(self, line: str) -> None:
        with self._print_lock:
            if self.tty:
                width = shutil.get_terminal_size().columns - 1
                self._status_line = line if len(line) <= width else line[: width - 3] + "..."
                self.out.write(f"\r\x1b[K{self._status_line}")
            elif line != self._status_line:
                self._status_line = line
                self.out.write(f"[{self.elapsed():5.1f}s] {line}\n")
            self.out.flush()

    def _monitor_loop(self) -> None:
        clients: dict[int, Client] = {}
        try:
            while not self._stop_monitor.wait(0.5):
                self._status(self._describe(clients))
        finally:
            for c in clients.values():
                c.close()

    def _state(self, clients: dict[int, Client], i: int) -> dict[str, Any] | None:
        # A connection to a daemon that restarted is stale: reconnect once at once.
        for _ in range(2):
            try:
                if i not in clients:
                    clients[i] = Client(self.cluster.socket_path(i), timeout=0.5)
                return clients[i].state(STREAM)
            except (DaemonUnreachable, ApiError, OSError):
                stale = clients.pop(i, None)
                if stale is None:
                    return None
                stale.close()
        return None

    def _describe(self, clients: dict[int, Client]) -> str:
        steps = self.progress.step
        step = str(min(steps.values())) if len(steps) == NODES else "-"  # "-": restoring
        parts = [f"step {step:>3}/{self.opts.steps}"]
        skew: Any = "?"
        for i in range(1, NODES + 1):
            st = self._state(clients, i)
            if st is None:
                parts.append(f"{node_name(i)} down")
                continue
            newest = st.get("newest", {}).get(node_name(i), {})

            def show(domain: str, newest: dict[str, int] = newest) -> str:
                value = newest.get(domain)
                return f"{value:>3}" if value is not None else "  -"

            rp = st.get("restore_point")
            parts.append(
                f"{node_name(i)} nvme {show('nvme')} s3 {show('s3')} "
                f"rp {rp if rp is not None else '-':>3}"
            )
            if i == 1 and st.get("skew") is not None:
                skew = st["skew"]
        return " | ".join([*parts, f"skew {skew}"])

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
        self._monitor = threading.Thread(target=self._monitor_loop, name="progress", daemon=True)
        self._monitor.start()

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
        self._stop_monitor.set()
        if self._monitor is not None:
            self._monitor.join(5)
        if self.tty and self._status_line:
            with self._print_lock:
                self.out.write("\n")
                self.out.flush()
        self.cluster.stop_all()
        if self.opts.keep:
            self.event(f"kept {self.cluster.dir} (daemon logs, tiers)")
        else:
            self.cluster.remove()


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
    return (
        f"VERIFIED: node-{VICTIM} died mid-checkpoint of epoch {opts.crash_at}; every rank "
        f"restored the agreed epoch {res.restore_point} and the final weights equal the "
        f"uninterrupted run bit for bit ({res.elapsed_s:.1f} s); {marker}."
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
    result = DemoResult(steps=opts.steps, every=opts.every, crash_epoch=opts.crash_at)
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
            for i in range(1, NODES + 1):
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
    """``python -m convergenced.demo``: the same as ``convergenced demo``."""
    return run_demo(argv)


if __name__ == "__main__":
    sys.exit(main())
