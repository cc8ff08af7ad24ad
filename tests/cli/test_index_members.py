"""``shardcache index --members``: a member index next to every shard, pinned in the manifest, on
S3 (moto) and file:// datasets; what cannot be indexed by sample is reported and left unpinned;
``--verify`` catches a damaged, a missing and a stale member index."""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import xxhash

from loader import parse_manifest as loader_parse_manifest
from loader.members import read_members
from tests.support.cli import run_cli
from tests.support.datasets import Dataset, make_tar, xxh3
from wire.members import members_key, parse_members


@dataclass
class Origin:
    """A dataset where the test can change objects behind the CLI's back."""

    dataset: Dataset
    env: dict[str, str]
    get: Callable[[str], bytes | None]
    put: Callable[[str, bytes], None]
    delete: Callable[[str], None]

    @property
    def url(self) -> str:
        return self.dataset.url


@pytest.fixture(params=["s3", "file"])
def origin(request: pytest.FixtureRequest) -> Origin:
    if request.param == "s3":
        dataset: Dataset = request.getfixturevalue("s3_dataset")
        client = request.getfixturevalue("s3_server").client()
        env = request.getfixturevalue("cli_env")

        def get(key: str) -> bytes | None:
            try:
                return bytes(client.get_object(Bucket=dataset.bucket, Key=dataset.prefix + key)["Body"].read())
            except client.exceptions.NoSuchKey:
                return None

        return Origin(dataset, env, get,
                      lambda key, data: client.put_object(Bucket=dataset.bucket, Key=dataset.prefix + key, Body=data),
                      lambda key: client.delete_object(Bucket=dataset.bucket, Key=dataset.prefix + key))
    dataset = request.getfixturevalue("file_dataset")
    root = Path(dataset.url[len("file://"):])
    return Origin(dataset, {}, lambda key: (root / key).read_bytes() if (root / key).exists() else None,
                  lambda key, data: (root / key).write_bytes(data), lambda key: (root / key).unlink())


def check_member_index(data: bytes, document: bytes, key: str) -> None:
    """The document indexes ``data`` (the shard's bytes): each field's bytes are tarfile's member,
    each sample's bytes hash to its digest."""
    table = parse_members(document, members_key(key))
    assert (table.shard_key, table.size, table.xxh3_128) == (key, len(data), xxh3(data))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        contents = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers() if m.isfile()]  # type: ignore[union-attr]
    got = []
    for i in range(table.samples):
        start, end = table.start(i), table.ends[i]
        assert xxhash.xxh3_64_intdigest(data[start:end]) == table.digests[i]
        for k, field in enumerate(table.layouts[table.layout_of[i]]):
            offset, size = table.offsets[table.first[i] + k], table.sizes[table.first[i] + k]
            assert start <= offset and offset + size <= end
            got.append((f"{table.keys[i]}.{field}", data[offset : offset + size]))
    assert got == contents


def test_members_writes_one_pinned_index_per_shard(origin: Origin):
    result = run_cli(["index", origin.url, "--members", "--json", "--jobs", "3"], env=origin.env)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    shards = origin.dataset.shards
    assert summary["ok"] is True and summary["members"] == len(shards) and summary["unindexed"] == []
    manifest = origin.get("manifest.json")
    assert manifest is not None
    entries = {entry["key"]: entry for entry in json.loads(manifest)["shards"]}
    assert sorted(entries) == sorted(shards)
    listed = {shard.key: shard for shard in loader_parse_manifest(manifest, "manifest.json")}
    for key, data in shards.items():
        document = origin.get(members_key(key))
        assert document is not None, key
        assert entries[key]["members_xxh3_128"] == xxh3(document)
        check_member_index(data, document, key)
        # The loader's own check accepts it against the manifest's pin.
        assert read_members(document, listed[key], members_key(key)).size == len(data)
    ok = run_cli(["index", origin.url, "--verify"], env=origin.env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert f"all {len(shards)} shards match" in ok.stdout and f"{len(shards)} member indexes" in ok.stdout
    report = json.loads(run_cli(["index", origin.url, "--verify", "--json"], env=origin.env).stdout)
    assert report["ok"] is True and report["member_indexes"] == len(shards)


def test_without_members_nothing_changes(file_dataset: Dataset, tmp_path: Path):
    result = run_cli(["index", file_dataset.url, "--json"])
    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout)) == {"ok", "manifest", "shards", "samples", "bytes"}
    root = Path(file_dataset.url[len("file://"):])
    assert not list(root.glob("*.members.json"))
    assert "members_xxh3_128" not in (root / "manifest.json").read_text()
    verify = run_cli(["index", file_dataset.url, "--verify", "--json"])
    assert verify.returncode == 0 and "member_indexes" not in json.loads(verify.stdout)


