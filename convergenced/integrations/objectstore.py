"""An object-store tier for `convergenced.integrations.files.CheckpointStore`: S3.

`ObjectTier` keeps a domain's shards in an S3 bucket (AWS S3, or any server of its
API: MinIO, Ceph's RADOS Gateway...) through fsspec's S3 filesystem (``s3fs``, the
``s3`` extra; PyTorch DCP's fsspec writer goes through it too)::

    from convergenced.integrations.files import CheckpointStore, Tier
    from convergenced.integrations.objectstore import ObjectTier

    remote = ObjectTier("s3", "s3://my-bucket/checkpoints")  # endpoint: AWS_ENDPOINT_URL
    store = CheckpointStore(client, SPEC, rank, Tier("nvme", "/nvme/ckpt"), remote)

**Configuration.** The bucket and a key prefix come from an ``s3://bucket/prefix``
URL; the endpoint from ``endpoint_url`` or, as for every AWS SDK, from
``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL`` or the config file (AWS's own when none
is set). Credentials, region, retries and addressing style come only from the
standard AWS configuration: the environment (``AWS_ACCESS_KEY_ID``...), the shared
credentials and config files, a profile, a web identity, the container or instance
metadata. The tier never takes credentials as arguments, never holds them and never
logs them: they cannot end up in a log line, a repr or an error message of this
module.

**Layout.** The shard of rank R of epoch E is the object
``<prefix>/<stream>/epoch-<E>/rank-<R>.shard``, the same path as in a directory tier
(`convergenced.integrations.shards`), so a directory tier copied with ``aws s3 sync``
is an object tier.

**Complete or absent.** A shard up to ``part_size`` bytes is one PUT; a larger one a
multipart upload of ``part_size`` parts. S3 makes an object visible under its key only
when the PUT or the multipart upload *completes*, whole and atomically, and a
multipart upload that is never completed never becomes an object at all. So no
temporary name and rename are needed (S3 has no rename: a copy would be a second
upload): a write that fails (an error reply, a process killed mid-upload) leaves the
key as it was. Each PUT and each part carries its Content-MD5, so the server refuses
bytes damaged on the way. A failed multipart upload is aborted at once, and one left
by a process that died is aborted when a store for the same rank opens (`sweep`).
Every shard read is verified against its digest by the store, which retracts a copy
that does not verify and tries the other tier.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from convergenced.integrations.shards import _stream_dir
from convergenced.integrations.store_api import Location

__all__ = ["DEFAULT_PART_SIZE", "MAX_PARTS", "MIN_PART_SIZE", "ObjectTier"]

log = logging.getLogger(__name__)

MIN_PART_SIZE = 5 * 2**20
"""S3's smallest part of a multipart upload (every part but the last): 5 MiB."""
MAX_PART_SIZE = 5 * 2**30
"""S3's largest part, and largest single PUT: 5 GiB."""
MAX_PARTS = 10_000
"""S3's most parts in one upload: a larger shard gets larger parts."""
DEFAULT_PART_SIZE = 64 * 2**20
"""Shards above this are uploaded in parts of this size."""

LIST_PAGE = 1000
"""Keys per listing request (S3's most)."""

_URL = re.compile(r"^s3://([^/]+)(?:/(.*))?$")

# Multipart uploads this process has under way: `sweep` never aborts them (another
# store of this process, a restarted thread, may be writing).
_IN_FLIGHT: set[str] = set()
_IN_FLIGHT_LOCK = threading.Lock()


def _md5(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()


@dataclass
class _Client:
    """The filesystem of one process (fsspec's event loop does not survive a fork)."""

    pid: int = -1
    fs: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True, init=False)
