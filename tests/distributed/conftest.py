"""Fixtures for the torchrun tests: a real ``shardcache master`` process (helpers:
tests/support/torchrun.py).

``train.py`` is the script torchrun runs; its name keeps pytest from collecting it, and
``collect_ignore`` says so explicitly (it imports torch and reads torchrun's environment)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.masters import running_master

collect_ignore = ["train.py", "train_map.py"]


@pytest.fixture
def master(tmp_path: Path) -> Iterator[str]:
    """``shardcache master`` with SQLite state (a real process); yields its URL."""
    with running_master(tmp_path) as url:
        yield url
