"""Real daemons restarted under running jobs: training goes on, nothing is lost.

A two-rank gloo job checkpoints with the torch checkpointer (on the files
integration), each rank on its own node. Both daemons are killed with SIGKILL while
the ranks train on; the ranks' next saves wait for their daemon, which comes back
within the reconnect bound. The job finishes bit for bit as an uninterrupted run, and
each daemon's write-ahead log holds every commit of its rank exactly once, although
the clients sent some of them twice (a save's commit in flight at the kill, the
shards the store committed again after reconnecting).
"""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path
from typing import Any

import test_integration_torch as tj  # skips this module too without torch
import torch
from daemons import LocalCluster, until

from convergenced.core.facts import Commit
from convergenced.daemon.durability.log_file import FactLog
from convergenced.daemon.main import WAL_NAME


def commits_in_log(cluster: LocalCluster, i: int) -> Counter[tuple[int, str, int]]:
    """(rank, domain, epoch) of every commit entry in node ``i``'s log (stopped)."""
    log, entries, _ = FactLog.open(cluster.dir / cluster.name(i) / "state" / WAL_NAME)
    log.close()
    return Counter((e.rank, e.domain, e.epoch) for e in entries if isinstance(e, Commit))


def test_a_gloo_job_trains_through_kill_9_of_its_daemons_bit_for_bit(
    tmp_path: Path,
    torch_reference: Path,
) -> None:
    with LocalCluster(tj.WORLD) as cluster:
        cluster.start_all()
        spec = cluster.spec(tj.STREAM, retention=0, mode="any", domains=["nvme", "s3"])

        def launch(name: str, **cfg: Any) -> tj.Launch:
            out = tmp_path / name
            out.mkdir()
            per_rank = [
                {"socket": str(cluster.socket_path(r + 1)), "local": str(tmp_path / f"nvme-{r}")}
                for r in range(tj.WORLD)
            ]
            base = {
                "out": str(out),
                "spec": spec,
                "remote": str(tmp_path / "s3"),
                "per_rank": per_rank,
                "generation": 0,
            }
            return tj.Launch(tmp_path, name, {**base, **cfg})

        out = tmp_path / "restarts"
        job = launch("restarts", checkpoint=True, pause_at=tj.EVERY)
        until(
            lambda: all((out / f"paused-{r}").exists() for r in range(tj.WORLD)),
            timeout=tj.PHASE_TIMEOUT,
            what=f"both ranks saved epoch {tj.EVERY}",
        )
        for i in range(1, tj.WORLD + 1):
            cluster.kill(i)  # SIGKILL
        (out / "go").touch()
        # Both ranks train on and write their next shard; its commit then waits for
        # the daemon (the ranks' clients reconnect for up to 60 s by default).
        nxt = 2 * tj.EVERY
        until(
            lambda: all(
                (tmp_path / f"nvme-{r}" / tj.STREAM / f"epoch-{nxt}" / f"rank-{r}.shard").exists()
                for r in range(tj.WORLD)
            ),
            timeout=tj.PHASE_TIMEOUT,
            what=f"both ranks wrote epoch {nxt} while their daemon was down",
        )
        assert all(p.poll() is None for p in job.procs), job.output()
        for i in range(1, tj.WORLD + 1):
            cluster.start(i)
        assert job.wait() == [0] * tj.WORLD, job.output()

        for r in range(tj.WORLD):
            ours = torch.load(out / f"final-{r}.pt", weights_only=True)
            reference = torch.load(torch_reference / f"final-{r}.pt", weights_only=True)
            tj._assert_same(ours, reference, f"rank {r}")
        clients = [cluster.client(i) for i in range(1, tj.WORLD + 1)]
        until(
            lambda: all(c.state(tj.STREAM)["restore_point"] == tj.STEPS for c in clients),
            what=f"restore point {tj.STEPS} on both nodes",
        )
        for c in clients:
            c.close()
        for i in range(1, tj.WORLD + 1):
            assert cluster.kill(i, signal.SIGTERM) == 0
            rank = i - 1
            logged = commits_in_log(cluster, i)
            # Every save's commit is in the log exactly once (no save was lost, and
            # none counted twice); every upload's at most once (gc may collect an
            # epoch before its upload), the last one once (close waits for uploads).
            epochs = range(tj.EVERY, tj.STEPS + 1, tj.EVERY)
            assert {e: logged[(rank, "nvme", e)] for e in epochs} == {e: 1 for e in epochs}
            assert all(n == 1 for n in logged.values()), logged
            assert logged[(rank, "s3", tj.STEPS)] == 1
            assert "reconnected to the daemon" in (job.logs[rank].read_text())
