"""`DcpCheckpointer` in one process (``dcp.save`` without a process group) against a
real daemon: when the commit happens, what it carries, opening again, loading only the
agreed step, GC, bad arguments, and the fsspec writer on a local ``file://`` URL, on
fsspec's in-memory filesystem (the object-store code path) and on a real S3 API
server (`tests/s3server.py`)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemons import LocalCluster

from convergenced.client import ApiError

CI = os.environ.get("CI") == "true"
try:
    import torch
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
except ImportError as exc:  # pragma: no cover - depends on the machine
    if CI:
        raise ImportError(f"CI=true but torch is not importable: {exc}") from exc
    pytest.skip("torch is not installed: pip install torch==2.13.0", allow_module_level=True)

# After the skip: these import torch.
from convergenced.integrations.dcp import (  # noqa: E402
    DcpCheckpointer,
    NoRestorePointError,
    ShardUnavailableError,
)
from convergenced.integrations.dcp_layout import dcp_step_complete  # noqa: E402
from convergenced.integrations.dcp_storage import DcpStorage, files_digest  # noqa: E402

# dcp.save and dcp.load in one process without a process group say so, as a warning.
pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning",
    "ignore:Detected an existing checkpoint:UserWarning",
)

STREAM = "dcpsolo"
SPEC = {
    "name": STREAM,
    "members": {"node-1": [0]},
    "policy": {"mode": "any", "domains": ["fs"]},
    "shared": ["fs"],
    "retention": 1,  # a rollback to the step before the newest may be needed
}


class Recording:
    """A real client that remembers the digest and size of each commit it sends."""

    def __init__(self, client: Recording) -> None:
        self.client = client
        self.commits: dict[int, tuple[str, int]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def commit(self, stream: str, rank: int, domain: str, epoch: int, **kw: Any) -> Any:
        reply = self.client.commit(stream, rank, domain, epoch, **kw)
        self.commits[epoch] = (kw["digest"], kw["size"])
        return reply


@pytest.fixture
def client() -> Iterator[Recording]:
    with LocalCluster(1) as cluster:
        cluster.start_all()
        yield Recording(cluster.client(1))


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((3,), value, dtype=torch.float64), "step": torch.tensor(int(value))}


def test_the_coordinator_commits_only_once_the_metadata_is_written(
    client: Recording, tmp_path: Path
) -> None:
    class FailingFinish(FileSystemWriter):
        def finish(self, metadata: Any, results: Any) -> None:
            raise OSError("disk full writing .metadata")

    ckpt = DcpCheckpointer(client, SPEC, 0, tmp_path, domain="fs")
    inner = FailingFinish(ckpt.checkpoint_id(1))
    with pytest.raises(CheckpointException) as failed:
        ckpt.save(_state(1), 1, storage_writer=inner)
    assert "disk full" in repr(failed.value.failures)
    assert ckpt.committed == []
    assert not dcp_step_complete(tmp_path / "step-1").ok  # data written, no metadata
    assert client.state(STREAM)["restore_point"] is None

    ckpt.save(_state(2), 2)
    assert ckpt.committed == [2]
    step = DcpStorage(ckpt.checkpoint_id(2))
    names = [f.name for f in dcp_step_complete(step.where).rank_files(0)]
    assert names == [".metadata", "__0_0.distcp"]
    digest, size = files_digest(step, names)
    assert client.commits[2] == (digest, size)
    assert size == sum(p.stat().st_size for p in (tmp_path / "step-2").iterdir())
    with pytest.raises(ApiError) as conflict:  # the daemon holds that digest
        client.commit(STREAM, 0, "fs", 2, digest="sha256:" + "0" * 64, size=size)
    assert conflict.value.reason == "digest_conflict"


def test_opening_again_commits_the_complete_steps_and_loads_the_agreed_one(
    client: Recording, tmp_path: Path
) -> None:
    ckpt = DcpCheckpointer(client, SPEC, 0, tmp_path, domain="fs")
    with pytest.raises(NoRestorePointError):
        ckpt.load(_state(0))
    for step in (1, 2, 3):
        ckpt.save(_state(step), step)
    (tmp_path / "step-3" / "__0_0.distcp").unlink()  # damaged after its commit
    os.makedirs(tmp_path / "step-4")  # a save that died before any file
    held = dict(client.commits)
    client.commits.clear()

    again = DcpCheckpointer(client, SPEC, 0, tmp_path, domain="fs")  # a new launch
    assert again.recommitted == [1, 2]  # the same digests: a repeat for the daemon
    assert client.commits == {e: held[e] for e in (1, 2)}
    state = _state(0)
    with pytest.raises(ShardUnavailableError, match=r"__0_0\.distcp: missing"):
        again.load(state)  # the agreed step 3 is no longer whole: retracted
    assert client.state(STREAM)["recoverable"] == [[1, 2]]
    third = DcpCheckpointer(client, SPEC, 0, tmp_path, domain="fs")
    assert third.load(state) == 2
    assert torch.equal(state["w"], _state(2)["w"]) and int(state["step"]) == 2


def test_gc_deletes_only_what_the_daemon_says_is_safe(client: Recording, tmp_path: Path) -> None:
    ckpt = DcpCheckpointer(client, SPEC, 0, tmp_path, domain="fs")
    for step in (1, 2, 3):
        ckpt.save(_state(step), step)
    safe = client.state(STREAM)["safe_to_delete"]
    deleted = ckpt.gc()
    assert [d.epoch for d in deleted] == [e for e in (1, 2, 3) if any(a <= e <= b for a, b in safe)]
    assert deleted and all(d.removed_dir and d.files[0] == ".metadata" for d in deleted)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"step-{e}" for e in (1, 2, 3) if e not in {d.epoch for d in deleted}
    ]
    assert client.state(STREAM)["restore_point"] == 3 and (tmp_path / "step-3").is_dir()


def test_bad_arguments_are_refused(client: Recording, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="step_format"):
        DcpCheckpointer(client, SPEC, 0, tmp_path, domain="fs", step_format="x")
    with pytest.raises(ValueError, match="not in the policy"):
        DcpCheckpointer(client, SPEC, 0, tmp_path, domain="nvme")
    ckpt = DcpCheckpointer(client, SPEC, 0, tmp_path, domain="fs")
    with pytest.raises(ValueError, match="saves to"):
        ckpt.writer(5, FileSystemWriter(tmp_path / "elsewhere"))


def _round_trip(client: Recording, root: str) -> DcpCheckpointer:
    ckpt = DcpCheckpointer(client, SPEC, 0, root, domain="fs")
    for step in (1, 2):
        ckpt.save(_state(step), step)
    assert ckpt.committed == [1, 2]
    assert dcp_step_complete(ckpt.checkpoint_id(2)).ok
    again = DcpCheckpointer(client, SPEC, 0, root, domain="fs")
    assert again.recommitted == [1, 2]
    state = _state(0)
    assert again.load(state) == 2 and int(state["step"]) == 2
    return again


def test_the_fsspec_writer_on_a_file_url(client: Recording, tmp_path: Path) -> None:
    ckpt = _round_trip(client, f"file://{tmp_path}")
    assert type(ckpt.writer(3).inner).__name__ == "FsspecWriter"
    assert (tmp_path / "step-2" / ".metadata").exists()


def test_the_fsspec_writer_on_an_object_store_path(client: Recording) -> None:
    pytest.importorskip("fsspec.implementations.memory")
    root = f"memory://dcp-{uuid.uuid4().hex}"
    ckpt = _round_trip(client, root)
    assert ckpt.steps() == [1, 2]
    # Nothing is safe to delete yet (the launch's generation protects its steps):
    # gc deletes nothing, through the object-store path as through a local one.
    assert client.state(STREAM)["safe_to_delete"] == []
    assert ckpt.gc() == [] and ckpt.steps() == [1, 2]


def test_the_fsspec_writer_on_a_real_s3_api(client: Recording, s3_bucket: Any) -> None:
    pytest.importorskip("s3fs")
    ckpt = _round_trip(client, f"{s3_bucket.url}/run")
    keys = s3_bucket.keys("run/step-2/")
    assert keys == ["run/step-2/.metadata", "run/step-2/__0_0.distcp"]
    assert ckpt.steps() == [1, 2]
