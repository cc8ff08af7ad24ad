"""The terminal summary's texts (``summary`` fixture, tests/support/summary.py) reach the
printed summary whether the tests run in one process or in pytest-xdist's workers, as CI runs
them: the benchmark smoke test's table is CI's only record of the suite's figures."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import REPO

# The suite's own fixture and plugin, as tests/conftest.py and tests/bench/conftest.py use them.
CONFTEST = '''
from tests.support.summary import register, summary

def pytest_configure(config):
    register(config)
'''

TESTS = '''
def test_one(summary):
    summary("table one", "| a | b |\\n")

def test_two(summary):
    summary("table two", "| c " + "| d |")  # not in the source the failure's traceback shows
    assert False, "a failing test's text is shown too"

def test_three():
    pass
'''


@pytest.mark.slow
@pytest.mark.parametrize("workers", [None, "2"])
def test_every_tests_text_is_in_the_summary_once(tmp_path: Path, workers: str | None) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_texts.py").write_text(TESTS)
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)]
    if workers:
        args += ["-n", workers]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    out = done.stdout
    assert done.returncode == 1 and "1 failed, 2 passed" in out, out[-3000:]
    for title, text in (("table one", "| a | b |"), ("table two", "| c | d |")):
        assert out.count(f" {title} ") == 1 and out.count(text) == 1, out[-3000:]
