"""`convergenced.integrations.dcp_layout` on what `torch.distributed.checkpoint.save`
really writes: a three-rank gloo job (real processes) saves one step with global
metadata and one with per-rank metadata, once per module; each test copies them and
breaks the copy the way a crash would (a rank's file missing or short, the metadata
torn or absent, a rank's own metadata missing).

This file is also the ranks' program for that save.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import pytest

from convergenced.integrations.dcp_layout import (
    DcpLayoutError,
    dcp_step_complete,
    file_rank,
    read_dcp_metadata,
)

CI = os.environ.get("CI") == "true"

try:
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="Failed to initialize NumPy", category=UserWarning
        )
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
except ImportError as exc:  # pragma: no cover - depends on the machine
    if CI:
        raise ImportError(f"CI=true but torch is not importable: {exc}") from exc
    pytest.skip(
        "torch is not installed: pip install torch==2.13.0 (the torch extra)",
        allow_module_level=True,
    )

WORLD = 3


def _rank_main(rank: int, port: int, out: str) -> None:  # pragma: no cover - in children
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=30),
    )
    state = {"replicated": torch.ones(3), f"shard-{rank}": torch.arange(rank + 2.0)}
    dcp.save(state, checkpoint_id=f"{out}/global")
    dcp.save(state, checkpoint_id=f"{out}/per-rank", use_collectives=False)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dcp-saved")
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(r), str(port), str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(WORLD)
    ]
    outputs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * WORLD, outputs
    return out


@pytest.fixture
def step(saved: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """A copy of the step of the layout the test's parameter names."""
    layout: str = request.param
    dst = tmp_path / layout
    shutil.copytree(saved / layout, dst)
    return dst


both = pytest.mark.parametrize("step", ["global", "per-rank"], indirect=True)
global_only = pytest.mark.parametrize("step", ["global"], indirect=True)
per_rank = pytest.mark.parametrize("step", ["per-rank"], indirect=True)


@both
def test_a_finished_save_is_complete_for_its_world(step: Path) -> None:
    c = dcp_step_complete(step)
    assert c.ok, c.problems
    assert c.problems == []
    assert c.saving_world == WORLD
    assert c.layout == ("global" if step.name == "global" else "per_rank")
    on_disk = {p.name: p.stat().st_size for p in step.iterdir()}
    assert {f.name for f in c.files} == set(on_disk)  # every file is referenced
    assert c.size_bytes == sum(on_disk.values())
    assert all(f.ok and f.present == on_disk[f.name] for f in c.files)
    for r in range(WORLD):
        assert any(f.name.startswith(f"__{r}_") for f in c.rank_files(r))
    assert dcp_step_complete(step, world=WORLD).ok


@global_only
def test_global_metadata_names_every_ranks_files(step: Path) -> None:
    metadata = read_dcp_metadata(step)
    names = {info.relative_path for info in metadata.storage_data.values()}
    assert names == {f"__{r}_0.distcp" for r in range(WORLD)}
    c = dcp_step_complete(step)
    assert [f.name for f in c.rank_files(0)] == [".metadata", "__0_0.distcp"]
    assert not c.world_inferred


@both
def test_a_missing_data_file_makes_it_incomplete(step: Path) -> None:
    (step / "__1_0.distcp").unlink()
    c = dcp_step_complete(step)
    assert not c.ok
    assert "__1_0.distcp: missing" in c.problems


@both
def test_a_short_data_file_makes_it_incomplete(step: Path) -> None:
    path = step / "__2_0.distcp"
    size = path.stat().st_size
    os.truncate(path, size - 1)
    c = dcp_step_complete(step)
    assert not c.ok
    assert c.problems == [f"__2_0.distcp: {size - 1} bytes, the metadata needs {size}"]


@global_only
def test_no_metadata_means_the_save_did_not_finish(step: Path) -> None:
    (step / ".metadata").unlink()  # every rank wrote, the coordinator's finish did not run
    c = dcp_step_complete(step)
    assert not c.ok
    assert c.layout == "none"
    assert "the save did not finish" in c.problems[0]
    with pytest.raises(DcpLayoutError, match=r"no \.metadata and no __0\.metadata"):
        read_dcp_metadata(step)


@global_only
def test_torn_metadata_is_a_problem_not_a_crash(step: Path) -> None:
    path = step / ".metadata"
    path.write_bytes(path.read_bytes()[:40])
    c = dcp_step_complete(step)
    assert not c.ok
    assert any(p.startswith(".metadata: unreadable") for p in c.problems), c.problems
    with pytest.raises(DcpLayoutError, match="unreadable"):
        read_dcp_metadata(step)


@per_rank
def test_per_rank_a_ranks_missing_metadata_is_found(step: Path) -> None:
    # Rank 1 died before its finish: DCP's own check (rank 0's metadata) still passes.
    (step / "__1.metadata").unlink()
    assert (step / "__0.metadata").exists()
    c = dcp_step_complete(step)
    assert not c.ok
    assert c.problems == [
        "no metadata of rank(s) 1 of the saving world of 3 (use_collectives=False: "
        "each rank writes its own)"
    ]


@per_rank
def test_per_rank_the_highest_rank_needs_the_world(step: Path) -> None:
    # Rank 2 died before writing anything: only the saving world's size can tell.
    for name in ("__2.metadata", "__2_0.distcp"):
        (step / name).unlink()
    inferred = dcp_step_complete(step)
    assert inferred.ok and inferred.world_inferred and inferred.saving_world == 2
    told = dcp_step_complete(step, world=WORLD)
    assert not told.ok and not told.world_inferred
    assert told.problems[0].startswith("no metadata of rank(s) 2 of the saving world of 3")


@per_rank
def test_per_rank_a_larger_saving_world_is_not_complete_for_a_smaller_one(step: Path) -> None:
    c = dcp_step_complete(step, world=2)
    assert not c.ok
    assert c.problems == ["files of rank 2 present: saved by a world of at least 3, not 2"]


@per_rank
def test_per_rank_metadata_is_read_for_the_asked_rank(step: Path) -> None:
    for r in range(WORLD):
        names = {i.relative_path for i in read_dcp_metadata(step, rank=r).storage_data.values()}
        assert names == {f"__{r}_0.distcp"}


@both
def test_an_fsspec_url_reads_the_same(step: Path) -> None:
    c = dcp_step_complete(f"file://{step}")
    assert c.ok, c.problems
    assert c.size_bytes == dcp_step_complete(step).size_bytes
    (step / "__0_0.distcp").unlink()
    assert "__0_0.distcp: missing" in dcp_step_complete(f"file://{step}").problems


def test_a_missing_directory_and_a_bad_world(tmp_path: Path) -> None:
    c = dcp_step_complete(tmp_path / "nope")
    assert not c.ok and c.layout == "none" and c.problems == ["no such directory"]
    with pytest.raises(DcpLayoutError, match="no such directory"):
        read_dcp_metadata(tmp_path / "nope")
    with pytest.raises(ValueError, match="world must be positive"):
        dcp_step_complete(tmp_path, world=0)


def test_file_ranks() -> None:
    assert file_rank("__12_3.distcp") == 12
    assert file_rank("__4.metadata") == 4
    assert file_rank(".metadata") == 0
    assert file_rank("notes.txt") is None


if __name__ == "__main__":  # pragma: no cover - the ranks of the fixture's save
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
