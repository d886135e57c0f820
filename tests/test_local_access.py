"""Who may use the local socket: file modes, and the kernel's word on who connected.

Why: the local API changes what the whole cluster believes (a commit moves every
member's restore point), so the security issue asks for two gates: the socket is mode
0660 in a 0750 directory, and every connection is checked against its ``SO_PEERCRED``
credentials (root, the daemon's user, ``[local] allowed_uids`` and members of
``allowed_gids`` are served; anyone else gets one ``not_allowed`` error and is closed).

What is tested:

- `peercred.allowed` on every branch, and the credential readers (``SO_PEERCRED``,
  ``SO_PEERGROUPS``, the ``/proc/<pid>/status`` fallback, a process that is gone);
- `open_unix_listener`: the directory it creates is 0750 whatever the umask, an
  existing one keeps its mode, one anyone may write without the sticky bit is refused,
  and nothing that is not a stale socket is ever removed;
- for real, with clients that are other users: the tests run as root and start child
  processes that drop to other uids and groups (``setgroups``/``setgid``/``setuid``)
  before connecting, first to an in-process `LocalApiServer`, then to a real
  ``convergenced run`` daemon configured with ``[local] allowed_uids/allowed_gids``.
  A refused client gets the exact error reply, the client library reports the reason
  (not a connection reset), and the daemon counts it and keeps serving everyone else.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import trio
from daemons import LocalCluster

from convergenced.client import Client
from convergenced.core.gate import OutputGate
from convergenced.core.node import NodeCore
from convergenced.daemon.config import Limits
from convergenced.daemon.localapi import peercred
from convergenced.daemon.localapi.operations import LocalOperations
from convergenced.daemon.localapi.peercred import PeerCredentials, PeerCredentialsError, allowed
from convergenced.daemon.localapi.server import LocalApiServer
from convergenced.daemon.localapi.unix_socket import open_unix_listener
from convergenced.daemon.telemetry import Telemetry

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.geteuid() != 0,
    reason="needs Linux (SO_PEERCRED) and root (to start clients as other users)",
)

OTHER = 65533
"""A uid (and gid) nobody allows: the refused client."""
NOBODY = 65534
GROUP = 4242
"""A supplementary group some clients hold."""

CHILD = r"""
import json, os, socket, struct, sys
import msgpack
from convergenced.client import ApiError, Client, DaemonUnreachable

mode, path, uid, gid, groups = sys.argv[1:6]
os.setgroups([int(g) for g in groups.split(",") if g])
os.setgid(int(gid))
os.setuid(int(uid))
if mode == "raw":  # connect, send nothing, print every frame until the daemon closes
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    buf, frames = b"", []
    while True:
        try:
            data = s.recv(65536)
        except ConnectionResetError:
            frames.append("reset")
            break
        if not data:
            break
        buf += data
        while len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]:
            n = struct.unpack(">I", buf[:4])[0]
            frames.append(msgpack.unpackb(buf[4 : 4 + n]))
            buf = buf[4 + n :]
    print(json.dumps(frames))
else:  # the client library, as a training script would use it
    try:
        with Client(path, timeout=10) as c:
            print(json.dumps({"ok": c.status()["node"]}))
    except DaemonUnreachable as exc:
        print(json.dumps({"unreachable": str(exc)}))
    except ApiError as exc:
        print(json.dumps({"error": [exc.kind.value, exc.reason, str(exc)]}))
"""


def child_argv(mode: str, path: Path, uid: int, gid: int, groups: tuple[int, ...]) -> list[str]:
    """A python that connects to ``path`` as ``uid``/``gid``/``groups`` (imports first)."""
    return [
        sys.executable,
        "-c",
        CHILD,
        mode,
        str(path),
        str(uid),
        str(gid),
        ",".join(map(str, groups)),
    ]


def run_child(mode: str, path: Path, uid: int, gid: int, groups: tuple[int, ...] = ()) -> Any:
    out = subprocess.run(
        child_argv(mode, path, uid, gid, groups),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return json.loads(out.stdout)


def refusal(uid: int, gid: int) -> dict[str, Any]:
    """The exact error reply a refused client gets."""
    return {
        "id": None,
        "error": {
            "kind": "rejected",
            "reason": "not_allowed",
            "message": f"uid {uid} (gid {gid}) may not use this daemon: add it to [local] "
            "allowed_uids or a group in allowed_gids",
        },
    }


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A short directory under /tmp that other users may traverse (not list)."""
    d = Path(tempfile.mkdtemp(prefix="cvg-acc-", dir="/tmp"))
    os.chmod(d, 0o711)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