class ObjectTier:
    """One persistence domain kept in an S3 bucket under a prefix (a `StorageTier`)."""

    domain: str
    """The domain name committed to the daemon (``s3``...)."""
    url: str
    """``s3://<bucket>[/<prefix>]``, as given."""
    bucket: str
    prefix: str
    """The key prefix, without a trailing ``/`` (empty: the bucket's root)."""
    endpoint_url: str | None
    """The S3 API's URL; None: the standard AWS configuration's."""
    part_size: int
    """Bytes per part of a multipart upload; shards up to this size are one PUT."""
    _client: _Client = field(repr=False, compare=False)

    def __init__(
        self,
        domain: str,
        url: str,
        *,
        endpoint_url: str | None = None,
        part_size: int = DEFAULT_PART_SIZE,
    ) -> None:
        """A tier ``domain`` in the bucket and prefix of ``url`` (``s3://bucket/prefix``).

        Raises:
            ValueError: ``url`` is not an ``s3://`` URL with a bucket, or ``part_size``
                is outside S3's limits (5 MiB to 5 GiB).
        """
        m = _URL.match(url) if isinstance(url, str) else None
        if m is None:
            raise ValueError(f"object tier {domain!r}: {url!r} is not an s3://bucket/prefix URL")
        if type(part_size) is not int or not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE:
            raise ValueError(
                f"object tier {domain!r}: part_size {part_size!r} is outside S3's limits "
                f"({MIN_PART_SIZE} to {MAX_PART_SIZE} bytes)"
            )
        object.__setattr__(self, "domain", domain)
        object.__setattr__(self, "url", url)
        object.__setattr__(self, "bucket", m.group(1))
        object.__setattr__(self, "prefix", (m.group(2) or "").strip("/"))
        object.__setattr__(self, "endpoint_url", endpoint_url)
        object.__setattr__(self, "part_size", part_size)
        object.__setattr__(self, "_client", _Client())

    # -- the filesystem -----------------------------------------------------------------

    @property
    def filesystem(self) -> Any:
        """This process's ``s3fs.S3FileSystem`` of the tier (created on first use).

        Raises:
            ImportError: s3fs is not installed (``pip install 'convergenced[s3]'``).
        """
        state = self._client
        with state.lock:
            if state.fs is None or state.pid != os.getpid():
                try:
                    import s3fs
                except ImportError as exc:
                    raise ImportError(
                        "an object tier needs s3fs: pip install 'convergenced[s3]'"
                    ) from exc
                # No key or secret: the AWS SDK's own chain finds the credentials.
                # No listing cache: other hosts write the bucket too.
                state.fs = s3fs.S3FileSystem(
                    endpoint_url=self.endpoint_url,
                    skip_instance_cache=True,
                    use_listings_cache=False,
                )
                state.pid = os.getpid()
            return state.fs

    def _call(self, method: str, **kwargs: Any) -> Any:
        return self.filesystem.call_s3(method, Bucket=self.bucket, **kwargs)

    def _root(self, stream: str) -> str:
        """The key prefix of ``stream``'s shards, ending with ``/``."""
        head = f"{self.prefix}/" if self.prefix else ""
        return f"{head}{_stream_dir(stream)}/"

    def key(self, stream: str, epoch: int, rank: int) -> str:
        """The object key of the shard of ``rank`` of ``epoch``."""
        return f"{self._root(stream)}epoch-{epoch}/rank-{rank}.shard"

    def _rank_keys(self, stream: str, rank: int) -> re.Pattern[str]:
        root = re.escape(self._root(stream))
        return re.compile(rf"^{root}epoch-(0|[1-9][0-9]*)/rank-{rank}\.shard$")

    # -- StorageTier --------------------------------------------------------------------

    def locate(self, stream: str, epoch: int, rank: int) -> str:
        """``s3://<bucket>/<key>``."""
        return f"s3://{self.bucket}/{self.key(stream, epoch, rank)}"

    def write(self, stream: str, epoch: int, rank: int, data: bytes) -> None:
        """One PUT, or a multipart upload completed only once every part is stored;
        a failed one is aborted. Complete or absent (see the module docstring).

        Raises:
            OSError: the server refused or could not be reached (the key unchanged).
        """
        key = self.key(stream, epoch, rank)
        if len(data) <= self.part_size:
            self._call("put_object", Key=key, Body=data, ContentMD5=_md5(data))
            log.debug("put s3://%s/%s (%d bytes)", self.bucket, key, len(data))
            return
        part = max(self.part_size, -(-len(data) // MAX_PARTS))
        upload = self._call("create_multipart_upload", Key=key)["UploadId"]
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT.add(upload)
        try:
            parts = []
            for number, offset in enumerate(range(0, len(data), part), start=1):
                chunk = data[offset : offset + part]
                reply = self._call(
                    "upload_part",
                    Key=key,
                    UploadId=upload,
                    PartNumber=number,
                    Body=chunk,
                    ContentMD5=_md5(chunk),
                )
                parts.append({"PartNumber": number, "ETag": reply["ETag"]})
            self._call(
                "complete_multipart_upload",
                Key=key,
                UploadId=upload,
                MultipartUpload={"Parts": parts},
            )
        except BaseException:
            # Nothing of it is visible; aborting frees the parts stored so far. If
            # the abort fails too, `sweep` (or the bucket's lifecycle rule) does it.
            with contextlib.suppress(Exception):
                self._call("abort_multipart_upload", Key=key, UploadId=upload)
            raise
        finally:
            with _IN_FLIGHT_LOCK:
                _IN_FLIGHT.discard(upload)
        log.debug(
            "uploaded s3://%s/%s (%d bytes, %d parts)", self.bucket, key, len(data), len(parts)
        )

    def read(self, stream: str, epoch: int, rank: int) -> bytes:
        """The object's bytes.

        Raises:
            FileNotFoundError: no such object.
            OSError: it could not be read.
        """
        data: bytes = self.filesystem.cat_file(f"{self.bucket}/{self.key(stream, epoch, rank)}")
        return data

    def stamp(self, stream: str, epoch: int, rank: int) -> tuple[int, str] | None:
        """The object's size and ETag (a HEAD request), None if there is none."""
        try:
            head = self._call("head_object", Key=self.key(stream, epoch, rank))
        except FileNotFoundError:
            return None
        return (int(head["ContentLength"]), str(head["ETag"]))

    def epochs(self, stream: str, rank: int) -> list[int]:
        """The epochs with an object of ``rank``'s shard, from a listing of the
        stream's prefix (one request per 1000 shards of every rank)."""
        pattern = self._rank_keys(stream, rank)
        found: list[int] = []
        token: dict[str, str] = {}
        while True:
            page = self._call(
                "list_objects_v2", Prefix=self._root(stream), MaxKeys=LIST_PAGE, **token
            )
            for item in page.get("Contents", []):
                m = pattern.match(item["Key"])
                if m:
                    found.append(int(m.group(1)))
            if not page.get("IsTruncated"):
                return sorted(found)
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def delete(self, stream: str, epoch: int, rank: int) -> None:
        """Delete the object (S3 answers a missing key the same way)."""
        self._call("delete_object", Key=self.key(stream, epoch, rank))

    def sweep(self, stream: str, rank: int) -> list[Location]:
        """Abort the unfinished multipart uploads of ``rank``'s shards that no writer
        of this process has under way: a process that died mid-upload left them (they
        were never objects, but S3 keeps, and bills, their parts until aborted)."""
        pattern = self._rank_keys(stream, rank)
        aborted: list[Location] = []
        markers: dict[str, str] = {}
        while True:
            page = self._call(
                "list_multipart_uploads",
                Prefix=self._root(stream),
                MaxUploads=LIST_PAGE,
                **markers,
            )
            for upload in page.get("Uploads", []):
                key, upload_id = upload["Key"], upload["UploadId"]
                with _IN_FLIGHT_LOCK:
                    ours = upload_id in _IN_FLIGHT
                if ours or not pattern.match(key):
                    continue
                with contextlib.suppress(FileNotFoundError):  # aborted meanwhile
                    self._call("abort_multipart_upload", Key=key, UploadId=upload_id)
                    aborted.append(f"s3://{self.bucket}/{key}")
            if not page.get("IsTruncated"):
                break
            markers = {
                "KeyMarker": page["NextKeyMarker"],
                "UploadIdMarker": page["NextUploadIdMarker"],
            }
        if aborted:
            log.info("aborted %d unfinished upload(s) of rank %d: %s", len(aborted), rank, aborted)
        return aborted
