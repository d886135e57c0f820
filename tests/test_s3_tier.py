"""The object-store tier (`ObjectTier`) against a real S3 API server (tests/s3server.py):
configuration from the standard AWS environment alone, the layout of a directory
tier, multipart uploads above the part size, writes that fail (an error reply, a
process killed mid-upload) leaving nothing under the final key, and the sweep of
uploads a dead writer left unfinished."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from s3server import ACCESS_KEY, SECRET_KEY, S3Bucket, require_s3fs

from convergenced.integrations import objectstore
from convergenced.integrations.objectstore import MIN_PART_SIZE, ObjectTier
from convergenced.integrations.shards import encode_shard

PART = MIN_PART_SIZE  # the smallest S3 allows
BIG = 2 * PART + 123  # three parts


@pytest.fixture(autouse=True)
def _s3fs() -> None:
    require_s3fs()


def tier(bucket: S3Bucket, prefix: str = "ckpt", **options: object) -> ObjectTier:
    return ObjectTier("s3", f"{bucket.url}/{prefix}", part_size=PART, **options)  # type: ignore[arg-type]


def until(check: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def test_a_shard_round_trips_under_the_directory_tiers_layout(s3_bucket: S3Bucket) -> None:
    t = tier(s3_bucket, "team/ckpt/")
    data = encode_shard("a/job", 3, 7, b"weights")[0]
    assert t.epochs("a/job", 3) == [] and t.stamp("a/job", 7, 3) is None
    t.write("a/job", 7, 3, data)
    t.write("a/job", 12, 3, data)
    t.write("a/job", 7, 4, data)  # another rank's shard of the same epoch
    assert s3_bucket.keys() == [
        "team/ckpt/a%2Fjob/epoch-12/rank-3.shard",
        "team/ckpt/a%2Fjob/epoch-7/rank-3.shard",
        "team/ckpt/a%2Fjob/epoch-7/rank-4.shard",
    ]
    assert t.locate("a/job", 7, 3) == f"{s3_bucket.url}/team/ckpt/a%2Fjob/epoch-7/rank-3.shard"
    assert t.read("a/job", 7, 3) == data
    assert t.epochs("a/job", 3) == [7, 12] and t.epochs("a/job", 4) == [7]
    size, etag = t.stamp("a/job", 7, 3)  # type: ignore[misc]
    assert size == len(data) and etag.startswith('"')
    t.delete("a/job", 7, 3)
    t.delete("a/job", 7, 3)  # deleting what is gone is no error
    assert t.epochs("a/job", 3) == [12]
    with pytest.raises(FileNotFoundError):
        t.read("a/job", 7, 3)


def test_listings_page_through_what_one_answer_cannot_hold(
    s3_bucket: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(objectstore, "LIST_PAGE", 2)  # S3 answers at most 1000 a page
    t = tier(s3_bucket)
    client, name = s3_bucket.client, s3_bucket.name
    for epoch in range(7):
        for rank in (0, 1):
            client.put_object(Bucket=name, Key=t.key("job", epoch, rank), Body=b"x")
        client.create_multipart_upload(Bucket=name, Key=t.key("job", epoch + 10, 0))
    assert t.epochs("job", 0) == list(range(7))
    assert len(t.sweep("job", 0)) == 7 and s3_bucket.uploads() == []


def test_a_shard_above_the_part_size_is_a_multipart_upload(s3_bucket: S3Bucket) -> None:
    t = tier(s3_bucket)
    data = os.urandom(BIG)
    t.write("job", 1, 0, data)
    assert t.read("job", 1, 0) == data
    head = s3_bucket.client.head_object(Bucket=s3_bucket.name, Key=t.key("job", 1, 0))
    assert head["ETag"].endswith('-3"')  # S3's ETag of an object of three parts
    t.write("job", 2, 0, data[:PART])  # exactly one part's worth: one PUT
    head = s3_bucket.client.head_object(Bucket=s3_bucket.name, Key=t.key("job", 2, 0))
    assert "-" not in head["ETag"]
    assert s3_bucket.uploads() == []


@pytest.mark.parametrize(
    ("method", "query", "after"),
    [
        ("PUT", "partNumber", 1),  # the second part refused
        ("POST", "uploadId", 0),  # the completion refused
        ("PUT", None, 0),  # a single PUT refused
    ],
)
def test_a_failed_write_leaves_nothing_under_its_key(
    s3_bucket: S3Bucket, method: str, query: str | None, after: int
) -> None:
    t = tier(s3_bucket)
    t.write("job", 1, 0, b"old")  # an earlier content of the key stays as it was
    s3_bucket.server.fail(method, path=t.key("job", 2, 0), query=query, after=after)
    with pytest.raises(OSError, match="injected"):
        t.write("job", 2, 0, os.urandom(BIG) if query else b"new")
    s3_bucket.server.fail(method, path=t.key("job", 1, 0), query=query, after=after)
    with pytest.raises(OSError, match="injected"):
        t.write("job", 1, 0, os.urandom(BIG) if query else b"new")
    assert [r["hits"] for r in s3_bucket.server.faults()] == [1, 1]
    assert s3_bucket.keys() == [t.key("job", 1, 0)] and t.read("job", 1, 0) == b"old"
    assert s3_bucket.uploads() == []  # the failed multipart upload was aborted


_KILLED_WRITER = """
import os, sys
from convergenced.integrations.objectstore import ObjectTier
tier = ObjectTier("s3", sys.argv[1], part_size=int(sys.argv[2]))
tier.write("job", 5, 0, os.urandom(int(sys.argv[3])))
"""


def test_a_writer_killed_mid_upload_leaves_no_object_and_the_next_store_aborts_it(
    s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    t = tier(s3_bucket)
    s3_bucket.server.fail("PUT", query="partNumber", after=1, hold=60)  # the second part hangs
    writer = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, t.url, str(PART), str(BIG)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        until(lambda: s3_bucket.server.faults()[0]["hits"] == 1)  # part 1 stored, 2 sent
        writer.send_signal(signal.SIGKILL)
        assert writer.wait(10) == -signal.SIGKILL
    finally:
        writer.kill()
        writer.wait()
        assert writer.stderr is not None
        writer.stderr.close()
        s3_bucket.server.clear_faults()  # releases the held request
    assert s3_bucket.keys() == []  # never an object: the upload was not completed
    (left,) = s3_bucket.uploads()
    assert left["Key"] == t.key("job", 5, 0)
    assert tier(s3_bucket).sweep("job", 1) == []  # another rank's store leaves it
    assert tier(s3_bucket).sweep("job", 0) == [t.locate("job", 5, 0)]
    assert s3_bucket.uploads() == []


def test_sweep_leaves_the_uploads_this_process_has_under_way(s3_bucket: S3Bucket) -> None:
    t = tier(s3_bucket)
    s3_bucket.server.fail("POST", query="uploadId", hold=60)  # the completion hangs
    errors: list[BaseException] = []

    def write() -> None:
        try:
            t.write("job", 5, 0, os.urandom(BIG))
        except BaseException as exc:
            errors.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        until(lambda: s3_bucket.server.faults()[0]["hits"] == 1)
        assert tier(s3_bucket).sweep("job", 0) == []  # a writer of this process is at it
        assert len(s3_bucket.uploads()) == 1
    finally:
        s3_bucket.server.clear_faults()
        writer.join(30)
    assert len(errors) == 1 and s3_bucket.keys() == [] and s3_bucket.uploads() == []


def test_bad_configuration_is_refused() -> None:
    for url in ("/mnt/bucket", "s3://", "s3:///key", "gs://bucket/x", "bucket/key"):
        with pytest.raises(ValueError, match="not an s3://bucket/prefix URL"):
            ObjectTier("s3", url)
    for size in (MIN_PART_SIZE - 1, 6 * 2**30, 8.0 * 2**20):
        with pytest.raises(ValueError, match="outside S3's limits"):
            ObjectTier("s3", "s3://bucket", part_size=size)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ObjectTier("s3", "s3://bucket", key=ACCESS_KEY, secret=SECRET_KEY)  # type: ignore[call-arg]


def test_the_endpoint_may_be_given_and_credentials_come_from_the_environment(
    s3_bucket: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint = os.environ.pop("AWS_ENDPOINT_URL")
    monkeypatch.delenv("AWS_SHARED_CREDENTIALS_FILE")  # the variables instead of the file
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    t = tier(s3_bucket, endpoint_url=endpoint)
    t.write("job", 1, 0, b"shard")
    assert t.read("job", 1, 0) == b"shard"


def test_credentials_are_never_logged_nor_shown(
    s3_bucket: S3Bucket, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, the AWS SDK's included
    t = tier(s3_bucket)
    t.write("job", 1, 0, os.urandom(BIG))
    t.epochs("job", 0)
    t.read("job", 1, 0)
    s3_bucket.server.fail("PUT", query="partNumber")
    with pytest.raises(OSError) as failed:
        t.write("job", 2, 0, os.urandom(BIG))
    shown = [repr(t), str(t), str(failed.value), repr(failed.value), caplog.text]
    assert not [text for text in shown if SECRET_KEY in text]
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("convergenced")]
    assert ours and not [m for m in ours if ACCESS_KEY in m]
    assert ACCESS_KEY not in repr(t) + str(failed.value)


def test_without_credentials_the_tier_fails_and_says_so(
    s3_bucket: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_SHARED_CREDENTIALS_FILE")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    with pytest.raises(Exception, match=r"(?i)credentials"):
        tier(s3_bucket).write("job", 1, 0, b"shard")
    assert s3_bucket.keys() == []
