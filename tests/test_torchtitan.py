"""torchtitan's CheckpointManager on real daemons: a two-rank gloo job on CPU resumes from
the agreed step, where torchtitan's own rule would pick one that rank 1 cannot load.

Two gloo rank processes started as torchrun starts them (its environment), each
on its own node's daemon, sharing one checkpoint folder (domain ``pfs``, shared in the
spec), torchtitan's own optimizer and LR scheduler containers and its config system
building `ConvergencedCheckpointManager`; the loop calls the manager as torchtitan's
``Trainer.train`` does (``load(step=load_step)`` first, then ``save(step, last_step=)``
after every step). torchtitan's trainer itself does not run here: its models import
triton, which the CPU build of torch lacks, and it sets a CUDA device.

The first launch saves steps 2, 4, 6 asynchronously and its last step, 7, in full.
Then rank 1's data file of step 7 is lost. torchtitan's rule (the highest ``step-N``
holding ``.metadata``) picks 7 on both ranks, which rank 1 cannot load; the second
launch's ranks load the agreed step 6 instead, bit for bit what the first launch held
at step 6, train to 10, and end with torchtitan's default model-only export of step 10,
which is never committed: the restore point stays 8.

This file is also the ranks' program: each rank runs it with the launch's configuration.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
import warnings
from pathlib import Path
from typing import Any

import pytest
from daemons import LocalCluster

from convergenced.integrations import torchtitan as titan

CI = os.environ.get("CI") == "true"

try:
    import torch
    import torch.distributed as dist
    from torchtitan.components.checkpoint import (  # type: ignore[import-untyped]
        CheckpointManager,
    )
    from torchtitan.components.optimizer import (  # type: ignore[import-untyped]
        LRSchedulersContainer,
        default_adamw,
    )
except ImportError as exc:
    if CI:  # CI installs the torchtitan extra (make install): its absence is a failure
        raise ImportError(f"CI=true but torchtitan is not importable: {exc}") from exc
    pytest.skip(
        "torchtitan is not installed: pip install 'convergenced[torchtitan]'",
        allow_module_level=True,
    )

STREAM = "titan"
WORLD = 2
INTERVAL = 2
LAUNCH_TIMEOUT = 120.0


# -- one rank, as torchrun starts it ------------------------------------------------------


class TrainState:
    """The trainer's own state in the checkpoint (torchtitan's Trainer saves its step)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def rank_main(cfg: dict[str, Any]) -> None:
    """Build the manager through torchtitan's config, load, train, save; report."""
    warnings.simplefilter("ignore")  # torchtitan's own warnings are not under test here
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    out = Path(cfg["out"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizers = default_adamw(lr=0.05, implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(
        optimizers=optimizers, training_steps=cfg["steps"]
    )
    state = TrainState()
    manager_cls = titan.manager_class()
    config = manager_cls.Config(
        enable=True, folder="checkpoint", interval=INTERVAL, keep_latest_k=2,
        async_mode=cfg["async_mode"], last_save_model_only=cfg["last_save_model_only"],
        spec_file=cfg["spec_file"], domain="pfs", socket=cfg["sockets"][rank],
        restore_timeout=30.0,
    )  # fmt: skip
    ckpt = config.build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": state}, sd_adapter=None, base_folder=cfg["dump"],
    )  # fmt: skip
    torchtitan_pick = CheckpointManager._find_load_step(ckpt)  # its own rule, this rank
    ckpt.load(step=-1)
    report = {
        "torchtitan_would_load": torchtitan_pick,
        "restored": ckpt.restored_step,
        "generation": ckpt.generation,
        "step": state.step,
    }
    (out / f"restored-{rank}.json").write_text(json.dumps(report))
    torch.save(model.state_dict(), out / f"loaded-{rank}.pt")
    while state.step < cfg["steps"]:
        state.step += 1
        g = torch.Generator().manual_seed(100 * state.step + rank)
        x = torch.randn(16, 4, generator=g)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        loss.backward()
        for p in model.parameters():  # the data-parallel gradient, as FSDP would sum it
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= WORLD
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        ckpt.save(state.step, last_step=state.step == cfg["steps"])
        if state.step % INTERVAL == 0:
            torch.save(model.state_dict(), out / f"model-{state.step}-{rank}.pt")
    ckpt.close()
    dist.destroy_process_group()


# -- launches -------------------------------------------------------------------------------


def _launch(tmp: Path, name: str, cfg: dict[str, Any]) -> Path:
    """Run one launch to its end, its ranks started as torchrun starts them (the
    environment variables of ``init_process_group``'s env:// rendezvous); return its
    output directory."""
    out = tmp / name
    out.mkdir()
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = []
    for rank in range(WORLD):
        env = {
            **os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(WORLD), "LOCAL_WORLD_SIZE": str(WORLD),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
        }  # fmt: skip
        log = (out / f"rank-{rank}.log").open("wb")
        argv = [sys.executable, __file__, json.dumps({**cfg, "out": str(out)})]
        ranks.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
        log.close()
    try:
        codes = [p.wait(timeout=LAUNCH_TIMEOUT) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = "".join(
        (out / f"rank-{r}.log").read_text(errors="replace")[-3000:] for r in range(WORLD)
    )
    assert codes == [0] * WORLD, logs
    return out


def _metric(cluster: LocalCluster, i: int, name: str) -> float:
    port = cluster.metrics_base_port + i - 1
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.rpartition(" ")[2])
    raise AssertionError(f"{name} not exported by node {i}")


def _restored(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"restored-{r}.json").read_text()) for r in range(WORLD)]


