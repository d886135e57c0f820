"""A torchrun job relaunched with its restart counter back at 0 resumes from the agreed
epoch and ends bit for bit as an uninterrupted run.

Real torchrun (``python -m torch.distributed.run --standalone``), two gloo ranks on
CPU, each rank on its own node's daemon, `TorchCheckpointer.restore` given no
generation (rank 0 asks its daemon for a new one and broadcasts it). The first launch
runs with ``--max-restarts 1``: in its attempt 0, rank 1 dies halfway through writing
its shard of epoch 6; torchrun restarts both ranks (``TORCHELASTIC_RESTART_COUNT`` 1),
which restore epoch 3, save 6 and 9, and then the whole launch is killed (SIGKILL to
torchrun and its workers, as a preemption would). The second launch is a new torchrun,
whose restart count is 0 again: generation 0 is closed by then, so a job that used the
count as its generation would fail; its ranks restore epoch 9 instead and finish.

This file is also the ranks' program: torchrun runs it with the launch's configuration.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import test_integration_torch as job  # the model, data and steps of the gloo job test
from daemons import LocalCluster, until

from convergenced.client import ApiError, Client
from convergenced.integrations.files import NoRestorePointError, Tier
from convergenced.integrations.torch import TorchCheckpointer

torch = job.torch
dist = job.dist

STREAM = "relaunched"
WORLD = job.WORLD
LAUNCH_TIMEOUT = 90.0


# -- one rank, as torchrun starts it ------------------------------------------------------


def rank_main(cfg: dict[str, Any]) -> None:
    """Restore (a new generation), train, checkpoint; crash or hang where told to."""
    warnings.simplefilter("error")  # as pytest's filterwarnings = error, in the child
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    out = Path(cfg["out"])
    _init_process_group(rank, restart)
    model, optimizer, scheduler = job.make_job()
    ddp = job.DistributedDataParallel(model)
    torch.manual_seed(1000 + rank)  # per-rank dropout and batches, as the gloo job test
    random.seed(2000 + rank)
    data = job.dataset()
    start = 0
    ckpt: TorchCheckpointer | None = None
    if cfg["checkpoint"]:
        client = Client(cfg["sockets"][rank])
        client.declare(cfg["spec"])
        local = Tier("nvme", cfg["locals"][rank])
        ckpt = TorchCheckpointer(client, STREAM, rank, local, Tier("s3", cfg["remote"]))
        try:
            epoch, extra = ckpt.restore(
                model=ddp, optimizer=optimizer, scheduler=scheduler, timeout=30
            )
            start = extra["step"]
        except NoRestorePointError:
            epoch = None
        report = {"generation": ckpt.generation, "epoch": epoch}
        (out / f"restored-{restart}-{rank}.json").write_text(json.dumps(report))
        crash = cfg.get("crash")
        if crash and (restart, rank) == (crash["restart"], crash["rank"]):
            job._arm_crash(crash["epoch"], local.directory)
    for step in range(start, job.STEPS):
        job.train_step(ddp, optimizer, scheduler, data)
        done = step + 1
        if ckpt is not None and done % job.EVERY == 0:
            extra = {"step": done, "sample_index": done * 8}
            ckpt.save(done, model=ddp, optimizer=optimizer, scheduler=scheduler, extra=extra)
            ckpt.gc()
            hang = cfg.get("hang")
            if hang and (restart, done) == (hang["restart"], hang["epoch"]):
                (out / f"hanging-{rank}").write_text(str(os.getpid()))
                time.sleep(3600)  # until the launch is killed
    final = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
    }
    torch.save(final, out / f"final-{rank}.pt")
    if ckpt is not None:
        ckpt.close()
    dist.destroy_process_group()


def _init_process_group(rank: int, restart: int) -> None:
    """``init_process_group("gloo")`` on torchrun's store, under a prefix of this attempt.

    torchrun keeps its store across the restarts of one launch, and gloo's keys are the
    same in every attempt: a rank of attempt 1 that starts before its peer then reads
    the address of attempt 0's dead rank and fails to connect (seen on 2 loaded cores).
    """
    timeout = timedelta(seconds=30)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group("gloo", timeout=timeout)
        return
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)  # fmt: skip
    store = dist.PrefixStore(f"attempt-{restart}/", agent)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)


# -- launches -------------------------------------------------------------------------------


class Torchrun:
    """One launch: torchrun and the ranks it starts, in a session of their own."""

    def __init__(self, tmp: Path, name: str, cfg: dict[str, Any], max_restarts: int) -> None:
        self.out = tmp / name
        self.out.mkdir()
        self.log = tmp / f"{name}.log"
        argv = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
            f"--nproc-per-node={WORLD}", f"--max-restarts={max_restarts}",
            "--monitor-interval=0.1", __file__, json.dumps({**cfg, "out": str(self.out)}),
        ]  # fmt: skip
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
        with self.log.open("wb") as fh:
            self.proc = subprocess.Popen(
                argv, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=LAUNCH_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the launch did not end:\n{self.output()}") from None

    def kill(self) -> None:
        """SIGKILL torchrun, then its ranks (each runs in a session of its own)."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for marker in self.out.glob("hanging-*"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(marker.read_text()), signal.SIGKILL)

    def restored(self, restart: int) -> list[dict[str, Any]]:
        """What each rank of attempt ``restart`` restored."""
        return [
            json.loads((self.out / f"restored-{restart}-{r}.json").read_text())
            for r in range(WORLD)
        ]


