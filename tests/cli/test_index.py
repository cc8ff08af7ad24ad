"""``shardcache index``: the manifest it writes, --verify, errors, and its progress display."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

from loader import parse_manifest as loader_parse_manifest
from tests.support.cli import run_cli, run_pty
from tests.support.datasets import Dataset, make_tar, xxh3
from tests.support.processes import free_port


def samples_by_tarfile(data: bytes) -> int:
    """Independent count: distinct basenames up to the first dot, in archive order."""
    keys: list[str] = []
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            if member.isfile():
                base = member.name.split("/")[-1].split(".", 1)[0]
                stem = "/".join(member.name.split("/")[:-1] + [base])
                if not keys or keys[-1] != stem:
                    keys.append(stem)
    return len(keys)


def expected_manifest(shards: dict[str, bytes]) -> dict[str, Any]:
    return {
        "version": 1,
        "format": "webdataset",
        "shards": [
            {"key": key, "size": len(data), "xxh3_128": xxh3(data), "samples": samples_by_tarfile(data)}
            for key, data in sorted(shards.items())
        ],
    }


def test_index_s3_writes_the_manifest_with_put_object(s3_dataset: Dataset, s3_server: Any, cli_env: dict[str, str]):
    # Objects that are not shards are ignored; shards in sub-prefixes keep their relative key.
    client = s3_server.client()
    client.put_object(Bucket=s3_dataset.bucket, Key="train/README.txt", Body=b"not a shard")
    extra = make_tar(3, 100, seed=42)
    client.put_object(Bucket=s3_dataset.bucket, Key="train/more/x-000000.tar", Body=extra)
    result = run_cli(["index", s3_dataset.url], env=cli_env)
    assert result.returncode == 0, result.stderr
    assert "indexed 7 shards" in result.stdout
    body = client.get_object(Bucket=s3_dataset.bucket, Key="train/manifest.json")["Body"].read()
    doc = json.loads(body)
    assert doc == expected_manifest({**s3_dataset.shards, "more/x-000000.tar": extra})
    samples = {shard["key"]: shard["samples"] for shard in doc["shards"]}
    assert samples == {**{key: 4 for key in s3_dataset.shards}, "more/x-000000.tar": 3}
    # The loader accepts what index writes.
    assert [s.key for s in loader_parse_manifest(body, "m")] == [s["key"] for s in doc["shards"]]


def test_index_file_origin_writes_atomically_elsewhere(file_dataset: Dataset, tmp_path: Path):
    out = tmp_path / "out" / "m.json"
    out.parent.mkdir()
    out.write_text("old")
    result = run_cli(["index", file_dataset.url, "--output", str(out), "--json", "--jobs", "3"])
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary == {"ok": True, "manifest": str(out), "shards": 5, "samples": 20,
                       "bytes": file_dataset.total_bytes}
    assert json.loads(out.read_text()) == expected_manifest(file_dataset.shards)
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.json"]  # no temp file left behind
    assert not (tmp_path / "root" / "bkt" / "train" / "manifest.json").exists()
    # Default target: manifest.json at the prefix, with file:// output.
    assert run_cli(["index", file_dataset.url]).returncode == 0
    assert json.loads((tmp_path / "root/bkt/train/manifest.json").read_text()) == expected_manifest(file_dataset.shards)


@pytest.mark.slow
def test_index_counts_samples_like_the_webdataset_package(tmp_path: Path):
    import webdataset as wds

    directory = tmp_path / "root" / "b" / "wds"
    directory.mkdir(parents=True)
    with wds.TarWriter(str(directory / "s-000000.tar")) as sink:
        for i in range(9):
            sink.write({"__key__": f"sample{i:04d}", "seg.png": b"p" * (i + 1), "cls": str(i).encode(), "json": b"{}"})
    result = run_cli(["index", f"file://{directory}/", "--output", "-"])
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    data = (directory / "s-000000.tar").read_bytes()
    assert doc["shards"] == [{"key": "s-000000.tar", "size": len(data), "xxh3_128": xxh3(data), "samples": 9}]
    assert sum(1 for _ in wds.WebDataset(str(directory / "s-000000.tar"), shardshuffle=False)) == 9


@pytest.mark.slow
def test_verify_reports_every_mismatch(s3_dataset: Dataset, s3_server: Any, cli_env: dict[str, str]):
    assert run_cli(["index", s3_dataset.url], env=cli_env).returncode == 0
    ok = run_cli(["index", s3_dataset.url, "--verify"], env=cli_env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "all 6 shards match" in ok.stdout

    client = s3_server.client()
    bucket = s3_dataset.bucket
    good = s3_dataset.shards["train-000001.tar"]
    flipped = bytearray(good)
    flipped[2048] ^= 0xFF  # same size, one byte of sample data differs
    client.put_object(Bucket=bucket, Key="train/train-000001.tar", Body=bytes(flipped))
    client.put_object(Bucket=bucket, Key="train/train-000002.tar", Body=s3_dataset.shards["train-000002.tar"][:3000])
    client.delete_object(Bucket=bucket, Key="train/train-000003.tar")
    client.put_object(Bucket=bucket, Key="train/train-000009.tar", Body=make_tar(2, 10, seed=9))
    client.put_object(Bucket=bucket, Key="train/train-000004.tar", Body=make_tar(5, 6000, seed=4, first=16))

    bad = run_cli(["index", s3_dataset.url, "--verify"], env=cli_env)
    assert bad.returncode == 1
    assert "Traceback" not in bad.stderr
    lines = [line for line in bad.stdout.splitlines() if line.startswith("MISMATCH")]
    found = {(line.split()[1], line.split()[2].rsplit("/", 1)[1].rstrip(":")) for line in lines}
    assert found == {
        ("xxh3_128", "train-000001.tar"),
        ("size", "train-000002.tar"), ("xxh3_128", "train-000002.tar"), ("unreadable", "train-000002.tar"),
        ("missing", "train-000003.tar"),
        ("size", "train-000004.tar"), ("xxh3_128", "train-000004.tar"), ("samples", "train-000004.tar"),
        ("unlisted", "train-000009.tar"),
    }
    as_json = run_cli(["index", s3_dataset.url, "--verify", "--json"], env=cli_env)
    assert as_json.returncode == 1
    report = json.loads(as_json.stdout)
    assert report["ok"] is False and len(report["mismatches"]) == len(found)
    # --verify wrote nothing: the manifest still describes the original shards.
    body = client.get_object(Bucket=bucket, Key="train/manifest.json")["Body"].read()
    assert json.loads(body) == expected_manifest(s3_dataset.shards)


def test_a_corrupt_shard_fails_indexing_and_writes_nothing(file_dataset: Dataset, tmp_path: Path):
    directory = tmp_path / "root" / "bkt" / "train"
    (directory / "train-000002.tar").write_bytes(b"this is not a tar file" * 100)
    result = run_cli(["index", file_dataset.url])
    assert result.returncode == 1
    assert "corrupt shard" in result.stderr and "train-000002.tar" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (directory / "manifest.json").exists()


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["index", "http://example.com/x/"], 2, "unsupported dataset URL"),
        (["index", "s3://no-such-bucket-here/train/"], 2, "NoSuchBucket"),
        (["index", "file:///nonexistent/dir/"], 2, "no such directory"),
        (["index", "s3://bucket/train/", "--jobs", "zero"], 2, "--jobs"),
        (["index", "s3://bucket/train/", "--s3-endpoint", "http://127.0.0.1:{port}"], 69, "cannot reach S3"),
    ],
)
@pytest.mark.slow
def test_errors_are_one_clear_line(args: list[str], code: int, needle: str, cli_env: dict[str, str]):
    args = [a.replace("{port}", str(free_port())) for a in args]
    result = run_cli(args, env=cli_env)
    assert result.returncode == code, result.stderr
    assert needle in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_verify_without_a_manifest_says_how_to_build_one(file_dataset: Dataset):
    result = run_cli(["index", file_dataset.url, "--verify"])
    assert result.returncode == 2
    assert "shardcache index" in result.stderr and "no manifest" in result.stderr


def test_verify_of_an_empty_manifest_says_to_index(file_dataset: Dataset):
    # One rule for CLI and loader (wire.dataset): a manifest listing no shards is an error.
    directory = Path(file_dataset.url[len("file://"):])
    (directory / "manifest.json").write_text('{"version": 1, "format": "webdataset", "shards": []}')
    result = run_cli(["index", file_dataset.url, "--verify"])
    assert result.returncode == 1
    assert "manifest lists no shards" in result.stderr and "shardcache index" in result.stderr


def test_progress_bar_on_a_terminal(file_dataset: Dataset):
    code, drawn = run_pty(["index", file_dataset.url, "--jobs", "2"], columns=100)
    assert code == 0, drawn
    frames = [f for f in drawn.split("\x1b[2K") if "files" in f]
    assert frames, drawn
    last = frames[-1].splitlines()[0]
    assert last.startswith("index  [") and "[" in last and "█" in last
    assert "100.0%" in last and "5/5 files" in last and "ETA" in last and "/s" in last
    assert all(len(f.splitlines()[0]) <= 99 for f in frames)  # fits the terminal
    assert "indexed 5 shards" in drawn


@pytest.mark.slow
def test_output_to_another_s3_key_and_verify_it(s3_dataset: Dataset, s3_server: Any, cli_env: dict[str, str]):
    target = f"s3://{s3_dataset.bucket}/manifests/train.json"
    result = run_cli(["index", s3_dataset.url, "--output", target], env=cli_env)
    assert result.returncode == 0, result.stderr
    client = s3_server.client()
    body = client.get_object(Bucket=s3_dataset.bucket, Key="manifests/train.json")["Body"].read()
    assert json.loads(body) == expected_manifest(s3_dataset.shards)
    assert "Contents" not in client.list_objects_v2(Bucket=s3_dataset.bucket, Prefix="train/manifest.json")
    verify = run_cli(["index", s3_dataset.url, "--verify", "--output", target], env=cli_env)
    assert verify.returncode == 0 and "all 6 shards match" in verify.stdout
    bad_target = run_cli(["index", s3_dataset.url, "--output", f"s3://{s3_dataset.bucket}/dir/"], env=cli_env)
    assert bad_target.returncode == 2 and "needs a bucket and a key" in bad_target.stderr
