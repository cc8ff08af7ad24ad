"""loader.heap: a reading process keeps freed sample buffers for the next batch (glibc's trim
threshold), counted by the page faults a batched read makes, in processes of their own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from loader import LoaderSettings
from loader.errors import ConfigError

BATCHES = """
import mmap, os, random, resource, sys, tempfile
from loader.heap import keep_freed_heap
print(keep_freed_heap(int(sys.argv[1])), keep_freed_heap(int(sys.argv[1])))
f = tempfile.TemporaryFile()
for _ in range(256):  # in pieces: a block over malloc's mmap threshold, once freed, raises its trim threshold
    f.write(os.urandom(65536))
f.flush()
buf = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
random.seed(1)
for o in range(0, 16 << 20, 65536):  # the mapping's own pages in first, in pieces the heap reuses
    buf[o : o + 65536]
offsets = range(0, (16 << 20) - 111_000, 4096)
batch = [bytes(buf[o : o + 111_000]) for o in random.sample(offsets, 64)]
del batch  # the first batch grows the heap
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(30):
    batch = [bytes(buf[o : o + 111_000]) for o in random.sample(offsets, 64)]
    del batch
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _run(threshold: int, env: dict[str, str] | None = None) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", BATCHES, str(threshold)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **(env or {})}, check=True).stdout.split("\n")
    return out[0], int(out[1])


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc")
def test_batches_freed_together_are_not_faulted_in_again() -> None:
    said, kept = _run(64 << 20)
    assert said == "True False"  # set once per process
    said, given_back = _run(0)
    assert said == "False False"
    # 30 batches of 64 x 111 KB: given back and faulted in again (~27 pages each) without it.
    assert given_back > 30 * 64 * 10 and kept < given_back / 10, (kept, given_back)


def test_the_users_own_setting_stands() -> None:
    said, _ = _run(64 << 20, {"MALLOC_TRIM_THRESHOLD_": "131072"})
    assert said == "False False"


def test_settings() -> None:
    assert LoaderSettings().heap_trim_threshold_bytes == 64 << 20
    assert LoaderSettings.from_env({"SHARDCACHE_HEAP_TRIM_THRESHOLD": "0"}).heap_trim_threshold_bytes == 0
    with pytest.raises(ConfigError, match="SHARDCACHE_HEAP_TRIM_THRESHOLD"):
        LoaderSettings.from_env({"SHARDCACHE_HEAP_TRIM_THRESHOLD": "lots"})
    with pytest.raises(ConfigError, match="heap_trim_threshold_bytes"):
        LoaderSettings(heap_trim_threshold_bytes=-1)