def _assert_same(a: dict[str, Any], b: dict[str, Any], where: str) -> None:
    assert set(a) == set(b), where
    for key, value in a.items():
        assert torch.equal(value, b[key]), f"{where}: {key} differs"


def test_a_relaunch_loads_the_agreed_step_not_torchtitans_highest_with_metadata(
    tmp_path: Path,
) -> None:
    with LocalCluster(WORLD) as cluster:
        cluster.start_all()
        spec = {
            "name": STREAM,
            "members": {cluster.name(r + 1): [r] for r in range(WORLD)},
            "policy": {"mode": "all", "domains": ["pfs"]},
            "shared": ["pfs"],
            "retention": 2,
        }
        spec_file = tmp_path / "spec.json"
        spec_file.write_text(json.dumps(spec))
        dump = tmp_path / "dump"
        cfg = {
            "spec_file": str(spec_file),
            "sockets": [str(cluster.socket_path(r + 1)) for r in range(WORLD)],
            "dump": str(dump),
        }
        first = _launch(tmp_path, "first", {**cfg, "steps": 7, "async_mode": "async",
                                            "last_save_model_only": False})  # fmt: skip
        assert (
            _restored(first)
            == [{"torchtitan_would_load": -1, "restored": None, "generation": 0, "step": 0}] * WORLD
        )
        client = cluster.client(1)
        assert client.wait(STREAM, 7, timeout=20)["restore_point"] == 7
        # The manager timed its saves (2, 4, 6 and 7) and reported them: the figure is
        # the share of the save cycles the loop waited, on every node.
        for i in (1, 2):
            overhead = cluster.client(i).state(STREAM)["overhead"]
            assert overhead is not None and overhead["saves"] == 3, overhead
            assert 0 < overhead["ratio"] < 1, overhead
            ratio = f'convergenced_checkpoint_overhead_ratio{{stream="{STREAM}"}}'
            assert _metric(cluster, i, ratio) == overhead["ratio"]
        folder = dump / "checkpoint"
        # Rank 1's part of step 7 is lost (its disk, or the store, lost the object).
        (folder / "step-7" / "__1_0.distcp").unlink()
        assert (folder / "step-7" / ".metadata").exists()

        second = _launch(tmp_path, "second", {**cfg, "steps": 10, "async_mode": "disabled",
                                              "last_save_model_only": True})  # fmt: skip
        restored = _restored(second)
        # Step 7 could not be restored: an incomplete recovery, counted once by each node
        # whose rank found the step incomplete and retracted its part. Both ranks check
        # the step; one whose daemon already heard the other's retraction when it asked
        # learns that the step is lost and retracts nothing, so one node or both count
        # it, and the max over the nodes counts the generation (the metric's help).
        incomplete = 'convergenced_incomplete_recoveries_total{stream="titan"}'
        counted = [_metric(cluster, i, incomplete) for i in (1, 2)]
        assert max(counted) == 1 and set(counted) <= {0, 1}, counted
        assert [r["torchtitan_would_load"] for r in restored] == [7] * WORLD
        assert [(r["restored"], r["step"]) for r in restored] == [(6, 6)] * WORLD
        assert len({r["generation"] for r in restored}) == 1
        for r in range(WORLD):
            _assert_same(
                torch.load(second / f"loaded-{r}.pt", weights_only=True),
                torch.load(first / f"model-6-{r}.pt", weights_only=True),
                f"rank {r}'s model loaded",
            )
        # The final model-only export of step 10 is written, never committed.
        assert (folder / "step-10" / ".metadata").exists()
        assert client.wait(STREAM, 8, timeout=20)["restore_point"] == 8
        newest = client.state(STREAM)["newest"]
        assert newest == {cluster.name(r + 1): {"pfs": 8} for r in range(WORLD)}
        assert titan.resumable(folder / "step-8") and not titan.resumable(folder / "step-10")


def test_importing_the_module_does_not_import_torchtitan() -> None:
    code = (
        "import sys, convergenced.integrations.torchtitan as t; "
        "assert t.step_of('/x/step-12') == 12 and t.step_of('/x/step-12.tmp') is None; "
        "print(any(m.startswith('torchtitan') for m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_an_enabled_config_names_its_stream_and_domain() -> None:
    cls = titan.manager_class()
    with pytest.raises(ValueError, match="spec_file"):
        cls.Config(enable=True, domain="pfs")
    with pytest.raises(ValueError, match="spec_file"):
        cls.Config(enable=True, domain="pfs", spec_file="a.json", stream="job")
    with pytest.raises(ValueError, match="domain"):
        cls.Config(enable=True, stream="job")
    assert not cls.Config().enable  # disabled, as torchtitan's default: nothing needed


def test_a_spec_file_is_read_as_declare_reads_it(tmp_path: Path) -> None:
    spec = {"name": "job", "members": {"node-1": [0, 1]}, "policy": {"mode": "any",
            "domains": ["pfs"]}}  # fmt: skip
    (tmp_path / "s.json").write_text(json.dumps({"spec": spec}))
    (tmp_path / "s.toml").write_text(
        'name = "job"\n[members]\nnode-1 = [0, 1]\n[policy]\nmode = "any"\ndomains = ["pfs"]\n'
    )
    assert titan.load_spec(tmp_path / "s.json") == titan.load_spec(tmp_path / "s.toml")
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(ValueError, match="expected a map"):
        titan.load_spec(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="spec_file"):
        titan.load_spec(tmp_path / "missing.json")


if __name__ == "__main__":  # pragma: no cover - a rank of a launch
    rank_main(json.loads(sys.argv[1]))
