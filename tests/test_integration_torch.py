"""The torch integration against real daemons: a two-rank gloo job on CPU, each rank on
its own node, that crashes mid-save on one rank and resumes from the agreed restore
point bit for bit; a round trip of model, optimizer, scheduler, RNG states and
data-loader position; a corrupt shard falling back to the other tier; mixed-epoch
loads refused; garbage collection; and no torch import unless the module is used."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from daemons import LocalCluster

from convergenced import fsutil
from convergenced.client import Client
from convergenced.integrations import files
from convergenced.integrations.files import (
    CheckpointError,
    MixedEpochError,
    NoRestorePointError,
    Tier,
    encode_shard,
    write_atomic,
)
from convergenced.integrations.torch import FORMAT, TorchCheckpointer, load_states

CI = os.environ.get("CI") == "true"

try:
    with warnings.catch_warnings():
        # Without NumPy (optional here), importing torch warns "Failed to initialize
        # NumPy: No module named 'numpy'" (a UserWarning from its C++ side); torch works
        # without it, and the integration stores NumPy's RNG state only when it exists.
        warnings.filterwarnings(
            "ignore", message="Failed to initialize NumPy", category=UserWarning
        )
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
except ImportError as exc:
    if CI:  # CI installs torch (make install): its absence there is a failure
        raise ImportError(f"CI=true but torch is not importable: {exc}") from exc
    pytest.skip(
        "torch is not installed: pip install torch==2.13.0 (the torch extra)",
        allow_module_level=True,
    )

TESTS = Path(__file__).resolve().parent
STREAM = "torchjob"
# Two ranks: a float sum of two addends is the same whichever comes first, so DDP's
# gradient all_reduce gives the same bits however its buckets are laid out (the
# resumed run's first step uses the initial buckets, the reference's rebuilt ones).
WORLD = 2
STEPS = 12
EVERY = 3
CRASH_RANK = 1
CRASH_AT = 9  # rank 1 dies writing its shard of epoch 9: the agreed restore point is 6
CRASH_EXIT = 17
PHASE_TIMEOUT = 60.0


# -- the training job (runs in the child processes too) ---------------------------------


class Net(torch.nn.Module):
    """Tiny, with dropout so that a wrongly restored torch RNG changes the result."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(4, 8)
        self.drop = torch.nn.Dropout(0.25)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.out(self.drop(torch.tanh(self.hidden(x))))
        return y


def make_job(seed: int = 0) -> tuple[Net, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    return model, optimizer, scheduler


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(42)
    x = torch.randn(64, 4, generator=g)
    y = x @ torch.tensor([[0.5], [-1.0], [2.0], [0.25]]) + 0.01 * torch.randn(64, 1, generator=g)
    return x, y


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    data: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """One step; the batch comes from Python's RNG, the dropout mask from torch's."""
    x, y = data
    idx = random.sample(range(len(x)), 8)
    loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
    optimizer.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    scheduler.step()


def worker(cfg: dict[str, Any]) -> None:
    """One rank of the gloo job: restore if there is a restore point, train, checkpoint."""
    warnings.simplefilter("error")  # as pytest's filterwarnings = error, in the child
    torch.set_num_threads(1)
    rank, out = cfg["rank"], Path(cfg["out"])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{cfg['port']}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=30),
    )
    model, optimizer, scheduler = make_job()
    ddp = DistributedDataParallel(model)
    torch.manual_seed(1000 + rank)  # per-rank dropout and batches
    random.seed(2000 + rank)
    data = dataset()
    start = 0
    ckpt: TorchCheckpointer | None = None
    if cfg["checkpoint"]:
        client = Client(cfg["socket"])
        client.declare(cfg["spec"])  # every rank may: the same spec again is a no-op
        local, remote = Tier("nvme", cfg["local"]), Tier("s3", cfg["remote"])
        ckpt = TorchCheckpointer(client, STREAM, rank, local, remote)
        try:
            epoch, extra = ckpt.restore(
                cfg["generation"], model=ddp, optimizer=optimizer, scheduler=scheduler, timeout=30
            )
            start = extra["step"]
            report = {"epoch": epoch, "extra": extra, "domain": ckpt.restored_from}
        except NoRestorePointError:
            report = {"epoch": None}
        (out / f"restored-{cfg['generation']}-{rank}.json").write_text(json.dumps(report))
        if cfg.get("crash_at") is not None and rank == CRASH_RANK:
            _arm_crash(cfg["crash_at"], Path(cfg["local"]))
    for step in range(start, STEPS):
        train_step(ddp, optimizer, scheduler, data)
        done = step + 1
        if ckpt is not None and done % EVERY == 0:
            extra = {"step": done, "sample_index": done * 8}
            ckpt.save(done, model=ddp, optimizer=optimizer, scheduler=scheduler, extra=extra)
            ckpt.gc()
            if cfg.get("pause_at") == done:  # the test kills the daemons meanwhile
                (out / f"paused-{rank}").touch()
                while not (out / "go").exists():
                    time.sleep(0.01)
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