# -- the decision ----------------------------------------------------------------------


def creds(uid: int, gid: int, groups: tuple[int, ...] = ()) -> PeerCredentials:
    return PeerCredentials(1234, uid, gid, frozenset(groups))


@pytest.mark.parametrize(
    ("who", "allowed_uids", "allowed_gids", "expected"),
    [
        pytest.param(creds(0, 0), (), (), True, id="root"),
        pytest.param(creds(1000, 1000), (), (), True, id="the-daemons-own-uid"),
        pytest.param(creds(1001, 1001), (1001,), (), True, id="listed-uid"),
        pytest.param(creds(1001, 50), (), (50,), True, id="primary-gid-listed"),
        pytest.param(creds(1001, 1001, (7, 50)), (), (50,), True, id="supplementary-gid-listed"),
        pytest.param(creds(1001, 1001, (7, 8)), (1002,), (50,), False, id="nothing-matches"),
        pytest.param(creds(1001, 1001), (), (), False, id="nothing-configured"),
        pytest.param(creds(1001, 1001, (1000,)), (1000,), (), False, id="groups-are-not-uids"),
        pytest.param(creds(1001, 1000), (1000,), (), False, id="gids-are-not-uids"),
        pytest.param(creds(2**32 - 2, 2**32 - 2), (2**32 - 2,), (), True, id="large-uid"),
    ],
)
def test_allowed_decides_by_uid_then_groups(
    who: PeerCredentials,
    allowed_uids: tuple[int, ...],
    allowed_gids: tuple[int, ...],
    expected: bool,
) -> None:
    assert allowed(who, 1000, allowed_uids, allowed_gids) is expected


def test_refusal_message_names_the_uid_and_the_fix() -> None:
    assert peercred.refusal_message(creds(1234, 99)) == refusal(1234, 99)["error"]["message"]


# -- reading credentials -------------------------------------------------------------


class FakeSock:
    """``getsockopt`` answers from a table; an exception value is raised."""

    def __init__(self, answers: dict[int, bytes | OSError]) -> None:
        self.answers = answers
        self.asked: list[int] = []

    def getsockopt(self, level: int, option: int, buflen: int) -> bytes:
        assert level == socket.SOL_SOCKET
        self.asked.append(option)
        answer = self.answers[option]
        if isinstance(answer, OSError):
            raise answer
        return answer[:buflen]


STATUS_TEXT = "Name:\tpython3\nUid:\t1001\t1001\t1001\t1001\nGroups:\t27 100 4242 \nVmRSS:\t1 kB\n"


def test_read_credentials_of_a_socketpair_names_this_process() -> None:
    a, b = socket.socketpair()
    with a, b:
        assert peercred.read_credentials(a) == PeerCredentials(
            os.getpid(), os.getuid(), os.getgid()
        )


def test_read_credentials_failure_is_a_typed_error() -> None:
    assert peercred.SO_PEERCRED is not None
    with pytest.raises(PeerCredentialsError, match="SO_PEERCRED failed"):
        peercred.read_credentials(FakeSock({peercred.SO_PEERCRED: OSError(95, "not supported")}))
    with pytest.raises(PeerCredentialsError, match="returned 4 bytes"):
        peercred.read_credentials(FakeSock({peercred.SO_PEERCRED: b"\0" * 4}))


def test_status_groups_line_is_parsed() -> None:
    assert peercred.parse_status_groups(STATUS_TEXT) == {27, 100, 4242}
    assert peercred.parse_status_groups("Name:\tx\nGroups:\t\n") == frozenset()
    assert peercred.parse_status_groups("Name:\tx\n") == frozenset()


def test_proc_groups_tolerates_a_process_that_is_gone(tmp_path: Path) -> None:
    (tmp_path / "321").mkdir()
    (tmp_path / "321" / "status").write_text(STATUS_TEXT)
    assert peercred.proc_groups(321, proc=tmp_path) == {27, 100, 4242}
    assert peercred.proc_groups(322, proc=tmp_path) == frozenset()  # exited
    assert peercred.proc_groups(0, proc=tmp_path) == frozenset()  # in another pid namespace


