"""rclone (its own Go S3 client, the Debian package scripts/test.sh installs) through the node
daemon: lsjson with metadata and hashes, copy with multi-thread ranged downloads, cat with
offsets, and the exit codes and messages of a missing key and bucket."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.client_dataset import MANY, Dataset, sha256
from tests.support.compare import assert_same, scrub

RCLONE = shutil.which("rclone")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(RCLONE is None, reason="rclone missing: scripts/test.sh installs the Debian package")]


def rclone(url: str, home: Path, *args: str) -> tuple[int, str, str]:
    # AWS_CA_BUNDLE (set on some machines for boto3) makes rclone's S3 backend refuse its own HTTP
    # transport ("unable to load custom CA bundle"); the endpoints here are plain http anyway.
    env = {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}
    env |= {"RCLONE_CONFIG": str(home / "rclone.conf"), "RCLONE_CONFIG_X_TYPE": "s3", "RCLONE_CONFIG_X_PROVIDER": "Other",
           "RCLONE_CONFIG_X_ENDPOINT": url, "RCLONE_CONFIG_X_ACCESS_KEY_ID": "testing", "RCLONE_CONFIG_X_SECRET_ACCESS_KEY": "testing",
           "RCLONE_CONFIG_X_SESSION_TOKEN": "testing", "RCLONE_CONFIG_X_REGION": "us-east-1", "RCLONE_CONFIG_X_FORCE_PATH_STYLE": "true"}
    (home / "rclone.conf").touch()
    proc = subprocess.run([str(RCLONE), "--low-level-retries", "1", "--retries", "1", "--s3-no-check-bucket", *args],
                          capture_output=True, text=True, env=env, timeout=120, cwd=home)
    return proc.returncode, proc.stdout, scrub(proc.stderr, url)


def errors(stderr: str) -> list[str]:
    """rclone's error lines without their timestamps."""
    return [line.split(" ", 2)[-1] for line in stderr.splitlines() if "ERROR" in line or "Failed" in line]


def entries(stdout: str) -> list[dict[str, Any]]:
    """lsjson's entries; a directory's ModTime is the time of the listing (S3 has no directories),
    so it is left out."""
    return [{k: v for k, v in e.items() if not (e["IsDir"] and k == "ModTime")} for e in json.loads(stdout)]


def views(url: str, home: Path, dataset: Dataset) -> dict[str, Any]:
    b = dataset.bucket
    out: dict[str, Any] = {}
    for name, target in (("odd", "odd"), ("nested", "nested"), ("top", "")):
        rc, stdout, stderr = rclone(url, home, "lsjson", "-R", "--hash", "-M", f"X:{b}/{target}")
        out[f"lsjson {name}"] = [rc, entries(stdout) if rc == 0 else stdout, errors(stderr)]
    rc, stdout, _ = rclone(url, home, "lsjson", "--files-only", f"X:{b}/many")
    out["many"] = [rc, len(json.loads(stdout)) if rc == 0 else stdout]
    target = home / "copy" / url.rsplit(":", 1)[1]
    rc, _, stderr = rclone(url, home, "copy", "--multi-thread-cutoff", "4M", "--multi-thread-streams", "4", f"X:{b}/big", str(target))
    out["copy big"] = [rc, errors(stderr), {p.name: sha256(p.read_bytes()) for p in sorted(target.iterdir())} if target.exists() else {}]
    for key in ("odd/with space.txt", "odd/plus+sign.txt", "odd/%41%2F literal escapes.txt", "odd/ünïcödé-日本語.txt"):
        rc, stdout, stderr = rclone(url, home, "cat", f"X:{b}/{key}")
        out[f"cat {key}"] = [rc, sha256(stdout.encode()), errors(stderr)]
    rc, stdout, stderr = rclone(url, home, "cat", "--offset", "10", "--count", "20", f"X:{b}/odd/with space.txt")
    out["cat range"] = [rc, stdout, errors(stderr)]
    for name, args in (("cat missing key", ["cat", f"X:{b}/no/such key"]), ("lsjson missing bucket", ["lsjson", f"X:{dataset.missing_bucket}"])):
        rc, stdout, stderr = rclone(url, home, *args)
        out[name] = [rc, stdout, errors(stderr)]
    return out


def test_rclone_matches_origin(dataset: Dataset, origin_url: str, daemon_url: str, tmp_path: Path) -> None:
    direct = views(origin_url, tmp_path, dataset)
    assert direct["many"] == [0, MANY]
    assert direct["copy big"][0] == 0
    assert direct["cat odd/with space.txt"][1] == dataset.objects["odd/with space.txt"].sha
    assert_same(direct, views(daemon_url, tmp_path, dataset))
