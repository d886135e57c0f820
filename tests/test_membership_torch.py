"""A gloo job relaunched on a spare after a host died for good restores the agreed epoch,
the moved rank from the shared tier.

The first launch saves from this process: rank 0 on node-1 and rank 1 on node-2 save
epochs 3 and 6 (in nvme and, flushed, in the shared s3 tier); rank 0 also saves 9, and
rank 1 dies before it does. node-2 is then gone for good (daemon, state directory,
disk). The relaunch is a real two-rank gloo job, rank 1 now on node-3, a spare that
never held the stream: each rank creates its `TorchCheckpointer` with the new spec, a
collective in which rank 0 asks node-1 for the launch and broadcasts it; every rank
declares the new member map, rank 1's store commits the shards it finds in the shared
tier, and both restore epoch 6 (not rank 0's newer 9), rank 1 from s3, bit for bit as
saved. (The bit-for-bit resume of a whole gloo run is `test_integration_torch`'s.)

This file is also the ranks' program (``python tests/test_membership_torch.py CFG``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import test_integration_torch as job  # the model, data and steps of the gloo job test
from daemons import LocalCluster, until

from convergenced.client import Client
from convergenced.integrations.files import Launch, Tier
from convergenced.integrations.torch import TorchCheckpointer

torch = job.torch
dist = job.dist

STREAM = "moved"
WORLD = job.WORLD
LAUNCH_TIMEOUT = 90.0


def spec(members: dict[str, list[int]]) -> dict[str, Any]:
    return {"name": STREAM, "members": members, "shared": ["s3"],
            "policy": {"mode": "any", "domains": ["nvme", "s3"]}}  # fmt: skip


def snapshot(model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    """What a restore must bring back: the states and the RNGs, cloned."""
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": job._clone(optimizer.state_dict()),
        "scheduler": job._clone(scheduler.state_dict()),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
    }


def rank_main(cfg: dict[str, Any]) -> None:
    """One rank of the relaunch: create the checkpointer (a collective), restore."""
    warnings.simplefilter("error")  # as pytest's filterwarnings = error, in the child
    torch.set_num_threads(1)
    rank, out = cfg["rank"], Path(cfg["out"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=30))  # fmt: skip
    model, optimizer, scheduler = job.make_job(seed=99)  # other weights than those saved
    client = Client(cfg["sockets"][rank])
    local, remote = Tier("nvme", cfg["locals"][rank]), Tier("s3", cfg["remote"])
    with TorchCheckpointer(client, cfg["spec"], rank, local, remote) as ckpt:
        assert ckpt.store.launch is not None and ckpt.store.recommitted is not None
        epoch, extra = ckpt.restore(model=model, optimizer=optimizer, scheduler=scheduler,
                                    timeout=30)  # fmt: skip
        report = {
            "launch": [ckpt.store.launch.generation, ckpt.store.launch.membership],
            "adopted": ckpt.store.recommitted.committed,
            "epoch": epoch,
            "extra": extra,
            "domain": ckpt.restored_from,
        }
    torch.save(snapshot(model, optimizer, scheduler), out / f"restored-{rank}.pt")
    (out / f"restored-{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def relaunch(tmp: Path, cfg: dict[str, Any]) -> Path:
    """Run both ranks of the relaunch to their end; return their output directory."""
    out = tmp / "relaunch"
    out.mkdir()
    port = job._free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs, logs = [], []
    for rank in range(WORLD):
        arg = json.dumps({**cfg, "rank": rank, "port": port, "out": str(out)})
        logs.append(tmp / f"relaunch-{rank}.log")
        with logs[-1].open("wb") as fh:
            procs.append(subprocess.Popen([sys.executable, __file__, arg], stdout=fh,
                                          stderr=subprocess.STDOUT, env=env))  # fmt: skip
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
    codes = [p.wait() for p in procs]
    assert codes == [0] * WORLD, "\n".join(
        f"--- {log.name} ---\n{log.read_text(errors='replace')[-3000:]}" for log in logs
    )
    return out


def test_a_rank_whose_host_died_restores_on_a_spare_from_the_shared_tier(
    tmp_path: Path,
) -> None:
    with LocalCluster(3) as cluster:
        cluster.start_all()
        clients = [cluster.client(i) for i in (1, 2, 3)]
        until(lambda: all(c.status()["summary"].startswith("2/") for c in clients),
              what="the links")  # fmt: skip
        nvme = [tmp_path / f"node-{i}-nvme" for i in (1, 2, 3)]
        remote = Tier("s3", tmp_path / "s3")
        first = spec({"node-1": [0], "node-2": [1]})
        saved: dict[int, dict[str, Any]] = {}
        data = job.dataset()
        for rank in range(WORLD):  # the first launch, one rank after the other
            model, optimizer, scheduler = job.make_job(seed=rank)
            ckpt = TorchCheckpointer(clients[rank], first, rank, Tier("nvme", nvme[rank]),
                                     remote, launch=Launch(0, 0))  # fmt: skip
            for done in range(1, 10):
                job.train_step(model, optimizer, scheduler, data)
                if done % job.EVERY:
                    continue
                if (rank, done) == (1, 9):
                    break  # rank 1 dies before its save of 9
                ckpt.save(done, model=model, optimizer=optimizer, scheduler=scheduler,
                          extra={"step": done})  # fmt: skip
                ckpt.flush(10)
                if done == 6:
                    saved[rank] = snapshot(model, optimizer, scheduler)
            ckpt.close()
        cluster.kill(2)  # node-2's host is gone: its daemon, its state, its disk
        shutil.rmtree(cluster.dir / "node-2" / "state")
        shutil.rmtree(nvme[1])

        out = relaunch(tmp_path, {
            "spec": spec({"node-1": [0], "node-3": [1]}), "remote": str(remote.directory),
            "sockets": [str(cluster.socket_path(i)) for i in (1, 3)],
            "locals": [str(nvme[0]), str(nvme[2])],
        })  # fmt: skip
        reports = [json.loads((out / f"restored-{r}.json").read_text()) for r in range(WORLD)]
        assert reports == [
            {"launch": [1, 1], "adopted": [["nvme", 3], ["nvme", 6], ["nvme", 9], ["s3", 3],
             ["s3", 6], ["s3", 9]], "epoch": 6, "extra": {"step": 6}, "domain": "nvme"},
            {"launch": [1, 1], "adopted": [["s3", 3], ["s3", 6]], "epoch": 6,
             "extra": {"step": 6}, "domain": "s3"},
        ]  # fmt: skip
        for r in range(WORLD):
            restored = torch.load(out / f"restored-{r}.pt", weights_only=True)
            job._assert_same(restored, saved[r], f"rank {r}")


if __name__ == "__main__":  # pragma: no cover - a rank of the relaunch
    rank_main(json.loads(sys.argv[1]))
