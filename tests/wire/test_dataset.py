"""wire.dataset: the dataset URL and the manifest format, one reader for the CLI and the loader."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wire.dataset import MANIFEST_NAME, DatasetURL, ManifestShard, check_key, parse_dataset_url, parse_manifest
from wire.errors import EmptyManifest, InvalidName, ManifestError
from wire.names import split_origin_path


@pytest.mark.parametrize(
    ("url", "parsed"),
    [
        ("s3://b/train", DatasetURL("s3://b/train/", "s3", bucket="b", prefix="train/")),
        ("s3://b/", DatasetURL("s3://b/", "s3", bucket="b")),
        ("s3://b", DatasetURL("s3://b/", "s3", bucket="b")),
        ("file:///data/b/train", DatasetURL("file:///data/b/train/", "file", path="/data/b/train/")),
        ("file://localhost/data/b%20c/", DatasetURL("file:///data/b c/", "file", path="/data/b c/")),
    ],
)
def test_dataset_urls(url: str, parsed: DatasetURL) -> None:
    assert parse_dataset_url(url) == parsed
    assert parsed.object_url(MANIFEST_NAME) == parsed.url + "manifest.json"


@pytest.mark.parametrize(
    "url", ["http://x/y", "s3:///nobucket", "file://host/x", "", "s3://b/a/../../c", "s3://b/a//c/", "file:///a\x00b", "x", None]
)
def test_bad_dataset_urls(url: object) -> None:
    with pytest.raises(InvalidName):
        parse_dataset_url(url)


def test_a_file_dataset_maps_onto_an_origin_by_its_first_directory() -> None:
    dataset = parse_dataset_url("file:///data/bkt/train/")
    assert split_origin_path(dataset.path, "/data") == ("bkt", "train/")


def manifest(shards: object, **extra: object) -> bytes:
    return json.dumps({"version": 1, "format": "webdataset", "shards": shards, **extra}).encode()


def test_a_manifest_reads_back_normalised() -> None:
    data = manifest([{"key": "a.tar", "size": 3, "xxh3_128": "AB" * 16, "samples": 1}, {"key": "d/b.tar"}])
    assert parse_manifest(data, "m") == [ManifestShard("a.tar", 3, "ab" * 16, 1), ManifestShard("d/b.tar", None, None, None)]


def test_an_empty_manifest_is_an_error_that_says_what_to_do() -> None:
    with pytest.raises(EmptyManifest, match="manifest lists no shards; run `shardcache index`") as info:
        parse_manifest(manifest([]), "s3://b/p/manifest.json")
    assert isinstance(info.value, ManifestError) and "s3://b/p/manifest.json" in str(info.value)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"{not json", "not valid JSON"),
        (b"[]", "JSON object"),
        (b'{"version": 2, "shards": []}', "version"),
        (b'{"version": 1, "format": "tfrecord", "shards": []}', "format"),
        (b'{"version": 1, "shards": {"a": 1}}', "must be a list"),
        (manifest([1]), "must be an object"),
        (manifest([{"key": "../../etc/passwd"}]), "plain relative path"),
        (manifest([{"key": "a//b"}]), "plain relative path"),
        (manifest([{"key": "a\\b"}]), "backslash"),
        (manifest([{"key": 5}]), "string"),
        (manifest([{"key": "a.tar"}, {"key": "a.tar"}]), "twice"),
        (manifest([{"key": "a.tar", "size": -1}]), "non-negative"),
        (manifest([{"key": "a.tar", "samples": True}]), "non-negative"),
        (manifest([{"key": "a.tar", "xxh3_128": "zz"}]), "32 hex"),
        (manifest([{"key": "a.tar", "xxh3_128": "0" * 32 + "\n"}]), "32 hex"),
    ],
)
def test_hostile_manifests(data: bytes, match: str) -> None:
    with pytest.raises(ManifestError, match=match):
        parse_manifest(data, "m")


@given(st.text(max_size=40))
def test_check_key_accepts_only_plain_relative_paths(key: str) -> None:
    parts = key.split("/")
    plain = bool(key) and "\x00" not in key and "\\" not in key and all(p not in ("", ".", "..") for p in parts)
    if plain:
        assert check_key(key) == key
    else:
        with pytest.raises(ManifestError):
            check_key(key)


def test_the_loader_reads_an_empty_manifest_as_no_dataset() -> None:
    import loader
    from loader.errors import DatasetNotFound

    with pytest.raises(DatasetNotFound, match="manifest lists no shards; run `shardcache index`"):
        loader.parse_manifest(manifest([]), "m")
    # The loader's ManifestError is also the rule's own, so either `except` catches it.
    with pytest.raises(ManifestError) as info:
        loader.parse_manifest(b"[]", "m")
    assert isinstance(info.value, loader.ManifestError)
    assert [s.index for s in loader.parse_manifest(manifest([{"key": "a.tar"}, {"key": "b.tar"}]), "m")] == [0, 1]
