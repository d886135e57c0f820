"""A Megatron-style job crashes mid-save, again and again; its loader never sees a
torn iteration.

Two real daemons (node-1 hosts rank 0, node-2 rank 1), a Megatron layout of tensor
parallel 2 in one shared directory, and real processes: one writer per rank saving
``iter_{N:07d}/mp_rank_{rank:02d}/model_optim_rng.pt`` with plain writes, chunk by
chunk, rank 0 writing ``latest_checkpointed_iteration.txt`` right after its own file
(sooner than Megatron, which waits for a barrier: the worst case), and one
``convergenced marker`` process per node. Each seed runs two launches; each launch
is killed at a random point of a save (SIGKILL, files cut short), in some launches
one rank hangs for ever half way through a file (alive, its file never changing
again), and before the second relaunch rank 1's files of the agreed iteration and every
newer one are lost (the restore point rolls back). Each relaunch asks a new generation, runs
``convergenced marker --once --generation G`` on both nodes, and loads what the
tracker file names, as Megatron would: it must exist, whole, with the bytes that rank
saved for that iteration.
"""

from __future__ import annotations

import hashlib
import io
import random
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemons import LocalCluster, until

TRACKER = "latest_checkpointed_iteration.txt"
EVERY = 10

WRITER = r"""
import io, os, sys, time, random, zipfile, hashlib
root = sys.argv[1]
rank, start, seed, hang_at = (int(a) for a in sys.argv[2:6])
rng = random.Random(seed * 1000 + rank * 7 + start)
parent = os.getppid()
def orphaned():
    # Never outlive the test: a writer whose test died (killed, timed out) stops
    # instead of filling the disk with iterations for ever.
    return os.getppid() != parent
def payload(step):
    block = hashlib.sha256(f"{step}/{rank}".encode()).digest() * 2048
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", block)
    return buf.getvalue()
step = start
for _ in range(5000):
    if orphaned():
        break
    step += EVERY
    d = os.path.join(root, f"iter_{step:07d}", f"mp_rank_{rank:02d}")
    os.makedirs(d, exist_ok=True)
    data = payload(step)
    with open(os.path.join(d, "model_optim_rng.pt"), "wb") as f:
        for i in range(0, len(data), 8192):
            if step == hang_at and i >= len(data) // 2:
                f.flush()
                while not orphaned():
                    time.sleep(0.5)
                sys.exit(0)
            f.write(data[i:i + 8192])
            f.flush()
            time.sleep(rng.random() * 0.002)
    if rank == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as t:
            t.write(str(step))
    time.sleep(rng.random() * 0.03)
""".replace("EVERY", str(EVERY))


def block(step: int, rank: int) -> bytes:
    """What the writer of ``rank`` stores for ``step``."""
    return hashlib.sha256(f"{step}/{rank}".encode()).digest() * 2048


def load(root: Path) -> int | None:
    """What a Megatron loader does: read the tracker, open every rank's file of it."""
    try:
        text = (root / TRACKER).read_text()
    except FileNotFoundError:
        return None  # no checkpoint: start from scratch
    step = int(text)
    for rank in (0, 1):
        path = root / f"iter_{step:07d}" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt"
        data = path.read_bytes()  # FileNotFoundError: the tracker named a torn iteration
        with zipfile.ZipFile(io.BytesIO(data)) as z:  # BadZipFile: a torn file
            assert z.read("archive/data.pkl") == block(step, rank), f"{path}: not rank {rank}'s"
    return step


def marker_argv(cluster: LocalCluster, i: int, root: Path, stream: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "convergenced.cli", "marker", "--format", "megatron",
        "--dir", str(root), "--domain", "nvme", "--stream", stream, "--tp", "2",
        "--settle", "0.15", "--period", "0.03", "--socket", str(cluster.socket_path(i)),
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(2) as c:
        c.start_all()
        yield c


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait(timeout=30)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_loader_reading_the_tracker_never_sees_a_torn_iteration(
    cluster: LocalCluster, seed: int
) -> None:
    rng = random.Random(seed)
    stream = f"crash{seed}"
    root = cluster.dir / stream
    root.mkdir()
    spec = cluster.spec(stream, retention=1000)
    for i in (1, 2):
        cluster.client(i).declare(spec)
    loaded: list[int | None] = []
    start = 0
    gen: int | None = None
    for launch in range(2):
        hang = rng.random() < 0.4
        hang_rank = rng.randrange(2)
        hang_at = start + EVERY * rng.randint(1, 3) if hang else -1
        gen_args = [] if gen is None else ["--generation", str(gen)]
        markers = [
            subprocess.Popen(
                marker_argv(cluster, i, root, stream, *gen_args), stderr=subprocess.DEVNULL
            )
            for i in (1, 2)
        ]
        writers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    WRITER,
                    str(root),
                    str(rank),
                    str(start),
                    str(seed),
                    str(hang_at if rank == hang_rank else -1),
                ]
            )
            for rank in (0, 1)
        ]
        try:
            if launch == 0:  # let a first iteration be agreed, so that there is a rollback
                until(lambda: cluster.client(1).state(stream)["restore_point"] is not None,
                      timeout=60, what="a first agreed iteration")  # fmt: skip
            time.sleep(rng.uniform(0.1, 0.6))  # the crash: somewhere in some save
        finally:
            stop(writers)
            stop(markers)
        rolled_from = None
        if launch == 1:
            # node-2's disk loses rank 1's files of the iteration the daemons agreed on
            # last and of every newer one: the restore point must roll back below it.
            rolled_from = cluster.client(1).state(stream)["restore_point"]
            if rolled_from is not None:
                for d in root.glob("iter_*/mp_rank_01"):
                    if int(d.parent.name[5:]) >= rolled_from:
                        shutil.rmtree(d)
        gen = int(cluster.client(1).next_generation(stream)["generation"])
        for r in both_once(cluster, root, stream, gen):
            assert r.returncode == 0, r.stderr
        step = load(root)
        if rolled_from is not None:
            assert step is None or step < rolled_from, (step, rolled_from)
        loaded.append(step)
        start = step or 0
    assert any(s for s in loaded), f"seed {seed}: nothing ever agreed: {loaded}"


def both_once(
    cluster: LocalCluster, root: Path, stream: str, gen: int
) -> list[subprocess.CompletedProcess[str]]:
    """Both nodes' ``--once`` at the same time: the generation resolves once both froze."""
    procs = [
        subprocess.Popen(
            marker_argv(
                cluster, i, root, stream, "--once", "--generation", str(gen), "--timeout", "30"
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (1, 2)
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=60)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out
