"""Peer links authenticate both ends (issue 29, item 5): a captured peer header is good once, at
the member it was addressed to, for the range it named; whatever answers at a member's address
without the secret is no member and its answers are refused; and a peer's bytes are checked
against what the origin says, not what the peer says. Real daemons (in-process, on loopback) in
front of the session's moto server; the hostile peers are small HTTP servers in the test."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import http.client
import http.server
import os
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sidecar.daemon.peers.config import ClusterSettings
from sidecar.daemon.peers.signing import ANSWER_HEADER, PEER_HEADER, PeerAsk, new_nonce, sign, sign_answer, verify
from tests.support.daemons import PEER_SECRET, http_get, live_members, make_settings
from tests.support.processes import free_port
from tests.support.threads import serving
from tests.support.waits import wait_until
from wire.rendezvous import member_id, ranked

pytestmark = pytest.mark.timeout(120)

OTHER_SECRET = b"fedcba9876543210fedcba9876543210"


_get = http_get


def _peers(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/_shardcache/peers", timeout=10) as resp:
        import json

        return {m["id"]: m for m in json.loads(resp.read())["members"]}


def _member(tmp: Path, endpoint: str, peers: tuple[str, ...] = (), secret: bytes | None = PEER_SECRET) -> Any:
    settings = make_settings(tmp, "s3", endpoint)
    url = "http://" + settings.listen[0][len("tcp://"):]
    return dataclasses.replace(settings, cluster=ClusterSettings(
        peers=peers or (f"http://127.0.0.1:{free_port()}",), advertise_url=url, secret=secret,
        health_interval_s=0.2, health_timeout_s=1.0,
    ))


# -- the recipient's side: requests -----------------------------------------------------------------


def test_a_replayed_peer_request_is_refused(start_daemon: Any, tmp_path: Path, s3_server: Any, bucket: str) -> None:
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="a.bin", Body=b"x" * 1000)
    client.put_object(Bucket=bucket, Key="b.bin", Body=b"y" * 1000)
    daemon = start_daemon(_member(tmp_path / "c", s3_server.endpoint))
    me = member_id(daemon.url)
    asker = "http://127.0.0.1:1"
    target = f"/{bucket}/a.bin"
    header = {PEER_HEADER: sign(PEER_SECRET, PeerAsk(asker, me, new_nonce()), "GET", target)}
    assert _get(daemon.url + target, header) == (200, b"x" * 1000)
    status, body = _get(daemon.url + target, header)  # the same header again: a replay
    assert status == 403 and b"not a peer" in body and b"replayed" in body
    # Replayed before its first use reached the daemon (a HEAD captured, then the GET): refused too.
    b_target = f"/{bucket}/b.bin"
    nonce = new_nonce()
    assert _get(daemon.url + b_target, {PEER_HEADER: sign(PEER_SECRET, PeerAsk(asker, me, nonce), "GET", b_target)})[0] == 200
    again = {PEER_HEADER: sign(PEER_SECRET, PeerAsk(asker, me, nonce), "GET", b_target)}  # a later second, same nonce
    status, body = _get(daemon.url + b_target, again)
    assert status == 403 and b"replayed" in body
    stats = daemon.stats()
    assert stats["served_bytes"]["peer"] == 2000  # the replays read nothing
    assert stats["cluster"]["replay_cache"]["replays"] == 2


def test_a_redirected_peer_request_is_refused(start_daemon: Any, tmp_path: Path, s3_server: Any, bucket: str) -> None:
    data = os.urandom(4096)
    s3_server.client().put_object(Bucket=bucket, Key="a.bin", Body=data)
    a = start_daemon(_member(tmp_path / "a", s3_server.endpoint))
    b = start_daemon(_member(tmp_path / "b", s3_server.endpoint))
    target = f"/{bucket}/a.bin"
    asker = "http://127.0.0.1:1"
    for_a = {PEER_HEADER: sign(PEER_SECRET, PeerAsk(asker, member_id(a.url), new_nonce()), "GET", target)}
    status, body = _get(b.url + target, for_a)  # captured on its way to a, presented at b
    assert status == 403 and b"not a peer" in body and b"addressed to" in body
    stats = b.stats()
    assert stats["cache"]["items"] == 0 and stats["origin_read_bytes"] == 0 and stats["served_bytes"]["peer"] == 0
    # The range is signed: a header for the first 100 bytes does not read the whole object.
    ranged = {"Range": "bytes=0-99"}
    ranged[PEER_HEADER] = sign(PEER_SECRET, PeerAsk(asker, member_id(a.url), new_nonce()), "GET", target, ranged)
    status, body = _get(a.url + target, {**ranged, "Range": "bytes=0-4095"})
    assert status == 403 and b"wrong peer signature" in body
    assert a.stats()["cache"]["items"] == 0
    assert _get(a.url + target, for_a) == (200, data)  # where it was addressed: good, once


# -- the asker's side: answers -----------------------------------------------------------------------


class _Hostile:
    """Whatever answers at a member's address: ``/readyz`` (signed with ``readyz_secret``, or
    not) and the objects of ``objects`` (path -> headers, body), their answers signed by
    ``answer`` (headers, the request's PeerAsk or None -> the answer header, or None)."""

    def __init__(self, readyz_secret: bytes | None, answer: Callable[[dict[str, str], PeerAsk | None], str | None]) -> None:
        self.objects: dict[str, tuple[dict[str, str], bytes]] = {}
        self.reads = 0
        hostile = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _ask(self) -> PeerAsk | None:
                # What the request says (checked only where this one has the secret: a member's).
                value = self.headers.get(PEER_HEADER)
                if value is None or readyz_secret is None:
                    return None
                if readyz_secret == PEER_SECRET:
                    return verify(readyz_secret, value, self.command, self.path, self.headers, hostile.id, None)
                fields = dict(part.partition("=")[::2] for part in value.split(","))
                return PeerAsk(fields["m"], hostile.id, fields["n"])

            def _answer(self, send_body: bool) -> None:
                ask = self._ask()
                if self.path == "/readyz":
                    headers, body = {"Content-Type": "application/json"}, b'{"ready": true, "node": "impostor"}'
                    headers["Content-Length"] = str(len(body))
                    signature = sign_answer(readyz_secret, ask, 200, headers) if ask is not None else None
                elif self.path in hostile.objects:
                    hostile.reads += 1
                    headers, body = dict(hostile.objects[self.path][0]), hostile.objects[self.path][1]
                    headers["Content-Length"] = str(len(body))
                    signature = answer(headers, ask)
                else:
                    headers, body, signature = {"Content-Length": "0"}, b"", None
                self.send_response(200 if body or self.path == "/readyz" else 404)
                for name, value in headers.items():
                    self.send_header(name, value)
                if signature is not None:
                    self.send_header(ANSWER_HEADER, signature)
                self.end_headers()
                if send_body:
                    self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self._answer(True)

            def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
                self._answer(False)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.id = member_id(self.url)


def _unsigned(headers: dict[str, str], ask: PeerAsk | None) -> str | None:
    return None


def _member_signed(headers: dict[str, str], ask: PeerAsk | None) -> str | None:
    assert ask is not None
    return sign_answer(PEER_SECRET, ask, 200, headers)


ANSWERS: dict[str, Callable[[dict[str, str], PeerAsk | None], str | None]] = {
    "unsigned": _unsigned,
    "another secret": lambda headers, ask: sign_answer(OTHER_SECRET, ask, 200, headers) if ask else None,
    "another request's": lambda headers, ask: sign_answer(PEER_SECRET, dataclasses.replace(ask, nonce=new_nonce()), 200, headers)
    if ask else None,
}


@pytest.mark.parametrize("secret", [None, OTHER_SECRET], ids=["unsigned", "another secret"])
def test_an_address_that_answers_readyz_without_the_secret_is_no_member(
    start_daemon: Any, tmp_path: Path, s3_server: Any, bucket: str, secret: bytes | None
) -> None:
    impostor = _Hostile(secret, _unsigned)
    settings = _member(tmp_path / "c", s3_server.endpoint, (impostor.url,))
    me = settings.cluster.advertise_url
    key = _owned_by(bucket, impostor.url, me)
    data = os.urandom(64 * 1024)
    s3_server.client().put_object(Bucket=bucket, Key=key, Body=data)
    impostor.objects[f"/{bucket}/{key}"] = ({"ETag": f'"{hashlib.md5(b"lie").hexdigest()}"'}, b"lie")
    with serving(impostor.server):
        daemon = start_daemon(settings)
        wait_until(lambda: (_peers(daemon.url)[impostor.id]["problem"] or "").startswith("not a member"), timeout=15,
                   what="the impostor's health check refused")
        time.sleep(0.6)  # a few more checks: still not live
        assert impostor.id not in live_members(daemon.url)
        assert _get(f"{daemon.url}/{bucket}/{key}") == (200, data)
        assert impostor.reads == 0


def _owned_by(bucket: str, owner: str, other: str) -> str:
    return next(f"k{i}.bin" for i in range(1000)
                if ranked([member_id(owner), member_id(other)], f"{bucket}/k{i}.bin")[0] == member_id(owner))


def _read_until_whole(url: str, data: bytes) -> list[tuple[int, bytes]]:
    """GETs of ``url`` until one answers ``data`` whole (a fill that fails its check cuts its
    answers short: the client retries); every answer."""
    answers: list[tuple[int, bytes]] = []
    for _ in range(3):
        try:
            answers.append(_get(url))
        except (OSError, http.client.HTTPException) as exc:
            answers.append((0, repr(exc).encode()))
        if answers[-1] == (200, data):
            break
    return answers


def _liar(start_daemon: Any, tmp_path: Path, s3_server: Any, bucket: str,
          answer: Callable[[dict[str, str], PeerAsk | None], str | None]) -> tuple[_Hostile, Any, str, bytes]:
    """A daemon and a hostile peer that passes its health checks (it has the secret, or a member's
    signed /readyz) and owns the object ``key`` (data at the origin)."""
    liar = _Hostile(PEER_SECRET, answer)
    settings = _member(tmp_path / "c", s3_server.endpoint, (liar.url,))
    key = _owned_by(bucket, liar.url, settings.cluster.advertise_url)
    data = os.urandom(256 * 1024)
    s3_server.client().put_object(Bucket=bucket, Key=key, Body=data)
    return liar, settings, key, data


def _cached_from_the_origin(daemon: Any, data: bytes) -> None:
    """The one copy in the daemon's cache holds the origin's bytes (the liar's were never cached)."""
    wait_until(lambda: daemon.stats()["cache"]["items"] == 1, timeout=10, what="the origin's copy published")
    files = [p for p in Path(daemon.settings.store.root).rglob("*") if p.is_file() and p.stat().st_size == len(data)]
    assert [p.read_bytes() == data for p in files] == [True]


@pytest.mark.parametrize("how", list(ANSWERS))
def test_answers_not_signed_by_the_member_asked_are_refused(
    start_daemon: Any, tmp_path: Path, s3_server: Any, bucket: str, how: str
) -> None:
    liar, settings, key, data = _liar(start_daemon, tmp_path, s3_server, bucket, ANSWERS[how])
    bad = bytes(b ^ 0xFF for b in data)
    # The origin's version by its headers: only the signature tells this answer from a member's.
    etag = s3_server.client().head_object(Bucket=bucket, Key=key)["ETag"]
    liar.objects[f"/{bucket}/{key}"] = ({"ETag": etag, "Content-Type": "binary/octet-stream"}, bad)
    with serving(liar.server):
        daemon = start_daemon(settings)
        wait_until(lambda: liar.id in live_members(daemon.url), timeout=15, what="the liar live")
        assert _get(f"{daemon.url}/{bucket}/{key}") == (200, data)  # the origin's, at once: the answer was not read
        assert liar.reads >= 1
        stats = daemon.stats()
        assert stats["peer_read_bytes"] == 0 and stats["origin_read_bytes"] == len(data)
        _cached_from_the_origin(daemon, data)


@pytest.mark.parametrize("lie", ["another version", "another checksum", "bytes only"])
def test_a_members_bytes_that_do_not_match_the_origin_are_refused(
    start_daemon: Any, tmp_path: Path, s3_server: Any, bucket: str, lie: str
) -> None:
    """A member with the secret (a corrupt cache, or a compromised node) signs its answers, and
    its bytes still do not get into the cache: they are checked against the origin's checksum."""
    liar, settings, key, data = _liar(start_daemon, tmp_path, s3_server, bucket, _member_signed)
    bad = bytes(b ^ 0xFF for b in data)
    head = s3_server.client().head_object(Bucket=bucket, Key=key)
    if lie == "another version":  # a consistent story about another object
        headers = {"ETag": f'"{hashlib.md5(bad).hexdigest()}"'}
    elif lie == "another checksum":  # the origin's version, with a checksum of its own bytes
        crc = base64.b64encode(zlib.crc32(bad).to_bytes(4, "big")).decode()
        headers = {"ETag": head["ETag"], "x-amz-checksum-crc32": crc, "x-amz-checksum-type": "FULL_OBJECT"}
    else:  # the origin's version, and no claim the bytes could be checked against
        headers = {"ETag": head["ETag"]}
    liar.objects[f"/{bucket}/{key}"] = ({**headers, "Content-Type": "binary/octet-stream"}, bad)
    with serving(liar.server):
        daemon = start_daemon(settings)
        wait_until(lambda: liar.id in live_members(daemon.url), timeout=15, what="the liar live")
        answers = _read_until_whole(f"{daemon.url}/{bucket}/{key}", data)
        assert answers[-1] == (200, data)
        assert all(body != bad for _, body in answers)
        assert liar.reads == 1  # refused once, then the object comes from the origin
        stats = daemon.stats()
        assert stats["cluster"]["origin_heads"] == 1  # one origin HEAD per fill from a peer
        if lie == "bytes only":
            assert stats["verification"]["fills"]["failed"] == 1  # every byte was checked, and the fill failed
        else:
            assert stats["cluster"]["peer_answers_disowned"] == 1  # refused at the headers: no byte read
            assert stats["peer_read_bytes"] == 0 and len(answers) == 1
        _cached_from_the_origin(daemon, data)


def test_members_answer_each_other_signed(start_daemon: Any, tmp_path: Path, s3_server: Any, bucket: str,
                                          caplog: pytest.LogCaptureFixture) -> None:
    """Two real members: a HEAD and a ranged GET through the one that does not own the object are
    answered by the owner (signed: nothing falls through to the origin)."""
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    daemons = []
    for i, port in enumerate(ports):
        settings = dataclasses.replace(make_settings(tmp_path / f"c{i}", "s3", s3_server.endpoint), listen=(f"tcp://127.0.0.1:{port}",))
        settings = dataclasses.replace(settings, cluster=ClusterSettings(
            peers=(urls[1 - i],), advertise_url=urls[i], secret=PEER_SECRET, health_interval_s=0.2))
        daemons.append(start_daemon(settings))
    asker, owner = daemons
    key = _owned_by(bucket, urls[1], urls[0])
    data = os.urandom(100_000)
    s3_server.client().put_object(Bucket=bucket, Key=key, Body=data)
    wait_until(lambda: live_members(asker.url) == {member_id(u) for u in urls}, timeout=15, what="both live")
    request = urllib.request.Request(f"{asker.url}/{bucket}/{key}", method="HEAD")
    with urllib.request.urlopen(request, timeout=20) as resp:
        assert resp.status == 200 and resp.headers["Content-Length"] == str(len(data))
    assert _get(f"{asker.url}/{bucket}/{key}", {"Range": "bytes=10-99"}) == (206, data[10:100])
    assert _get(f"{asker.url}/{bucket}/{key}") == (200, data)
    assert not [r for r in caplog.records if "trying the next candidate" in r.getMessage()]
    stats = asker.stats()
    assert stats["origin_read_bytes"] == 0 and stats["peer_read_bytes"] >= len(data)
    assert stats["cluster"]["origin_heads"] >= 1
    assert owner.stats()["cluster"]["replay_cache"]["nonces"] >= 3


def test_the_replay_cache_is_bounded_and_never_forgets_a_nonce_it_could_take_again() -> None:
    from sidecar.daemon.peers.replay import Nonces, Replayed

    nonces = Nonces(3, window_s=60)
    now = 1_000_000.0
    for i, t in enumerate((999_990, 999_995, 1_000_000)):
        nonces.admit("m", f"n{i}", t, now)
    with pytest.raises(Replayed, match="replayed"):
        nonces.admit("m", "n1", 999_995, now)
    nonces.admit("m", "n3", 1_000_000, now)  # full: n0 (stamped 999_990) forgotten early
    assert len(nonces) == 3 and nonces.floor == 999_990
    with pytest.raises(Replayed, match="reaches back"):
        nonces.admit("m", "n0", 999_990, now)  # would have been a replay: refused by the floor
    nonces.admit("m", "n4", 1_000_001, now + 70)  # n1..n3 past the window: forgotten on time
    assert len(nonces) == 1
