"""Who may connect to the daemon's unix sockets (``--socket-group``), on a real daemon process:
with a group, ``daemon.sock`` and ``handles.sock`` are mode 0660 and that group's, and a process
of another user outside the group is refused by the kernel; without one they stay 0666, with a
warning that says what to pass.

The refused connection is a real one: a child forked from this (root) process drops to another
user and group before it connects, as a container of another pod would run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.servers import ServerExited
from tests.support.daemons import DaemonProcess

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="changing a child's user and group needs root")

GROUP = 8600  # the chart's default (sidecar.k8s.inject.SOCKET_GID)
STRANGER = (23456, 23456)  # uid, gid of no one in particular
SIDECAR = (23457, GROUP)  # another user, in the socket's group (the injector's runAsGroup)


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    # Not under pytest's tmp_path (0700 from /tmp/pytest-of-root on): the other users must reach
    # the socket, so that its own mode, not a directory's, is what refuses them.
    path = Path(tempfile.mkdtemp(prefix="shardcache-sockets-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def daemon(tmp: Path, sockets: Path, *extra: str) -> Iterator[DaemonProcess]:
    origin = tmp / "origin"
    (origin / "bk").mkdir(parents=True, exist_ok=True)
    args = ["--listen", f"unix://{sockets}/daemon.sock", "--handles", f"unix://{sockets}/handles.sock",
            "--origin", f"file://{origin}", "--cache-dir", str(tmp / "cache"), "--cache-size", "64MiB",
            "--min-free", "0", *extra]
    process = DaemonProcess(args, tmp / "daemon.log")
    with process:
        yield process


def connect_as(path: Path, uid: int, gid: int) -> int:
    """0 if a process of ``uid``:``gid`` (no supplementary groups) connects to ``path`` and gets an
    HTTP answer or a handle-protocol connection; the errno of the refusal otherwise."""
    pid = os.fork()
    if pid == 0:  # the child: only system calls until _exit (the parent has threads)
        code = 99
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(5)
                sock.connect(str(path))
                code = 0
        except OSError as exc:
            code = exc.errno or 98
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def http_get_as_group_member(path: Path) -> bytes:
    """What ``GET /healthz`` over ``path`` answers to the sidecar's user (in the group)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            os.setgroups([])
            os.setgid(SIDECAR[1])
            os.setuid(SIDECAR[0])
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(5)
                sock.connect(str(path))
                sock.sendall(b"GET /healthz HTTP/1.0\r\nHost: x\r\n\r\n")
                os.write(write, sock.recv(64))
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as answer:
        return answer.read()


def test_sockets_belong_to_the_group(tmp_path: Path, socket_dir: Path) -> None:
    with daemon(tmp_path, socket_dir, "--socket-group", str(GROUP)) as process:
        for name in ("daemon.sock", "handles.sock"):
            info = (socket_dir / name).stat()
            assert stat.S_ISSOCK(info.st_mode)
            assert stat.S_IMODE(info.st_mode) == 0o660, f"{name}: {oct(info.st_mode)}"
            assert info.st_gid == GROUP, name
            # Another pod's user, outside the group: the kernel refuses the connection.
            assert connect_as(socket_dir / name, *STRANGER) == 13, name  # EACCES
            # The injected sidecar's user, in the group: served.
            assert connect_as(socket_dir / name, *SIDECAR) == 0, name
        assert http_get_as_group_member(socket_dir / "daemon.sock").startswith(b"HTTP/1.0 200")
        assert "mode 0666" not in process.log.read_text()


def test_without_a_group_the_sockets_stay_open_with_a_warning(tmp_path: Path, socket_dir: Path) -> None:
    with daemon(tmp_path, socket_dir) as process:
        for name in ("daemon.sock", "handles.sock"):
            assert stat.S_IMODE((socket_dir / name).stat().st_mode) == 0o666, name
            assert connect_as(socket_dir / name, *STRANGER) == 0, name
        log = process.log.read_text()
        assert "mode 0666" in log and "--socket-group" in log, log[-2000:]


def test_a_bad_group_is_refused_with_what_to_pass(tmp_path: Path, socket_dir: Path) -> None:
    for index, value in enumerate(("trainers", "-1", "4294967295", "８６００")):
        log = tmp_path / f"bad{index}.log"
        process = DaemonProcess(["--listen", f"unix://{socket_dir}/daemon.sock", "--cache-dir", str(tmp_path / "c"),
                                 "--socket-group", value], log)
        with pytest.raises(ServerExited), process:
            pass
        assert "--socket-group must be a numeric group id" in log.read_text(), value
