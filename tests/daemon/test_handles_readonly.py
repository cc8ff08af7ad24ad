"""Descriptors handed to pods cannot be reopened for writing, not even by root
(``serve --handles --cache-dir-read-only``; ``StoreSettings.read_only_view``).

A reopen through ``/proc/self/fd/N`` goes through the mount the file was opened on. The node
daemon runs here in its own mount namespace (``unshare --mount --propagation private``) holding a
read-only bind mount of its cache directory at a second path, as the chart's DaemonSet mounts the
cache volume twice; the test process is the pod: it gets descriptors over the real handle socket
(:mod:`wire.handles`) and, as root, tries to write through them. Then the hole without the flag,
which this test documents, and the views the daemon refuses to start with. Real processes, real
mounts; skipped where mount namespaces are not permitted.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import xxhash

from tests.support.daemons import DaemonProcess
from tests.support.handles import read_all
from tests.support.processes import REPO, spawn, stop
from wire.handles import exchange

BUCKET = "shards"
KEY = "train/shard-000000.tar"
DATA = os.urandom(2 * 1024 * 1024 + 11)
WARNING = "--handles without --cache-dir-read-only"
AS_ROOT = os.geteuid() == 0


def _probe_mount_namespace(tmp: Path) -> str | None:
    """Why a private mount namespace with a read-only bind mount cannot be made here, or None."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "needs unshare and mount (util-linux)"
    source, target = tmp / "probe-source", tmp / "probe-target"
    source.mkdir()
    target.mkdir()
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         'mount --bind "$1" "$2" && mount -o remount,bind,ro "$2"', "sh", str(source), str(target)],
        capture_output=True, text=True, timeout=10,
    )
    if probe.returncode != 0:
        return f"a private mount namespace with a read-only bind mount is not permitted here (needs root or CAP_SYS_ADMIN): {probe.stderr.strip()}"
    return None


@pytest.fixture(scope="module")
def namespaces(tmp_path_factory: pytest.TempPathFactory) -> None:
    reason = _probe_mount_namespace(tmp_path_factory.mktemp("probe"))
    if reason is not None:
        pytest.skip(reason)


def in_namespace(cache: Path, view: Path, command: list[str], *, read_only: bool = True) -> list[str]:
    """``command`` run in a private mount namespace where ``cache`` is bind-mounted at ``view``
    (then remounted read-only unless ``read_only`` is false). The mount dies with the namespace."""
    script = 'mount --bind "$1" "$2" && ' + ('mount -o remount,bind,ro "$2" && ' if read_only else "") + 'shift 2 && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(cache), str(view), *command]


