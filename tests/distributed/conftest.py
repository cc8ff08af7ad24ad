"""Fixtures for the torchrun tests: the loader tests' real ``shardcache master`` process.

``train.py`` is the script torchrun runs; its name keeps pytest from collecting it, and
``collect_ignore`` says so explicitly (it imports torch and reads torchrun's environment)."""

from __future__ import annotations

from tests.loader.conftest import master

__all__ = ["collect_ignore", "master"]

collect_ignore = ["train.py", "harness.py"]