def test_read_groups_prefers_so_peergroups_and_falls_back_to_proc(tmp_path: Path) -> None:
    assert peercred.SO_PEERGROUPS is not None
    (tmp_path / "321").mkdir()
    (tmp_path / "321" / "status").write_text(STATUS_TEXT)
    packed = struct.pack("3I", 5, 6, 7)
    kernel = FakeSock({peercred.SO_PEERGROUPS: packed})
    assert peercred.read_groups(kernel, 321, proc=tmp_path) == {5, 6, 7}
    for answer in (OSError(34, "ERANGE: more groups than the buffer"), b"\1\2\3"):
        old_kernel = FakeSock({peercred.SO_PEERGROUPS: answer})
        assert peercred.read_groups(old_kernel, 321, proc=tmp_path) == {27, 100, 4242}


def test_groups_are_read_only_when_the_uid_does_not_decide() -> None:
    assert peercred.SO_PEERCRED is not None and peercred.SO_PEERGROUPS is not None
    ucred = struct.pack("=iII", 42, 1001, 1001)
    groups = struct.pack("I", 50)

    def sock() -> FakeSock:
        return FakeSock({peercred.SO_PEERCRED: ucred, peercred.SO_PEERGROUPS: groups})

    s = sock()
    assert peercred.check(s, 1000, (1001,), (50,)) == (PeerCredentials(42, 1001, 1001), True)
    assert s.asked == [peercred.SO_PEERCRED]
    s = sock()
    assert peercred.check(s, 1000, (), ())[1] is False
    assert s.asked == [peercred.SO_PEERCRED]  # no group could help
    s = sock()
    assert peercred.check(s, 1000, (), (50,)) == (
        PeerCredentials(42, 1001, 1001, frozenset({50})),
        True,
    )
    assert s.asked == [peercred.SO_PEERCRED, peercred.SO_PEERGROUPS]


# -- the socket and its directory -----------------------------------------------------


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


async def test_missing_socket_directory_is_created_0750_whatever_the_umask(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run" / "convergenced" / "api.sock"
    old = os.umask(0o077)
    try:
        listener = await open_unix_listener(path)
    finally:
        os.umask(old)
    async with listener:
        assert mode(path.parent) == 0o750
        assert mode(path) == 0o660
        assert stat.S_ISSOCK(os.stat(path).st_mode)


@pytest.mark.parametrize("existing", [0o755, 0o700, 0o1777, 0o1733], ids=oct)
async def test_existing_socket_directory_keeps_its_mode(tmp_path: Path, existing: int) -> None:
    directory = tmp_path / "run"
    directory.mkdir()
    os.chmod(directory, existing)
    async with await open_unix_listener(directory / "api.sock"):
        assert mode(directory) == existing
        assert mode(directory / "api.sock") == 0o660


@pytest.mark.parametrize("unsafe", [0o777, 0o773, 0o702], ids=oct)
async def test_directory_anyone_may_write_without_sticky_bit_is_refused(
    tmp_path: Path, unsafe: int
) -> None:
    directory = tmp_path / "run"
    directory.mkdir()
    os.chmod(directory, unsafe)
    with pytest.raises(PermissionError, match="anyone could replace the daemon's socket"):
        await open_unix_listener(directory / "api.sock")
    assert not (directory / "api.sock").exists()
    assert mode(directory) == unsafe


async def test_socket_directory_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "run").write_text("not a directory")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        await open_unix_listener(tmp_path / "run" / "api.sock")


async def test_something_that_is_not_a_socket_is_never_removed(tmp_path: Path) -> None:
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    with pytest.raises(FileExistsError, match="not a socket"):
        await open_unix_listener(precious)
    link = tmp_path / "link.sock"
    link.symlink_to(precious)
    with pytest.raises(FileExistsError, match="not a socket"):
        await open_unix_listener(link)
    assert link.is_symlink() and precious.read_text() == "keep me"


async def test_stale_socket_is_replaced_but_a_live_one_is_not(tmp_path: Path) -> None:
    path = tmp_path / "api.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # the file stays: a daemon killed with -9 leaves this
    async with await open_unix_listener(path):
        with pytest.raises(OSError, match="already listening"):
            await open_unix_listener(path)
        assert stat.S_ISSOCK(os.stat(path).st_mode)


# -- real clients of other users, in-process server -----------------------------------


class StubOperations:
    """Just enough of `LocalOperations` for ``status``."""

    def status(self) -> dict[str, Any]:
        return {"node": "stub"}


