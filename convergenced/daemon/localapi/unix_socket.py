"""The local socket: where it lives and who may replace it.

The socket is created mode 0660 in a directory the daemon creates mode 0750, and a
socket left by a dead daemon is replaced, but nothing else ever is: a path that is
not a socket, or a socket another daemon still answers on, is refused.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import trio

SOCKET_MODE = 0o660
RUNTIME_DIR_MODE = 0o750
"""Mode of the socket's directory when the daemon creates it."""


def prepare_socket_dir(directory: Path) -> None:
    """Make sure the socket's directory exists and is safe to put the socket in.

    A missing directory is created mode 0750 exactly, whatever the umask (its own
    missing parents get the default mode). An existing one is left as it is: it may
    be ``/tmp``, a systemd ``RuntimeDirectory`` or a volume someone else manages,
    and its mode is theirs to choose. But one that anyone may write to without the
    sticky bit is refused: there anyone could replace the daemon's socket with their
    own and read (and answer) every training process's requests.

    Raises:
        OSError: the path is not a directory, cannot be created, or is unsafe.
    """
    if not directory.exists():
        directory.parent.mkdir(parents=True, exist_ok=True)
        try:
            directory.mkdir(mode=RUNTIME_DIR_MODE)
        except FileExistsError:
            pass  # created meanwhile by someone else: judged below like any existing one
        else:
            os.chmod(directory, RUNTIME_DIR_MODE)
            return
    st = os.stat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{directory}: not a directory (the socket's directory)")
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        raise PermissionError(
            f"{directory}: anyone may write to this directory (mode {mode:04o}, no sticky "
            "bit), so anyone could replace the daemon's socket; put the socket in a "
            "directory only the daemon's user can write (a missing one is created mode "
            "0750), or set the sticky bit (chmod +t)"
        )


async def open_unix_listener(path: Path, *, backlog: int = 128) -> trio.SocketListener:
    """Bind the local socket at ``path`` (mode 0660), replacing a stale one.

    The directory is prepared by `prepare_socket_dir`. Something at ``path`` that is
    not a socket (a file, a symlink) is never removed; a socket nobody answers on is
    the leftover of a dead daemon and is replaced.

    Raises:
        OSError: another daemon is listening there already, or the path is unusable.
    """
    prepare_socket_dir(path.parent)
    try:
        st: os.stat_result | None = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise FileExistsError(f"{path}: exists and is not a socket; refusing to replace it")
        probe = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        try:
            await probe.connect(str(path))
        except OSError:
            path.unlink()  # nobody answers: a leftover of a dead daemon
        else:
            raise OSError(f"{path}: another daemon is already listening on this socket")
        finally:
            probe.close()
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    try:
        old = os.umask(0o777 & ~SOCKET_MODE)
        try:
            await sock.bind(str(path))
        finally:
            os.umask(old)
        os.chmod(path, SOCKET_MODE)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return trio.SocketListener(sock)