def test_a_relaunch_with_its_counter_back_at_0_resumes_from_the_agreed_epoch(
    tmp_path: Path,
) -> None:
    with LocalCluster(WORLD) as cluster:
        cluster.start_all()
        spec = cluster.spec(STREAM, retention=0, mode="any", domains=["nvme", "s3"])
        cfg = {
            "spec": spec,
            "sockets": [str(cluster.socket_path(r + 1)) for r in range(WORLD)],
            "locals": [str(tmp_path / f"nvme-{r}") for r in range(WORLD)],
            "remote": str(tmp_path / "s3"),
        }
        reference = Torchrun(tmp_path, "reference", {**cfg, "checkpoint": False}, 0)
        assert reference.wait() == 0, reference.output()

        crash = {"restart": 0, "rank": 1, "epoch": 6}
        hang = {"restart": 1, "epoch": 9}
        first = Torchrun(tmp_path, "first", {**cfg, "checkpoint": True, "crash": crash,
                                             "hang": hang}, 1)  # fmt: skip
        try:
            until(lambda: len(list(first.out.glob("hanging-*"))) == WORLD, LAUNCH_TIMEOUT,
                  "both ranks of attempt 1 saving epoch 9")  # fmt: skip
        except AssertionError:
            first.kill()
            raise AssertionError(first.output()) from None
        first.kill()  # the whole launch, as a preemption would
        # Generations from next_generation start above the membership declared (0).
        assert first.restored(0) == [{"generation": 1, "epoch": None}] * WORLD
        assert first.restored(1) == [{"generation": 2, "epoch": 3}] * WORLD
        client = cluster.client(1)
        assert client.wait(STREAM, 9, timeout=20)["restore_point"] == 9
        # What a job naming its generation by TORCHELASTIC_RESTART_COUNT would ask now.
        with pytest.raises(ApiError) as info:
            client.restore_point(STREAM, 0, timeout=5)
        assert info.value.reason == "generation_closed"

        second = Torchrun(tmp_path, "second", {**cfg, "checkpoint": True}, 0)
        assert second.wait() == 0, second.output()
        assert second.restored(0) == [{"generation": 3, "epoch": 9}] * WORLD
        for r in range(WORLD):
            ours = torch.load(second.out / f"final-{r}.pt", weights_only=True)
            theirs = torch.load(reference.out / f"final-{r}.pt", weights_only=True)
            job._assert_same(ours, theirs, f"rank {r}")


if __name__ == "__main__":  # pragma: no cover - a rank started by torchrun
    rank_main(json.loads(sys.argv[1]))
