"""wire.names: digests, ids, warm-up ids, file:// origin paths and addresses, the one home of
each rule both sides apply."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wire.errors import InvalidName
from wire.names import (
    ID_PATTERN,
    Address,
    is_id,
    is_xxh3_128,
    origin_object_path,
    parse_connect,
    parse_listen,
    parse_object_url,
    split_origin_path,
    validate_id,
    validate_xxh3_128,
    warmup_id,
)

# -- digests --------------------------------------------------------------------------------------


@given(st.binary(min_size=16, max_size=16))
def test_any_128_bit_digest_is_accepted_in_either_case_and_normalised(raw: bytes) -> None:
    digest = raw.hex()
    assert is_xxh3_128(digest) and is_xxh3_128(digest.upper())
    assert validate_xxh3_128(digest.upper()) == digest


@pytest.mark.parametrize("text", ["", "zz", "0" * 31, "0" * 33, "g" * 32, "0" * 32 + "\n", " " + "0" * 31, None, 5, b"0" * 32])
def test_what_is_not_a_digest(text: object) -> None:
    assert not is_xxh3_128(text)
    with pytest.raises(InvalidName, match="objects\\[3\\].xxh3_128 must be 32 hex digits"):
        validate_xxh3_128(text, "objects[3].xxh3_128")


# -- ids ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["a", "resnet50", "A.b_c-d", "0" * 128, "w-0123456789abcdef"])
def test_ids(text: str) -> None:
    assert is_id(text) and validate_id(text, "job name") == text


@pytest.mark.parametrize("text", ["", "-a", ".a", "_a", "a" * 129, "a b", "a/b", "../x", "a\n", "é", None, 7])
def test_not_ids(text: object) -> None:
    assert not is_id(text)
    with pytest.raises(InvalidName, match="job name"):
        validate_id(text, "job name")


@given(st.text(max_size=300))
def test_is_id_is_the_pattern(text: str) -> None:
    assert is_id(text) == (re.fullmatch(ID_PATTERN, text) is not None)


objects_st = st.lists(
    st.tuples(st.text(max_size=8), st.text(max_size=20), st.none() | st.just("f" * 32)), max_size=8, unique_by=lambda o: o[:2]
)


@given(objects_st, st.text(max_size=80))
def test_warmup_ids_are_valid_ids_whatever_the_name(objects: list[tuple[str, str, str | None]], name: str) -> None:
    ident = warmup_id(objects, name)
    assert is_id(ident)
    assert ident == warmup_id(list(reversed(objects)), name)


def test_warmup_id_keeps_its_format() -> None:
    # The CLI and the daemon both compute it (a re-run attaches to the job in progress): the
    # format is part of the contract between versions.
    assert re.fullmatch(r"train-[0-9a-f]{16}", warmup_id([("b", "k", None)], "train"))
    assert warmup_id([("b", "k", None)], "///").startswith("w-")


# -- file:// origins ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "root", "split"),
    [
        ("/data/b/train/", "/data", ("b", "train/")),
        ("/data/b/train/0.tar", "/data/", ("b", "train/0.tar")),
        ("/data/b/", "/data", ("b", "")),
        ("/data/b", "/data", ("b", "")),
        ("/data/", "/data", ("", "")),
        ("/data", "/data", ("", "")),
        ("/database/b/", "/data", None),
        ("/other/b/", "/data", None),
        ("/x/b/k", "/", ("x", "b/k")),
    ],
)
def test_the_first_directory_under_the_root_is_the_bucket(path: str, root: str, split: tuple[str, str] | None) -> None:
    assert split_origin_path(path, root) == split


@given(st.from_regex(r"[a-z0-9]{2,12}", fullmatch=True), st.from_regex(r"[a-z0-9]{1,8}(/[a-z0-9]{1,8}){0,3}", fullmatch=True))
def test_origin_paths_round_trip(bucket: str, key: str) -> None:
    path = origin_object_path("/srv/data/", bucket, key)
    assert path == f"/srv/data/{bucket}/{key}"
    assert split_origin_path(path, "/srv/data") == (bucket, key)
    assert parse_object_url("file://" + path, "/srv/data") == (bucket, key)


@pytest.mark.parametrize(("bucket", "key"), [("..", "k"), ("b/x", "k"), ("bk", "../../etc/passwd"), ("bk", "/etc/passwd"), ("bk", "a\x00b")])
def test_origin_paths_refuse_escapes(bucket: str, key: str) -> None:
    with pytest.raises(InvalidName):
        origin_object_path("/srv/data", bucket, key)


def test_object_urls_under_a_file_origin() -> None:
    with pytest.raises(InvalidName, match="not under this daemon's origin"):
        parse_object_url("file:///etc/passwd", "/srv/data")
    with pytest.raises(InvalidName, match="bucket"):
        parse_object_url("file:///srv/data/", "/srv/data")


# -- addresses ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("tcp://0.0.0.0:8600", Address("tcp", "0.0.0.0", 8600)),
        ("tcp://[::]:8443", Address("tcp", "::", 8443)),
        ("tcp://:8700", Address("tcp", "", 8700)),
        (" tcp://Node:1 ", Address("tcp", "node", 1)),
        ("unix:///run/shardcache/daemon.sock", Address("unix", path="/run/shardcache/daemon.sock")),
    ],
)
def test_listen_addresses(text: str, address: Address) -> None:
    assert parse_listen(text) == address


@pytest.mark.parametrize(
    "text",
    ["http://0.0.0.0:80", "0.0.0.0:8443", "tcp://h", "tcp://h:", "tcp://h:0", "tcp://h:65536", "tcp://h:x", "tcp://h:1/p",
     "tcp://u@h:1", "tcp://[::1:1", "unix://relative.sock", "unix://", ""],
)
def test_listen_addresses_refused_say_what_to_write(text: str) -> None:
    with pytest.raises(InvalidName, match="invalid listen address.*(tcp://HOST:PORT|unix:///path.sock)"):
        parse_listen(text)


@given(st.integers(min_value=-10, max_value=70000))
def test_ports_are_1_to_65535_for_servers_and_clients(port: int) -> None:
    ok = 1 <= port <= 65535
    for parse in (lambda: parse_listen(f"tcp://h:{port}"), lambda: parse_connect(f"h:{port}", 8600)):
        if ok:
            assert parse().port == port
        else:
            with pytest.raises(InvalidName):
                parse()


@pytest.mark.parametrize(
    ("text", "kwargs", "address"),
    [
        ("http://10.1.2.3:8600", {}, Address("tcp", "10.1.2.3", 8600)),
        ("node", {}, Address("tcp", "node", 8600)),
        ("tcp://node/", {}, Address("tcp", "node", 8600)),
        ("[::1]:9", {}, Address("tcp", "::1", 9)),
        ("unix:///s.sock", {}, Address("unix", path="/s.sock")),
        ("unix:///a%20b.sock", {}, Address("unix", path="/a b.sock")),
        ("https://m/", {"schemes": ("http", "https"), "default_port": None}, Address("tcp", "m", 443, tls=True)),
        ("http://m", {"schemes": ("http", "https"), "default_port": None}, Address("tcp", "m", 80)),
        ("http://m:1/api/", {"base_path": True}, Address("tcp", "m", 1, base="/api")),
    ],
)
def test_connect_addresses(text: str, kwargs: dict, address: Address) -> None:
    kwargs = {"default_port": 8600, **kwargs}
    assert parse_connect(text, **kwargs) == address


@pytest.mark.parametrize("text", ["ftp://x:1", "https://x:1", "unix://relative.sock", "http://", "http://h:1/path", "h:0", "http://u@h"])
def test_connect_addresses_refused_say_what_to_write(text: str) -> None:
    with pytest.raises(InvalidName, match="http://host:port|unix:///path.sock"):
        parse_connect(text, 8600)


@pytest.mark.parametrize(
    "address",
    [Address("tcp", "10.0.0.1", 8600), Address("tcp", "::1", 1), Address("tcp", "m", 443, tls=True, base="/x"), Address("unix", path="/s.sock")],
)
def test_an_address_url_parses_back(address: Address) -> None:
    assert parse_connect(address.url, schemes=("http", "https"), base_path=True) == address
