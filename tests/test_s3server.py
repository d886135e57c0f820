"""The S3 test server (`s3server`) is a real S3 API: what the object-store tests rely on.

A client configured only by the standard AWS environment the fixture sets (no keys or
endpoint passed) reaches it; it enforces S3's rules that the tier depends on (a
multipart upload is invisible until completed, parts below 5 MiB refused, an object's
ETag names its part count); and its injected faults really fail requests.
"""

from __future__ import annotations

import pytest
from s3server import S3Bucket, require_s3fs

MIB = 2**20


def _fs() -> object:
    return require_s3fs().S3FileSystem(skip_instance_cache=True, use_listings_cache=False)


def test_a_client_configured_by_the_environment_alone_reaches_the_server(
    s3_bucket: S3Bucket,
) -> None:
    fs = _fs()
    fs.pipe(f"{s3_bucket.name}/a/b", b"hello")  # type: ignore[attr-defined]
    assert fs.cat(f"{s3_bucket.name}/a/b") == b"hello"  # type: ignore[attr-defined]
    assert s3_bucket.keys() == ["a/b"]


def test_a_multipart_upload_is_invisible_until_completed(s3_bucket: S3Bucket) -> None:
    s3, bucket = s3_bucket.client, s3_bucket.name
    upload = s3.create_multipart_upload(Bucket=bucket, Key="big")["UploadId"]
    parts = []
    for number, size in ((1, 5 * MIB), (2, 10)):
        etag = s3.upload_part(
            Bucket=bucket, Key="big", UploadId=upload, PartNumber=number, Body=b"x" * size
        )["ETag"]
        parts.append({"PartNumber": number, "ETag": etag})
    assert s3_bucket.keys() == [] and [u["Key"] for u in s3_bucket.uploads()] == ["big"]
    s3.complete_multipart_upload(
        Bucket=bucket, Key="big", UploadId=upload, MultipartUpload={"Parts": parts}
    )
    assert s3_bucket.keys() == ["big"] and s3_bucket.uploads() == []
    head = s3.head_object(Bucket=bucket, Key="big")
    assert head["ContentLength"] == 5 * MIB + 10 and head["ETag"].endswith('-2"')


def test_parts_below_five_mib_are_refused_as_s3_does(s3_bucket: S3Bucket) -> None:
    s3, bucket = s3_bucket.client, s3_bucket.name
    upload = s3.create_multipart_upload(Bucket=bucket, Key="small")["UploadId"]
    parts = [
        {"PartNumber": n, "ETag": s3.upload_part(
            Bucket=bucket, Key="small", UploadId=upload, PartNumber=n, Body=b"y" * 100
        )["ETag"]}
        for n in (1, 2)
    ]  # fmt: skip
    with pytest.raises(s3.exceptions.ClientError, match="EntityTooSmall"):
        s3.complete_multipart_upload(
            Bucket=bucket, Key="small", UploadId=upload, MultipartUpload={"Parts": parts}
        )
    assert s3_bucket.keys() == []


def test_an_injected_fault_fails_the_matching_requests_and_counts_them(
    s3_bucket: S3Bucket,
) -> None:
    s3, bucket, server = s3_bucket.client, s3_bucket.name, s3_bucket.server
    server.fail("PUT", path="/doomed", status=503, code="SlowDown", times=1)
    with pytest.raises(s3.exceptions.ClientError, match="SlowDown"):
        s3.put_object(Bucket=bucket, Key="doomed", Body=b"1")
    s3.put_object(Bucket=bucket, Key="doomed", Body=b"2")  # only the first one failed
    s3.put_object(Bucket=bucket, Key="other", Body=b"3")
    assert [r["hits"] for r in server.faults()] == [1]
    assert s3.get_object(Bucket=bucket, Key="doomed")["Body"].read() == b"2"
    server.clear_faults()
    assert server.faults() == []
