"""A real S3 API server for the tests: moto's S3 service in server mode, as a process.

The server is moto (``moto[s3]`` with flask, in the ``dev`` extra) serving the S3 REST
API over HTTP on a free loopback port: real requests, SigV4-signed by the client,
multipart uploads, ETags and listings as S3 answers them. It keeps its objects in
memory, so each test gets a bucket of its own (`s3_bucket`). It is started once per
session from this file (``python tests/s3server.py --serve``): the process binds port
0 itself and prints the port it got, so no port is ever guessed.

Its fixtures are registered in ``tests/conftest.py``, so any test can ask for them::

    from s3server import S3Bucket

    def test_something(s3_bucket: S3Bucket) -> None:
        url = s3_bucket.url + "/ckpt"  # s3://<bucket>/ckpt
        ...  # any AWS SDK in this process or its children finds the endpoint and keys

`s3_bucket` points the standard AWS configuration at the server for the test: a
temporary shared credentials file (``AWS_SHARED_CREDENTIALS_FILE``) and config file
(``AWS_CONFIG_FILE``, with the region), ``AWS_ENDPOINT_URL``, and no other credential
source (the AWS key variables, ``AWS_PROFILE`` and the instance metadata service are
cleared or disabled), so a client that works here reads its configuration the way it
would on AWS, and nothing reaches any other host.

**Faults.** The server answers ``POST /_faults`` (bucket names never start with ``_``)
with rules that make matching requests fail with an S3 error, before moto sees them:
`S3Server.fail` adds one, `S3Server.faults` reads them back with how many requests
each failed (a test can check its fault really happened), `S3Server.clear_faults`
drops them. `s3_bucket` clears them before and after each test.

Without moto the fixtures skip, except under ``CI=true``, where that is a failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

IN_CI = os.environ.get("CI") == "true"
REGION = "us-east-1"
ACCESS_KEY = "AKIACONVERGENCEDTEST"
SECRET_KEY = "convergenced/test/secret/" + "s" * 15
"""Moto accepts any keys; these are distinctive, so a test can look for them in logs."""

# Every variable through which the AWS SDKs find credentials, a profile or an endpoint:
# cleared for a test, so only the files this fixture writes configure the client.
AWS_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)

_FAULTS_PATH = "/_faults"


# -- the server process -------------------------------------------------------------


class _Faults:
    """WSGI middleware: fail the requests that match a rule, count how many each failed."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app
        self.rules: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.released = threading.Event()  # set when the rules are cleared

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        path = environ.get("PATH_INFO", "")
        method = environ.get("REQUEST_METHOD", "")
        if path == _FAULTS_PATH:
            return self._control(method, environ, start_response)
        query = environ.get("QUERY_STRING", "")
        with self.lock:
            rule = next((r for r in self.rules if self._matches(r, method, path, query)), None)
            if rule is not None and rule["passed"] < rule["after"]:
                rule["passed"] += 1
                rule = None
            if rule is not None:
                rule["hits"] += 1
            released = self.released
        if rule is None:
            return self.app(environ, start_response)
        if rule["hold"]:  # a request that hangs, until the test clears the rules
            released.wait(rule["hold"])
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{0}</Code>'
            "<Message>injected by the test: {0}</Message><RequestId>fault</RequestId></Error>"
        ).format(rule["code"])
        start_response(
            f"{rule['status']} Injected",
            [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))],
        )
        return [body.encode()]

    @staticmethod
    def _matches(rule: dict[str, Any], method: str, path: str, query: str) -> bool:
        if rule["times"] is not None and rule["hits"] >= rule["times"]:
            return False
        if rule["method"] not in (None, method):
            return False
        if rule["path"] is not None and rule["path"] not in path:
            return False
        params = {p.split("=", 1)[0] for p in query.split("&") if p}
        return rule["query"] is None or rule["query"] in params

    def _control(
        self, method: str, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> list[bytes]:
        with self.lock:
            if method == "POST":
                size = int(environ.get("CONTENT_LENGTH") or 0)
                rule = json.loads(environ["wsgi.input"].read(size))
                self.rules.append({**rule, "hits": 0, "passed": 0})
            elif method == "DELETE":
                self.rules.clear()
                self.released.set()
                self.released = threading.Event()
            body = json.dumps(self.rules).encode()
        start_response("200 OK", [("Content-Type", "application/json")])
        return [body]


def _serve() -> None:
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    app = _Faults(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
    print(f"port {server.server_port}", flush=True)
    server.serve_forever()


# -- the fixtures -------------------------------------------------------------------


@dataclass
class S3Server:
    """A running S3 API server: its endpoint, keys and region, and its fault rules."""

    endpoint: str
    """``http://127.0.0.1:<port>``."""
    region: str
    access_key: str
    secret_key: str
    config_dir: Path
    """Holds ``credentials`` and ``config``, the AWS files `s3_bucket` points to."""
    process: subprocess.Popen[str]

    @property
    def credentials_file(self) -> Path:
        return self.config_dir / "credentials"

    @property
    def config_file(self) -> Path:
        return self.config_dir / "config"

    def environment(self) -> dict[str, str]:
        """The AWS variables that point a client at this server (through the files)."""
        return {
            "AWS_SHARED_CREDENTIALS_FILE": str(self.credentials_file),
            "AWS_CONFIG_FILE": str(self.config_file),
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_EC2_METADATA_DISABLED": "true",  # never ask 169.254.169.254
        }

    def client(self) -> Any:
        """A botocore S3 client of this server, for a test to look at the bucket."""
        import botocore.session

        session = botocore.session.get_session()
        return session.create_client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
        )

    def _faults(self, method: str, rule: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        data = json.dumps(rule).encode() if rule is not None else None
        request = urllib.request.Request(self.endpoint + _FAULTS_PATH, data, method=method)
        with urllib.request.urlopen(request, timeout=10) as answer:
            rules: list[dict[str, Any]] = json.loads(answer.read())
            return rules

    def fail(
        self,
        method: str | None = None,
        *,
        path: str | None = None,
        query: str | None = None,
        status: int = 500,
        code: str = "InternalError",
        times: int | None = None,
        after: int = 0,
        hold: float = 0,
    ) -> None:
        """Fail requests with ``method`` (None: any) whose path contains ``path`` and
        whose query has the parameter ``query`` (``uploadId``, ``partNumber``...),
        answering ``status`` and the S3 error ``code``: ``times`` of them (None: all,
        retries included) after letting the first ``after`` through. With ``hold``,
        each such request hangs first, up to ``hold`` seconds or until
        `clear_faults` (a process can be killed in the middle of it)."""
        rule = {
            "method": method,
            "path": path,
            "query": query,
            "status": status,
            "code": code,
            "times": times,
            "after": after,
            "hold": hold,
        }
        self._faults("POST", rule)

    def faults(self) -> list[dict[str, Any]]:
        """The rules in force, each with ``hits``: how many requests it failed (or
        holds)."""
        return self._faults("GET")

    def clear_faults(self) -> None:
        """Drop every rule, and release the requests they hold."""
        self._faults("DELETE")


@dataclass
class S3Bucket:
    """A fresh bucket on the server, for one test."""

    name: str
    server: S3Server
    client: Any
    """A botocore S3 client of the server (`S3Server.client`)."""

    @property
    def url(self) -> str:
        """``s3://<name>``."""
        return f"s3://{self.name}"

    def keys(self, prefix: str = "") -> list[str]:
        """Every key in the bucket under ``prefix``, sorted."""
        found: list[str] = []
        pages = self.client.get_paginator("list_objects_v2")
        for page in pages.paginate(Bucket=self.name, Prefix=prefix):
            found.extend(item["Key"] for item in page.get("Contents", []))
        return sorted(found)

    def uploads(self) -> list[dict[str, Any]]:
        """The multipart uploads started and neither completed nor aborted."""
        answer = self.client.list_multipart_uploads(Bucket=self.name)
        uploads: list[dict[str, Any]] = answer.get("Uploads", [])
        return uploads


def _missing(reason: str) -> None:
    if IN_CI:
        pytest.fail(reason + ", required under CI (make install puts it in .venv)")
    pytest.skip(reason)


def require_s3fs() -> Any:
    """The s3fs module (the ``s3`` extra): a skip without it, a failure under CI."""
    try:
        import s3fs
    except ImportError:
        _missing("s3fs is not installed (pip install -e '.[s3]')")
    return s3fs


def _start(config_dir: Path) -> S3Server:
    try:
        import moto  # noqa: F401
        import werkzeug  # noqa: F401
    except ImportError as exc:
        _missing(f"the S3 test server is not installed ({exc.name}; pip install -e '.[dev]')")
    process = subprocess.Popen(
        [sys.executable, __file__, "--serve"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={k: v for k, v in os.environ.items() if k not in AWS_VARIABLES},
    )
    assert process.stdout is not None
    line = process.stdout.readline()  # the server prints its port once it listens
    if not line.startswith("port "):
        process.kill()
        process.wait()
        process.stdout.close()
        raise RuntimeError(f"the S3 test server did not start (exit {process.poll()})")
    endpoint = f"http://127.0.0.1:{int(line.split()[1])}"
    (config_dir / "credentials").write_text(
        f"[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n"
    )
    # One attempt per request: a test's injected fault fails at once instead of after
    # the SDK's backoff (retries are the AWS configuration's, max_attempts, as here).
    (config_dir / "config").write_text(
        f"[default]\nregion = {REGION}\nretry_mode = standard\nmax_attempts = 1\n"
    )
    return S3Server(endpoint, REGION, ACCESS_KEY, SECRET_KEY, config_dir, process)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """The session's S3 API server (started on first use)."""
    server = _start(tmp_path_factory.mktemp("aws"))
    try:
        yield server
    finally:
        server.process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.process.wait(timeout=10)
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()
        assert server.process.stdout is not None
        server.process.stdout.close()


@pytest.fixture
def s3_bucket(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Bucket]:
    """A new bucket, and the AWS environment of this process pointed at the server."""
    for name in AWS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.environment().items():
        monkeypatch.setenv(name, value)
    client = s3_server.client()
    name = f"test-{uuid.uuid4().hex[:20]}"
    client.create_bucket(Bucket=name)
    s3_server.clear_faults()
    try:
        yield S3Bucket(name, s3_server, client)
    finally:
        s3_server.clear_faults()
        client.close()


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
