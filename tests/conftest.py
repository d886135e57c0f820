"""Fixtures shared by several test modules."""

from __future__ import annotations

from pathlib import Path

import pytest

# The real S3 API server's fixtures (s3_server, s3_bucket), for any test to request.
from s3server import s3_bucket, s3_server  # noqa: F401


@pytest.fixture(scope="session")
def torch_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory of an uninterrupted run's ``final-<rank>.pt`` of the gloo job of
    `test_integration_torch`, without any checkpointing: run once per session, for
    every test that compares a run's end state to it (bit for bit)."""
    import test_integration_torch as tj  # torch only for the tests that ask

    tmp = tmp_path_factory.mktemp("torch-reference")
    out = tmp / "reference"
    out.mkdir()
    per_rank = [{"socket": "", "local": ""} for _ in range(tj.WORLD)]
    ref = tj.Launch(tmp, "reference", {"out": str(out), "checkpoint": False, "per_rank": per_rank})
    assert ref.wait() == [0] * tj.WORLD, ref.output()
    return out
