"""The demo's training job: a toy data-parallel model and the threads that train it.

A linear model whose weights are sharded across ``NODES`` ranks; every step is a pure
function of the full weights and the step number (the batch is seeded by the step), so
a run resumed from any checkpoint reproduces the uninterrupted run bit for bit, which is
what the demo verifies. Each rank is a `Trainer` thread standing in for one training
process: it asks its own daemon for the restore point, steps in lockstep with the others
through a `Collective` (their NCCL/gloo), and checkpoints its shard with
`convergenced.integrations.files`. A launch either names its generation (the story
does, when the hosts stay the same) or lets rank 0 ask its daemon for the launch
(`convergenced.integrations.launches.new_launch`) and broadcast it over the collective;
each rank's store then declares the spec, with the launch's member map, for it. The
victim of the `Crash` plan dies halfway through writing one shard.

Trainers see the run that launched them only through `TrainerHost`, so this module does
not import the story (`story.Demo`) that imports it.
"""

from __future__ import annotations

import random
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from convergenced.client import Client, DaemonUnreachable
from convergenced.integrations.files import (
    CheckpointError,
    CheckpointStore,
    CorruptShardError,
    Launch,
    NoRestorePointError,
    Payload,
    Tier,
    encode_shard,
    write_atomic,
)
from convergenced.integrations.launches import new_launch
from convergenced.tools.cluster import node_name
from convergenced.tools.demo.nodes import DemoCluster
from convergenced.tools.demo.options import Options

STREAM = "demo"
NODES = 3
DIM = 8
"""Weights per rank (the model has ``NODES * DIM`` weights, sharded by rank)."""
BATCH = 16
LEARNING_RATE = 0.1
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


# -- the trainers ----------------------------------------------------------------------


class Killed(Exception):
    """Raised inside the victim trainer: its process "dies" here."""


class Collective:
    """An all-gather among the trainer threads (their NCCL/gloo), with a timeout."""

    def __init__(self, n: int) -> None:
        """A collective of ``n`` ranks."""
        self._barrier = threading.Barrier(n)
        self._slots: list[list[float]] = [[] for _ in range(n)]
        self._value: Any = None

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

    def broadcast(self, rank: int, value: Any) -> Any:
        """Rank 0's ``value``, on every rank (the others pass anything).

        Raises:
            threading.BrokenBarrierError: a rank died (or timed out).
        """
        if rank == 0:
            self._value = value
        self._barrier.wait(COLLECTIVE_TIMEOUT)
        got = self._value
        self._barrier.wait(COLLECTIVE_TIMEOUT)
        return got

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


class TrainerHost(Protocol):
    """What a `Trainer` uses of the run that launched it (`story.Demo` is the one)."""

    opts: Options
    cluster: DemoCluster
    progress: Progress

    def spec(self) -> dict[str, Any]:
        """The stream every rank of the current launch declares (its member map)."""

    def local_tier(self, node: int) -> Tier:
        """Node ``node``'s local tier."""

    def remote_tier(self) -> Tier:
        """The shared tier."""

    def marker_path(self) -> Path:
        """Where rank 0 writes the ``latest`` marker."""

    def upload_delay(self, node: int, rank: int) -> Callable[[int], float]:
        """Rank ``rank``'s upload lag on node ``node``."""

    def event(self, text: str) -> None:
        """Print one event line."""


class Trainer(threading.Thread):
    """One rank's training process (a thread here), for one launch (generation)."""

    def __init__(
        self,
        demo: TrainerHost,
        node: int,
        rank: int,
        generation: int | None,
        *,
        collective: Collective,
        crash: Crash | None,
    ) -> None:
        """Rank ``rank`` on node ``node``, launched as ``generation`` (None: rank 0 asks
        its daemon for the launch and hands it to the others)."""
        label = f"g{generation}" if generation is not None else "asked"
        super().__init__(name=f"trainer-{node_name(node)}-{label}", daemon=True)
        self.demo = demo
        self.node = node
        self.rank = rank
        self.generation = generation
        self.collective = collective
        self.crash = crash
        self.launch: Launch | None = None
        """The launch rank 0 asked for (None: the generation was named)."""
        self.store: CheckpointStore | None = None
        self.restored: int | None = None
        self.restored_from: str | None = None
        self.adopted: list[int] = []
        """Epochs of this rank's shards found in the shared tier only, and committed."""
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
        store: CheckpointStore | None = None
        flush = False
        try:
            store = self.store = self._open(client)
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
            # A crashed process's connection dies with it: its uploader must not wait
            # for the daemon (killed too) to come back.
            client.close()
            self.collective.abort()
        except threading.BrokenBarrierError:
            self.outcome = "stopped"  # a peer died: the launcher stops this rank too
        except BaseException as exc:
            self.outcome, self.error = "failed", exc
            self.collective.abort()
        finally:
            try:
                if store is not None:
                    store.close(flush=flush, timeout=PHASE_TIMEOUT)
            except (CheckpointError, TimeoutError) as exc:
                if self.error is None:
                    self.outcome, self.error = "failed", exc
            finally:
                client.close()

    def _open(self, client: Client) -> CheckpointStore:
        demo = self.demo
        local, remote = demo.local_tier(self.node), demo.remote_tier()
        delay = demo.upload_delay(self.node, self.rank)
        if self.generation is not None:
            store = CheckpointStore(client, STREAM, self.rank, local, remote, upload_delay=delay)
            client.declare(demo.spec())  # every rank may; the same spec again is a no-op
            return store
        launch = None
        if self.rank == 0:
            launch = new_launch(client, demo.spec(), timeout=PHASE_TIMEOUT)
            new = launch.membership == launch.generation > 0
            demo.event(
                f"{node_name(self.node)} rank 0: new launch, generation {launch.generation}, "
                f"membership {launch.membership}"
                + (" (a new member map, from this generation on)" if new else "")
            )
        self.launch = self.collective.broadcast(self.rank, launch)
        store = CheckpointStore(client, demo.spec(), self.rank, local, remote,
                                launch=self.launch, upload_delay=delay)  # fmt: skip
        found = store.recommitted.committed if store.recommitted is not None else []
        if found and all(domain == remote.domain for domain, _ in found):
            # Nothing of this rank on this host's own disk: it moved here.
            self.adopted = [epoch for _, epoch in found]
            demo.event(
                f"{node_name(self.node)} rank {self.rank}: none of its shards on this node's "
                f"nvme; verified its shards of epochs {self.adopted} in s3 and committed them "
                "here (adoption)"
            )
        return store

    def _restore(self, store: CheckpointStore) -> tuple[list[float], int]:
        generation = self.generation
        if generation is None:
            assert self.launch is not None
            generation = self.launch.generation
        try:
            epoch = store.agreed_epoch(generation, timeout=PHASE_TIMEOUT)
        except NoRestorePointError:
            self.demo.event(
                f"{node_name(self.node)} rank {self.rank}: generation {generation} has "
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
            f"{node_name(self.node)} rank {self.rank}: generation {generation} restore "
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
            final = Path(store.path(store.local, epoch))  # the local tier: a directory
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
