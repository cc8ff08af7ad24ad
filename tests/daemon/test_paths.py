"""The path a request names is the object it gets: through the pod sidecar exactly as directly, and
on a ``file://`` origin never anything outside its root, whatever links the tree holds."""

from __future__ import annotations

import http.client
import json
import os
import re
import urllib.parse

import pytest

from tests.support.daemons import make_settings

SECRET = b"host file: do not serve me"


def raw(port: int, method: str, path: str) -> tuple[int, bytes, dict[str, str]]:
    """``method path`` sent byte for byte: http.client neither decodes nor resolves dots."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def s3_code(body: bytes) -> str | None:
    found = re.search(rb"<Code>([^<]*)</Code>", body)
    return found.group(1).decode() if found else None


def listed_keys(body: bytes) -> list[str]:
    return [k.decode() for k in re.findall(rb"<Key>([^<]*)</Key>", body)]


# -- the pod sidecar forwards the path as it was sent ----------------------------------------------


@pytest.fixture
def node_and_sidecar(tmp_path, start_daemon):
    root = tmp_path / "origin"
    (root / "bk" / "pct" / "a").mkdir(parents=True)
    (root / "bk" / "pct" / "a%2Fb").write_bytes(b"the key with a percent in it")
    (root / "bk" / "pct" / "a" / "b").write_bytes(b"the key with a slash in it")
    (root / "other").mkdir()
    (root / "other" / "key").write_bytes(b"another bucket")
    sock = tmp_path / "run" / "daemon.sock"
    node = start_daemon(make_settings(tmp_path / "node-cache", f"file://{root}", extra_listen=(f"unix://{sock}",)))
    sidecar = start_daemon(
        make_settings(tmp_path / "pod-cache", f"file://{root}", mode="sidecar", upstream=f"unix://{sock}")
    )
    return node, sidecar


@pytest.mark.parametrize(
    "path",
    [
        "/bk/%2e%2e/other/key",
        "/bk/pct/%2e%2e/%2e%2e/other/key",
        "/bk/../other/key",
        "/bk/pct/a%252Fb",
        "/bk/pct/a/b",
        "/bk?list-type=2&prefix=pct/a%252F",
        "/bk?list-type=2&prefix=pct%2Fa%2F",
        "/bk/pct/a%2Fb",
    ],
)
def test_sidecar_answers_what_the_node_daemon_answers(node_and_sidecar, path):
    node, sidecar = node_and_sidecar
    direct = raw(node.port, "GET", path)
    through = raw(sidecar.port, "GET", path)
    assert through[2].get("x-shardcache-via") == "upstream", path  # it was forwarded, not served locally
    assert (through[0], s3_code(through[1])) == (direct[0], s3_code(direct[1])), path
    if direct[0] == 200:
        assert through[1] == direct[1], path
    assert b"another bucket" not in through[1]


def test_sidecar_forwards_traversal_to_the_daemons_own_checks(node_and_sidecar):
    _, sidecar = node_and_sidecar
    status, body, headers = raw(sidecar.port, "GET", "/bk/%2e%2e/other/key")
    assert (status, s3_code(body), headers.get("x-shardcache-via")) == (400, "InvalidArgument", "upstream")
    status, body, _ = raw(sidecar.port, "GET", "/bk/pct/a%252Fb")
    assert (status, body) == (200, b"the key with a percent in it")
    status, body, _ = raw(sidecar.port, "GET", "/bk?list-type=2&prefix=pct/a%252F")
    assert status == 200 and listed_keys(body) == ["pct/a%2Fb"]


# -- a file:// origin serves nothing outside its root ----------------------------------------------


def linked_tree(tmp_path):
    """(root, outside): an origin root whose tree links out of it in every way, and within it in two."""
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "secret.txt").write_bytes(SECRET)
    (outside / "sub" / "deep.txt").write_bytes(SECRET)
    root = tmp_path / "origin"
    (root / "bk" / "train").mkdir(parents=True)
    (root / "bk" / "train" / "0.tar").write_bytes(b"shard zero")
    (root / "rootfs").symlink_to("/")  # a bucket that is the host's whole file system
    (root / "elsewhere").symlink_to(outside)  # a bucket outside the root
    (root / "bk" / "linkdir").symlink_to(outside)  # a directory inside a bucket, pointing out
    (root / "bk" / "linkfile").symlink_to(outside / "secret.txt")  # a file pointing out
    (root / "bk" / "train" / "relative").symlink_to("../../../outside/secret.txt")
    (root / "bk" / "loop").symlink_to("loop")
    # links that stay inside the root keep working
    (root / "bk" / "inlink").symlink_to("train/0.tar")
    (root / "alias").symlink_to("bk")
    return root, outside


@pytest.fixture
def linked_root(tmp_path, start_daemon):
    """A daemon on the :func:`linked_tree` origin."""
    root, outside = linked_tree(tmp_path)
    daemon = start_daemon(make_settings(tmp_path / "cache", f"file://{root}"))
    daemon.outside = outside
    return daemon


def escaping_keys(daemon) -> list[str]:
    host_path = str(daemon.outside / "secret.txt").lstrip("/")
    return [
        "/rootfs/" + host_path,
        "/elsewhere/secret.txt",
        "/elsewhere/sub/deep.txt",
        "/bk/linkdir/secret.txt",
        "/bk/linkdir/sub/deep.txt",
        "/bk/linkfile",
        "/bk/train/relative",
        "/alias/linkfile",
    ]


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_nothing_outside_the_root_is_read_or_described(linked_root, method):
    for path in escaping_keys(linked_root):
        status, body, headers = raw(linked_root.port, method, path)
        assert status == 403, (method, path, status, body)
        assert SECRET not in body
        assert "etag" not in headers and "last-modified" not in headers, (method, path)
        if method == "GET":
            assert s3_code(body) == "AccessDenied", path


def test_links_that_stay_inside_the_root_keep_working(linked_root):
    for path in ["/bk/train/0.tar", "/bk/inlink", "/alias/train/0.tar", "/alias/inlink"]:
        assert raw(linked_root.port, "GET", path)[:2] == (200, b"shard zero"), path
        status, _, headers = raw(linked_root.port, "HEAD", path)
        assert status == 200 and headers["content-length"] == "10", path


def test_listings_show_nothing_outside_the_root(linked_root):
    status, body, _ = raw(linked_root.port, "GET", "/bk?list-type=2")
    assert status == 200, body
    assert listed_keys(body) == ["inlink", "train/0.tar"]
    assert re.findall(rb"<Size>(\d+)</Size>", body) == [b"10", b"10"]  # no size of a file outside
    for prefix in ["linkdir/", "linkdir/sub/", "linkfile", "train/relative", "loop/"]:
        status, body, _ = raw(linked_root.port, "GET", "/bk?list-type=2&prefix=" + urllib.parse.quote(prefix))
        assert status == 200 and listed_keys(body) == [], (prefix, body)
    status, body, _ = raw(linked_root.port, "GET", "/bk?list-type=2&delimiter=/")
    assert status == 200 and b"linkdir" not in body and b"linkfile" not in body
    host_dir = str(linked_root.outside).lstrip("/") + "/"
    for path in ["/elsewhere?list-type=2", "/rootfs?list-type=2&prefix=" + urllib.parse.quote(host_dir)]:
        status, body, _ = raw(linked_root.port, "GET", path)
        assert (status, s3_code(body)) == (403, "AccessDenied"), (path, body)
        assert listed_keys(body) == []
    status, body, _ = raw(linked_root.port, "GET", "/alias?list-type=2")
    assert status == 200 and listed_keys(body) == ["inlink", "train/0.tar"]


def cached(daemon, url: str) -> tuple[int, dict]:
    status, body, _ = raw(daemon.port, "GET", "/_shardcache/cached?url=" + urllib.parse.quote(url, safe=""))
    return status, json.loads(body)


def test_cached_shows_nothing_outside_the_root(linked_root):
    status, answer = cached(linked_root, "s3://bk/")
    assert status == 200, answer
    assert (answer["objects"], answer["bytes"]) == (2, 20) and sorted(answer["missing"]) == ["inlink", "train/0.tar"]
    for url in ["s3://bk/linkdir/", "s3://bk/linkfile"]:
        status, answer = cached(linked_root, url)
        assert status == 200 and (answer["objects"], answer["bytes"], answer["missing"]) == (0, 0, []), (url, answer)
    for url in ["s3://elsewhere/", "s3://rootfs/" + str(linked_root.outside).lstrip("/") + "/"]:
        status, answer = cached(linked_root, url)
        assert (status, answer["error"]) == (403, "AccessDenied"), (url, answer)
        assert "secret" not in json.dumps(answer)


@pytest.mark.parametrize(
    "path",
    [
        "/bk/" + "a" * 256,  # one component over NAME_MAX: ENAMETOOLONG
        "/bk/train/" + "b" * 300 + "/0.tar",
        "/bk/train/0.tar/under",  # a key below a file: ENOTDIR
        "/bk/loop",  # a link to itself: ELOOP
        "/bk/loop/under",
        "/bk/train",  # a directory is not an object
        "/bk/nothing-here",
        # A key ending in '/' (an S3 folder marker) or holding '//' is its own key, which no file
        # can have: not the file whose path the file system would make of it.
        "/bk/train/0.tar/",
        "/bk/train/0.tar//",
        "/bk/train//0.tar",
        "/bk/inlink/",
        "/alias/train/0.tar/",
    ],
)
def test_keys_no_file_can_have_are_missing_objects(linked_root, path):
    status, body, _ = raw(linked_root.port, "GET", path)
    assert (status, s3_code(body)) == (404, "NoSuchKey"), (path, body)
    assert raw(linked_root.port, "HEAD", path)[0] == 404, path


def test_listing_prefixes_no_file_can_have_are_empty(linked_root):
    # 'train//' would list train/0.tar as 'train//0.tar', a key no file has (GET answers 404)
    for prefix in ["a" * 256, "a" * 256 + "/", "train/0.tar/", "train/" + "b" * 300 + "/x", "train//", "train//0"]:
        status, body, _ = raw(linked_root.port, "GET", "/bk?list-type=2&prefix=" + prefix)
        assert status == 200 and listed_keys(body) == [], (prefix, body)


def test_sidecar_absolute_form_target_is_not_glued_to_the_upstream(node_and_sidecar):
    """``GET http://host/path`` appended to the upstream base would name another host; the
    sidecar answers it itself, as the node daemon would."""
    node, sidecar = node_and_sidecar
    for target in ["http://shardcache-daemon/bk/%2e%2e/other/key", "http://evil.example/other/key"]:
        direct = raw(node.port, "GET", target)
        through = raw(sidecar.port, "GET", target)
        assert (through[0], s3_code(through[1])) == (direct[0], s3_code(direct[1])), (target, through, direct)
        if direct[0] == 200:
            assert through[1] == direct[1], target


def test_a_link_swapped_in_after_the_check_is_caught_by_the_descriptor(tmp_path):
    """The race the open guards against: the path was checked, then a component became a link
    out of the root. Handing the open an unresolved path is what that race looks like to it."""
    from sidecar.daemon.origins.base import FileOrigin
    from sidecar.errors import AccessDenied

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_bytes(SECRET)
    root = tmp_path / "origin"
    (root / "bk").mkdir(parents=True)
    (root / "bk" / "swapped").symlink_to(outside)
    (root / "bk" / "ok.txt").write_bytes(b"fine")
    origin = FileOrigin(root.resolve())
    with pytest.raises(AccessDenied):
        origin._open_real(str(root.resolve() / "bk" / "swapped" / "secret.txt"), "bk/swapped/secret.txt")
    fd, st = origin._open_real(str(root.resolve() / "bk" / "ok.txt"), "bk/ok.txt")
    try:
        assert st.st_size == 4 and os.pread(fd, 10, 0) == b"fine"
    finally:
        os.close(fd)


@pytest.mark.parametrize("prefix", ["../", "..%2F", "..%2F..%2F", "train%2F..%2F..%2F..%2Foutside%2F", "%2Fetc%2F", ".", "train/./"])
def test_hostile_listing_prefixes_are_refused(linked_root, prefix):
    for query in ["list-type=2&", ""]:  # ListObjectsV2 and v1
        status, body, _ = raw(linked_root.port, "GET", f"/bk?{query}prefix={prefix}")
        assert (status, s3_code(body)) == (400, "InvalidArgument"), (prefix, body)
        assert listed_keys(body) == [] and SECRET not in body


def test_the_file_origin_touches_nothing_outside_its_root(tmp_path, monkeypatch):
    """Containment is decided from the names and each link's text, before the file system is
    asked: not a stat, an open or a directory read of a path outside the root (nor of the root's
    own parent directories), whatever is asked of the origin and however it is refused."""
    import asyncio
    import threading

    from sidecar.daemon.origins.base import FileOrigin

    root, outside = linked_tree(tmp_path)
    origin = FileOrigin(root)
    touched: list[str] = []

    recorder = threading.local()

    def recording(name: str):
        real = getattr(os, name)

        def call(path, *args, **kwargs):
            # Names relative to a directory descriptor are inside the directory it was checked to be.
            if kwargs.get("dir_fd") is None and isinstance(path, str | bytes | os.PathLike) and not getattr(recorder, "busy", False):
                # Where the call lands, not the text it names: the kernel follows every link on the
                # way (a stat of root/bucket stats what the bucket links to), and the last one too
                # unless the call says not to. Worked out by the recorder with the real functions.
                recorder.busy = True
                try:
                    text = os.fsdecode(path)
                    flags = args[0] if args else kwargs.get("flags", 0)
                    follows = (name in ("stat", "scandir", "listdir") and kwargs.get("follow_symlinks", True)) or (
                        name == "open" and not flags & os.O_NOFOLLOW)
                    parent, last = os.path.split(text)
                    touched.append(os.path.realpath(text) if follows else os.path.join(os.path.realpath(parent), last))
                finally:
                    recorder.busy = False
            return real(path, *args, **kwargs)

        return call

    async def outcome(make) -> str:
        try:
            result = await make()
        except Exception as exc:
            return type(exc).__name__
        if isinstance(result, tuple):  # open_first: (info, body)
            result[1].close()
        return "ok"

    async def scenario() -> dict[str, str]:
        await origin.start()  # resolves the root once: the one look above it, on purpose
        for name in ("stat", "lstat", "open", "scandir", "listdir", "readlink"):
            monkeypatch.setattr(os, name, recording(name))
        seen: dict[str, str] = {}
        try:
            for prefix in ["../", "../outside/", "train/../../../outside/", "/", str(outside) + "/", "train//"]:
                seen[f"list bk {prefix}"] = await outcome(lambda p=prefix: origin.list_objects_v2("bk", {"prefix": p}))
            for prefix in ["linkdir/", "linkdir/sub/", "train/relative", "loop/", ""]:
                seen[f"list bk {prefix}"] = await outcome(lambda p=prefix: origin.list_objects("bk", {"prefix": p}))
            for bucket, prefix in [("elsewhere", ""), ("rootfs", str(outside).lstrip("/") + "/")]:
                seen[f"list {bucket}"] = await outcome(lambda b=bucket, p=prefix: origin.list_objects_v2(b, {"prefix": p}))
                seen[f"head bucket {bucket}"] = await outcome(lambda b=bucket: origin.head_bucket(b))
            keys = [("rootfs", str(outside / "secret.txt").lstrip("/")), ("elsewhere", "secret.txt"),
                    ("bk", "linkdir/secret.txt"), ("bk", "linkdir/sub/deep.txt"), ("bk", "linkfile"),
                    ("bk", "train/relative"), ("alias", "linkfile"), ("bk", "train/0.tar/"), ("bk", "train//0.tar"),
                    ("bk", "train/0.tar"), ("alias", "inlink")]
            for bucket, key in keys:
                seen[f"head {bucket}/{key}"] = await outcome(lambda b=bucket, k=key: origin.head(b, k))
                seen[f"get {bucket}/{key}"] = await outcome(lambda b=bucket, k=key: origin.call(origin.open_first, b, k))
        finally:
            monkeypatch.undo()
            await origin.close()
        return seen

    seen = asyncio.run(scenario())
    real_root = str(root.resolve())
    outside_root = [path for path in touched if not (
        os.path.normpath(path) == real_root or os.path.normpath(path).startswith(real_root + "/")
        or path.startswith("/proc/"))]  # the descriptor check reads the process's own table (/proc/self/fd)
    assert outside_root == []
    assert touched  # the recording saw the origin's calls
    refused = {"list bk ../", "list bk ../outside/", "list bk train/../../../outside/", "list bk /", f"list bk {outside}/"}
    assert {what for what, result in seen.items() if result == "InvalidName"} == refused
    assert {what for what, result in seen.items() if result == "AccessDenied"} == {
        "list elsewhere", "head bucket elsewhere", "list rootfs", "head bucket rootfs",
        *(f"{op} {b}/{k}" for op in ("head", "get") for b, k in [
            ("rootfs", str(outside / "secret.txt").lstrip("/")), ("elsewhere", "secret.txt"), ("bk", "linkdir/secret.txt"),
            ("bk", "linkdir/sub/deep.txt"), ("bk", "linkfile"), ("bk", "train/relative"), ("alias", "linkfile")])}
    assert {what for what, result in seen.items() if result == "ObjectNotFound"} == {
        f"{op} bk/{k}" for op in ("head", "get") for k in ["train/0.tar/", "train//0.tar"]}
    assert seen["get bk/train/0.tar"] == seen["get alias/inlink"] == seen["list bk "] == seen["list bk train//"] == "ok"
