"""`DcpCheckpointer` against real daemons and real gloo jobs on CPU.

Three ranks, one daemon each (node i hosts rank i-1), save a DTensor sharded by rows
across the world plus a replicated tensor every 3 steps with ``dcp.save`` or
``dcp.async_save``; one rank is killed inside DCP's ``write_data`` of step 6; the job
is relaunched, every rank loads the agreed step, and training ends bit for bit as an
uninterrupted run. The updates are elementwise, so a world of another size (a
resharding load) ends with the same table too. With ``use_collectives=False`` the
newest step holding metadata (rank 0's, the one DCP checks) is not restorable
everywhere: DCP's rule picks it, ours does not.

This file is also the ranks' program.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from daemons import LocalCluster
from test_dcp_layout import _free_port

from convergenced.client import ApiError, Client
from convergenced.integrations.dcp_layout import dcp_step_complete

CI = os.environ.get("CI") == "true"
try:
    import torch
    import torch.distributed as dist
except ImportError as exc:  # pragma: no cover - depends on the machine
    if CI:
        raise ImportError(f"CI=true but torch is not importable: {exc}") from exc
    pytest.skip("torch is not installed: pip install torch==2.13.0", allow_module_level=True)

TESTS = Path(__file__).resolve().parent
STREAM = "dcpjob"
STEPS = 12
EVERY = 3
CRASH_AT = 6
CRASH_RANK = 1
CRASH_EXIT = 17
ROWS = 6


# -- one rank of the job (runs in the child processes) -------------------------------------


def _arm_crash(step_dir: str) -> None:
    """Die inside DCP's write_data of ``step_dir``: the data written, half of it torn
    off, no return (no commit, no metadata from this rank)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    original = FileSystemWriter.write_data

    def torn(self: Any, plan: Any, planner: Any) -> Any:
        fut = original(self, plan, planner)
        if os.fspath(self.path) == step_dir:
            for r in fut.wait():
                path = Path(step_dir, r.storage_data.relative_path)
                os.truncate(path, path.stat().st_size // 2)
            os._exit(CRASH_EXIT)
        return fut

    FileSystemWriter.write_data = torn  # type: ignore[method-assign]  # doomed process


def rank_main(cfg: dict[str, Any]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from convergenced.integrations.dcp import DcpCheckpointer, NoRestorePointError

    torch.set_num_threads(1)
    rank, world = cfg["rank"], cfg["world"]
    t0 = time.monotonic()

    def mark(what: str) -> None:  # in the rank's log, for a failing test's output
        print(f"{time.monotonic() - t0:7.2f}s rank {rank}: {what}", flush=True)

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=world
    )
    mark("process group up")
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(ROWS * 2, dtype=torch.float64).reshape(ROWS, 2) / 7
    table = distribute_tensor(full, mesh, [Shard(0)])
    rows = distribute_tensor(
        torch.arange(ROWS, dtype=torch.float64)[:, None].expand(ROWS, 2).contiguous(),
        mesh,
        [Shard(0)],
    )
    w = torch.ones(4, dtype=torch.float64)
    out = Path(cfg["out"])
    ckpt = None
    start = 0
    if cfg.get("spec"):
        ckpt = DcpCheckpointer(Client(cfg["socket"]), cfg["spec"], rank, cfg["root"], domain="fs")
        mark(f"checkpointer open, recommitted {ckpt.recommitted}")
        state = {"table": table, "w": w, "step": torch.tensor(0)}
        try:
            epoch: int | None = ckpt.load(state, timeout=30)
            start = int(state["step"])
        except NoRestorePointError:
            epoch = None
        mark(f"loaded {epoch}")
        report = {"epoch": epoch, "generation": ckpt.generation(), "recommitted": ckpt.recommitted}
        (out / f"restored-{rank}.json").write_text(json.dumps(report))
        if cfg.get("crash") and rank == CRASH_RANK:
            _arm_crash(ckpt.checkpoint_id(CRASH_AT))
    for t in range(start, cfg.get("stop", STEPS)):
        table = table * 0.75 + rows * (t + 1)
        w = w * 0.5 + (t + 1)
        done = t + 1
        if ckpt is not None and done % EVERY == 0:
            state = {"table": table, "w": w, "step": torch.tensor(done)}
            kw = {"use_collectives": cfg.get("collectives", True)}
            if cfg.get("async"):
                ckpt.wait()  # the previous background save, as a job would before the next
                ckpt.async_save(state, done, **kw)
            else:
                ckpt.save(state, done, **kw)
            mark(f"saved {done}, gc {[d.epoch for d in ckpt.gc()]}")
    if ckpt is not None:
        ckpt.close()
    whole = table.full_tensor()
    if rank == 0:
        torch.save({"table": whole, "w": w}, out / "final.pt")
    dist.destroy_process_group()
    mark("done")


# -- launches -------------------------------------------------------------------------------


class Job:
    """One launch: ``world`` rank processes, rank r on node r+1's daemon."""

    def __init__(self, tmp: Path, name: str, cluster: LocalCluster | None, **cfg: Any) -> None:
        self.out = tmp / name
        self.out.mkdir()
        world = cfg.setdefault("world", 3)
        port = _free_port()
        self.logs = [self.out / f"rank-{r}.log" for r in range(world)]
        self.procs = []
        for rank, log in enumerate(self.logs):
            sock = str(cluster.socket_path(rank + 1)) if cluster else ""
            c = {**cfg, "rank": rank, "port": port, "out": str(self.out), "socket": sock}
            with log.open("wb") as fh:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, __file__, json.dumps(c)],
                        stdout=fh,
                        stderr=subprocess.STDOUT,
                        env={**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"},
                    )
                )

    def output(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.read_text()[-3000:]}" for p in self.logs)

    def wait(self, timeout: float = 90.0) -> list[int]:
        """Exit codes; once a rank failed, the others get 10 s to fail on their own."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = [p.poll() for p in self.procs]
            if all(c is not None for c in codes):
                break
            if any(c not in (None, 0) for c in codes):
                deadline = min(deadline, time.monotonic() + 10)
            time.sleep(0.05)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        return [p.wait() for p in self.procs]

    def restored(self) -> list[dict[str, Any]]:
        return [
            json.loads((self.out / f"restored-{r}.json").read_text())
            for r in range(len(self.procs))
        ]

    def final(self) -> dict[str, Any]:
        final: dict[str, Any] = torch.load(self.out / "final.pt")
        return final


def _spec(nodes: int, retention: int = 0) -> dict[str, Any]:
    return {
        "name": STREAM,
        "members": {f"node-{i}": [i - 1] for i in range(1, nodes + 1)},
        "policy": {"mode": "any", "domains": ["fs"]},
        "shared": ["fs"],
        "retention": retention,
    }


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """The final state of an uninterrupted run, computed here on whole tensors: the
    job's updates are elementwise, so each element gets the very operations it gets in
    a shard of any world, and the same bits."""
    table = torch.arange(ROWS * 2, dtype=torch.float64).reshape(ROWS, 2) / 7
    rows = torch.arange(ROWS, dtype=torch.float64)[:, None].expand(ROWS, 2).contiguous()
    w = torch.ones(4, dtype=torch.float64)
    for t in range(STEPS):
        table = table * 0.75 + rows * (t + 1)
        w = w * 0.5 + (t + 1)
    return {"table": table, "w": w}


def _assert_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert set(a) == set(b)
    for k, value in a.items():
        assert value.dtype == b[k].dtype and torch.equal(value, b[k]), f"{k} differs"


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*"))


def _gc_everywhere(cluster: LocalCluster, root: Path, world: int) -> None:
    """One more `DcpCheckpointer.gc` on every rank (the job's last one ran before its
    last step was agreed), then: what went was safe to delete, and whole steps remain,
    the agreed one among them."""
    from convergenced.integrations.dcp import DcpCheckpointer

    before = _steps(root)
    deleted: set[int] = set()
    for rank in range(world):
        ckpt = DcpCheckpointer(cluster.client(rank + 1), STREAM, rank, root, domain="fs",
                               recommit=False)  # fmt: skip
        deleted |= {d.epoch for d in ckpt.gc()}
    left = _steps(root)
    assert deleted and set(before) - set(left) == deleted, (before, left)
    for epoch in deleted:  # retired before deleted: the daemon refuses it back
        with pytest.raises(ApiError) as refused:
            cluster.client(1).commit(STREAM, 0, "fs", epoch)
        assert refused.value.reason == "retired"
    state = cluster.client(1).state(STREAM)
    assert state["restore_point"] == STEPS and STEPS in left, state
    problems = {e: dcp_step_complete(root / f"step-{e}").problems for e in left}
    assert not any(problems.values()), problems


@pytest.mark.parametrize(
    ("mode", "relaunch_world"),
    [("save", 3), ("async_save", 2)],
    ids=["save-same-world", "async_save-resharded-to-2"],
)
def test_a_rank_killed_mid_save_resumes_from_the_agreed_step_bit_for_bit(
    tmp_path: Path, reference: dict[str, Any], mode: str, relaunch_world: int
) -> None:
    """Rank 1 dies inside write_data of step 6; the relaunch loads step 3 on every rank.
    With async_save the relaunch runs on two hosts (node-3's is gone for good): a new
    member map, whose ranks verify step 3 complete for the three ranks that saved it,
    and DCP reshards the table from three shards to two."""
    root = tmp_path / "ckpt"
    cfg = {"root": str(root), "async": mode == "async_save"}
    with LocalCluster(3) as cluster:
        cluster.start_all()
        first = Job(tmp_path, "first", cluster, crash=True, spec=_spec(3, retention=1), **cfg)
        codes = first.wait()
        assert codes[CRASH_RANK] == CRASH_EXIT, first.output()
        assert all(c != 0 for c in codes), first.output()  # the others' collective broke
        torn = dcp_step_complete(root / f"step-{CRASH_AT}")
        assert not torn.ok  # no .metadata: the coordinator never ran finish
        assert torn.layout == "none", torn.problems

        if relaunch_world < 3:
            cluster.kill(3)
        second = Job(
            tmp_path, "second", cluster, world=relaunch_world,
            spec=_spec(relaunch_world, retention=1), **cfg,
        )  # fmt: skip
        assert second.wait() == [0] * relaunch_world, second.output()
        restored = second.restored()
        assert [r["epoch"] for r in restored] == [3] * relaunch_world
        assert all(r["recommitted"] == [3] for r in restored), restored
        _assert_equal(second.final(), reference)
        if relaunch_world < 3:
            spec = cluster.client(1).state(STREAM)["spec"]
            assert sorted(spec["members"]) == ["node-1", "node-2"]
            assert restored[0]["generation"] >= 1
        _gc_everywhere(cluster, root, relaunch_world)


def test_per_rank_metadata_the_newest_step_with_metadata_is_not_restorable(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    root = tmp_path / "ckpt"
    cfg = {"spec": _spec(3), "root": str(root), "collectives": False}
    with LocalCluster(3) as cluster:
        cluster.start_all()
        first = Job(tmp_path, "first", cluster, crash=True, **cfg)
        assert first.wait()[CRASH_RANK] == CRASH_EXIT, first.output()
        step = root / f"step-{CRASH_AT}"
        # DCP's rule (rank 0's metadata exists) and "the highest step holding metadata"
        # both pick step 6; it lacks rank 1's metadata and data.
        with_metadata = [e for e in _steps(root) if list((root / f"step-{e}").glob("*.metadata"))]
        assert max(with_metadata) == CRASH_AT
        assert (step / "__0.metadata").exists() and not (step / "__1.metadata").exists()
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        dcp_writer = FileSystemWriter(step)
        dcp_writer.set_up_storage_writer(True, rank=0, use_collectives=False)
        assert dcp_writer._metadata_exists()
        found = dcp_step_complete(step, world=3)
        assert not found.ok and "no metadata of rank(s) 1" in found.problems[0]

        second = Job(tmp_path, "second", cluster, **cfg)
        assert second.wait() == [0, 0, 0], second.output()
        assert [r["epoch"] for r in second.restored()] == [3, 3, 3]
        _assert_equal(second.final(), reference)


if __name__ == "__main__":  # pragma: no cover - a rank of a job
    rank_main(json.loads(sys.argv[1]))