def test_members_go_next_to_the_shards_whatever_the_output(origin: Origin, tmp_path: Path):
    result = run_cli(["index", origin.url, "--members", "--output", "-"], env=origin.env)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)  # stdout is the manifest alone
    assert all("members_xxh3_128" in entry for entry in doc["shards"])
    assert f"{len(origin.dataset.shards)} member indexes" in result.stderr
    assert origin.get("manifest.json") is None
    for entry in doc["shards"]:
        document = origin.get(members_key(entry["key"]))
        assert document is not None and xxh3(document) == entry["members_xxh3_128"]
    out = tmp_path / "m.json"
    text = run_cli(["index", origin.url, "--members", "--output", str(out)], env=origin.env)
    assert text.returncode == 0, text.stderr
    assert f"{len(origin.dataset.shards)} member indexes -> next to the shards at {origin.url}" in text.stdout
    assert run_cli(["index", origin.url, "--verify", "--output", str(out)], env=origin.env).returncode == 0


def sparse_shard(tmp_path: Path) -> bytes:
    """GNU tar's sparse member (``tar --sparse``): read as the file it stands for, so it counts,
    but its bytes are not a slice of the shard."""
    src = tmp_path / "sparse-src"
    src.mkdir()
    with open(src / "000001.bin", "wb") as handle:
        handle.truncate(1 << 20)
        os.pwrite(handle.fileno(), b"data", 4096)
    (src / "000001.cls").write_bytes(b"1")
    out = tmp_path / "sparse.tar"
    subprocess.run(["tar", "-C", str(src), "--sparse", "--format=gnu", "-cf", str(out), "000001.bin", "000001.cls"],
                   check=True, timeout=60)
    return out.read_bytes()


