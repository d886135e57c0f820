"""Training-thread blocking per checkpoint: barrier + ``latest`` marker vs convergenced.

A real ``torch.distributed`` job (gloo, CPU) of N worker processes (N = 2, 4, 8) on
loopback, each rank simulating its own host with its own real ``convergenced run``
daemon (`tests.daemons.LocalCluster`: mutual TLS, signed records, 50 ms tick; one
stream whose members are the N nodes, one rank each). Every worker runs the same
loop: a training step repeated K = 5 times, then a checkpoint.

* **step**: "forward/backward" = ``sleep(6 ms x s_r x LogNormal(0, 0.15))`` where
  ``s_r ~ U(0.9, 1.1)`` is a fixed per-rank speed (seeded); a gloo ``all_reduce`` of
  a 64 KiB float32 "gradient", which brings the ranks back in step every step as DDP
  does (``--no-step-allreduce`` drops it: the ranks then meet only at checkpoints and
  drift apart in between); "optimizer step and bookkeeping" =
  ``sleep(1 ms x LogNormal(0, 0.5))`` plus, with probability 2 %, a stall
  ``U(5, 20) ms`` (GC pause, data-loader hiccup, logging). Compute is a sleep, as a
  GPU kernel is for the CPU: the 2 cores are left to the daemons, gloo,
  serialization and fsyncs. What happens after the step's last all_reduce is what
  brings the ranks to the checkpoint out of step.
* **shard** (identical in every variant): ``torch.save`` of a 256 KiB state dict of
  tensors to a temporary file, fsync, rename to ``rank-R/epoch-E.pt``, fsync of the
  directory. Shards older than the last two are deleted after the checkpoint.
* **coordination**, one of:

  * *barrier + marker*: ``dist.barrier()``, then rank 0 writes ``latest`` (temporary
    file, fsync, rename, fsync of the directory); the other ranks go on at once;
  * *barrier + marker + barrier*: the same then a second ``dist.barrier()``, so no
    rank trains before the marker exists (what most real setups do);
  * *convergenced*: ``Client.commit(stream, rank, "nvme", epoch)`` to the rank's
    own local daemon, acknowledged once the daemon's write-ahead log is fsynced; no
    barrier. Epochs count this variant's checkpoints (1, 2, 3...), so every rank's
    sets stay contiguous as in a real job;
  * *convergenced commit_nowait*: ``Client.commit_nowait`` (README, "Using it from
    training code"): send this checkpoint's commit, collect the previous one's answer
    (normally long arrived); blocked counts both. The shard's own fsync is the
    durability; the daemon's fsync happens while training goes on. Shares the epoch
    counter with *convergenced*;
  * *no checkpoint*: K steps and nothing else, the baseline of the job-time table;
  * three **profile probes** in the coordination step's place: a 64-byte append +
    fsync of a rank-local file (the "one local fsync" floor), a no-fsync request to
    the local daemon (``streams``: client, socket and daemon dispatch), and a commit
    to a stream whose only member is the local node (the commit path without the
    agreement traffic the shared stream starts on every daemon at the same moment).

**Blocked per checkpoint** is the wall time the training thread spends in the
coordination step: from the moment its own shard is durable to the moment it may
train again. **Whole checkpoint** adds the shard write. Median and p99 are over every
rank and every measured checkpoint; the ratio barrier/convergenced compares medians
(and p99s) from the same run.

All variants run in the same worker processes, on the same process group and the
same daemons, interleaved in blocks of 10 checkpoints whose order rotates every round
(each variant follows every other equally often; load drifts hit all alike). Each
block opens with one excluded settling checkpoint (its interval straddles two
variants), after a warm-up of 5 checkpoints per variant. With an all_reduce every
step, a rank that skips the barrier meets its slower peers at the next all_reduce
anyway: the **job time** table shows that, as the mean wall time of one interval (K
steps + checkpoint) per variant and what it adds to the no-checkpoint interval.

The profile also has, per N, the daemons' own write+fsync histogram over the loop
(``convergenced_wal_fsync_duration_seconds``, scraped before and after: it spans the
hand-off to the daemon's disk thread and back), and, once the workers are gone, the
quiet floor: raw ``write + fsync`` on the daemons' file system, ``commit`` and
``streams`` over a bare Unix socket (daemon + kernel only) and through `Client`
(which adds its reader thread's hand-off), back to back; then the same `Client`
requests at the loop's pace, each after ~50 ms idle (a rank commits once per
interval, so its daemon is idle when the commit comes), next to a one-byte echo
between two plain processes idle as long (what waking up costs on this machine,
without any convergenced code). During the loop: CPU shares (daemons,
workers, this process, everything else), CPU pressure (``/proc/pressure/cpu``
"some": the share of time some task waited for a core) and the run-queue wait of
the daemons and workers (``/proc/PID/task/*/schedstat``).

Everything shares the machine's cores (2 here): N daemons, N workers and this
process. The barrier's cost includes that scheduler noise as much as the commit's
does. Nothing is tuned to meet the target (issue 8: the training thread blocked at
most 1 ms median per checkpoint with convergenced).

Usage::

    .venv/bin/python benchmarks/bench_training.py [--quick] [--json] [--nodes N ...]
        [--checkpoints C] [--shard-kib KIB] [--no-step-allreduce] [--seed S]
        [--out DIR]

``--quick``: N = 2, 10 checkpoints per variant (< 20 s). ``--json`` also prints one
JSON object with every number as the last line. ``--out DIR`` writes
``DIR/training.md`` (command, description, tables, verdict) and ``DIR/training.png``
(``training-drift.*`` with ``--no-step-allreduce``)
(box plot of the blocked time; needs matplotlib). Needs torch (the ``torch`` extra);
torch is imported by the worker processes only.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import math
import os
import random
import resource
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import bench_daemon as bd  # noqa: E402  (puts the repository on sys.path)
import report  # noqa: E402

from convergenced.client import Client  # noqa: E402
from convergenced.core import local_api_codec as codec  # noqa: E402
from tests.daemons import LocalCluster  # noqa: E402

MS = 1e-3
PACE_S = 0.05
"""Idle time before each paced probe (about one checkpoint interval of the loop)."""
TARGET_BLOCKED_S = 1 * MS
"""Issue 8: the training thread blocked at most 1 ms per checkpoint (median)."""

STREAM = "bench-training"
PROBE_STREAM = "bench-training-probe"
SOLO_STREAM = "bench-training-solo"
DOMAIN = "nvme"

BARRIER = "barrier_marker"
BARRIER2 = "barrier_marker_barrier"
CVG = "convergenced"
CVG_NOWAIT = "convergenced_nowait"
FSYNC = "local_fsync"
NOOP = "daemon_noop"
SOLO = "solo_commit"
NONE = "no_checkpoint"
VARIANTS = (BARRIER, BARRIER2, CVG, CVG_NOWAIT, FSYNC, NOOP, SOLO, NONE)
COORDINATED = (BARRIER, BARRIER2, CVG, CVG_NOWAIT)
DIAGNOSTIC = (FSYNC, NOOP, SOLO)
"""Profile probes inside the loop, in the coordination step's place."""
LABELS = {
    BARRIER: "barrier + marker",
    BARRIER2: "barrier + marker + barrier",
    CVG: "convergenced commit",
    CVG_NOWAIT: "convergenced commit_nowait",
    FSYNC: "local fsync only (probe)",
    NOOP: "daemon no-op request (probe)",
    SOLO: "commit to a one-member stream (probe)",
    NONE: "no checkpoint",
}