def _arm_crash(epoch: int, local: Path) -> None:
    """Make this process die halfway through writing its local shard of ``epoch``:
    half a temporary file, no rename, no commit (as a power cut or OOM kill would)."""
    original = fsutil.write_atomic  # what the directory tier writes with

    def torn(path: Path, data: bytes, **options: Any) -> None:
        if local in path.parents and path.parent.name == f"epoch-{epoch}":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.with_name(f".{path.name}.torn.tmp").write_bytes(data[: len(data) // 2])
            os._exit(CRASH_EXIT)
        original(path, data, **options)

    fsutil.write_atomic = torn  # this process is doomed: no need to restore it


def _child_main() -> None:  # pragma: no cover - runs in the child processes
    worker(json.loads(sys.argv[1]))


# -- helpers ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Launch:
    """One launch of the job: WORLD rank processes, as torchrun would start them."""

    def __init__(self, tmp: Path, name: str, base: dict[str, Any]) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        port = _free_port()
        code = (
            "import sys; sys.path.insert(0, sys.argv[2]); "
            "import test_integration_torch as t; t._child_main()"
        )
        for rank in range(WORLD):
            cfg = {**base, "rank": rank, "port": port, **base["per_rank"][rank]}
            del cfg["per_rank"]
            log = tmp / f"{name}-rank-{rank}.log"
            self.logs.append(log)
            with log.open("wb") as fh:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", code, json.dumps(cfg), str(TESTS)],
                        stdout=fh,
                        stderr=subprocess.STDOUT,
                        env={**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"},
                    )
                )

    def output(self) -> str:
        return "\n".join(
            f"--- {log.name} ---\n{log.read_text(errors='replace')[-3000:]}" for log in self.logs
        )

    def wait(self, timeout: float = PHASE_TIMEOUT) -> list[int]:
        """Each rank's exit code. Once one rank failed, the others get a grace period to
        fail on their own (their collective broke), then are killed, as torchrun does."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = [p.poll() for p in self.procs]
            if all(c is not None for c in codes):
                break
            if any(c not in (None, 0) for c in codes):
                deadline = min(deadline, time.monotonic() + 15)
            time.sleep(0.05)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        return [p.wait() for p in self.procs]


def _assert_same(a: Any, b: Any, where: str = "state") -> None:
    """Bitwise equality of nested states: torch.equal on every tensor."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys differ"
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _eventually(check: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


_declare = LocalCluster.declare_solo


def _states(model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": _clone(optimizer.state_dict()),
        "scheduler": _clone(scheduler.state_dict()),
    }


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


# -- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(WORLD) as c:
        c.start_all()
        yield c


@pytest.fixture
def client(cluster: LocalCluster) -> Client:
    return cluster.client(1)


@pytest.fixture
def tiers(tmp_path: Path) -> tuple[Tier, Tier]:
    return Tier("nvme", tmp_path / "nvme"), Tier("s3", tmp_path / "bucket")


# -- the distributed job ------------------------------------------------------------------


def test_gloo_job_crashing_mid_save_resumes_bit_for_bit(
    cluster: LocalCluster, tmp_path: Path, torch_reference: Path
) -> None:
    spec = cluster.spec(STREAM, retention=0, mode="any", domains=["nvme", "s3"])
    remote = tmp_path / "s3"

    def launch(name: str, **cfg: Any) -> Launch:
        out = tmp_path / name
        out.mkdir()
        per_rank = [
            {"socket": str(cluster.socket_path(r + 1)), "local": str(tmp_path / f"nvme-{r}")}
            for r in range(WORLD)
        ]
        base = {"out": str(out), "spec": spec, "remote": str(remote), "per_rank": per_rank}
        return Launch(tmp_path, name, {**base, **cfg})

    # Generation 0: no restore point yet; rank 1 dies writing its shard of epoch 9.
    first = launch("gen0", checkpoint=True, generation=0, crash_at=CRASH_AT)
    codes = first.wait()
    assert codes[CRASH_RANK] == CRASH_EXIT, first.output()
    assert codes[0] != 0, first.output()  # its collective broke (or the launcher killed it)
    for r in range(WORLD):
        restored = json.loads((tmp_path / "gen0" / f"restored-0-{r}.json").read_text())
        assert restored == {"epoch": None}
    torn = tmp_path / f"nvme-{CRASH_RANK}" / STREAM / f"epoch-{CRASH_AT}"
    assert [p.name for p in torn.iterdir()] == [f".rank-{CRASH_RANK}.shard.torn.tmp"]
    assert (tmp_path / "nvme-0" / STREAM / f"epoch-{CRASH_AT}" / "rank-0.shard").exists()
    state = cluster.client(1).state(STREAM)
    assert state["newest"]["node-1"]["nvme"] == CRASH_AT
    assert state["newest"]["node-2"]["nvme"] == CRASH_AT - EVERY

    # Generation 1: every rank restores the agreed epoch 6 (not rank 0's newer 9) and
    # finishes.
    second = launch("gen1", checkpoint=True, generation=1)
    assert second.wait() == [0] * WORLD, second.output()
    for r in range(WORLD):
        restored = json.loads((tmp_path / "gen1" / f"restored-1-{r}.json").read_text())
        want = CRASH_AT - EVERY
        assert restored == {
            "epoch": want,
            "extra": {"step": want, "sample_index": want * 8},
            "domain": "nvme",
        }

    for r in range(WORLD):
        ours = torch.load(tmp_path / "gen1" / f"final-{r}.pt", weights_only=True)
        reference = torch.load(torch_reference / f"final-{r}.pt", weights_only=True)
        _assert_same(ours, reference, f"rank {r}")
    # Garbage collection ran on the save path: epoch 3 is gone everywhere.
    for r in range(WORLD):
        assert not (tmp_path / f"nvme-{r}" / STREAM / "epoch-3").exists()
    _eventually(lambda: cluster.client(1).state(STREAM)["restore_point"] == STEPS)


# -- one process, the checkpointer directly -------------------------------------------------


def test_round_trip_restores_states_rng_and_position(
    client: Client, tiers: tuple[Tier, Tier]
) -> None:
    stream = _declare(client, "roundtrip", "nvme")
    data = dataset()
    model, optimizer, scheduler = make_job()
    random.seed(7)
    with TorchCheckpointer(client, stream, 0, tiers[0]) as ckpt:
        with pytest.raises(NoRestorePointError):
            ckpt.restore(0, model=model, timeout=20)
        for _ in range(5):
            train_step(model, optimizer, scheduler, data)
        shard = ckpt.save(
            5,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            extra={"step": 5, "sample_index": 40, "note": ("resume", 1.5)},
        )
        saved = _states(model, optimizer, scheduler)
        draws = (torch.rand(4), random.random())  # what the RNGs give next after the save
        assert shard.path is not None
        payload = files.read_shard(shard.path).payload
        assert isinstance(payload, dict)
        meta = json.loads(payload["meta"])
        assert meta == {
            "format": FORMAT,
            "stream": stream,
            "rank": 0,
            "epoch": 5,
            "torch": str(torch.__version__),
            "components": ["model", "optimizer", "scheduler"],
        }
        for _ in range(3):  # go on training: everything moves away from epoch 5
            train_step(model, optimizer, scheduler, data)
        torch.manual_seed(99)
        random.seed(99)
        client.wait(stream, 5, timeout=20)
        epoch, extra = ckpt.restore(
            1, model=model, optimizer=optimizer, scheduler=scheduler, timeout=20
        )
        assert ckpt.restored_from == "nvme"
    assert (epoch, extra) == (5, {"step": 5, "sample_index": 40, "note": ("resume", 1.5)})
    _assert_same(_states(model, optimizer, scheduler), saved)
    _assert_same((torch.rand(4), random.random()), draws)


def test_corrupt_local_shard_falls_back_to_the_remote_tier(
    client: Client, tiers: tuple[Tier, Tier]
) -> None:
    stream = _declare(client, "fallback", "nvme", "s3", mode="any")
    local, remote = tiers
    model, optimizer, scheduler = make_job()
    with TorchCheckpointer(client, stream, 0, local, remote) as ckpt:
        ckpt.save(1, model=model, optimizer=optimizer)
        train_step(model, optimizer, scheduler, dataset())
        ckpt.save(2, model=model, optimizer=optimizer, extra={"step": 2})
        saved = _states(model, optimizer, scheduler)
        ckpt.flush(timeout=20)
        client.wait(stream, 2, timeout=20)
        path = ckpt.store.path(local, 2)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF  # a flipped bit inside the torch state
        path.write_bytes(bytes(data))
        fresh, fresh_opt, _ = make_job(seed=5)
        assert ckpt.restore(1, model=fresh, optimizer=fresh_opt, timeout=20) == (2, {"step": 2})
        assert ckpt.restored_from == "s3"
        _assert_same(_states(fresh, fresh_opt, scheduler)["model"], saved["model"])
        _assert_same(_states(fresh, fresh_opt, scheduler)["optimizer"], saved["optimizer"])
        # The corrupt copy was retracted: the daemon no longer counts nvme epoch 2.
        assert client.state(stream)["newest"]["node-1"] == {"nvme": 1, "s3": 2}


def test_mixed_epoch_loads_are_refused(client: Client, tiers: tuple[Tier, Tier]) -> None:
    stream = _declare(client, "mixed", "nvme", ranks=2)
    local = tiers[0]
    model, _, _ = make_job()
    ranks = [TorchCheckpointer(client, stream, r, local) for r in (0, 1)]
    for epoch in (1, 2):
        for ckpt in ranks:
            ckpt.save(epoch, model=model, extra={"step": epoch})
    ranks[0].save(3, model=model, extra={"step": 3})  # rank 1 never saved epoch 3
    # What a "latest" marker per rank would assemble: rank 0 at 3, rank 1 at 2.
    newest = [ranks[0].store.read(3, retract=False), ranks[1].store.read(2, retract=False)]
    with pytest.raises(MixedEpochError, match="rank 0 at epoch 3, rank 1 at epoch 2"):
        load_states(newest)
    client.wait(stream, 2, timeout=20)
    assert ranks[0].restore(1, model=model, timeout=20).epoch == 2  # the agreed one
    states = load_states([c.store.read(2) for c in ranks], epoch=2)
    assert sorted(states) == [0, 1]
    assert all(s["extra"] == {"step": 2} for s in states.values())

    # A shard whose torch state was saved as epoch 1 under an epoch 4 header (copied
    # parts, say) is refused before the model is touched.
    stale = ranks[0].store.read(1).payload
    for r in (0, 1):
        data, digest, size = encode_shard(stream, r, 4, stale)
        write_atomic(ranks[r].store.path(local, 4), data)
        client.commit(stream, r, "nvme", 4, digest=digest, size=size)
    client.wait(stream, 4, timeout=20)
    before = _clone(model.state_dict())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    moved = _clone(model.state_dict())
    with pytest.raises(MixedEpochError, match="saved as stream 'mixed' rank 0 epoch 1"):
        ranks[0].restore(2, model=model, timeout=20)
    _assert_same(model.state_dict(), moved)  # untouched
    assert not torch.equal(moved["out.bias"], before["out.bias"])
    for ckpt in ranks:
        ckpt.close()


def test_restore_refuses_a_component_that_was_not_saved(
    client: Client, tiers: tuple[Tier, Tier]
) -> None:
    stream = _declare(client, "partial", "nvme")
    model, optimizer, _ = make_job()
    with TorchCheckpointer(client, stream, 0, tiers[0]) as ckpt:
        ckpt.save(1, model=model)
        client.wait(stream, 1, timeout=20)
        with pytest.raises(CheckpointError, match="has no optimizer state"):
            ckpt.restore(1, model=model, optimizer=optimizer, timeout=20)


def test_gc_deletes_what_the_daemon_says_is_safe(client: Client, tiers: tuple[Tier, Tier]) -> None:
    stream = _declare(client, "torchgc", "nvme")
    model, _, _ = make_job()
    with TorchCheckpointer(client, stream, 0, tiers[0]) as ckpt:
        for epoch in (1, 2, 3):
            ckpt.save(epoch, model=model)
        client.wait(stream, 3, timeout=20)
        _eventually(lambda: client.state(stream)["safe_to_delete"] == [[1, 2]])
        assert sorted(d.epoch for d in ckpt.gc()) == [1, 2]
        assert ckpt.store.epochs(tiers[0]) == [3]


def test_numpy_rng_state_round_trips(client: Client, tiers: tuple[Tier, Tier]) -> None:
    np = pytest.importorskip("numpy", reason="NumPy is optional; its RNG state is saved if present")
    stream = _declare(client, "numpyrng", "nvme")
    model, _, _ = make_job()
    np.random.seed(3)
    with TorchCheckpointer(client, stream, 0, tiers[0]) as ckpt:
        ckpt.save(1, model=model)
        after = np.random.random(3)
        client.wait(stream, 1, timeout=20)
        ckpt.restore(1, model=model, timeout=20)
    assert (np.random.random(3) == after).all()


def test_importing_the_integrations_does_not_import_torch() -> None:
    code = (
        "import sys, convergenced.integrations, convergenced.integrations.files, "
        "convergenced.integrations.torch; print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False"
