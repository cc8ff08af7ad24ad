"""Fixtures of the benchmark tests: ``summary`` puts a text in pytest's terminal summary, where
CI's log shows it (the smoke test's table: CI runs the benchmark suite once, inside the tests)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.support.summary import SUMMARY_PROPERTY

__all__ = ["summary"]


@pytest.fixture
def summary(request: pytest.FixtureRequest) -> Callable[[str, str], None]:
    """``summary(title, text)``: show ``text`` under ``title`` at the end of the run. It travels
    on the test's report (its user properties), so that pytest-xdist's workers' texts reach the
    controller, which prints the summary (tests/conftest.py)."""

    def show(title: str, text: str) -> None:
        request.node.user_properties.append((SUMMARY_PROPERTY, [title, text]))

    return show