def repeated_field_shard() -> bytes:
    """A sample naming a field twice: counted by the scan, refused by the loader's sample reader."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in ("000000.cls", "000000.cls", "000001.cls"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"1"))
    return out.getvalue()


@pytest.mark.parametrize(("kind", "reason"), [("sparse", "sparse member"), ("repeated", "cls")])
def test_a_shard_that_cannot_be_indexed_is_reported_and_left_unpinned(origin: Origin, tmp_path: Path, kind: str,
                                                                       reason: str):
    bad = sparse_shard(tmp_path) if kind == "sparse" else repeated_field_shard()
    origin.put("odd-000000.tar", bad)
    result = run_cli(["index", origin.url, "--members", "--json"], env=origin.env)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert f"no member index for {origin.url}odd-000000.tar:" in result.stderr and reason in result.stderr
    assert "1 of" in result.stderr and "without a member index" in result.stderr
    summary = json.loads(result.stdout)
    assert summary["ok"] is False and summary["members"] == len(origin.dataset.shards)
    assert [item["key"] for item in summary["unindexed"]] == ["odd-000000.tar"]
    # The manifest is written all the same: the shard listed, counted and checksummed, not pinned.
    manifest = origin.get("manifest.json")
    assert manifest is not None
    entries = {entry["key"]: entry for entry in json.loads(manifest)["shards"]}
    assert entries["odd-000000.tar"] == {"key": "odd-000000.tar", "size": len(bad), "xxh3_128": xxh3(bad),
                                         "samples": 1 if kind == "sparse" else 2}
    assert all("members_xxh3_128" in entries[key] for key in origin.dataset.shards)
    assert origin.get(members_key("odd-000000.tar")) is None
    assert run_cli(["index", origin.url, "--verify"], env=origin.env).returncode == 0


def test_a_shard_that_is_no_tar_writes_no_manifest(origin: Origin):
    # As without --members: an unreadable shard fails the run and no manifest pins anything.
    origin.put("train-000002.tar", b"this is not a tar file" * 100)
    result = run_cli(["index", origin.url, "--members"], env=origin.env)
    assert result.returncode == 1
    assert "corrupt shard" in result.stderr and "train-000002.tar" in result.stderr
    assert "Traceback" not in result.stderr
    assert origin.get("manifest.json") is None
    assert origin.get(members_key("train-000002.tar")) is None


def mismatches(result: subprocess.CompletedProcess[str]) -> set[tuple[str, str]]:
    lines = [line for line in result.stdout.splitlines() if line.startswith("MISMATCH")]
    return {(line.split()[1], line.split()[2].rsplit("/", 1)[1].rstrip(":")) for line in lines}


def test_verify_catches_a_damaged_a_missing_and_a_stale_member_index(origin: Origin):
    assert run_cli(["index", origin.url, "--members"], env=origin.env).returncode == 0
    shards = origin.dataset.shards
    # damaged: one byte of a digest flipped (still a valid document)
    document = origin.get(members_key("train-000001.tar"))
    assert document is not None
    at = document.index(json.loads(document)["samples"][0][3].encode()) + 5
    flipped = bytearray(document)
    flipped[at] = ord("0") if flipped[at] != ord("0") else ord("1")
    origin.put(members_key("train-000001.tar"), bytes(flipped))
    # missing
    origin.delete(members_key("train-000002.tar"))
    # stale: the shard replaced by another of the same size after indexing
    replaced = make_tar(4, 4096, seed=99, first=12)
    assert len(replaced) == len(shards["train-000003.tar"]) and replaced != shards["train-000003.tar"]
    origin.put("train-000003.tar", replaced)
    # another shard's index in its place
    other = origin.get(members_key("train-000000.tar"))
    assert other is not None
    origin.put(members_key("train-000004.tar"), other)

    bad = run_cli(["index", origin.url, "--verify"], env=origin.env)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "Traceback" not in bad.stderr
    assert mismatches(bad) == {
        ("members", "train-000001.tar"),
        ("members", "train-000002.tar"),
        ("xxh3_128", "train-000003.tar"), ("members", "train-000003.tar"),
        ("members", "train-000004.tar"),
    }
    details = {p["key"]: p["detail"] for p in json.loads(
        run_cli(["index", origin.url, "--verify", "--json"], env=origin.env).stdout)["mismatches"]
        if p["problem"] == "members"}
    assert "hashes to" in details["train-000001.tar"] and "the manifest pins" in details["train-000001.tar"]
    assert "no member index at" in details["train-000002.tar"] and "--members" in details["train-000002.tar"]
    assert "stale" in details["train-000003.tar"]
    assert "hashes to" in details["train-000004.tar"]
    # --verify wrote nothing; indexing again with --members makes it whole.
    assert origin.get(members_key("train-000002.tar")) is None
    assert run_cli(["index", origin.url, "--members"], env=origin.env).returncode == 0
    again = run_cli(["index", origin.url, "--verify"], env=origin.env)
    assert again.returncode == 0, again.stdout
    document = origin.get(members_key("train-000003.tar"))
    assert document is not None
    check_member_index(replaced, document, "train-000003.tar")


def test_verify_names_an_index_that_parses_wrong_but_is_pinned(file_dataset: Dataset):
    # A pin on a document that is not a member index (a hand-edited manifest): the parse's error.
    root = Path(file_dataset.url[len("file://"):])
    assert run_cli(["index", file_dataset.url, "--members"]).returncode == 0
    junk = b'{"__kind__": "shardcache-members-v1", "shard": {"key": "train-000000.tar"}}'
    (root / members_key("train-000000.tar")).write_bytes(junk)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["shards"][0]["members_xxh3_128"] = xxh3(junk)
    (root / "manifest.json").write_text(json.dumps(manifest))
    result = run_cli(["index", file_dataset.url, "--verify", "--json"])
    assert result.returncode == 1
    problems = json.loads(result.stdout)["mismatches"]
    assert [(p["key"], p["problem"]) for p in problems] == [("train-000000.tar", "members")]
    assert "shard.size" in problems[0]["detail"]


def test_help_says_where_member_indexes_go():
    result = run_cli(["index", "--help"])
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "--members" in text and "next to the shard" in text and "whatever --output says" in text