class Daemon(DaemonProcess):
    """A node daemon named ``name`` on the file:// origin in ``tmp``: its cache dir, an HTTP listener
    and a handle socket there; ``launcher`` (:func:`in_namespace`) runs it in a mount namespace."""

    def __init__(self, tmp: Path, name: str, extra: list[str]) -> None:
        self.cache = tmp / f"cache-{name}"
        self.cache.mkdir(exist_ok=True)
        self.handles = tmp / f"run-{name}" / "handles.sock"
        super().__init__(["--origin", f"file://{tmp / 'origin'}", "--cache-dir", str(self.cache), "--cache-size", "64MiB",
                          "--min-free", "0", "--handles", f"unix://{self.handles}", *extra], tmp / f"{name}.log")

    def ask(self) -> tuple[dict[str, object], int]:
        """The descriptor of the shard (a miss first, then hits), as a pod's sidecar asks for it."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(self.handles))
            sock.settimeout(30)
            reply, fd = exchange(sock, {"op": "open", "bucket": BUCKET, "key": KEY})
        assert reply["status"] == 200 and fd is not None, reply
        return reply, fd


@pytest.fixture
def origin(tmp_path: Path) -> Path:
    (tmp_path / "origin" / BUCKET / "train").mkdir(parents=True)
    (tmp_path / "origin" / BUCKET / KEY).write_bytes(DATA)
    return tmp_path


@pytest.fixture
def viewed(namespaces: None, origin: Path) -> Iterator[Daemon]:
    """A node daemon whose descriptors are opened through a read-only view of its cache."""
    view = origin / "cache-view"
    view.mkdir()
    daemon = Daemon(origin, "viewed", ["--cache-dir-read-only", str(view)])
    daemon.launcher = in_namespace(daemon.cache, view, [])
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()


def reopen(fd: int, flags: int) -> int:
    return os.open(f"/proc/self/fd/{fd}", flags)


# -- through the read-only view -------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_a_handed_out_descriptor_cannot_be_reopened_for_writing_even_by_root(viewed: Daemon) -> None:
    for expected in ("miss", "hit"):
        reply, fd = viewed.ask()
        try:
            assert reply["cache"] == expected and reply["xxh3_128"] == xxhash.xxh3_128_hexdigest(DATA)
            # Reads work: pread, mmap, a reopen for reading, the file's identity as the daemon's.
            assert read_all(fd) == DATA
            with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mapped:
                assert mapped[-100:] == DATA[-100:]
            again = reopen(fd, os.O_RDONLY)
            try:
                assert os.pread(again, 64, 0) == DATA[:64]
            finally:
                os.close(again)
            published = next((viewed.cache / "v1" / "data").glob(f"*/{reply_id(viewed)}"))
            assert (os.fstat(fd).st_dev, os.fstat(fd).st_ino) == (published.stat().st_dev, published.stat().st_ino)
            # Writing does not, whoever asks: the reopen goes through the read-only mount. As root
            # (CAP_DAC_OVERRIDE, CAP_FOWNER) the file's 0444 would not have stopped any of these.
            for flags in (os.O_WRONLY, os.O_RDWR, os.O_WRONLY | os.O_TRUNC, os.O_RDONLY | os.O_TRUNC):
                with pytest.raises(OSError) as denied:
                    os.close(reopen(fd, flags))
                assert denied.value.errno == errno.EROFS, flags
            changes: list[tuple[Callable[..., object], tuple[object, ...]]] = [
                (os.fchmod, (0o644,)), (os.fchown, (0, 0)), (os.utime, ((1, 1),))]
            for change, args in changes:
                with pytest.raises(OSError) as denied:
                    change(fd, *args)
                assert denied.value.errno == errno.EROFS, change
        finally:
            os.close(fd)
    assert published.read_bytes() == DATA and published.stat().st_mode & 0o777 == 0o444
    # HTTP (sendfile from the daemon's own, writable mount) is as before.
    with urllib.request.urlopen(f"{viewed.url}/{BUCKET}/{KEY}", timeout=30) as resp:
        assert resp.headers["x-shardcache-cache"] == "hit" and resp.read() == DATA
    log = viewed.log.read_text()
    assert "opened through the read-only view" in log and WARNING not in log


def reply_id(daemon: Daemon) -> str:
    """The entry id of the shard, from the daemon's one meta file."""
    (meta,) = (daemon.cache / "v1" / "meta").glob("*/*.json")
    return str(json.loads(meta.read_bytes())["id"])


# -- without the flag: the hole, documented ------------------------------------------------------


@pytest.mark.timeout(90)
@pytest.mark.skipif(not AS_ROOT, reason="the hole needs a user that may write a 0444 file: root (CAP_DAC_OVERRIDE)")
def test_without_the_view_root_reopens_its_descriptor_for_writing(origin: Path) -> None:
    daemon = Daemon(origin, "plain", []).start()
    try:
        _, reader = daemon.ask()  # another pod's reader, holding the file meanwhile
        _, fd = daemon.ask()
        try:
            writable = reopen(fd, os.O_WRONLY)  # what the read-only view stops
            try:
                os.pwrite(writable, b"\0" * 16, 0)
            finally:
                os.close(writable)
            # The shared bytes changed under the reader that holds them...
            assert os.pread(reader, 16, 0) == b"\0" * 16 != DATA[:16]
        finally:
            os.close(fd)
            os.close(reader)
        # ...until the next open: the moved ctime makes the daemon re-hash, drop and refetch it.
        reply, fd = daemon.ask()
        try:
            assert reply["cache"] == "miss" and read_all(fd) == DATA
        finally:
            os.close(fd)
        # Said once, at start, with what to do.
        log = daemon.log.read_text()
        assert log.count(WARNING) == 1 and "--cache-dir-read-only" in log.split(WARNING, 1)[1].splitlines()[0]
    finally:
        daemon.stop()


# -- views the daemon refuses -------------------------------------------------------------------