async def serve_and_run(
    open_dir: Path,
    children: list[list[str]],
    *,
    allowed_uids: tuple[int, ...] = (),
    allowed_gids: tuple[int, ...] = (),
) -> tuple[list[Any], list[str]]:
    """Run ``children`` one by one against a `LocalApiServer`; their outputs and the
    reasons the server counted."""
    path = open_dir / "run" / "api.sock"
    listener = await open_unix_listener(path)
    os.chmod(path.parent, 0o755)  # let the other users reach the socket: the test is
    os.chmod(path, 0o666)  # about the credential check, not the file modes
    gate = OutputGate(NodeCore("stub", 1))
    telemetry = Telemetry()

    async def durable(position: int) -> None:
        gate.synced(gate.take_unlogged()[1])

    server = LocalApiServer(
        cast(LocalOperations, StubOperations()),
        gate,
        durable,
        Limits(),
        telemetry,
        allowed_uids=allowed_uids,
        allowed_gids=allowed_gids,
    )
    outputs: list[Any] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, server.handle, [listener])
        with trio.fail_after(60):
            for argv in children:
                done = await trio.run_process(
                    [a.replace("{path}", str(path)) for a in argv], capture_stdout=True
                )
                outputs.append(json.loads(done.stdout))
        nursery.cancel_scope.cancel()
    errors = telemetry.counters()
    reasons = [k.removeprefix("api_errors_") for k in errors for _ in range(errors[k])]
    return outputs, reasons


async def test_refused_client_gets_one_not_allowed_reply_and_is_counted(open_dir: Path) -> None:
    raw = child_argv("raw", Path("{path}"), OTHER, OTHER, ())
    outputs, reasons = await serve_and_run(open_dir, [raw], allowed_uids=(NOBODY,))
    assert outputs == [[refusal(OTHER, OTHER)]]  # then a clean end of stream, no reset
    assert reasons == ["not_allowed"]


async def test_client_library_reports_why_it_was_refused(open_dir: Path) -> None:
    # A few times: the refusal races the client's first request, and the reason must
    # win every time (not "connection reset" or "broken pipe").
    lib = child_argv("client", Path("{path}"), OTHER, OTHER, (GROUP + 1,))
    outputs, reasons = await serve_and_run(open_dir, [lib] * 4, allowed_gids=(GROUP,))
    for out in outputs:
        assert "unreachable" in out, out
        assert "uid 65533 (gid 65533) may not use this daemon" in out["unreachable"]
    assert reasons == ["not_allowed"] * 4


Ids = tuple[int, ...]


@pytest.mark.parametrize(
    "case",
    [
        pytest.param((0, 0, (), (), ()), id="root"),
        pytest.param((NOBODY, NOBODY, (), (NOBODY,), ()), id="listed-uid"),
        pytest.param((OTHER, GROUP, (), (), (GROUP,)), id="primary-group"),
        pytest.param((OTHER, OTHER, (7, GROUP), (), (GROUP,)), id="supplementary-group"),
    ],
)
async def test_allowed_clients_are_served(
    open_dir: Path, case: tuple[int, int, Ids, Ids, Ids]
) -> None:
    uid, gid, groups, allowed_uids, allowed_gids = case
    lib = child_argv("client", Path("{path}"), uid, gid, groups)
    outputs, reasons = await serve_and_run(
        open_dir, [lib], allowed_uids=allowed_uids, allowed_gids=allowed_gids
    )
    assert outputs == [{"ok": "stub"}]
    assert reasons == []


# -- a real daemon -------------------------------------------------------------------------


def test_daemon_serves_only_the_configured_uids_and_groups() -> None:
    with LocalCluster(1) as cluster:
        with cluster.configs[0].open("a") as f:
            f.write(f"\n[local]\nallowed_uids = [{NOBODY}]\nallowed_gids = [{GROUP}]\n")
        cluster.start_all()
        path = cluster.socket_path(1)
        os.chmod(cluster.dir, 0o711)
        os.chmod(path.parent, 0o755)
        os.chmod(path, 0o666)
        with Client(path) as root:
            before = root.status()["counters"]
            assert run_child("raw", path, OTHER, OTHER) == [refusal(OTHER, OTHER)]
            lib = run_child("client", path, OTHER, OTHER, (GROUP + 1,))
            assert "may not use this daemon" in lib["unreachable"]
            assert run_child("client", path, NOBODY, NOBODY) == {"ok": "node-1"}
            assert run_child("client", path, OTHER, OTHER, (GROUP,)) == {"ok": "node-1"}
            after = root.status()["counters"]  # the daemon kept serving root throughout
        assert after.get("api_errors_not_allowed", 0) - before.get("api_errors_not_allowed", 0) == 2
        assert "local client refused" in cluster.log(1)