# The training step (see the module docstring).
COMPUTE_MS = 6.0
COMPUTE_SIGMA = 0.15
RANK_SPEED = (0.9, 1.1)
OPTIMIZER_MS = 1.0
OPTIMIZER_SIGMA = 0.5
STALL_P = 0.02
STALL_MS = (5.0, 20.0)
GRAD_FLOATS = 16384
"""64 KiB of float32 all-reduced every step."""


def nominal_interval_s(cfg: Config) -> float:
    """Mean of the sleeps of one checkpoint interval (K steps), in seconds."""
    compute = COMPUTE_MS * math.exp(COMPUTE_SIGMA**2 / 2) * sum(RANK_SPEED) / 2
    optimizer = OPTIMIZER_MS * math.exp(OPTIMIZER_SIGMA**2 / 2) + STALL_P * sum(STALL_MS) / 2
    return cfg.every * (compute + optimizer) * MS


def step_description(cfg: Config) -> str:
    """The training step, in one line."""
    sync = (
        f"gloo all_reduce of {GRAD_FLOATS * 4 // 1024} KiB"
        if cfg.step_allreduce
        else "no all_reduce (ranks meet only at checkpoints)"
    )
    return (
        f"forward/backward sleep({COMPUTE_MS:g} ms x s_r x LogNormal(0, {COMPUTE_SIGMA:g})), "
        f"s_r ~ U({RANK_SPEED[0]:g}, {RANK_SPEED[1]:g}) fixed per rank; {sync}; optimizer "
        f"sleep({OPTIMIZER_MS:g} ms x LogNormal(0, {OPTIMIZER_SIGMA:g})) + with p = "
        f"{STALL_P:g} a stall U({STALL_MS[0]:g}, {STALL_MS[1]:g}) ms"
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    """Sizes of one run."""

    mode: str
    nodes: tuple[int, ...]
    checkpoints: int
    """Measured checkpoints per variant per rank (per N)."""
    warmup: int
    """Warm-up checkpoints per variant per rank, excluded."""
    block: int
    """Checkpoints in a row of one variant."""
    every: int
    """Training steps between checkpoints (K)."""
    shard_kib: int
    tick_ms: int
    probes: int
    """Samples of each profile probe."""
    seed: int
    step_allreduce: bool = True
    """All-reduce a gradient every step (DDP); False: ranks meet only at checkpoints."""


FULL = Config(
    mode="full",
    nodes=(2, 4, 8),
    checkpoints=200,
    warmup=5,
    block=10,
    every=5,
    shard_kib=256,
    tick_ms=50,
    probes=300,
    seed=1,
)
QUICK = dataclasses.replace(
    FULL, mode="quick", nodes=(2,), checkpoints=10, warmup=1, block=5, probes=30
)


def schedule(cfg: Config) -> list[tuple[str, bool]]:
    """(variant, excluded?) of every checkpoint, the same on every rank.

    A warm-up per variant first; then blocks in a rotating order, each opened by one
    excluded settling checkpoint (the switch from the previous variant, whose interval
    straddles the two, and which absorbs any drift the previous variant let build up).
    """
    out = [(v, True) for v in VARIANTS for _ in range(cfg.warmup)]
    rounds = math.ceil(cfg.checkpoints / cfg.block)
    for r in range(rounds):
        count = min(cfg.block, cfg.checkpoints - r * cfg.block)
        shift = r % len(VARIANTS)
        for v in VARIANTS[shift:] + VARIANTS[:shift]:
            out += [(v, True)] + [(v, False)] * count
    return out


# -- /proc helpers --------------------------------------------------------------------


def runq_wait_s(pid: int | str = "self") -> float:
    """Seconds the threads of ``pid`` spent runnable but waiting for a CPU."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return math.nan
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that just ended
    return total / 1e9


def cpu_pressure_s() -> float:
    """Total seconds some task waited for a CPU (``/proc/pressure/cpu``), nan if none."""
    try:
        with open("/proc/pressure/cpu", encoding="ascii") as f:
            for line in f:
                if line.startswith("some"):
                    return int(line.rsplit("total=", 1)[1]) / 1e6
    except (OSError, IndexError, ValueError):
        pass
    return math.nan


def fsync_dir(path: Path) -> None:
    """fsync a directory (makes a rename in it durable)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the worker (one rank; runs in its own process) --------------------------------------


def import_torch() -> Any:
    """Import torch, or exit with a clear message."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
            import torch
            import torch.distributed
    except ImportError as exc:
        raise SystemExit(
            f"bench_training.py needs torch (the torch extra: pip install torch==2.13.0): {exc}"
        ) from None
    return torch


def worker(cfg: dict[str, Any]) -> None:
    """One rank: the loop of the module docstring; writes its samples as JSON."""
    torch = import_torch()
    dist = torch.distributed
    torch.set_num_threads(1)
    rank, world = int(cfg["rank"]), int(cfg["world"])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    rng = random.Random(cfg["seed"] * 1000 + rank)
    speed = rng.uniform(*RANK_SPEED)
    grad = torch.zeros(GRAD_FLOATS)
    floats = cfg["shard_kib"] * 1024 // 4
    gen = torch.Generator().manual_seed(rank)
    state = {
        "weight": torch.randn(floats // 2, generator=gen),
        "exp_avg": torch.randn(floats // 4, generator=gen),
        "exp_avg_sq": torch.rand(floats // 4, generator=gen),
        "step": torch.zeros((), dtype=torch.int64),
    }
    job = Path(cfg["dir"])
    shards = job / f"rank-{rank}"
    shards.mkdir(parents=True, exist_ok=True)
    client = Client(cfg["socket"])
    probe_fd = os.open(shards / "fsync-probe", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    every = int(cfg["every"])
    plan = [(str(v), bool(w)) for v, w in cfg["schedule"]]
    clock = time.perf_counter

    def step() -> None:
        time.sleep(COMPUTE_MS * speed * rng.lognormvariate(0, COMPUTE_SIGMA) * MS)
        if cfg["step_allreduce"]:
            dist.all_reduce(grad)
        pause = OPTIMIZER_MS * rng.lognormvariate(0, OPTIMIZER_SIGMA)
        if rng.random() < STALL_P:
            pause += rng.uniform(*STALL_MS)
        time.sleep(pause * MS)

    def write_shard(index: int) -> Path:
        path = shards / f"epoch-{index}.pt"
        tmp = shards / f".epoch-{index}.pt.tmp"
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(shards)
        return path

    def write_marker(index: int) -> None:
        tmp = job / ".latest.tmp"
        with open(tmp, "w", encoding="ascii") as f:
            f.write(f"{index}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, job / "latest")
        fsync_dir(job)

    records: list[list[Any]] = []
    kept: list[Path] = []
    epoch = 0  # this rank's convergenced epochs (1, 2, 3...: contiguous)
    pending = None  # the last commit_nowait, its answer collected at the next one
    solo = 0
    total_steps = 0
    dist.barrier()  # everyone connected before the clock starts (untimed)
    (job / f"ready-{rank}").touch()
    cpu0, wait0, wall0 = _self_cpu_s(), runq_wait_s(), clock()
    last_end = clock()
    previous = ""
    for index, (variant, warm) in enumerate(plan):
        for _ in range(every):
            step()
            total_steps += 1
        state["step"].fill_(total_steps)
        t0 = clock()
        t1 = t2 = t0
        if variant != NONE:
            kept.append(write_shard(index))
            t1 = clock()
            if variant == CVG:
                epoch += 1
                client.commit(cfg["stream"], rank, DOMAIN, epoch)
            elif variant == CVG_NOWAIT:
                # The README's pattern: send this commit, collect the previous one's
                # answer (long since arrived, normally); both count as blocked.
                epoch += 1
                if pending is not None:
                    pending.result(timeout=120)
                pending = client.commit_nowait(cfg["stream"], rank, DOMAIN, epoch)
            elif variant == FSYNC:
                os.write(probe_fd, b"x" * 64)
                os.fsync(probe_fd)
            elif variant == NOOP:
                client.streams()
            elif variant == SOLO:
                solo += 1
                client.commit(cfg["solo_stream"], 0, DOMAIN, solo)
            else:
                dist.barrier()
                if rank == 0:
                    write_marker(index)
                if variant == BARRIER2:
                    dist.barrier()
            t2 = clock()
        records.append([index, variant, warm, t1 - t0, t2 - t1, t2 - last_end, variant != previous])
        last_end, previous = t2, variant
        while len(kept) > 2:
            kept.pop(0).unlink()
    wall = clock() - wall0
    if pending is not None:
        pending.result(timeout=120)
    result = {
        "rank": rank,
        "speed": speed,
        "epochs": epoch,
        "solo_epochs": solo,
        "wall_s": wall,
        "cpu_s": _self_cpu_s() - cpu0,
        "runq_wait_s": runq_wait_s() - wait0,
        "torch": str(torch.__version__),
        "records": records,
    }
    tmp = Path(cfg["result"]).with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(cfg["result"])
    dist.barrier()
    os.close(probe_fd)
    client.close()
    dist.destroy_process_group()


def _self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


# -- statistics -------------------------------------------------------------------------


def stats(values: Sequence[float]) -> dict[str, float]:
    """Count, median, p90, p99, max and mean (seconds)."""
    return {
        "n": len(values),
        "p50_s": bd.median(values),
        "p90_s": bd.percentile(values, 90),
        "p99_s": bd.percentile(values, 99),
        "max_s": max(values) if values else math.nan,
        "mean_s": sum(values) / len(values) if values else math.nan,
    }


def ratio(a: float, b: float) -> float:
    """a / b (nan when b is not positive)."""
    return a / b if b > 0 else math.nan


# -- the profile probes -------------------------------------------------------------------


class RawConn:
    """A bare blocking Unix-socket connection to the daemon: no reader thread, no queue."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
        self.reader = codec.FrameReader()
        self.rid = 0

    def call(self, op: str, **args: Any) -> Any:
        """One request, one reply."""
        self.rid += 1
        self.sock.sendall(codec.encode_frame(codec.request(self.rid, op, **args)))
        while True:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("daemon closed the connection")
            for reply in self.reader.feed(data):
                if reply.get("id") == self.rid:
                    if "error" in reply:
                        raise codec.error_from_wire(reply["error"])
                    return reply.get("ok")

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()


def scrape_fsync(port: int) -> dict[str, Any]:
    """The write-ahead log fsync histogram of one daemon (cumulative buckets)."""
    name = "convergenced_wal_fsync_duration_seconds"
    out: dict[str, Any] = {"buckets": {}, "count": 0.0, "sum": 0.0}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out["buckets"][le] = float(line.rsplit(" ", 1)[1])
        elif line.startswith(name + "_count "):
            out["count"] = float(line.split()[1])
        elif line.startswith(name + "_sum "):
            out["sum"] = float(line.split()[1])
    return out


def fsync_delta(
    before: Sequence[dict[str, Any]], after: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """What every daemon's fsync histogram gained between two scrapes, summed."""
    count = sum(a["count"] - b["count"] for a, b in zip(after, before, strict=True))
    total = sum(a["sum"] - b["sum"] for a, b in zip(after, before, strict=True))
    buckets: dict[str, float] = {}
    for a, b in zip(after, before, strict=True):
        for le, v in a["buckets"].items():
            buckets[le] = buckets.get(le, 0.0) + v - b["buckets"].get(le, 0.0)

    def bound(q: float) -> float:
        """Upper bound of the bucket holding the q-th percentile."""
        want = q / 100 * count
        for le, v in sorted(buckets.items(), key=lambda kv: float(kv[0])):
            if v >= want:
                return float(le)
        return math.inf

    return {
        "fsyncs": int(count),
        "mean_s": total / count if count else math.nan,
        "p50_le_s": bound(50) if count else math.nan,
        "p99_le_s": bound(99) if count else math.nan,
    }


def probe(cluster: LocalCluster, samples: int) -> dict[str, Any]:
    """Quiet-floor profile of one commit, taken round robin so drift hits all alike."""
    raw_fsync: list[float] = []
    raw_commit: list[float] = []
    raw_noop: list[float] = []
    client_commit: list[float] = []
    client_noop: list[float] = []
    path = cluster.socket_path(1)
    client = cluster.client(1)
    LocalCluster.declare_solo(client, PROBE_STREAM, DOMAIN)
    raw = RawConn(path)
    clock = time.perf_counter
    fd = os.open(cluster.dir / "fsync-probe", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    epoch = 0
    try:
        for _ in range(samples):
            t = clock()
            os.write(fd, b"x" * 64)
            os.fsync(fd)
            raw_fsync.append(clock() - t)
            epoch += 1
            t = clock()
            raw.call("commit", stream=PROBE_STREAM, rank=0, domain=DOMAIN, epoch=epoch)
            raw_commit.append(clock() - t)
            t = clock()
            raw.call("streams")
            raw_noop.append(clock() - t)
            epoch += 1
            t = clock()
            client.commit(PROBE_STREAM, 0, DOMAIN, epoch)
            client_commit.append(clock() - t)
            t = clock()
            client.streams()
            client_noop.append(clock() - t)
    finally:
        os.close(fd)
        raw.close()
    paced = paced_probe(client, max(10, samples // 5), epoch)
    return {
        "samples": samples,
        "raw_fsync": stats(raw_fsync),
        "raw_socket_commit": stats(raw_commit),
        "raw_socket_noop": stats(raw_noop),
        "client_commit": stats(client_commit),
        "client_noop": stats(client_noop),
    } | paced


ECHO = "import os\nwhile (b := os.read(0, 1)):\n    os.write(1, b)\n"
"""A byte echo: a process-to-process round trip with no daemon in it."""


def paced_probe(client: Client, samples: int, epoch: int) -> dict[str, Any]:
    """The same requests at the training loop's pace: each after about PACE_S idle.

    A training rank commits every few seconds, so its daemon (and the rank's own
    client thread) is idle when the commit arrives; a tight loop keeps both hot. The
    echo round trip between two processes that were idle as long shows what waking up
    costs on this machine, without any convergenced code.
    """
    echo = subprocess.Popen(
        [sys.executable, "-c", ECHO], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
    )
    assert echo.stdin is not None and echo.stdout is not None
    wfd, rfd = echo.stdin.fileno(), echo.stdout.fileno()
    clock = time.perf_counter
    rng = random.Random(0)

    def idle() -> None:  # jittered: no phase lock with the daemons' 50 ms tick
        time.sleep(rng.uniform(0.5, 1.5) * PACE_S)

    echo_s: list[float] = []
    commit_s: list[float] = []
    noop_s: list[float] = []
    try:
        os.write(wfd, b"x")
        os.read(rfd, 1)  # started
        for _ in range(samples):
            idle()
            t = clock()
            os.write(wfd, b"x")
            os.read(rfd, 1)
            echo_s.append(clock() - t)
            idle()
            epoch += 1
            t = clock()
            client.commit(PROBE_STREAM, 0, DOMAIN, epoch)
            commit_s.append(clock() - t)
            idle()
            t = clock()
            client.streams()
            noop_s.append(clock() - t)
    finally:
        echo.stdin.close()
        echo.wait(timeout=10)
        echo.stdout.close()
    return {
        "pace_s": PACE_S,
        "paced_samples": samples,
        "paced_echo": stats(echo_s),
        "paced_client_commit": stats(commit_s),
        "paced_client_noop": stats(noop_s),
    }


# -- one node count --------------------------------------------------------------------------


def free_port() -> int:
    """A free TCP port on loopback (for gloo's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for(
    check: Callable[[], bool],
    procs: Sequence[subprocess.Popen[bytes]],
    logs: Sequence[Path],
    timeout: float,
    what: str,
) -> None:
    """Poll ``check`` until true; fail early (with the logs) if a worker exits badly."""
    deadline = time.monotonic() + timeout
    while not check():
        bad = [p.returncode for p in procs if p.poll() not in (None, 0)]
        if bad or time.monotonic() > deadline:
            tails = "\n".join(
                f"--- {log.name} ---\n{log.read_text(errors='replace')[-3000:]}" for log in logs
            )
            why = f"worker exit codes {bad}" if bad else "timeout"
            raise RuntimeError(f"waiting for {what}: {why}\n{tails}")
        time.sleep(0.05)


def run_nodes(n: int, cfg: Config) -> dict[str, Any]:
    """Start N daemons and N workers, run the loop, collect and profile."""
    plan = schedule(cfg)
    with LocalCluster(n, tick_ms=cfg.tick_ms) as cluster:
        cluster.start_all()
        clients = [cluster.client(i) for i in range(1, n + 1)]
        spec = cluster.spec(STREAM)
        for i, c in enumerate(clients, 1):
            c.declare(spec)
            c.declare(
                {
                    "name": f"{SOLO_STREAM}-{i}",
                    "members": {cluster.name(i): [0]},
                    "policy": {"mode": "all", "domains": [DOMAIN]},
                    "retention": 0,
                }
            )
        # Epoch 0 everywhere and agreed: every link is up before the workers start.
        for i, c in enumerate(clients):
            c.commit(STREAM, i, DOMAIN, 0)
        for c in clients:
            c.wait(STREAM, 0, 60.0)
        job = cluster.dir / "ckpt"
        job.mkdir()
        port = free_port()
        results = [cluster.dir / f"result-{r}.json" for r in range(n)]
        logs = [cluster.dir / f"worker-{r}.log" for r in range(n)]
        procs: list[subprocess.Popen[bytes]] = []
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
        daemons = [cluster.procs[i].pid for i in range(1, n + 1)]
        ports = [cluster.metrics_base_port + i for i in range(n)]
        try:
            for r in range(n):
                wcfg = {
                    "rank": r,
                    "world": n,
                    "port": port,
                    "seed": cfg.seed,
                    "socket": str(cluster.socket_path(r + 1)),
                    "stream": STREAM,
                    "solo_stream": f"{SOLO_STREAM}-{r + 1}",
                    "dir": str(job),
                    "result": str(results[r]),
                    "every": cfg.every,
                    "shard_kib": cfg.shard_kib,
                    "step_allreduce": cfg.step_allreduce,
                    "schedule": plan,
                }
                with logs[r].open("wb") as log:
                    procs.append(
                        subprocess.Popen(
                            [sys.executable, str(Path(__file__).resolve()), "--worker"],
                            stdin=subprocess.PIPE,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            env=env,
                        )
                    )
                assert procs[-1].stdin is not None
                procs[-1].stdin.write(json.dumps(wcfg).encode())
                procs[-1].stdin.close()
            wait_for(
                lambda: all((job / f"ready-{r}").exists() for r in range(n)),
                procs,
                logs,
                120.0,
                "the workers to start",
            )
            fsync0 = [scrape_fsync(p) for p in ports]
            meter = bd.CpuMeter(daemons)
            psi0 = cpu_pressure_s()
            dwait0 = sum(runq_wait_s(p) for p in daemons)
            expected = len(plan) * (cfg.every * 10 * MS + 5 * MS)
            wait_for(
                lambda: all(p.exists() for p in results),
                procs,
                logs,
                120.0 + 5 * expected,
                "the training loop",
            )
            cpu: dict[str, Any] = dict(meter.stop())
            psi = cpu_pressure_s() - psi0
            dwait = sum(runq_wait_s(p) for p in daemons) - dwait0
            load_end = bd.loadavg()
            fsync1 = [scrape_fsync(p) for p in ports]
            for p in procs:
                p.wait(timeout=60)
            codes = [p.returncode for p in procs]
            if any(codes):
                raise RuntimeError(f"worker exit codes {codes}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        ranks = [json.loads(p.read_text()) for p in results]
        # The protocol did its job: the last epoch is the restore point on every node.
        last = ranks[0]["epochs"]
        started = time.perf_counter()
        for c in clients:
            c.wait(STREAM, last, 60.0)
        agreed_s = time.perf_counter() - started
        profile = probe(cluster, cfg.probes)
    wall = cpu["wall_s"]
    workers_cpu = sum(r["cpu_s"] for r in ranks) / wall
    cpu["workers"] = workers_cpu
    cpu["other"] = max(0.0, cpu["other"] - workers_cpu)
    cpu["cpu_pressure_some"] = psi / wall
    cpu["daemon_runq_wait"] = dwait / (n * wall)
    cpu["worker_runq_wait"] = sum(r["runq_wait_s"] for r in ranks) / (n * wall)
    cpu["loadavg_at_end"] = load_end
    commits = sum(r["epochs"] + r["solo_epochs"] for r in ranks)  # both streams
    daemon_fsync = fsync_delta(fsync0, fsync1)
    daemon_fsync["commits"] = commits
    profile["daemon_wal_fsync_under_load"] = daemon_fsync
    return summarize(n, cfg=cfg, ranks=ranks, cpu=cpu, profile=profile, agreed_s=agreed_s)


def summarize(
    n: int,
    *,
    cfg: Config,
    ranks: Sequence[dict[str, Any]],
    cpu: dict[str, Any],
    profile: dict[str, Any],
    agreed_s: float,
) -> dict[str, Any]:
    """Pool every rank's samples per variant."""
    blocked: dict[str, list[float]] = {v: [] for v in VARIANTS}
    shard: dict[str, list[float]] = {v: [] for v in VARIANTS}
    whole: dict[str, list[float]] = {v: [] for v in VARIANTS}
    interval: dict[str, list[float]] = {v: [] for v in VARIANTS}
    rank0_blocked: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in ranks:
        for _index, variant, warm, write_s, blocked_s, interval_s, first in r["records"]:
            if warm:
                continue
            blocked[variant].append(blocked_s)
            shard[variant].append(write_s)
            whole[variant].append(write_s + blocked_s)
            if r["rank"] == 0:
                rank0_blocked[variant].append(blocked_s)
            if not first:
                interval[variant].append(interval_s)
    base = stats(interval[NONE])["mean_s"]
    variants: dict[str, Any] = {}
    for v in VARIANTS:
        iv = stats(interval[v])
        variants[v] = {
            "label": LABELS[v],
            "interval": iv,
            "added_per_checkpoint_s": iv["mean_s"] - base,
        }
        if v != NONE:
            variants[v] |= {
                "blocked": stats(blocked[v]),
                "blocked_rank0": stats(rank0_blocked[v]),
                "shard_write": stats(shard[v]),
                "whole_checkpoint": stats(whole[v]),
            }
    cvg = variants[CVG]["blocked"]
    ratios = {
        v: {
            "p50": ratio(variants[v]["blocked"]["p50_s"], cvg["p50_s"]),
            "p99": ratio(variants[v]["blocked"]["p99_s"], cvg["p99_s"]),
            "whole_p50": ratio(
                variants[v]["whole_checkpoint"]["p50_s"],
                variants[CVG]["whole_checkpoint"]["p50_s"],
            ),
        }
        for v in (BARRIER, BARRIER2, CVG_NOWAIT)
    }
    return {
        "nodes": n,
        "checkpoints_per_rank_per_variant": cfg.checkpoints,
        "warmup_per_variant": cfg.warmup,
        "variants": variants,
        "ratios_vs_convergenced": ratios,
        "target_blocked_p50_s": TARGET_BLOCKED_S,
        "target_met": bool(cvg["p50_s"] <= TARGET_BLOCKED_S),
        "target_met_nowait": bool(variants[CVG_NOWAIT]["blocked"]["p50_s"] <= TARGET_BLOCKED_S),
        "cpu": cpu,
        "profile": profile,
        "restore_point_reached_s": agreed_s,
        "rank_speeds": [r["speed"] for r in ranks],
        "torch": ranks[0]["torch"],
        "_samples": blocked,  # for the plot; not in the JSON
    }


# -- rendering ------------------------------------------------------------------------------


def fmt_ms(seconds: float) -> str:
    """Milliseconds, three significant digits ("-" for nan)."""
    if math.isnan(seconds):
        return "-"
    if math.isinf(seconds):
        return "inf"
    return f"{seconds * 1e3:.3g}"


def fmt_x(x: float) -> str:
    """A ratio."""
    return "-" if math.isnan(x) else f"{x:.3g}x"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], md: bool) -> str:
    """A text table (first column left-aligned) or a Markdown one."""
    if md:
        lines = ["| " + " | ".join(headers) + " |"]
        lines.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|")
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    out = [line(headers), "-" * len(line(headers))]
    return "\n".join(out + [line(r) for r in rows])


def blocked_table(results: Sequence[dict[str, Any]], md: bool) -> str:
    """A. time blocked per checkpoint, and the whole checkpoint next to it."""
    headers = [
        "N, variant",
        "samples",
        "blocked p50 ms",
        "p90",
        "p99",
        "max",
        "barrier/cvg p50",
        "p99",
        "whole ckpt p50 ms",
        "p99",
        "shard write p50 ms",
    ]
    rows = []
    for res in results:
        for v in COORDINATED:
            d = res["variants"][v]
            b, w, s = d["blocked"], d["whole_checkpoint"], d["shard_write"]
            r = res["ratios_vs_convergenced"].get(v)
            rows.append(
                [
                    f"{res['nodes']}, {LABELS[v]}",
                    str(b["n"]),
                    fmt_ms(b["p50_s"]),
                    fmt_ms(b["p90_s"]),
                    fmt_ms(b["p99_s"]),
                    fmt_ms(b["max_s"]),
                    fmt_x(r["p50"]) if r else "1x",
                    fmt_x(r["p99"]) if r else "1x",
                    fmt_ms(w["p50_s"]),
                    fmt_ms(w["p99_s"]),
                    fmt_ms(s["p50_s"]),
                ]
            )
    return table(headers, rows, md)


def job_table(results: Sequence[dict[str, Any]], md: bool) -> str:
    """B. job time per checkpoint interval."""
    headers = ["N, variant", "intervals", "mean ms", "p50", "p99", "added per ckpt ms"]
    rows = []
    for res in results:
        for v in (*COORDINATED, NONE):
            d = res["variants"][v]
            iv = d["interval"]
            rows.append(
                [
                    f"{res['nodes']}, {LABELS[v]}",
                    str(iv["n"]),
                    fmt_ms(iv["mean_s"]),
                    fmt_ms(iv["p50_s"]),
                    fmt_ms(iv["p99_s"]),
                    "0 (baseline)" if v == NONE else fmt_ms(d["added_per_checkpoint_s"]),
                ]
            )
    return table(headers, rows, md)


def cpu_table(results: Sequence[dict[str, Any]], md: bool) -> str:
    """C. what the cores were doing during the loop."""
    headers = [
        "N",
        "loop s",
        "daemons",
        "workers",
        "bench",
        "other",
        "CPU pressure",
        "daemon runq wait",
        "worker runq wait",
        "loadavg at end",
    ]
    rows = []
    for res in results:
        c = res["cpu"]
        rows.append(
            [
                str(res["nodes"]),
                f"{c['wall_s']:.1f}",
                f"{c['daemons']:.0%}",
                f"{c['workers']:.0%}",
                f"{c['client']:.0%}",
                f"{c['other']:.0%}",
                "-" if math.isnan(c["cpu_pressure_some"]) else f"{c['cpu_pressure_some']:.0%}",
                f"{c['daemon_runq_wait']:.1%}",
                f"{c['worker_runq_wait']:.1%}",
                c["loadavg_at_end"],
            ]
        )
    return table(headers, rows, md)


def loop_profile_table(results: Sequence[dict[str, Any]], md: bool) -> str:
    """D. the commit taken apart, in the loop (the coordination step's slot, under load)."""
    headers = [
        "N",
        "local fsync p50 ms",
        "p99",
        "daemon no-op p50 ms",
        "p99",
        "solo commit p50 ms",
        "p99",
        "commit p50 ms",
        "p99",
        "daemon WAL fsync mean ms",
        "p50 <=",
        "WAL fsyncs per commit",
    ]
    rows = []
    for res in results:
        v = res["variants"]
        f = res["profile"]["daemon_wal_fsync_under_load"]
        row = [str(res["nodes"])]
        for key in (FSYNC, NOOP, SOLO, CVG):
            row += [fmt_ms(v[key]["blocked"]["p50_s"]), fmt_ms(v[key]["blocked"]["p99_s"])]
        row += [
            fmt_ms(f["mean_s"]),
            fmt_ms(f["p50_le_s"]),
            f"{f['fsyncs'] / f['commits']:.2f}" if f["commits"] else "-",
        ]
        rows.append(row)
    return table(headers, rows, md)


def quiet_profile_table(results: Sequence[dict[str, Any]], md: bool) -> str:
    """E. the quiet floor, after the loop."""
    headers = [
        "N",
        "raw fsync p50 ms",
        "p99",
        "bare socket: commit p50 ms",
        "no-op p50",
        "Client: commit p50 ms",
        "p99",
        "no-op p50",
        "after idle: echo p50 ms",
        "Client no-op p50",
        "Client commit p50",
        "p99",
    ]
    rows = []
    for res in results:
        p = res["profile"]
        rows.append(
            [
                str(res["nodes"]),
                fmt_ms(p["raw_fsync"]["p50_s"]),
                fmt_ms(p["raw_fsync"]["p99_s"]),
                fmt_ms(p["raw_socket_commit"]["p50_s"]),
                fmt_ms(p["raw_socket_noop"]["p50_s"]),
                fmt_ms(p["client_commit"]["p50_s"]),
                fmt_ms(p["client_commit"]["p99_s"]),
                fmt_ms(p["client_noop"]["p50_s"]),
                fmt_ms(p["paced_echo"]["p50_s"]),
                fmt_ms(p["paced_client_noop"]["p50_s"]),
                fmt_ms(p["paced_client_commit"]["p50_s"]),
                fmt_ms(p["paced_client_commit"]["p99_s"]),
            ]
        )
    return table(headers, rows, md)


def verdict(results: Sequence[dict[str, Any]]) -> str:
    """The verdict, computed from the data."""

    def per_n(get: Callable[[dict[str, Any]], str]) -> str:
        return "/".join(get(r) for r in results)

    met = [r["nodes"] for r in results if r["target_met"]]
    missed = [r["nodes"] for r in results if not r["target_met"]]
    ns = per_n(lambda r: str(r["nodes"]))
    if not missed:
        target = f"target (<= 1 ms median) MET at every N ({ns})"
    elif not met:
        target = f"target (<= 1 ms median) MISSED at every N ({ns})"
    else:
        target = (
            f"target (<= 1 ms median) met at N = {', '.join(map(str, met))}, "
            f"MISSED at N = {', '.join(map(str, missed))}"
        )

    def blocked(v: str) -> str:
        return per_n(lambda r: fmt_ms(r["variants"][v]["blocked"]["p50_s"]))

    def ratios(v: str) -> str:
        return per_n(lambda r: fmt_x(r["ratios_vs_convergenced"][v]["p50"]))

    def added(v: str) -> str:
        return per_n(lambda r: fmt_ms(r["variants"][v]["added_per_checkpoint_s"]))

    return (
        f"Verdict: the convergenced commit blocked the training thread {blocked(CVG)} ms "
        f"median at N = {ns}: {target}. barrier + marker blocked {blocked(BARRIER)} ms "
        f"median ({ratios(BARRIER)} the commit's), barrier + marker + barrier "
        f"{blocked(BARRIER2)} ms ({ratios(BARRIER2)}). Job time added per checkpoint (mean): "
        f"barrier + marker {added(BARRIER)} ms, barrier + marker + barrier {added(BARRIER2)} "
        f"ms, convergenced {added(CVG)} ms. Medians and ratios from this one run."
        f" With commit_nowait (the answer collected at the next checkpoint) the training "
        f"thread was blocked {blocked(CVG_NOWAIT)} ms median: target "
        + ("met" if all(r["target_met_nowait"] for r in results) else "MISSED")
        + f" ({ratios(CVG_NOWAIT)} the waited commit's; job time added per checkpoint "
        f"{added(CVG_NOWAIT)} ms)."
    )


def profile_findings(results: Sequence[dict[str, Any]]) -> list[str]:
    """Where a missed target's time goes (one line per N that missed), from the data."""
    lines = []
    for r in results:
        if r["target_met"]:
            continue
        p = r["profile"]
        f = p["daemon_wal_fsync_under_load"]
        c = r["cpu"]
        v = r["variants"]
        loop = v[CVG]["blocked"]["p50_s"]
        solo = v[SOLO]["blocked"]["p50_s"]
        fs, noop = v[FSYNC]["blocked"]["p50_s"], v[NOOP]["blocked"]["p50_s"]
        fs_mean = v[FSYNC]["blocked"]["mean_s"]
        per_commit = f["fsyncs"] / f["commits"] if f["commits"] else math.nan
        quiet = p["client_commit"]["p50_s"]
        floor = (
            f"so even without load one commit misses the target ({fmt_ms(quiet)} ms)"
            if quiet > TARGET_BLOCKED_S
            else f"so without load one commit meets the target ({fmt_ms(quiet)} ms): the "
            "miss comes with the load"
        )
        lines.append(
            f"N = {r['nodes']}: the commit blocked {fmt_ms(loop)} ms median. In the same slot "
            f"of the same loop: a local fsync alone {fmt_ms(fs)} ms; a no-fsync request to "
            f"the daemon {fmt_ms(noop)} ms (Client, Unix socket, the daemon's dispatch); a "
            f"commit to a one-member stream {fmt_ms(solo)} ms (the commit path, no peers). "
            f"Differences of medians: the shared stream's agreement (commit - one-member "
            f"commit) {fmt_ms(loop - solo)} ms; the commit path beyond a no-op and a local "
            f"fsync {fmt_ms(solo - noop - fs)} ms. The daemons' log write+fsync, timed from "
            f"the hand-off to their disk thread until their event loop resumes, averaged "
            f"{fmt_ms(f['mean_s'])} ms ({per_commit:.2f} per commit, one at a time) against "
            f"{fmt_ms(fs_mean)} ms mean for a worker's own fsync in the same slot. CPU during "
            f"the loop: {c['daemons'] + c['workers'] + c['client'] + c['other']:.2f} of "
            f"{os.cpu_count()} cores busy, some task waiting for a core "
            f"{_pct(c['cpu_pressure_some'])} of the time, daemons runnable but not running "
            f"{c['daemon_runq_wait']:.1%} of their wall time. Quiet cluster afterwards: "
            f"bare-socket no-op {fmt_ms(p['raw_socket_noop']['p50_s'])} ms, raw fsync "
            f"{fmt_ms(p['raw_fsync']['p50_s'])} ms, bare-socket commit "
            f"{fmt_ms(p['raw_socket_commit']['p50_s'])} ms, Client commit {fmt_ms(quiet)} ms; "
            f"{floor}. At the loop's pace (each request after ~{PACE_S * 1e3:g} ms idle, no "
            f"other load): Client no-op {fmt_ms(p['paced_client_noop']['p50_s'])} ms, Client "
            f"commit {fmt_ms(p['paced_client_commit']['p50_s'])} ms, while a bare process "
            f"echo idle as long takes {fmt_ms(p['paced_echo']['p50_s'])} ms."
        )
    return lines


def _pct(x: float) -> str:
    return "?" if math.isnan(x) else f"{x:.0%}"


def render(results: Sequence[dict[str, Any]], cfg: Config, md: bool) -> str:
    """Every table, with its notes."""
    sections = [
        (
            "A. training thread blocked per checkpoint (coordination: own shard durable -> "
            "may train again), all ranks x checkpoints",
            blocked_table(results, md),
            [
                "whole ckpt = shard write (torch.save + fsync + rename + dir fsync) + blocked; "
                "barrier/cvg = this row's blocked median (p99) / the convergenced row's",
                "barrier + marker: rank 0 alone also writes the marker (2 fsyncs) after the "
                "barrier; barrier + marker + barrier: every rank waits for it",
            ],
        ),
        (
            f"B. job time per interval ({cfg.every} steps + checkpoint), mean over ranks and "
            "intervals; intervals straddling two variants left out",
            job_table(results, md),
            [
                "added per ckpt = mean interval - mean no-checkpoint interval: the wall time a "
                "checkpoint costs the whole job, including the wait a skipped barrier moves "
                "to the next all_reduce",
                "the sleeps alone make a no-checkpoint interval of "
                f"{nominal_interval_s(cfg) * 1e3:.3g} ms on average; the rest is the "
                "all_reduces and waiting for a core",
            ],
        ),
        (
            "C. CPU during the loop (share of one core; "
            f"{os.cpu_count()} cores), and time spent waiting for one",
            cpu_table(results, md),
            [
                "bench = this process; other = everything else, kernel threads (ext4 "
                "journal behind our fsyncs) included",
                "CPU pressure: /proc/pressure/cpu 'some' (share of time some task waited for "
                "a core); runq wait: share of wall time a daemon / worker (all threads) was "
                "runnable but not running",
            ],
        ),
        (
            "D. profile of the commit in the loop: probes run in the coordination step's "
            "place (same loop, same shard write just before, same load)",
            loop_profile_table(results, md),
            [
                "local fsync: 64-byte append + fsync of a rank-local file; daemon no-op: "
                "Client.streams() to the local daemon (no fsync, wakes no peer); solo commit: "
                "Client.commit to a stream whose only member is this node (no peer to tell)",
                "daemon WAL fsync: convergenced_wal_fsync_duration_seconds (write + fsync of "
                "one group commit), all daemons over the loop; p50 <= is a bucket bound; "
                "fsyncs per commit: all of the log's fsyncs / commits (both streams)",
            ],
        ),
        (
            f"E. quiet floor: the same cluster after the loop, {cfg.probes} samples each, "
            "round robin",
            quiet_profile_table(results, md),
            [
                "raw fsync: 64-byte append + fsync on the daemons' file system; bare socket: "
                "request frames on a plain Unix socket (no Client thread); no-op: `streams`; "
                "all back to back",
                f"after idle: each request after U(0.5, 1.5) x {PACE_S * 1e3:g} ms idle, as in the "
                "loop (a rank commits once per interval); echo: a one-byte round trip to a "
                "plain Python process idle as long, no convergenced code (the machine's "
                f"wake-up cost); {max(10, cfg.probes // 5)} samples each",
            ],
        ),
    ]
    out = []
    for title, body, notes in sections:
        if md:
            out += [f"**{title}**", "", body, "", *(f"* {n}" for n in notes), ""]
        else:
            out += [title, "", body, "", *(f"   {n}" for n in notes), ""]
    return "\n".join(out).rstrip()


def plot(
    results: Sequence[dict[str, Any]], samples: dict[int, dict[str, list[float]]], path: Path
) -> None:
    """Box plot of the blocked time per N and variant (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {BARRIER: "#d62728", BARRIER2: "#ff7f0e", CVG: "#1f77b4", CVG_NOWAIT: "#2ca02c"}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.2
    for k, v in enumerate(COORDINATED):
        data = [[x * 1e3 for x in samples[r["nodes"]][v]] for r in results]
        pos = [i + (k - (len(COORDINATED) - 1) / 2) * width for i in range(len(results))]
        box = ax.boxplot(
            data,
            positions=pos,
            widths=width * 0.85,
            whis=(1, 99),
            showfliers=False,
            patch_artist=True,
        )
        for patch in box["boxes"]:
            patch.set_facecolor(colors[v])
            patch.set_alpha(0.7)
        for median in box["medians"]:
            median.set_color("black")
        ax.plot([], [], color=colors[v], linewidth=8, alpha=0.7, label=LABELS[v])
    ax.axhline(
        TARGET_BLOCKED_S * 1e3,
        color="grey",
        linestyle="--",
        linewidth=1,
        label="target: 1 ms median",
    )
    ax.set_yscale("log")
    ax.set_xticks(range(len(results)), [f"N = {r['nodes']}" for r in results])
    ax.set_ylabel("training thread blocked per checkpoint (ms)")
    ax.set_title("Coordination per checkpoint (box: p25-p75, whiskers: p1-p99)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report_name(cfg: Config) -> str:
    """The BENCHMARKS.md section this run fills: ranks kept in step, or drifting."""
    return "training" if cfg.step_allreduce else "training-drift"


def markdown(
    results: Sequence[dict[str, Any]], cfg: Config, info: dict[str, Any], argv: Sequence[str]
) -> str:
    """DIR/training.md."""
    m = info["machine"]
    findings = profile_findings(results)
    lines = [
        f"Command ({info['elapsed_s']:.0f} s):",
        "",
        f"    {report.command_line(__file__, argv)}",
        "",
        f"N gloo worker processes (torch {info['torch']}, CPU) on loopback, each rank its own "
        "simulated host with its own `convergenced run` daemon (mutual TLS, signed records, "
        f"tick {cfg.tick_ms} ms). Every worker repeats a training step "
        f"({step_description(cfg)}) and every {cfg.every} steps checkpoints: its "
        f"{cfg.shard_kib} KiB shard via `torch.save` to a temporary file, fsync, rename, "
        "directory fsync (identical in every variant), then the coordination step: "
        "`dist.barrier()` + rank 0 writes `latest` atomically (+ optionally a second "
        "barrier), or `Client.commit` to the local daemon (acknowledged after its log is "
        "fsynced), no barrier, or `Client.commit_nowait` (send this commit, collect the "
        "previous one's answer; the daemon's fsync overlaps training). All variants, and "
        "three profile probes that take the "
        "coordination step's place (a local fsync, a no-op request, a commit to a one-member "
        "stream), run interleaved in the same processes, on the same process group and "
        f"daemons: blocks of {cfg.block} checkpoints in rotating order, each block opened by "
        f"one excluded settling checkpoint; {cfg.checkpoints} measured checkpoints per rank "
        f"per variant per N after {cfg.warmup} warm-up ones.",
        "",
        "**Blocked** = wall time the training thread spends in the coordination step, from "
        "its own shard being durable to being allowed to train again. Medians and ratios "
        "are from this one run.",
        "",
        f"Machine: {m['cpu_count']} cores ({m['cpu']}), Python {m['python']}, loadavg at "
        f"start {m['loadavg_at_start']}, at end {info['loadavg_at_end']}. The N daemons, N "
        "workers and the benchmark share these cores: both the barrier and the commit include "
        "that scheduler noise (table C).",
        "",
        "What the barrier costs is the spread of the ranks' arrivals at it: here what "
        "follows the step's last all_reduce (the optimizer sleep and its stalls) and the "
        f"spread of {cfg.shard_kib} KiB shard writes to a local disk. Larger shards on "
        "shared storage, or ranks that meet less often (`--no-step-allreduce`), widen that "
        "spread; the commit does not depend on it. Tables D and E take the commit apart.",
        "",
        render(results, cfg, md=True),
        "",
        f"![blocked time per checkpoint]({report_name(cfg)}.png)",
        "",
        verdict(results),
    ]
    if findings:
        lines += ["", "Profile of the miss:", ""] + [f"* {f}" for f in findings]
    return "\n".join(lines) + "\n"


# -- main ------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run every N, print the tables (and JSON, and the report files)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        worker(json.loads(sys.stdin.read()))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="N = 2, 10 checkpoints (< 20 s)")
    parser.add_argument("--json", action="store_true", help="print a JSON object last")
    parser.add_argument("--nodes", type=int, nargs="+", metavar="N", help="default 2 4 8")
    parser.add_argument(
        "--checkpoints", type=int, metavar="C", help="measured per rank per variant (default 200)"
    )
    parser.add_argument("--seed", type=int, default=1, help="jitter seed (default 1)")
    parser.add_argument(
        "--shard-kib", type=int, metavar="KIB", help="size of each rank's shard (default 256)"
    )
    parser.add_argument(
        "--no-step-allreduce",
        action="store_true",
        help="no gradient all_reduce per step: ranks meet only at checkpoints and drift "
        "apart in between (default: DDP-like, one all_reduce per step)",
    )
    parser.add_argument("--out", type=Path, metavar="DIR", help="write training.md and .png")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    if args.nodes:
        if min(args.nodes) < 2:
            parser.error("--nodes: at least 2")
        cfg = dataclasses.replace(cfg, nodes=tuple(args.nodes))
    if args.checkpoints is not None:
        if args.checkpoints < 1:
            parser.error("--checkpoints: at least 1")
        cfg = dataclasses.replace(cfg, checkpoints=args.checkpoints)
    cfg = dataclasses.replace(cfg, seed=args.seed, step_allreduce=not args.no_step_allreduce)
    if args.shard_kib is not None:
        if args.shard_kib < 4:
            parser.error("--shard-kib: at least 4")
        cfg = dataclasses.replace(cfg, shard_kib=args.shard_kib)
    if importlib.util.find_spec("torch") is None:
        print(
            "bench_training.py needs torch (the torch extra: pip install torch==2.13.0)",
            file=sys.stderr,
        )
        return 2
    if args.out is not None and importlib.util.find_spec("matplotlib") is None:
        print("--out needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    info: dict[str, Any] = {
        "mode": cfg.mode,
        "machine": bd.machine(),
        "torch": importlib.metadata.version("torch"),
        "config": dataclasses.asdict(cfg),
        "step": step_description(cfg),
    }
    m = info["machine"]
    print(
        f"training-thread blocking per checkpoint ({cfg.mode}): gloo job of N workers, "
        f"N convergenced daemons (mutual TLS), torch {info['torch']}"
    )
    print(
        f"machine: os.cpu_count()={m['cpu_count']} (usable {m['nproc']})  cpu={m['cpu']}  "
        f"loadavg at start {m['loadavg_at_start']}"
    )
    print(f"step: {step_description(cfg)}")
    print(
        f"checkpoint every {cfg.every} steps, {cfg.shard_kib} KiB shard; {cfg.checkpoints} "
        f"measured (+{cfg.warmup} warm-up) checkpoints per rank per variant, blocks of "
        f"{cfg.block}"
    )
    started = time.perf_counter()
    results: list[dict[str, Any]] = []
    samples: dict[int, dict[str, list[float]]] = {}
    for n in cfg.nodes:
        res = run_nodes(n, cfg)
        samples[n] = res.pop("_samples", {})
        results.append(res)
        print(
            f"  N = {n}: done ({res['cpu']['wall_s']:.1f} s loop; the last committed epoch is "
            f"the restore point on every node, checked in "
            f"{res['restore_point_reached_s'] * 1e3:.0f} ms)",
            flush=True,
        )
    info["elapsed_s"] = round(time.perf_counter() - started, 1)
    info["loadavg_at_end"] = bd.loadavg()
    print()
    print(render(results, cfg, md=False))
    print()
    print(verdict(results))
    for line in profile_findings(results):
        print(f"profile: {line}")
    print(f"elapsed: {info['elapsed_s']} s  (loadavg at end {info['loadavg_at_end']})")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = report_name(cfg)
        (args.out / f"{name}.md").write_text(markdown(results, cfg, info, argv))
        plot(results, samples, args.out / f"{name}.png")
        print(f"wrote {args.out / name}.md and {args.out / name}.png")
    if args.json:
        out = info | {"results": results, "verdict": verdict(results)}
        print(json.dumps(_clean(out), separators=(",", ":"), sort_keys=True, allow_nan=False))
    return 0


def _clean(x: Any) -> Any:
    """JSON-safe: nan and inf become null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


if __name__ == "__main__":
    sys.exit(main())