def refused_start(argv: list[str], log: Path) -> str:
    proc = spawn(argv, log)
    try:
        proc.wait(timeout=30)
    finally:
        stop(proc)
    text = log.read_text()
    assert proc.returncode == 2, text[-3000:]
    return text


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_a_view_that_is_not_read_only_or_not_the_cache_refuses_to_start(namespaces: None, origin: Path) -> None:
    view = origin / "cache-view"
    view.mkdir()
    # The cache itself, but read-write: a descriptor through it could be reopened for writing.
    rw = Daemon(origin, "rw", ["--cache-dir-read-only", str(view)])
    text = refused_start(in_namespace(rw.cache, view, rw.command(), read_only=False), rw.log)
    assert "shardcache serve: error: --cache-dir-read-only: " in text and "mounted read-write" in text
    assert "mount -o remount,bind,ro" in text and "readOnly: true" in text and "Traceback" not in text
    # Read-only, but another cache directory (a layout of its own: another LOCK, another data).
    other = origin / "other-cache"
    (other / "v1" / "data").mkdir(parents=True)
    (other / "v1" / "LOCK").touch()
    daemon = Daemon(origin, "other", ["--cache-dir-read-only", str(view)])
    text = refused_start(in_namespace(other, view, daemon.command()), daemon.log)
    assert "is another directory than the cache" in text and f"a second time, read-only, at {view}" in text
    # Read-only, but an empty directory: nothing of the cache there.
    empty = origin / "empty"
    empty.mkdir()
    daemon = Daemon(origin, "empty", ["--cache-dir-read-only", str(view)])
    text = refused_start(in_namespace(empty, view, daemon.command()), daemon.log)
    assert "does not show the cache" in text
    # No mount at all: the path alone is not a view either.
    daemon = Daemon(origin, "none", ["--cache-dir-read-only", str(origin / "nowhere")])
    assert "does not show the cache" in refused_start(daemon.command(), daemon.log)


def test_the_flag_is_the_node_daemons(capsys: pytest.CaptureFixture[str]) -> None:
    from sidecar.cli import main

    code = main(["serve", "--mode", "sidecar", "--upstream", "unix:///run/shardcache/daemon.sock",
                 "--cache-dir-read-only", "/var/cache/shardcache-ro"])
    assert code == 2 and "--cache-dir-read-only is the node daemon's" in capsys.readouterr().err


# -- the store's own guard, after start-up ------------------------------------------------------

_GUARD = textwrap.dedent("""
    import os, subprocess, sys
    from pathlib import Path
    from cache import Store, StoreSettings
    from cache import ReadOnlyViewError

    root, view = Path(sys.argv[1]), Path(sys.argv[2])
    def run(*argv):
        subprocess.run(argv, check=True, capture_output=True, timeout=10)
    run("mount", "--bind", str(root), str(view))
    run("mount", "-o", "remount,bind,ro", str(view))
    store = Store(StoreSettings(root=root, read_only_view=view, min_free_ratio=0))
    store.open()
    data = b"x" * 100_000
    writer = store.begin("b", "k", '"e"', len(data))
    writer.write_at(0, data)
    entry = writer.commit()
    results = {}
    fd, _ = store.open_verified(entry, for_others=True)
    results["through the view"] = os.readlink(f"/proc/self/fd/{fd}").startswith(str(view))
    os.close(fd)
    fd, _ = store.open_verified(entry)
    results["the daemon's own"] = os.readlink(f"/proc/self/fd/{fd}").startswith(str(root))
    os.close(fd)
    for change, argv in (("remounted read-write", ("mount", "-o", "remount,bind,rw", str(view))),
                         ("unmounted", ("umount", str(view)))):
        run(*argv)
        try:
            store.open_verified(entry, for_others=True)
            results[change] = "handed out"
        except ReadOnlyViewError as exc:
            results[change] = "refused" if "no longer" in str(exc) else str(exc)
    results["entry kept"] = store.lookup("b", "k") is not None
    store.close()
    print(results)
""")


@pytest.mark.timeout(60)
def test_a_view_remounted_or_unmounted_later_hands_out_nothing(namespaces: None, tmp_path: Path) -> None:
    root, view = tmp_path / "cache", tmp_path / "view"
    root.mkdir()
    view.mkdir()
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", _GUARD, str(root), str(view)],
                          capture_output=True, text=True, timeout=50, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str({"through the view": True, "the daemon's own": True, "remounted read-write": "refused",
                                       "unmounted": "refused", "entry kept": True})
